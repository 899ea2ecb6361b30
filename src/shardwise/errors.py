"""The one exception type for bad user input (config, layout, paths).

The CLI renders it without a traceback and exits with code 2, before any process is spawned.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing input error: which field, what was wrong, how to fix it."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.field}: {self.problem}"
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text
