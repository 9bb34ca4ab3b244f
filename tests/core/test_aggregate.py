"""core.aggregate: the weighted (FedAvg) mean and the per-coordinate masked mean, by hand and bit for bit
against the implementations they replaced (consensus.weighted_mean, fedmeta.server_mean's loop,
masks.coordinate_mean / apply_coordinate_step, copied below as they were)."""

import pytest
import torch

from ciders.core import aggregate as agg
from ciders.core.tensors import lincomb


# ------------------------------------------------------------------------ the previous code, verbatim


def old_weights(sizes, uniform=False):
    if uniform:
        return [1.0 / len(sizes)] * len(sizes)
    total = float(sum(sizes))
    return [n / total for n in sizes]


def old_weighted_mean(states, p):  # core.consensus.weighted_mean
    return lincomb(list(zip(p, states)))


def old_server_mean(global_params, client_params, weights):  # algorithms.fedmeta.server_mean
    w = [float(v) for v in weights]
    total = sum(w)
    out = {}
    for k, ref in global_params.items():
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for j, c in enumerate(client_params):
            acc += (w[j] / total) * c[k].detach().to(torch.float64)
        out[k] = acc.to(ref.dtype)
    return out


def old_coordinate_mean(values, masks):  # core.masks.coordinate_mean
    keys = values[0].keys()
    total = {k: torch.zeros_like(values[0][k]) for k in keys}
    count = {k: torch.zeros_like(values[0][k]) for k in keys}
    for v, m in zip(values, masks):
        for k in keys:
            total[k] += v[k] * m[k]
            count[k] += m[k]
    mean = {k: torch.where(count[k] > 0, total[k] / count[k].clamp_min(1), torch.zeros_like(total[k])) for k in keys}
    return mean, count


def old_apply_coordinate_step(state, values, masks, lr):  # core.masks.apply_coordinate_step
    mean, count = old_coordinate_mean(values, masks)
    new = {k: state[k] - lr * mean[k] for k in state}
    trained_counts = [c[c > 0] for c in count.values() if bool((c > 0).any())]
    cover = min(int(c.min()) for c in trained_counts) if trained_counts else 0
    trained = sum(int((c > 0).sum()) for c in count.values())
    return new, {"covering": cover, "coordinates_trained": trained,
                 "coordinates": sum(c.numel() for c in count.values())}


def bits_equal(a, b):
    """Same keys, dtypes, shapes and bit patterns (torch.equal alone would take -0.0 for 0.0)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        view = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
                torch.float16: torch.int16}[x.dtype]
        if not torch.equal(x.contiguous().view(view), y.contiguous().view(view)):
            return False
    return True


def random_states(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(5, 4, generator=g).to(dtype), "b": torch.randn(4, generator=g).to(dtype)}
            for _ in range(n)]


# --------------------------------------------------------------------------------------- by hand


def test_weights_are_normalised():
    assert agg.normalise([1, 3]) == [0.25, 0.75]
    assert agg.normalise([10.0, 30.0]) == [0.25, 0.75]  # only the proportions matter
    assert agg.normalise([0, 2]) == [0.0, 1.0]
    assert agg.client_weights([1, 3]) == [0.25, 0.75]
    assert agg.client_weights([5, 5, 5], uniform=True) == [1 / 3] * 3
    assert sum(agg.client_weights([7, 11, 13])) == pytest.approx(1.0, abs=1e-15)
    for bad in ([], [0.0, 0.0], [1.0, -1.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError):
            agg.normalise(bad)
    with pytest.raises(ValueError, match="sizes"):
        agg.client_weights([0, 0])


def test_weighted_mean_by_hand():
    c1 = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[4.0, 0.0]])}
    c2 = {"a": torch.tensor([5.0, -2.0]), "b": torch.tensor([[0.0, 8.0]])}
    out = agg.weighted_mean([c1, c2], [1.0, 3.0])  # p = (1/4, 3/4)
    assert out["a"].tolist() == [0.25 * 1 + 0.75 * 5, 0.25 * 2 - 0.75 * 2] == [4.0, -1.0]
    assert out["b"].tolist() == [[1.0, 6.0]] and out["a"].dtype == torch.float32
    same = agg.weighted_sum([c1, c2], [0.25, 0.75])  # p given as it is
    assert same["a"].tolist() == [4.0, -1.0] and same["b"].tolist() == [[1.0, 6.0]]
    assert agg.weighted_sum([c1, c2], [1.0, 1.0])["a"].tolist() == [6.0, 0.0]  # no normalising there
    with pytest.raises(ValueError, match="no client"):
        agg.weighted_mean([], [])
    with pytest.raises(ValueError, match="2 client states but 1 weights"):
        agg.weighted_mean([c1, c2], [1.0])
    with pytest.raises(KeyError, match="client 1 has no 'b'"):
        agg.weighted_sum([c1, {"a": c2["a"]}], [0.5, 0.5])
    with pytest.raises(KeyError, match="lacks"):
        agg.weighted_sum([c1, {**c2, "z": torch.zeros(1)}], [0.5, 0.5])
    with pytest.raises(ValueError, match="shape"):
        agg.weighted_sum([c1, {"a": torch.zeros(3), "b": c2["b"]}], [0.5, 0.5])


def test_masked_mean_by_hand_untouched_coordinates_and_covering_counts():
    s = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0]), "h": torch.tensor([[10.0, 20.0]])}
    v = [{"w": torch.tensor([1.0, 1.0, 1.0, 9.0]), "h": torch.tensor([[2.0, 4.0]])},
         {"w": torch.tensor([3.0, 5.0, 7.0, 9.0]), "h": torch.tensor([[6.0, 8.0]])},
         {"w": torch.tensor([5.0, 0.0, 0.0, 9.0]), "h": torch.tensor([[1.0, 1.0]])}]
    m = [{"w": torch.tensor([1.0, 1.0, 0.0, 0.0]), "h": torch.tensor([[1.0, 1.0]])},
         {"w": torch.tensor([1.0, 0.0, 1.0, 0.0]), "h": torch.tensor([[1.0, 0.0]])},
         {"w": torch.tensor([1.0, 0.0, 0.0, 0.0]), "h": torch.tensor([[0.0, 0.0]])}]
    mean, count = agg.masked_mean(v, m)
    # w: coordinate 0 all three (mean 3), 1 client 0 (1), 2 client 1 (7), 3 nobody (0, not 9)
    assert mean["w"].tolist() == [3.0, 1.0, 7.0, 0.0] and count["w"].tolist() == [3.0, 1.0, 1.0, 0.0]
    assert mean["h"].tolist() == [[4.0, 4.0]] and count["h"].tolist() == [[2.0, 1.0]]
    new, stats = agg.masked_step(s, v, m, lr=0.5)
    assert new["w"].tolist() == [1.0 - 1.5, 2.0 - 0.5, 3.0 - 3.5, 4.0]  # coordinate 3 untouched
    assert new["h"].tolist() == [[10.0 - 2.0, 20.0 - 2.0]]
    assert stats == {"covering": 1, "coordinates_trained": 5, "coordinates": 6}
    assert agg.covering({"w": torch.tensor([0.0, 2.0, 3.0])}) == {"covering": 2, "coordinates_trained": 2,
                                                                  "coordinates": 3}
    assert agg.covering({"w": torch.zeros(2)})["covering"] == 0
    with pytest.raises(ValueError, match="one mask per value"):
        agg.masked_mean(v, m[:2])


def test_full_masks_give_the_uniform_weighted_mean():
    vals = random_states(3, torch.float64, 4)
    full = [{k: torch.ones_like(t) for k, t in v.items()} for v in vals]
    mean, count = agg.masked_mean(vals, full)
    want = agg.weighted_mean(vals, [1, 1, 1])
    assert all(torch.allclose(mean[k], want[k], rtol=1e-15, atol=1e-15) for k in want)
    assert all(bool((c == 3).all()) for c in count.values())


# ------------------------------------------------------------------- bit for bit against the old code


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bit_identical_to_the_replaced_implementations(dtype):
    states = random_states(4, dtype, 0)
    sizes = [3, 17, 5, 11]
    for uniform in (False, True):
        p = agg.client_weights(sizes, uniform=uniform)
        assert p == old_weights(sizes, uniform=uniform)
        assert bits_equal(agg.weighted_sum(states, p), old_weighted_mean(states, p))  # CIDERS Eq. 12
    ref = {k: torch.zeros_like(v) for k, v in states[0].items()}
    for w in ([1.0, 1.0, 1.0, 1.0], [0.5, 0.25, 0.125, 1.0], sizes):
        assert bits_equal(agg.weighted_mean(states, w, like=ref), old_server_mean(ref, states, w))  # FedAvg

    g = torch.Generator().manual_seed(1)
    masks = [{k: (torch.rand(v.shape, generator=g) < 0.5).to(dtype) for k, v in s.items()} for s in states]
    mean, count = agg.masked_mean(states, masks)
    old_mean, old_count = old_coordinate_mean(states, masks)
    assert bits_equal(mean, old_mean) and bits_equal(count, old_count)
    new, stats = agg.masked_step(ref, states, masks, 0.3)
    old_new, old_stats = old_apply_coordinate_step(ref, states, masks, 0.3)
    assert bits_equal(new, old_new) and stats == old_stats


def test_fedmeta_server_mean_is_the_fedavg_mean():
    from ciders.algorithms import fedmeta

    states = random_states(3, torch.float32, 2)
    ref = {k: torch.zeros_like(v) for k, v in states[0].items()}
    assert bits_equal(fedmeta.server_mean(ref, states, [2, 1, 1]), old_server_mean(ref, states, [2, 1, 1]))
    with pytest.raises(ValueError, match="server_mean: no client"):
        fedmeta.server_mean(ref, [], [])
