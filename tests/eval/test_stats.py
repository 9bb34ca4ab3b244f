"""eval.stats: Student-t 95% intervals over seeds, against tabulated quantiles."""

import math

import pytest

from ciders.eval.stats import mean_ci95, t975


def test_t_quantiles_match_the_tables_and_tend_to_the_normal():
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(4) == 2.776 and t975(30) == 2.042
    assert t975(40) == pytest.approx(2.021, abs=1e-3) and t975(120) == pytest.approx(1.980, abs=1e-3)
    assert t975(10 ** 6) == pytest.approx(1.960, abs=1e-3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="degrees of freedom"):
            t975(bad)


def test_mean_ci95_is_t_s_over_root_n():
    got = mean_ci95([1.0, 2.0, 6.0])
    assert got["mean"] == 3.0 and got["std"] == pytest.approx(math.sqrt(7)) and got["n"] == 3
    assert got["ci95"] == pytest.approx(4.303 * math.sqrt(7) / math.sqrt(3))
    assert mean_ci95([5.0])["ci95"] == 0.0
    with pytest.raises(ValueError, match="no values"):
        mean_ci95([])
    with pytest.raises(ValueError, match="non-finite"):
        mean_ci95([1.0, float("nan")])
