"""Confidence intervals over seeds (the RABO-family tables; docs/rabo.md#measured-here-cpu-scale-2-cores).

With n seeds the 95% interval of a mean is  mean +- t_{0.975, n-1} s / sqrt(n)  (Student t, s the sample
standard deviation): with 3 seeds t = 4.303, so the half-width is 2.48 s, far wider than mean +- s suggests.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

# t_{0.975, df} for df = 1 .. 30 (standard tables, 3 decimals)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (two-sided 95%). Beyond 30 the
    Cornish-Fisher expansion around the normal quantile (error < 1e-3)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_ci95(values: Sequence[float]) -> dict:
    """{"mean", "std" (sample), "ci95" (t half-width; 0 for one value), "n"} of per-seed values."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no values")
    if any(not math.isfinite(v) for v in vals):
        raise ValueError(f"non-finite value among {vals}")
    n = len(vals)
    sd = statistics.stdev(vals) if n > 1 else 0.0
    return {"mean": statistics.fmean(vals), "std": sd, "ci95": t975(n - 1) * sd / math.sqrt(n) if n > 1 else 0.0,
            "n": n}
