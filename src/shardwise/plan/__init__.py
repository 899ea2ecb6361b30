"""Planner: hardware table, memory and step-time models, layout search (no process groups)."""
