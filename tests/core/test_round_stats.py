"""E-RAE, S-DR and S-PPR of one client-round (docs/method.md#empirical-readouts-e-rae-s-dr-s-ppr) on hand-computed
values with non-zero c and c_i, the state split over two tensors so the norms must be global."""

import math

import pytest
import torch

from ciders.core.diagnostics import RoundStats


def st(a, b):
    return {"a": torch.tensor([a], dtype=torch.float64), "b": torch.tensor([b], dtype=torch.float64)}


def test_round_stats_by_hand():
    # c = (1, 0), c_i = (0, 1), gamma = 0.5: corr = gamma (c - c_i) = (0.5, -0.5)
    s = RoundStats(st(1.0, 0.0), st(0.0, 1.0), 0.5)
    s.add(st(2.0, 0.0))  # g_eff - c = (1.5, -0.5): 2.5;  ||g||^2 + ||c||^2 = 4 + 1
    s.add(st(0.0, 2.0))  # g_eff - c = (-0.5, 1.5): 2.5;  ||g||^2 + ||c||^2 = 4 + 1
    r = s.result()
    # 5 / 10; without ||c||^2 in the denominator 5 / 8, without the correction 6 / 10, with it negated 9 / 10
    assert r["e_rae"] == pytest.approx(5.0 / 10.0, rel=1e-12)
    # mean g = (1, 1) against reference c: delta = (0, 1), r = delta + corr = (0.5, 0.5), DR = 1 - ||r|| / ||delta||;
    # g_perp = (0, 1), u = g + corr = (1.5, 0.5), PPR = <u, g_perp> / ||g_perp||^2
    assert r["s_dr"] == pytest.approx(1 - math.sqrt(0.5), rel=1e-12)
    assert r["s_ppr"] == pytest.approx(0.5, rel=1e-12)
