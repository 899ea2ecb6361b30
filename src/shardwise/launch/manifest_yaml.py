"""Kubernetes manifests as commented YAML (`shardwise launch k8s`), and read back.

A manifest is plain data (dicts, lists, str, int, bool) plus comments keyed by the path of the entry they
explain: ("spec", "trainer", "args") puts its comment above that key, ("spec", "volumes", 0) above that list
item, () above the document. PyYAML writes no comments, and a manifest that says why each value is what it
is was the point (the /dev/shm size, the restart policy), so the block style is written here; what comes
back from PyYAML's safe_load (load_documents) must equal the data, which tests/unit/test_launch_k8s.py holds
for every document kind and the strings that YAML 1.1 readers (Kubernetes' sigs.k8s.io/yaml) would retype.
"""
from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Mapping

Comments = Mapping[tuple, str]

# Strings written bare: a letter, `/` or `_` first (a leading digit, dot, quote or sign can make a number, a
# tag or a special float), then only characters no YAML reader gives a meaning to. `--flag` arguments too.
_PLAIN = re.compile(r"(--?)?[A-Za-z_/][A-Za-z0-9_./=-]*")
# Words YAML 1.1 reads as booleans or null (go-yaml v2 behind kubectl's sigs.k8s.io/yaml does): quoted.
_RETYPED = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"})


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RETYPED:
            return value
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid double-quoted YAML scalar
    raise TypeError(f"no YAML form for {type(value).__name__}: {value!r}")


def _block_text(value: str) -> bool:
    """Whether a literal block (`|`) carries this string as it is: several lines, none with a tab, carriage
    return or other control character, or trailing spaces, which a literal block would not keep exactly
    (those strings are written quoted)."""
    if "\n" not in value.rstrip("\n") or value.startswith("\n"):
        return False
    return not any(line != line.rstrip() or any(ord(c) < 32 for c in line) for line in value.split("\n"))


def _literal(value: str, indent: int) -> list[str]:
    body = value.rstrip("\n")
    trailing = len(value) - len(body)
    chomp = "-" if trailing == 0 else "" if trailing == 1 else "+"
    # The first line starting with a space would set the block's indentation: then it is stated.
    head = "|" + ("2" if body.startswith(" ") else "") + chomp
    pad = " " * (indent + 2)
    lines = [pad + line if line else "" for line in body.split("\n")]
    return [head, *lines, *([""] * (trailing - 1) if chomp == "+" else [])]


# Comment lines are wrapped to this width (a newline in a comment's text starts a new line anyway).
WIDTH = 120


def _comment(comments: Comments, path: tuple, indent: int) -> list[str]:
    text = comments.get(path)
    if not text:
        return []
    width = max(60, WIDTH - indent - 2)
    lines = [part for line in text.split("\n") for part in (textwrap.wrap(line, width, break_on_hyphens=False) or [""])]
    return [" " * indent + ("# " + line if line else "#") for line in lines]


def _node(value: object, path: tuple, indent: int, comments: Comments) -> list[str]:
    """The lines of a mapping's or sequence's entries at `indent` (a scalar never comes here)."""
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"mapping keys are strings, got {key!r} at {path}")
            out += _comment(comments, (*path, key), indent)
            out += _entry(pad + _scalar(key) + ":", item, (*path, key), indent, comments, nested=indent + 2)
        return out
    for i, item in enumerate(value):
        out += _comment(comments, (*path, i), indent)
        out += _entry(pad + "-", item, (*path, i), indent, comments, nested=indent + 2, in_list=True)
    return out


def _entry(lead: str, item: object, path: tuple, indent: int, comments: Comments, nested: int,
           in_list: bool = False) -> list[str]:
    if isinstance(item, (dict, list)) and not item:
        return [f"{lead} {'{}' if isinstance(item, dict) else '[]'}"]
    if isinstance(item, dict) and in_list:
        # `- key: value` with the mapping's other keys under the first: the usual way lists of objects read.
        lines = _node(item, path, nested, comments)
        first = next(i for i, line in enumerate(lines) if not line.lstrip().startswith("#"))  # after its comments
        return [*lines[:first], lead + " " + lines[first][nested:], *lines[first + 1:]]
    if isinstance(item, (dict, list)):
        # A list under a key is written at the key's own indentation (kubectl's style).
        return [lead, *_node(item, path, indent if isinstance(item, list) and not in_list else nested, comments)]
    if isinstance(item, str) and _block_text(item):
        head, *body = _literal(item, indent)
        return [f"{lead} {head}", *body]
    return [f"{lead} {_scalar(item)}"]


def dump_documents(documents: list[tuple[dict, Comments]]) -> str:
    """Several manifests in one file, `---` between them, each with its comments."""
    parts = []
    for data, comments in documents:
        parts.append("\n".join([*_comment(comments, (), 0), *_node(data, (), 0, comments)]) + "\n")
    return "---\n".join(parts)


def load_documents(text: str) -> list[object]:
    """The documents of a YAML file, as Kubernetes reads them (PyYAML's safe loader: no tags, no objects)."""
    import yaml

    return [doc for doc in yaml.safe_load_all(text) if doc is not None]
