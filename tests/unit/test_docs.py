"""The docs cannot drift from the code: the configuration reference is generated from the config tree's
own documentation and must equal what `shardwise config --markdown` prints (`make docs` rewrites it);
README stays a landing page; every relative link in README.md and docs/ resolves."""
from __future__ import annotations

import re
from pathlib import Path

from shardwise.cli import CONFIG_REFERENCE_HEADER
from shardwise.config_reference import describe

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


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens, underscores kept), spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_anchor_names_a_heading_of_its_page():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", page.read_text()):
            linked = page.parent / target if target else page
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}
            if anchor not in slugs:
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken


IMAGE_MAX_BYTES = 200 * 1024  # "kept small": the repository carries them


def test_embedded_images_exist_are_small_pngs_and_none_is_orphaned():
    """docs/images/ holds what tools/docs_figures.py copied from real runs (`make figures`)."""
    embedded = set()
    for page in PAGES:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            image = (page.parent / target).resolve()
            assert image.is_file(), f"{page.relative_to(ROOT)} embeds {target}, which does not exist"
            assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{target} is not a PNG"
            assert image.stat().st_size <= IMAGE_MAX_BYTES, f"{target}: {image.stat().st_size} B"
            embedded.add(image)
    on_disk = {p.resolve() for p in (ROOT / "docs" / "images").iterdir()}
    assert on_disk == embedded, f"not embedded anywhere: {sorted(p.name for p in on_disk - embedded)}"
    import tools.docs_figures as figures  # every figure the generator makes is one of them

    assert {ROOT / "docs" / "images" / name for name, _, _ in figures.FIGURES} == on_disk


def test_no_page_repeats_another_pages_table_rows():
    """A table lives on one page; the others link to it (two copies drift apart)."""
    where: dict[str, set[str]] = {}
    for page in PAGES:
        for line in page.read_text().splitlines():
            if line.startswith("|") and not re.fullmatch(r"\|[\s\-:|]+\|?", line.strip()):
                where.setdefault(line.strip(), set()).add(page.name)
    repeated = {row: sorted(pages) for row, pages in where.items() if len(pages) > 1}
    assert not repeated, repeated


# Issue 62: a page a person reads answers "how do I ..." in its first screen, in short paragraphs, with
# headings to find the task by. docs/config.md is generated (`make docs`) and checked above instead.
READ_PAGES = [p for p in PAGES if p.name != "config.md"]
PARAGRAPH_MAX_LINES = 10
FIRST_SECTION_MAX_LINES = 15
LINES_PER_HEADING = 60


def _prose(page: Path) -> tuple[list[tuple[int, int]], list[int], int]:
    """(start line, length) of each paragraph outside code blocks and tables (a list item is a paragraph
    of its own), the line numbers of the headings outside code blocks, and the page's line count."""
    lines = page.read_text().splitlines()
    paragraphs: list[tuple[int, int]] = []
    headings: list[int] = []
    fenced, start, length = False, 0, 0
    for number, line in enumerate(lines, 1):
        text = line.strip()
        is_item = re.match(r"([-*]|\d+\.) ", text) is not None
        ends = text.startswith("```") or fenced or not text or text.startswith(("#", "|", "<!--")) or is_item
        if ends and length:
            paragraphs.append((start, length))
            length = 0
        if text.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if re.match(r"#{1,6} ", line):
            headings.append(number)
        elif text and not text.startswith(("|", "<!--")):
            if not length:
                start = number
            length += 1
    if length:
        paragraphs.append((start, length))
    return paragraphs, headings, len(lines)


def test_no_paragraph_runs_over_ten_lines():
    long = [f"{p.relative_to(ROOT)}:{start} ({n} lines)" for p in READ_PAGES for start, n in _prose(p)[0]
            if n > PARAGRAPH_MAX_LINES]
    assert not long, f"split these paragraphs (a list or a table for several items): {long}"


def test_every_page_opens_with_a_short_first_section():
    """What the page is for and the one command most users need, before the second heading."""
    long = []
    for page in READ_PAGES:
        _, headings, total = _prose(page)
        first = (headings[1] - 1 if len(headings) > 1 else total)
        if first > FIRST_SECTION_MAX_LINES:
            long.append(f"{page.relative_to(ROOT)}: {first} lines before its second heading")
    assert not long, long


def test_every_page_has_a_heading_per_sixty_lines():
    sparse = [f"{p.relative_to(ROOT)}: {len(h)} headings for {n} lines" for p in READ_PAGES
              for _, h, n in [_prose(p)] if len(h) * LINES_PER_HEADING < n]
    assert not sparse, sparse


# Issue 62 item 6: a shell block that tests/dist/test_docs_commands.py does not run (a cluster's, a GPU's, a
# long run's) still cannot drift from the CLI: its shardwise subcommands and their options, its `--section.key`
# config keys, its make targets, and the repository files it names (scripts included) must exist. Cheap:
# each subcommand's --help, in process.
SHARDWISE = {".venv/bin/shardwise", "shardwise"}
WITH_SUBCOMMAND = {"plan", "launch", "data", "checkpoint"}
OUTPUT_OPTIONS = {"--out", "--emit", "--plot", "--json", "--hf"}  # what they name is written, need not exist
REPO_DIRS = ("configs/", "benchmarks/", "tests/", "tools/", "docs/", "src/")


def _shell_commands(page: Path) -> list[list[str]]:
    """Each command of the page's ```bash blocks (and 4-space indented `shardwise ...` lines), continuation
    lines joined, comments dropped, split as bash would (a `;`, `&&` or `|` starts another)."""
    import shlex

    lines, commands, fenced, language, continued = page.read_text().splitlines(), [], False, "", False
    texts: list[str] = []
    for line in lines:
        if line.startswith("```"):
            fenced, language = not fenced, line[3:].strip()
            continue
        if fenced and language == "bash":
            texts.append(line)
        elif not fenced and line.startswith("    ") and (line.strip().startswith("shardwise ") or continued):
            texts.append(line.strip())
        continued = texts[-1].endswith("\\") if texts else False
    for text in "\n".join(texts).replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = list(lexer)
        except ValueError as e:
            raise AssertionError(f"{page.name}: does not parse as shell: {text!r} ({e})") from None
        command: list[str] = []
        for token in tokens + [";"]:
            if token and set(token) <= set(";&|"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(token)
    return commands


def _options_of(path: tuple[str, ...]) -> set[str] | None:
    """The options `shardwise PATH --help` lists (None: no such subcommand)."""
    import contextlib
    import io

    from shardwise.cli import main

    if path == ("checkpoint", "verify"):  # its only argument is the directory (and its import is torch's)
        return {"--help", "-h"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main([*path, "--help"])
        except SystemExit as e:
            code = e.code
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", out.getvalue())) if code in (0, None) else None


def test_every_shell_block_names_commands_options_keys_and_files_that_exist():
    from shardwise.config import all_keys

    keys, helps = set(all_keys()), {}
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    wrong = []
    for page in PAGES:
        for command in _shell_commands(page):
            where = f"{page.relative_to(ROOT)}: {' '.join(command)[:100]}"
            program, args = command[0], command[1:]
            for i, arg in enumerate(args):
                name = arg.split("=", 1)[0]
                if re.fullmatch(r"--[a-z_]+\.[a-z_.]+", name) and name[2:] not in keys and program != "make":
                    wrong.append(f"{where}: no config key {name[2:]}")
                after_output = i > 0 and args[i - 1] in OUTPUT_OPTIONS
                if arg.startswith(REPO_DIRS) and not after_output and not (ROOT / arg.split("=", 1)[0]).exists():
                    wrong.append(f"{where}: no file {arg}")
            if program == "make":
                wrong += [f"{where}: no make target {t}" for t in args if "=" not in t and t not in targets]
            elif program in SHARDWISE and args:
                path = tuple(args[:2] if args[0] in WITH_SUBCOMMAND and len(args) > 1 else args[:1])
                if path not in helps:
                    helps[path] = _options_of(path)
                if helps[path] is None:
                    wrong.append(f"{where}: no subcommand `shardwise {' '.join(path)}`")
                    continue
                for arg in args[len(path):]:
                    name = arg.split("=", 1)[0]
                    if name.startswith("--") and "." not in name and name not in helps[path]:
                        wrong.append(f"{where}: `shardwise {' '.join(path)}` has no option {name}")
    assert not wrong, "\n".join(wrong)
