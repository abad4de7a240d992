"""Errors that are part of the interface: bad input names where it came from and which field.

`InputError` is raised by every parser and validator (profiles, traces, scenarios, CLI arguments);
the CLI turns it into exit code 2 and a one-line message such as
``profile.yaml: decode.d1: missing``.
"""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """Invalid user input: `source` is a file name or argument, `field` the offending field."""

    def __init__(self, source: str, field: str, message: str) -> None:
        self.source = source
        self.field = field
        self.message = message
        super().__init__(f"{source}: {field}: {message}")
