"""Robust aggregates (`ciders.core.aggregate.coordinate_median` / `trimmed_mean`, docs/method.md#robust-aggregation)
against Flower 1.42's own code on the same random client states: the legacy `flwr.server.strategy.aggregate`
functions (`aggregate_median`: np.median; `aggregate_trimmed_avg`: its `_trim_mean`) and the Message-API strategies
`flwr.serverapp.strategy.FedMedian` / `FedTrimmedAvg`, whose real `aggregate_train` runs on reply Messages as in
tests/core/test_server_opt.py. Both are unweighted: the replies' num-examples are deliberately unequal."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ciders.core import aggregate as agg

SHAPES = {"lora_A": (4, 3), "lora_B": (5,), "bias": (), "emb": (2, 3, 4)}
COUNTS = [1, 2, 3, 4, 5, 7, 10]
FRACTIONS = [0.0, 0.1, 0.2, 0.34, 0.49]
DTYPES = [np.float64, np.float32]


def flwr() -> SimpleNamespace:
    """Flower's records and Message-API strategies (a test that needs them skips without the flower extra)."""
    app = pytest.importorskip("flwr.app")
    strategy = pytest.importorskip("flwr.serverapp.strategy")
    from flwr.common import Metadata

    return SimpleNamespace(app=app, strategy=strategy, Metadata=Metadata)


def reply(arr: dict, n: int, node: int):
    """A train reply as a ServerApp receives it (explicit metadata: no SuperLink / run context needed)."""
    f = flwr()
    content = f.app.RecordDict({"arrays": f.app.ArrayRecord({k: f.app.Array(v) for k, v in arr.items()}),
                                "metrics": f.app.MetricRecord({"num-examples": n})})
    md = f.Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="i",
                    group_id="1", created_at=0.0, ttl=3600.0, message_type="train")
    return f.app.Message(content=content, metadata=md)


def client_states(n: int, dtype, seed: int = 0) -> list[dict]:
    """n clients' states: normal values with ties (rounded to a coarse grid in a few coordinates) and one heavy tail."""
    g = np.random.default_rng(1000 * n + seed)
    out = []
    for _ in range(n):
        s = {k: g.normal(0.0, 1.0, shape) * (1 + 9 * (g.random(shape) < 0.1)) for k, shape in SHAPES.items()}
        s["lora_A"][0] = np.round(s["lora_A"][0])  # ties between clients
        out.append({k: np.asarray(v, dtype=dtype) for k, v in s.items()})
    return out


def torch_states(states: list[dict]) -> list[dict]:
    return [{k: torch.from_numpy(v.copy()) for k, v in s.items()} for s in states]


def flower_legacy():
    return pytest.importorskip("flwr.server.strategy.aggregate")


def results(states: list[dict]) -> list:
    """The legacy API's [(NDArrays, num_examples)] in key order, with unequal counts that must not matter."""
    return [([s[k] for k in SHAPES], 10 * (i + 1)) for i, s in enumerate(states)]


def max_diff(ours: dict, theirs: list) -> float:
    return max(float(np.abs(ours[k].numpy().astype(np.float64) - np.asarray(t, dtype=np.float64)).max(initial=0.0))
               for k, t in zip(SHAPES, theirs))


def tol(dtype) -> float:
    """The trimmed mean's sums: float64 both sides (seen: < 1e-15); Flower sums float32 in float32 (seen: 5e-7)."""
    return 1e-12 if dtype == np.float64 else 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", COUNTS)
def test_median_equals_flower_aggregate_median(n, dtype):
    states = client_states(n, dtype)
    ours = agg.coordinate_median(torch_states(states))
    theirs = flower_legacy().aggregate_median(results(states))
    assert list(ours) == list(SHAPES)
    assert all(ours[k].dtype == torch.from_numpy(states[0][k]).dtype and ours[k].shape == SHAPES[k] for k in ours)
    assert max_diff(ours, theirs) == 0.0  # bit for bit, float32 too: (a + b) / 2 rounds once either way
    if n % 2 == 0 and n > 1:  # the mean of the two middle values, not torch.median's lower one
        lower = {k: torch.from_numpy(np.stack([s[k] for s in states])).median(dim=0).values for k in SHAPES}
        assert max(float((ours[k] - lower[k]).abs().max()) for k in SHAPES) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("n", COUNTS)
def test_trimmed_mean_equals_flower_aggregate_trimmed_avg(n, fraction, dtype):
    states = client_states(n, dtype)
    ours = agg.trimmed_mean(torch_states(states), fraction)
    theirs = flower_legacy().aggregate_trimmed_avg(results(states), fraction)
    assert list(ours) == list(SHAPES)
    assert all(ours[k].dtype == torch.from_numpy(states[0][k]).dtype for k in ours)
    assert max_diff(ours, theirs) < tol(dtype)


def run_strategy(strategy, states: list[dict]) -> list:
    """Flower's Message-API strategy on one round of train replies (unequal num-examples), in key order."""
    replies = [reply(s, 10 * (i + 1), i + 1) for i, s in enumerate(states)]
    arrays, _ = strategy.aggregate_train(1, replies)
    return [arrays[k].numpy() for k in SHAPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [2, 3, 4, 5, 10])
def test_median_equals_flower_fedmedian_strategy(n, dtype):
    states = client_states(n, dtype, seed=1)
    theirs = run_strategy(flwr().strategy.FedMedian(), states)
    assert max_diff(agg.coordinate_median(torch_states(states)), theirs) == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("n", [2, 3, 4, 5, 10])
def test_trimmed_mean_equals_flower_fedtrimmedavg_strategy(n, fraction, dtype):
    states = client_states(n, dtype, seed=2)
    theirs = run_strategy(flwr().strategy.FedTrimmedAvg(beta=fraction), states)
    assert max_diff(agg.trimmed_mean(torch_states(states), fraction), theirs) < tol(dtype)


def test_by_hand():
    """Five clients, one coordinate each: 1, 2, 3, 4, 100 (the outlier last); and four without the outlier."""
    five = [{"x": torch.tensor([v], dtype=torch.float64)} for v in (4.0, 100.0, 1.0, 3.0, 2.0)]
    assert agg.coordinate_median(five)["x"].item() == 3.0
    assert agg.trimmed_mean(five, 0.2)["x"].item() == 3.0  # int(0.2 * 5) = 1 cut from each end: (2 + 3 + 4) / 3
    assert agg.trimmed_mean(five, 0.0)["x"].item() == 22.0  # nothing cut: the unweighted mean
    assert agg.trimmed_mean(five, 0.1)["x"].item() == 22.0  # int(0.5) = 0
    assert agg.trimmed_mean(five, 0.4)["x"].item() == 3.0  # int(2.0) = 2 cut from each end: the middle one
    four = five[:1] + five[2:]  # 4, 1, 3, 2
    assert agg.coordinate_median(four)["x"].item() == 2.5  # (2 + 3) / 2
    assert agg.trimmed_mean(four, 0.49)["x"].item() == 2.5  # int(1.96) = 1: (2 + 3) / 2
    one = five[:1]
    assert agg.coordinate_median(one)["x"].item() == 4.0 and agg.trimmed_mean(one, 0.49)["x"].item() == 4.0


def test_unweighted_and_per_coordinate():
    """The median picks each coordinate from whichever client holds the middle value there; no weights enter."""
    a = {"x": torch.tensor([0.0, 10.0, 5.0])}
    b = {"x": torch.tensor([10.0, 5.0, 0.0])}
    c = {"x": torch.tensor([5.0, 0.0, 10.0])}
    assert torch.equal(agg.coordinate_median([a, b, c])["x"], torch.tensor([5.0, 5.0, 5.0]))
    assert torch.equal(agg.trimmed_mean([a, b, c], 0.34)["x"], torch.tensor([5.0, 5.0, 5.0]))


def test_float32_in_float32_out_without_overflow():
    """Computed in float64: two float32 values near the top of the range average to a finite float32."""
    s = [{"x": torch.tensor([3e38], dtype=torch.float32)}, {"x": torch.tensor([3e38], dtype=torch.float32)}]
    for out in (agg.coordinate_median(s), agg.trimmed_mean(s, 0.0)):
        assert out["x"].dtype == torch.float32 and torch.isfinite(out["x"]).all()


def test_keys_shapes_and_fraction_are_checked():
    a = {"x": torch.zeros(3), "y": torch.zeros(2)}
    with pytest.raises(ValueError, match="no client states"):
        agg.coordinate_median([])
    with pytest.raises(ValueError, match="no client states"):
        agg.trimmed_mean([], 0.2)
    with pytest.raises(ValueError, match="shape"):
        agg.coordinate_median([a, {"x": torch.zeros(4), "y": torch.zeros(2)}])
    with pytest.raises(KeyError, match="'y'"):
        agg.trimmed_mean([a, {"x": torch.zeros(3)}], 0.2)
    with pytest.raises(KeyError, match="'z'"):
        agg.coordinate_median([a, {**a, "z": torch.zeros(1)}])
    for bad in (-0.1, 0.5, 0.7):
        with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
            agg.trimmed_mean([a, a], bad)
    out = agg.trimmed_mean([{"y": torch.ones(2), "x": torch.ones(3)}], 0.2)
    assert list(out) == ["y", "x"]  # the first state's key order
