"""Structured masks (capacity, rules) and per-coordinate aggregation against hand computations."""

import pytest
import torch

from ciders.core import aggregate as agg
from ciders.core import masks as mk


def model():
    g = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(8, 3, 3, 3, generator=g), "conv.bias": torch.randn(8, generator=g),
            "bn.weight": torch.randn(8, generator=g), "fc.weight": torch.randn(10, 8, generator=g),
            "fc.bias": torch.randn(10, generator=g)}


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.25, 0.125, 1 / 16])
@pytest.mark.parametrize("rule", ["importance", "static", "rolling", "oap"])
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
    new, stats = agg.masked_step(s, g, m, lr=0.5)
    # coordinate 0: both (mean 2); 1: client 0 (1); 2: client 1 (7); 3: nobody -> unchanged
    assert new["w"].tolist() == [1.0 - 0.5 * 2, 2.0 - 0.5 * 1, 3.0 - 0.5 * 7, 4.0]
    assert stats == {"covering": 1, "coordinates_trained": 3, "coordinates": 4}  # C* over trained coordinates


def test_full_masks_reduce_to_the_plain_average():
    g = torch.Generator().manual_seed(1)
    vals = [{"a": torch.randn(4, 3, generator=g)} for _ in range(3)]
    full = [mk.structured_masks(v, 1.0, "importance") for v in vals]
    mean, count = agg.masked_mean(vals, full)
    assert torch.allclose(mean["a"], sum(v["a"] for v in vals) / 3, atol=0, rtol=1e-6)
    assert bool((count["a"] == 3).all())
    assert mk.masked_fraction(mk.structured_masks(vals[0], 0.5, "static")) == 0.5


def test_magnitude_rule_keeps_the_largest_entries_of_each_tensor():
    p = {"fc.weight": torch.tensor([[0.1, -3.0], [2.0, 0.0]]), "fc.bias": torch.tensor([5.0, -1.0]),
         "head.weight": torch.tensor([[0.0, 0.0]])}
    m = mk.structured_masks(p, 0.5, "magnitude", keep_full=["head"])
    assert m["fc.weight"].tolist() == [[0.0, 1.0], [1.0, 0.0]] and m["fc.bias"].tolist() == [1.0, 0.0]
    assert m["head.weight"].tolist() == [[1.0, 1.0]]


PAPER_CAPS = [(1.0, 0.5, 0.25, 0.125, 1 / 16)[i % 5] for i in range(10)]  # 10 clients, R[i mod 5] (config default)


def oap_counts(w, caps, round_):
    """How many clients keep each unit of `w` under oap, and each client's kept units."""
    kept = [mk.kept_units(w, r, "oap", round_, client=i, capacities=caps) for i, r in enumerate(caps)]
    count = torch.zeros(w.shape[0], dtype=torch.long)
    for u in kept:
        count[u] += 1
    return count, kept


@pytest.mark.parametrize("caps", [PAPER_CAPS, [0.5, 0.25, 0.125, 1 / 16] * 2 + [0.25, 0.125]])
@pytest.mark.parametrize("n", [3, 8, 10, 37, 64])
def test_oap_capacity_and_optimal_coverage_every_round(caps, n):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, 5, generator=g)
    rank = torch.empty(n, dtype=torch.long)
    rank[torch.argsort(-w.abs().sum(1), stable=True)] = torch.arange(n)  # 0 = largest L1 norm
    ks = [max(1, round(r * n)) for r in caps]
    total = sum(ks)
    for q in range(12):
        count, kept = oap_counts(w, caps, q)
        for u, k in zip(kept, ks):
            assert len(u) == k and len(set(u.tolist())) == k  # exactly k = max(1, round(R*out)) distinct units
        assert int(count.min()) >= 1  # every unit trained by some client in every round
        # coverage of the unit of rank p: floor(L/n), plus one for the L mod n highest-norm units
        assert torch.equal(count, total // n + (rank < total % n).long())


def test_oap_beats_importance_on_coverage_without_a_full_client():
    caps = [0.5, 0.25, 0.25, 0.125, 0.125, 1 / 16, 1 / 16, 1 / 16, 1 / 16]  # sum 1.5: coverage is possible
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(3))
    count, _ = oap_counts(w, caps, round_=5)
    assert int(count.min()) == 1 and int(count.max()) == 2  # 24 slots over 16 units
    imp = torch.zeros(16, dtype=torch.long)
    for r in caps:
        imp[mk.kept_units(w, r, "importance")] += 1
    assert int((imp == 0).sum()) == 8  # the importance rule never trains the lower half


def test_oap_by_hand():
    w = torch.tensor([[1.0, 1.0], [5.0, 0.0], [0.0, 0.5], [3.0, 3.0]])  # L1 2, 5, .5, 6: ranking 3, 1, 0, 2
    caps = [0.5, 0.5, 0.25]  # k = 2, 2, 1: tape 3 1 | 0 2 | 3
    got = [mk.kept_units(w, r, "oap", 0, client=i, capacities=caps).tolist() for i, r in enumerate(caps)]
    assert got == [[1, 3], [0, 2], [3]]
    # round 1: clients in the order 1, 2, 0: tape 3 1 | 0 | 2 3
    got = [mk.kept_units(w, r, "oap", 1, client=i, capacities=caps).tolist() for i, r in enumerate(caps)]
    assert got == [[2, 3], [1, 3], [0]]


def test_oap_is_deterministic_rotates_the_top_window_and_defaults_to_importance():
    w = torch.randn(20, 6, generator=torch.Generator().manual_seed(7))
    for q in (0, 3, 11):
        for i, r in enumerate(PAPER_CAPS):
            a = mk.kept_units(w, r, "oap", q, client=i, capacities=PAPER_CAPS)
            b = mk.kept_units(w.clone(), r, "oap", q, client=i, capacities=list(PAPER_CAPS))
            assert torch.equal(a, b)
    for i, r in enumerate(PAPER_CAPS):  # client i heads the tape in round i: it gets the top-k units
        assert torch.equal(mk.kept_units(w, r, "oap", i, client=i, capacities=PAPER_CAPS),
                           mk.kept_units(w, r, "importance"))
    for r in (0.5, 0.25, 1 / 16):  # one client (the default): oap is the importance rule
        assert torch.equal(mk.kept_units(w, r, "oap", 4), mk.kept_units(w, r, "importance"))
    # n_clients alone: equal capacities; 4 clients x k=5 tile the 20 units exactly once
    count = torch.zeros(20, dtype=torch.long)
    for i in range(4):
        count[mk.kept_units(w, 0.25, "oap", 2, client=i, n_clients=4)] += 1
    assert bool((count == 1).all())
    with pytest.raises(ValueError, match="ratio"):
        mk.kept_units(w, 0.5, "oap", client=2, capacities=PAPER_CAPS)  # client 2's capacity is 0.25
    with pytest.raises(ValueError, match="client"):
        mk.kept_units(w, 0.5, "oap", client=10, capacities=PAPER_CAPS)


def test_oap_structured_masks_cover_every_coordinate():
    p = model()
    kw = {"groups": {"bn.weight": "conv"}, "keep_full": ["fc"], "capacities": PAPER_CAPS}
    for q in range(3):
        masks = [mk.structured_masks(p, r, "oap", round_=q, client=i, **kw) for i, r in enumerate(PAPER_CAPS)]
        _, stats = agg.masked_step(p, [p] * 10, masks, lr=0.1)
        # conv: 8 units, k = 8, 4, 2, 1, 1 twice = 32 slots -> every channel by exactly 4 clients
        assert stats["covering"] == 4 and stats["coordinates_trained"] == stats["coordinates"]
    imp = [mk.structured_masks(p, r, "importance", **{k: v for k, v in kw.items() if k != "capacities"})
           for r in PAPER_CAPS]
    assert agg.masked_step(p, [p] * 10, imp, lr=0.1)[1]["covering"] == 2  # only the two full clients


def test_segment_rule_windows_and_the_covering_number_it_sets():
    """`segment`: client s keeps units [s k, (s + 1) k) mod n of every layer. On Conv4 with the head's columns
    following the backbone (the C_x* ablation's model), C_x* is the size of the least-shared segment: 2 for
    segments 0,0,0,1,1,1,2,2,3,3 and 1 for 0,0,0,1,1,1,2,2,2,3; the cross-segment blocks of a conv between two
    pruned layers are trained by nobody and do not count."""
    from dataclasses import replace

    from ciders.algorithms import rabo as rb
    from ciders.config.bilevel import RaboConfig
    from ciders.models import vision as vz

    w = torch.zeros(8, 2)
    assert mk.kept_units(w, 0.25, "segment", segment=1).tolist() == [2, 3]
    assert mk.kept_units(w, 0.25, "segment", segment=5).tolist() == [2, 3]  # mod n
    assert mk.kept_units(w, 0.5, "segment", segment=1, round_=7).tolist() == [4, 5, 6, 7]  # fixed over rounds
    with pytest.raises(ValueError, match="segment must be an integer >= 0"):
        mk.kept_units(w, 0.5, "segment", segment=-1)
    state = rb.init_state(vz.conv4_init(width=8), vz.linear_init(5, 8))
    units = {"x": vz.conv4_units(), "y": vz.linear_units("block3.conv")}
    for segs, want in (((0, 0, 0, 1, 1, 1, 2, 2, 3, 3), 2), ((0, 0, 0, 1, 1, 1, 2, 2, 2, 3), 1)):
        cfg = replace(RaboConfig(), mask_rule="segment", segments=segs, keep_full=("head",)).validate()
        ms = [rb.client_masks(cfg, state, 0.25, units=units, client=i) for i in range(10)]
        _, cx = agg.masked_step(state.x, [state.x] * 10, [m.x for m in ms], lr=0.1)
        assert cx["covering"] == want
        assert 0 < cx["coordinates_trained"] < cx["coordinates"]  # off-diagonal blocks: nobody
        for i in (0, 3, 6):  # every client's mask is its own quarter of block 1's channels
            assert ms[i].x["block1.conv.bias"].nonzero().flatten().tolist() == [2 * segs[i], 2 * segs[i] + 1]
    with pytest.raises(Exception, match="rabo.segments: each must be an integer >= 0"):
        replace(RaboConfig(), segments=(0, -1)).validate()


# ------------------------------------------------------------------ bn_scale: an importance score that tracks training


def _conv4(width=16):
    from ciders.models import vision as vz

    return vz.conv4_init(width=width, seed=0), vz.conv4_groups()


def _kept(p, groups, norm, ratio=0.25):
    m = mk.structured_masks(p, ratio, "importance", norm=norm, groups=groups)
    return {i: set(torch.nonzero(m[f"block{i}.conv.bias"]).flatten().tolist()) for i in range(4)}


def test_bn_scale_ranks_by_the_scale_and_breaks_ties_by_l1():
    p, groups = _conv4()
    assert _kept(p, groups, "bn_scale") == _kept(p, groups, "l1")  # every scale 1 at init: the l1 mask
    g = torch.arange(16.0).flip(0)  # channel 0 largest ... 15 smallest, sign ignored
    p = {**p, "block1.bn.weight": -g}
    assert _kept(p, groups, "bn_scale")[1] == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="mask norm"):
        mk.kept_units(p["block0.conv.weight"], 0.5, "importance", norm="l3")


def test_bn_scale_sees_what_the_network_computes_and_l1_does_not():
    """Scaling a conv channel's weights and bias leaves a batch-statistics BN's output unchanged (the function
    is the same), yet moves the L1 ranking; bn_scale keeps its mask. Scaling the BN's scale does change the
    function, and bn_scale follows it."""
    from ciders.models import vision as vz

    p, groups = _conv4()
    gen = torch.Generator().manual_seed(2)
    p = {**p, **{f"block{i}.bn.weight": 1 + 0.1 * torch.randn(16, generator=gen) for i in range(4)}}  # trained-like
    imgs = torch.rand(8, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    low = sorted(set(range(16)) - _kept(p, groups, "l1")[2])[:4]  # four channels the l1 mask drops
    q = dict(p)
    for k in ("block2.conv.weight", "block2.conv.bias"):
        q[k] = p[k].clone()
        q[k][low] *= 100.0
    assert torch.allclose(vz.conv4_features(q, imgs), vz.conv4_features(p, imgs), atol=1e-4)
    assert _kept(q, groups, "l1")[2] == set(low)  # l1 follows a change the network cannot see
    assert _kept(q, groups, "bn_scale") == _kept(p, groups, "bn_scale")
    q = {**p, "block2.bn.weight": p["block2.bn.weight"].clone()}
    q["block2.bn.weight"][low] = 3.0
    assert _kept(q, groups, "bn_scale")[2] == set(low)


def test_bn_scale_masks_move_with_training_on_real_episodes():
    """20 ProtoNet steps on real Omniglot episodes: the bn_scale masks leave their initial units (14 of the 16
    kept units changed, against 9 for the L1 masks of the same weights; docs/rabo.md#importance-under-batch-norm)."""
    from ciders.algorithms.dist_protonet import protonet_loss
    from ciders.models import vision as vz
    from ciders.tasks import omniglot as om
    from helpers import vendored

    pool = om.load_characters(vendored("omniglot-slice", "images_background_small1.zip"))
    chars, g = sorted(pool), torch.Generator().manual_seed(0)
    p, groups = _conv4()
    start = {n: _kept(p, groups, n) for n in ("l1", "bn_scale")}
    x = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    opt = torch.optim.SGD(x.values(), lr=0.1)
    for _ in range(20):
        opt.zero_grad()
        protonet_loss(vz.conv4_features, x, om.episode(pool, chars, 5, 1, 3, g)).backward()
        opt.step()
    trained = {k: v.detach() for k, v in x.items()}
    moved = {n: sum(len(start[n][i] - _kept(trained, groups, n)[i]) for i in range(4)) for n in start}
    assert moved["bn_scale"] >= 8, moved  # of 16 kept units (4 per layer)
    assert moved["bn_scale"] > moved["l1"], moved


def test_bn_scale_through_rabo_client_masks_and_the_conv4_plan():
    from ciders.algorithms import rabo as rb
    from ciders.models import vision as vz

    x = vz.conv4_init(width=16, seed=0)
    x["block3.bn.weight"] = torch.arange(16.0)  # channels 12-15 have the largest scales
    y = vz.linear_init(5, 16)
    units = {"x": vz.conv4_units(), "y": vz.linear_units("block3.conv")}
    for norm, want in (("bn_scale", {12, 13, 14, 15}), ("l1", None)):
        cfg = rb.RaboConfig(mask_norm=norm)
        m = rb.client_masks(cfg, rb.init_state(x, y), 0.25, units=units)
        kept = set(torch.nonzero(m.x["block3.conv.bias"]).flatten().tolist())
        assert len(kept) == 4 and (want is None or kept == want)
        assert set(torch.nonzero(m.y["head.weight"].sum(0)).flatten().tolist()) == kept  # the head's columns follow
