# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv bench soak gpu-check clean docs docs-check figures

venv: $(STAMP)

# torch is installed first and alone so that pip takes the pinned CPU wheel (2.13.0) rather than
# resolving a newer CUDA build; the project's own pins then find it already satisfied.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardwise train --config configs/demo.toml --nproc 2

# Two pytest-xdist workers, each taking whole files (--dist loadfile: a file's module fixtures, such as
# the parity matrix's, run once), the files with the most tests first (xdist's default). The suite is
# bound by its CPU work: 6432 CPU-seconds (this process and its children) in 3507 s on 2 cores, 1.83
# cores busy on average (2026-11-30). Ordering the files longest first changed nothing (1949 s against
# 1934 s, 2026-11-27): a file left to run alone at the end (the docs' commands) uses both cores. A shorter
# `make test` needs less work: each run ends with the 20 files that cost the most CPU (tests/cpu_report.py:
# CPU, not wall time, is what a file costs the suite; parity 1019 CPU-s, the docs' commands 530 on 2026-11-30).
test: $(STAMP)
	@rm -rf build/cpu-report
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -p tests.cpu_report --cpu-report=build/cpu-report tests; \
	  status=$$?; $(BIN)/python -m tests.cpu_report build/cpu-report 20; exit $$status

# docs/config.md from the config tree's own documentation (tests/unit/test_docs.py fails when it is stale);
# docs-check: that, the links, and every README / docs block marked runnable, as written (also in make test).
docs: $(STAMP)
	$(BIN)/shardwise config --markdown > docs/config.md

# The docs' figures (docs/images/), copied from real runs of the code (about a minute on 2 cores).
figures: $(STAMP)
	$(BIN)/python tools/docs_figures.py

docs-check: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit/test_docs.py tests/dist/test_docs_commands.py

# Style and shape: ruff (lint + import order, config in pyproject.toml) and the import graph's floors
# (tools/import_graph.py: no circles, no upward import; docs/architecture.md §2); every test module imports
# (pytest's collection, ~20 s: a name a test imports from another test file, renamed, failed CI after an hour).
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/python tools/import_graph.py
	@out=$$($(BIN)/python -m pytest -q --collect-only -p no:cacheprovider tests 2>&1) \
	  || { echo "$$out" | tail -40; echo "lint: a test module does not import (above)"; exit 1; }

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

# Automatic restart under fire: SIGKILL a random worker 20 times (also mid-checkpoint); prints "N/20 identical".
soak: $(STAMP)
	$(BIN)/python benchmarks/kill_soak.py --trials 20

# Every one-GPU path on this machine's GPU, with the machine's own torch (no venv: a GPU machine keeps its
# CUDA build): runs/gpu-check/report.md and report.json (README "GPU check"). ARGS="--only 'train/*'" for a
# part. Without a CUDA GPU it says so and exits 0.
gpu-check:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
