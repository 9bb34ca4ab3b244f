"""Algorithms: the update rules of both method families, pure functions over explicit state.

CIDERS (`ciders.algorithms.ciders`) holds the client and server updates of Eqs. 4-12 (docs/method.md);
every CIDERS-family baseline is a module that fixes some of its knobs (`configure(cfg) -> cfg`), so all of
them run through the same client and server functions, round loop, data and evaluation. The RABO family
(`rabo`, `rafbo`, `fedmbo`, and the full-model baselines of `fedmeta`) is described in docs/rabo.md.
Every method, by name, is one row of `ciders.algorithms.registry`.
"""

from __future__ import annotations

import dataclasses

from ciders.algorithms.registry import REGISTRY, Method, get, names  # noqa: F401

METHODS = names("ciders")  # the CIDERS-family methods (`ciders compare --algorithms`)


def configure(cfg, method: str | None = None):
    """The effective config of `method` (default: the config's own, `cfg.algorithm.method`). Idempotent. The
    privacy checks run again on it: a method's own knobs (LocalOT uploads nothing) may rule out a setting."""
    out = get(method or cfg.algorithm.method, "ciders").configure(cfg)
    out.check_privacy()
    return out


def changes(before, after, prefix: str = "") -> list[str]:
    """'key: old -> new' for every setting `configure` changed (for the run log)."""
    out = []
    for f in dataclasses.fields(before):
        x, y = getattr(before, f.name), getattr(after, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(x):
            out += changes(x, y, key + ".")
        elif x != y:
            out.append(f"{key}: {x!r} -> {y!r}")
    return out
