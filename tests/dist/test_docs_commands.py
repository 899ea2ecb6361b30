"""The commands the docs show run as written: every ```bash block of README.md and docs/*.md that follows
a `<!-- runnable ... -->` line runs with bash -e, in page order (README first), in one fresh directory
that holds only links to the checkout's .venv and configs/ — as a newcomer types them after `make demo`
(the first block's runs are what later blocks export and generate from). A block that is not marked is
a cluster's, a GPU's or a long run's command, shown but not run here."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- runnable"


def runnable_blocks(page: Path) -> list[str]:
    lines, out, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith(MARK):
            assert lines[i + 1].startswith("```bash"), f"{page.name}:{i + 1}: a runnable mark must precede a ```bash block"
            end = lines.index("```", i + 2)
            out.append("\n".join(lines[i + 2:end]))
            i = end
        i += 1
    return out


def commands(block: str) -> list[str]:
    """A block's commands, a line continued with a trailing backslash joined to the next."""
    out, current = [], ""
    for line in block.splitlines():
        current += line + "\n"
        if not line.endswith("\\"):
            out.append(current)
            current = ""
    return out + ([current] if current else [])


def not_run_before(block: str, trained: set[str]) -> str:
    """The block without the trainings an earlier block already ran as written, in the same directory and
    run.dir (memory.md opens with README's offload run: a page shows the whole recipe, the test trains it once,
    ~20 s of the suite). Every other command runs, repeated or not."""
    kept = []
    for command in commands(block):
        key = command.strip()
        if key.startswith(".venv/bin/shardwise train ") and key in trained:
            continue
        trained.add(key)
        kept.append(command)
    return "".join(kept)


def test_a_repeated_training_is_dropped_and_nothing_else():
    trained: set[str] = set()
    first = "a \\\n  b\n.venv/bin/shardwise train --x=1 \\\n    --y=2\nls\n"
    assert not_run_before(first, trained) == first
    assert not_run_before(".venv/bin/shardwise train --x=1 \\\n    --y=2\nls\n", trained) == "ls\n"
    assert not_run_before(".venv/bin/shardwise train --x=2\n", trained) == ".venv/bin/shardwise train --x=2\n"


def test_every_runnable_block_runs_as_written(tmp_path):
    if not (ROOT / ".venv" / "bin" / "shardwise").exists():
        pytest.skip("no .venv in the checkout: the docs' commands call .venv/bin/shardwise (make venv creates it)")
    for name in (".venv", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [(page, block) for page in pages for block in runnable_blocks(page)]
    assert len(blocks) >= 5
    scratch = tmp_path / "tmp"  # the blocks' $TMPDIR (memory.md's NVMe directory): nothing lands in the machine's /tmp
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    trained: set[str] = set()
    for page, block in blocks:
        script = not_run_before(block, trained)
        done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
        assert done.returncode == 0, f"{page.name}:\n{block}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        # DTensor's note about one collective per mesh axis, once per rank (README's FSDP x TP run printed
        # it 4 times): parallel/mesh.py quiet_scalar_redistribute_notes
        assert "operations will be performed" not in done.stderr, f"{page.name}:\n{block}\n{done.stderr[-3000:]}"
