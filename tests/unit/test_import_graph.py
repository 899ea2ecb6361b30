"""The package keeps its floors (docs/architecture.md §2): tools/import_graph.py finds no circle and no
upward import, and it does find them when they exist (so the check cannot pass vacuously)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "import_graph.py"


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_circles_and_no_upward_imports():
    out = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 circles, 0 upward imports" in out.stdout


def test_the_checker_sees_circles_and_upward_imports():
    tool = _tool()
    edges = {"shardwise.models.a": {"shardwise.models.b"}, "shardwise.models.b": {"shardwise.models.a"},
             "shardwise.spec.x": {"shardwise.train.y"}, "shardwise.train.y": set(),
             "shardwise.plan.p": {"shardwise.parallel.q"}, "shardwise.parallel.q": set()}
    assert tool.circles(edges) == [["shardwise.models.a", "shardwise.models.b"]]
    assert tool.upward(edges) == [("shardwise.plan.p", "shardwise.parallel.q"), ("shardwise.spec.x", "shardwise.train.y")]


def test_the_spec_floor_imports_no_torch_and_nothing_above_it():
    tool = _tool()
    for module, targets in tool.graph().items():
        if module.startswith("shardwise.spec"):
            assert all(t.startswith(("shardwise.spec", "shardwise.errors")) for t in targets), (module, targets)
    for path in (ROOT / "src" / "shardwise" / "spec").glob("*.py"):
        assert "import torch" not in path.read_text(), path
