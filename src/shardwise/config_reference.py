"""The config reference, generated from the config tree's fields (config.py): `shardwise config --keys`
(the defaults as TOML, pasteable into a config file) and `--markdown` (docs/config.md's tables)."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import tomli_w

from shardwise.config import sections


def _toml_value(name: str, value: Any) -> str:
    """`name = value` as it would be written in a config file (true, "text", [1, 2]); TOML has no
    null, so a key that is unset by default says so in a comment."""
    if value is None:
        return f"# {name} = (unset)"
    return tomli_w.dumps({name: value}).strip()


def describe(markdown: bool = False) -> str:
    """Every key with its default and documentation: for `shardwise config --keys` the defaults as TOML, so
    a line can be pasted into a config file as it is; `markdown` (`config --markdown`): docs/config.md's
    tables, generated from the same fields so the reference cannot go stale (tests/unit/test_docs.py)."""
    lines = []

    def table(name: str, cls: type, array: bool = False) -> None:
        """[name] (or, `array`, the entries of an array of tables [[name]], commented in TOML: pasted as they
        are they would add an entry)."""
        head = f"[[{name}]]" if array else f"[{name}]"
        lines.extend([f"## {head}", "", "| key | default | meaning |", "|---|---|---|"] if markdown
                     else [f"# {head}, one table per entry:" if array else head])
        subs = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if dataclasses.is_dataclass(default):
                subs.append((f"{name}.{f.name}", type(default), False))
                continue
            item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
            if item is not None and dataclasses.is_dataclass(item):
                subs.append((f"{name}.{f.name}", item, True))
            if array:
                if markdown:
                    shown = f"`{_toml_value(f.name, default).split(' = ', 1)[1]}`"
                    lines.append(f"| `{f.name}` | {shown} | {f.metadata['doc'].replace('|', chr(92) + '|')} |")
                else:
                    lines.append(f"#   {_toml_value(f.name, default)}\n#       {f.metadata['doc']}")
                continue
            if markdown:
                shown = "unset" if default is None else f"`{_toml_value(f.name, default).split(' = ', 1)[1]}`"
                lines.append(f"| `{name}.{f.name}` | {shown} | {f.metadata['doc'].replace('|', chr(92) + '|')} |")
            else:
                lines.append(f"  {_toml_value(f.name, default)}\n      {f.metadata['doc']}")
        if markdown:
            lines.append("")
        for sub, sub_cls, sub_array in subs:
            table(sub, sub_cls, sub_array)

    for section, cls in sections().items():
        table(section, cls)
    return "\n".join(lines)
