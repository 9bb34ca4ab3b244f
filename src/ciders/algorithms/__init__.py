"""Algorithms. CIDERS (`ciders.algorithms.ciders`) holds the update rules; every baseline is a module
that fixes some of its knobs (`configure(cfg) -> cfg`), so all of them run through the same client and
server functions, engines, data and evaluation.

Method names for `ciders compare`: ciders-fo, ciders-fd, fedavg, fedprox, scaffold, fedot, fedbiot, localot.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

from ciders.errors import ConfigError

BASELINES = ("fedavg", "fedprox", "scaffold", "fedot", "fedbiot", "localot")
METHODS = ("ciders-fo", "ciders-fd") + BASELINES


def configure(cfg, method: str | None = None):
    """The effective config of `method` (default: cfg.algorithm.name) built from `cfg`. Idempotent."""
    method = method or (cfg.algorithm.name if cfg.algorithm.name != "ciders" else f"ciders-{cfg.algorithm.metagrad}")
    if method not in METHODS:
        raise ConfigError(f"unknown algorithm {method!r}; choose from {', '.join(METHODS)}")
    if method.startswith("ciders-"):
        return replace(cfg, algorithm=replace(cfg.algorithm, name="ciders", metagrad=method.split("-")[1]))
    return importlib.import_module(f"ciders.algorithms.{method}").configure(cfg)


def method_name(cfg) -> str:
    a = cfg.algorithm
    return f"ciders-{a.metagrad}" if a.name == "ciders" else a.name


def changes(before, after, prefix: str = "") -> list[str]:
    """'key: old -> new' for every setting `configure` changed (for the run log)."""
    import dataclasses

    out = []
    for f in dataclasses.fields(before):
        x, y = getattr(before, f.name), getattr(after, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(x):
            out += changes(x, y, key + ".")
        elif x != y:
            out.append(f"{key}: {x!r} -> {y!r}")
    return out
