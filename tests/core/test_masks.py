"""Structured masks (capacity, rules) and per-coordinate aggregation against hand computations."""

import pytest
import torch

from ciders.core import masks as mk


def model():
    g = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(8, 3, 3, 3, generator=g), "conv.bias": torch.randn(8, generator=g),
            "bn.weight": torch.randn(8, generator=g), "fc.weight": torch.randn(10, 8, generator=g),
            "fc.bias": torch.randn(10, generator=g)}


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.25, 0.125, 1 / 16])
@pytest.mark.parametrize("rule", ["importance", "static", "rolling"])
def test_masks_keep_whole_units_at_the_capacity(ratio, rule):
    p = model()
    m = mk.structured_masks(p, ratio, rule, round_=3, groups={"bn.weight": "conv"}, keep_full=["fc"])
    rows = m["conv.weight"].reshape(8, -1)
    kept = rows.amax(1)
    assert torch.equal(rows, kept[:, None].expand_as(rows))  # whole output channels
    assert int(kept.sum()) == max(1, round(ratio * 8))
    assert torch.equal(m["conv.bias"], kept) and torch.equal(m["bn.weight"], kept)  # 1-D params follow
    assert bool((m["fc.weight"] == 1).all() and (m["fc.bias"] == 1).all())  # the classifier is never pruned


def test_rules_pick_the_documented_units():
    w = torch.tensor([[1.0, 1.0], [5.0, 0.0], [0.0, 0.5], [3.0, 3.0]])
    assert mk.kept_units(w, 0.5, "importance").tolist() == [1, 3]  # L1 norms 2, 5, .5, 6
    assert mk.kept_units(w, 0.5, "importance", norm="l2").tolist() == [1, 3]
    assert mk.kept_units(w, 0.5, "static").tolist() == [0, 1]
    assert mk.kept_units(w, 0.5, "rolling", round_=3).tolist() == [0, 3]  # units 3, 4 mod 4
    assert mk.kept_units(w, 0.5, "full").tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="capacity"):
        mk.kept_units(w, 0.0, "static")


def test_coordinate_aggregation_with_overlapping_masks_by_hand():
    s = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    g = [{"w": torch.tensor([1.0, 1.0, 1.0, 9.0])}, {"w": torch.tensor([3.0, 5.0, 7.0, 9.0])}]
    m = [{"w": torch.tensor([1.0, 1.0, 0.0, 0.0])}, {"w": torch.tensor([1.0, 0.0, 1.0, 0.0])}]
    new, stats = mk.apply_coordinate_step(s, g, m, lr=0.5)
    # coordinate 0: both (mean 2); 1: client 0 (1); 2: client 1 (7); 3: nobody -> unchanged
    assert new["w"].tolist() == [1.0 - 0.5 * 2, 2.0 - 0.5 * 1, 3.0 - 0.5 * 7, 4.0]
    assert stats == {"covering": 1, "coordinates_trained": 3, "coordinates": 4}  # C* over trained coordinates


def test_full_masks_reduce_to_the_plain_average():
    g = torch.Generator().manual_seed(1)
    vals = [{"a": torch.randn(4, 3, generator=g)} for _ in range(3)]
    full = [mk.structured_masks(v, 1.0, "importance") for v in vals]
    mean, count = mk.coordinate_mean(vals, full)
    assert torch.allclose(mean["a"], sum(v["a"] for v in vals) / 3, atol=0, rtol=1e-6)
    assert bool((count["a"] == 3).all())
    assert mk.masked_fraction(mk.structured_masks(vals[0], 0.5, "static")) == 0.5


def test_magnitude_rule_keeps_the_largest_entries_of_each_tensor():
    p = {"fc.weight": torch.tensor([[0.1, -3.0], [2.0, 0.0]]), "fc.bias": torch.tensor([5.0, -1.0]),
         "head.weight": torch.tensor([[0.0, 0.0]])}
    m = mk.structured_masks(p, 0.5, "magnitude", keep_full=["head"])
    assert m["fc.weight"].tolist() == [[0.0, 1.0], [1.0, 0.0]] and m["fc.bias"].tolist() == [1.0, 0.0]
    assert m["head.weight"].tolist() == [[1.0, 1.0]]
