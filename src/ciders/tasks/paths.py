"""Where data files are: `${CIDERS_DATA}` in a path expands to the datasets directory (environment
variable CIDERS_DATA; default `data`, the repository's own slices, when run from a checkout). Relative paths
in a config file were already made relative to that file when it was loaded (config.base.load_config)."""

from __future__ import annotations

import os
from pathlib import Path

from ciders.errors import CidersError


def data_root() -> Path:
    return Path(os.environ.get("CIDERS_DATA") or "data")


def expand(path: str) -> Path:
    """`${CIDERS_DATA}` / `$CIDERS_DATA` and `~` expanded; no check that the path exists."""
    expanded = path.replace("${CIDERS_DATA}", str(data_root())).replace("$CIDERS_DATA", str(data_root()))
    return Path(os.path.expanduser(expanded))


def resolve(path: str) -> Path:
    p = expand(path)
    if not p.exists():
        hint = " (set CIDERS_DATA to the datasets directory)" if "CIDERS_DATA" in path else ""
        raise CidersError(f"data file not found: {path} -> {p.resolve()}{hint}")
    return p
