"""Where data files are: `${CIDERS_DATA}` in a path expands to the datasets directory (environment
variable CIDERS_DATA; default `data`, the repository's own slices, when run from a checkout); relative
paths are relative to the current directory."""

from __future__ import annotations

import os
from pathlib import Path

from ciders.errors import CidersError


def data_root() -> Path:
    return Path(os.environ.get("CIDERS_DATA") or "data")


def resolve(path: str) -> Path:
    expanded = path.replace("${CIDERS_DATA}", str(data_root())).replace("$CIDERS_DATA", str(data_root()))
    p = Path(os.path.expanduser(expanded))
    if not p.exists():
        hint = " (set CIDERS_DATA to the datasets directory)" if "CIDERS_DATA" in path else ""
        raise CidersError(f"data file not found: {path} -> {p.resolve()}{hint}")
    return p
