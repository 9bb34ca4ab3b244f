"""The two helpers every config section is written with: a field with its help text, and a nested section."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse's `help`
    """A config field with its help text (shown by `ciders config --keys`)."""
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def section(default_factory: Any, help: str) -> Any:  # noqa: A002
    return field(default_factory=default_factory, metadata={"help": help})
