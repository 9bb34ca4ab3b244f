"""Learning-rate and consensus-coefficient schedules (docs/method.md#schedules)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, base: float, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """Linear warmup over `warmup` steps to `base`, then cosine decay to base * min_ratio at `total`."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_at(step: int, kind: str, total: int, base: float, warmup: int = 0, min_ratio: float = 0.0) -> float:
    if kind == "constant":
        return base
    if kind == "warmup_cosine":
        return warmup_cosine(step, total, base, warmup, min_ratio)
    raise ValueError(f"unknown schedule {kind!r}")


def gamma_at(t: int, kind: str, gamma: float) -> float:
    """Constant gamma, or Protocol C: gamma_0 = gamma_1 = 0.9, gamma_t = max(0.01, 0.9 * 0.86^(t-1))
    for t >= 2 (floor reached at round 31)."""
    if kind == "constant":
        return gamma
    if kind == "protocol_c":
        return 0.9 if t < 2 else max(0.01, 0.9 * 0.86 ** (t - 1))
    raise ValueError(f"unknown gamma schedule {kind!r}")
