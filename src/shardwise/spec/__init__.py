"""The torch-free floor under both the trainer (parallel/, train/) and the planner (plan/).

What a run *is*, without running it: the parallel dims and what follows from them (dims.py), the
hardware table (hardware.py), model presets (presets.py) and every parameter's shape and tensor-
parallel split (shapes.py), pipeline stages (stages.py), the planner's and trainer's shared
description of one layout (layout.py) and every layout rule, written once (rules.py). Nothing here
imports torch, the config module or anything above it (docs/architecture.md, "Floors").
"""
