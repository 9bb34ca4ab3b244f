import pytest

from ciders.errors import ConfigError
from ciders.models.split import split_layers, strided_indices, student_count


def test_index_formula_matches_algorithm1():
    # floor(j * (m-1) / (n'-1)), j = 0..n'-1, written out for m = 22, n' = 18 (Qwen2-1.5B, a = 6)
    m, k = 22, 18
    assert strided_indices(m, k) == tuple(int(j * (m - 1) / (k - 1)) for j in range(k))
    idx = strided_indices(m, k)
    assert idx[0] == 0 and idx[-1] == m - 1 and len(set(idx)) == k


def test_paper_models_need_round():
    # Table II: Qwen2-1.5B 28 layers, a = 6, drop 0.2 -> 18 student layers: 0.8 * 22 = 17.6
    assert split_layers(28, 6, drop_ratio=0.2).student_layers == 18
    assert split_layers(28, 6, drop_ratio=0.2, rounding="floor").student_layers == 17
    assert split_layers(36, 6, drop_ratio=0.2).student_layers == 24  # Qwen2.5-3B
    assert split_layers(36, 6, drop_ratio=0.2, rounding="floor").student_layers == 24


@pytest.mark.parametrize("beta, m, rnd, flr", [(0.5, 5, 3, 2), (0.25, 10, 3, 2), (0.29, 100, 29, 29), (1.0, 7, 7, 7)])
def test_rounding_modes(beta, m, rnd, flr):
    # half up (not banker's rounding), and float error guarded: 0.29 * 100 = 28.999999999999996
    assert student_count(m, beta, "round") == rnd
    assert student_count(m, beta, "floor") == flr


def test_split_parts():
    s = split_layers(30, 2, drop_ratio=0.5)
    assert s.teacher_layers == 28 and s.messenger_indices == (28, 29)
    assert s.student_indices == (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 27)
    assert s.edge_layers == 16
    assert split_layers(10, 2, student_layers=1).student_indices == (0,)
    assert split_layers(10, 2, beta=1.0).student_indices == tuple(range(8))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_layers=6, messenger_layers=6), "must be < n=6"),
        (dict(n_layers=6, messenger_layers=7), "must be < n=6"),
        (dict(n_layers=6, messenger_layers=0), ">= 1"),
        (dict(n_layers=6, messenger_layers=2, beta=1.5), r"beta: must be in \(0, 1\]"),
        (dict(n_layers=6, messenger_layers=2, beta=0.0), r"beta: must be in \(0, 1\]"),
        (dict(n_layers=6, messenger_layers=2, drop_ratio=1.0), r"drop_ratio: must be in \[0, 1\)"),
        (dict(n_layers=6, messenger_layers=2, beta=0.5, drop_ratio=0.5), "only one of"),
        (dict(n_layers=6, messenger_layers=2, student_layers=5), r"must be in \[1, 4\]"),
        (dict(n_layers=40, messenger_layers=2, beta=0.01), "rounds to 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        split_layers(**kwargs)
