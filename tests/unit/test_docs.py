"""The docs cannot drift from the code: the configuration reference is generated from the config tree's
own documentation and must equal what `shardwise config --markdown` prints (`make docs` rewrites it);
README stays a landing page; every relative link in README.md and docs/ resolves."""
from __future__ import annotations

import re
from pathlib import Path

from shardwise.cli import CONFIG_REFERENCE_HEADER
from shardwise.config import describe

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_config_reference_is_generated_from_the_config_tree():
    want = CONFIG_REFERENCE_HEADER + describe(markdown=True) + "\n"
    assert (ROOT / "docs" / "config.md").read_text() == want, "docs/config.md is out of date: run `make docs`"


def test_readme_is_a_landing_page_that_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = set(re.findall(r"\]\(docs/([^)#]+)", readme))
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}  # every page reachable from the front page


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
