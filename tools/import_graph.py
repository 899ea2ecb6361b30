"""The package's import graph, checked against its floors: no circles, no import running back up.

    python tools/import_graph.py [--dot] [--max-upward N]

Reads every module under src/shardwise with `ast` (nothing is imported or run), resolves each
`import` / `from ... import` that names a shardwise module — at module level or inside a function,
since a deferred import is still a dependency — and prints the edges that cross a floor, every
circle (strongly connected component of more than one module, or a module importing itself) and
every import from a lower floor to a higher one. The floors are the map of docs/architecture.md;
a module's floor is that of the longest prefix listed in FLOORS. Exit 1 on a circle or on more
upward imports than --max-upward (default 0), so CI fails when the shape breaks.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "shardwise"

# Lowest first. Modules on one floor may import each other only where SIBLINGS_ALLOWED says so:
# parallel/ (the trainer's machinery) and plan/ (the planner) stand side by side and never meet.
FLOORS: list[tuple[str, ...]] = [
    ("shardwise.errors",),
    ("shardwise.spec",),
    ("shardwise.config", "shardwise.config_model", "shardwise.config_reference", "shardwise.tensors", "shardwise.scratch",
     "shardwise.paths", "shardwise.orphans"),
    # data/: corpus preparation and token shards, torch-free (its workers start without torch).
    ("shardwise.preflight", "shardwise.models", "shardwise.data"),
    ("shardwise.parallel", "shardwise.plan"),
    ("shardwise.train",),
    ("shardwise.launch",),
    ("shardwise.parity", "shardwise.infer"),
    ("shardwise.cli", "shardwise.__init__"),
]
SEPARATE = {("shardwise.parallel", "shardwise.plan"), ("shardwise.plan", "shardwise.parallel"),
            ("shardwise.preflight", "shardwise.models"), ("shardwise.models", "shardwise.preflight"),
            ("shardwise.data", "shardwise.models"), ("shardwise.models", "shardwise.data"),
            ("shardwise.data", "shardwise.preflight"), ("shardwise.preflight", "shardwise.data")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The shardwise modules `name` imports (a package import counts as its __init__)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith(PACKAGE) and t != PACKAGE:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def group(module: str) -> str:
    best = ""
    for floor in FLOORS:
        for prefix in floor:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best = prefix
    if not best:
        raise SystemExit(f"import_graph: {module} is on no floor; add it to FLOORS in {__file__}")
    return best


def floor_of(module: str) -> int:
    g = group(module)
    return next(i for i, floor in enumerate(FLOORS) if g in floor)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower floor to a higher one, or between groups kept apart on one floor."""
    bad = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            fa, fb = floor_of(a), floor_of(b)
            if fb > fa or (group(a), group(b)) in SEPARATE:
                bad.append((a, b))
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-upward", type=int, default=0, help="upward imports tolerated (default 0)")
    parser.add_argument("--dot", action="store_true", help="print the group-level graph in Graphviz dot")
    args = parser.parse_args()
    edges = graph()
    groups: dict[tuple[str, str], int] = {}
    for a, targets in edges.items():
        for b in targets:
            ga, gb = group(a), group(b)
            if ga != gb:
                groups[(ga, gb)] = groups.get((ga, gb), 0) + 1
    if args.dot:
        print("digraph shardwise {")
        for (ga, gb), n in sorted(groups.items()):
            print(f'  "{ga}" -> "{gb}" [label={n}];')
        print("}")
        return 0
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports")
    for i, floor in enumerate(FLOORS):
        print(f"floor {i + 1}: " + ", ".join(floor))
    found = circles(edges)
    bad = upward(edges)
    for comp in found:
        print("circle: " + " <-> ".join(comp))
    for a, b in bad:
        print(f"upward: {a} (floor {floor_of(a) + 1}) imports {b} (floor {floor_of(b) + 1})")
    print(f"{len(found)} circles, {len(bad)} upward imports (at most {args.max_upward} allowed)")
    return 1 if found or len(bad) > args.max_upward else 0


if __name__ == "__main__":
    sys.exit(main())
