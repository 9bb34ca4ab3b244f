"""Omniglot episodes from the real zips, Conv4 as a function of named parameters, and RABO rounds on them:
masks drop whole conv channels with their BN, capacity-1/4 clients leave channels to the full client
(C_x* = 1), and the hypergradient flows into x only where the client's mask is on."""

import pytest
import torch
import torch.nn.functional as F

from ciders.algorithms import rabo as rb
from ciders.models import vision as vz
from ciders.tasks import omniglot as om
from helpers import shared, vendored


@pytest.mark.full_data
def test_characters_shards_and_episodes():
    pool = om.load_characters(shared("omniglot", "images_background_small1.zip"))
    assert len(pool) == 136 and all(v.shape == (20, 1, 28, 28) for v in pool.values())
    imgs = torch.stack(list(pool.values()))
    assert float(imgs.min()) >= 0 and float(imgs.max()) <= 1 and 0.02 < float(imgs.mean()) < 0.3  # ink is sparse
    shards = om.shard(sorted(pool), 10, seed=0)
    flat = [c for s in shards for c in s]
    assert sorted(flat) == sorted(pool) and len(set(flat)) == 136 and {len(s) for s in shards} <= {13, 14}
    ep = om.episode(pool, shards[0], 5, 1, 3, torch.Generator().manual_seed(0))
    assert ep.support.shape == (5, 1, 28, 28) and ep.query.shape == (15, 1, 28, 28)
    assert sorted(ep.support_labels.tolist()) == list(range(5)) and sorted(set(ep.query_labels.tolist())) == list(range(5))


@pytest.mark.full_data
def test_official_one_shot_runs():
    runs = om.one_shot_runs(shared("omniglot", "all_runs.zip"))
    assert len(runs) == 20
    for r in runs:
        assert r.support.shape == (20, 1, 28, 28) and r.query.shape == (20, 1, 28, 28)
        assert sorted(r.query_labels.tolist()) == list(range(20))  # each class is queried once


def test_rabo_round_on_omniglot_with_conv4():
    pool = om.load_characters(vendored("omniglot-slice", "images_background_small1.zip"))  # 24 characters
    shards = om.shard(sorted(pool), 3, seed=0)
    width, n_way = 16, 5

    def g(x, y, ep):
        return F.cross_entropy(vz.linear(y, vz.conv4_features(x, ep.support)), ep.support_labels) + \
            0.05 * sum((v ** 2).sum() for v in y.values())

    def f(x, y, ep):
        return F.cross_entropy(vz.linear(y, vz.conv4_features(x, ep.query)), ep.query_labels)

    cfg = rb.RaboConfig(inner_steps=3, beta=0.5, alpha=0.1, solver_iters=5, keep_full=("head",)).validate()
    s = rb.init_state(vz.conv4_init(width=width, seed=0), vz.linear_init(n_way, width))
    gen = torch.Generator().manual_seed(0)
    eps = [om.episode(pool, sh, n_way, 1, 5, gen) for sh in shards]
    units = {"x": vz.conv4_units(), "y": vz.linear_units("block3.conv")}
    masks = [rb.client_masks(cfg, s, r, units=units) for r in (1.0, 0.5, 0.25)]
    for m, r in zip(masks, (1.0, 0.5, 0.25)):
        keep = m.x["block3.conv.weight"].reshape(width, -1).amax(1)
        assert int(keep.sum()) == round(r * width) and torch.equal(m.x["block3.bn.weight"], keep)
        # class outputs are never pruned; the head reads only the kept channels
        assert torch.equal(m.y["head.weight"], keep[None, :].expand(n_way, width))
    Gs = [rb.inner_update(cfg, s, m, g, [e] * 3)[0] for m, e in zip(masks, eps)]
    mid, si = rb.server_inner(cfg, s, Gs, masks)
    outs = [rb.outer_update(cfg, mid, m, f, g, e) for m, e in zip(masks, eps)]
    for (h, _), m in zip(outs, masks):
        assert all(bool(torch.isfinite(v).all()) for v in h.values())
        assert all(bool((h[k][m.x[k] == 0] == 0).all()) for k in h)  # nothing outside the sub-model travels
    new, so = rb.server_outer(cfg, mid, [o[0] for o in outs], masks)
    assert so["covering_x"] == 1 and si["covering_y"] == 1  # the head's columns of channels only the full client has
    assert any(not torch.equal(new.x[k], s.x[k]) for k in s.x)


def test_bilevel_loop_logs_covering_compute_and_bytes_against_fedmbo(tmp_path):
    """Two rounds of RABO and of FedMBO on real Omniglot through the bilevel loop: per-round covering
    numbers, and the sub-model clients cost fewer bytes and fewer gradient calls than FedMBO's."""
    from dataclasses import replace

    from ciders.algorithms import fedmbo
    from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig
    from ciders.federation.bilevel_loop import run_bilevel
    from ciders.workloads.bilevel import FewShotTask
    from ciders.fileio import read_jsonl

    pool = om.load_characters(vendored("omniglot-slice", "images_background_small1.zip"))  # Balinese
    ev = om.load_characters(vendored("omniglot-slice", "images_background_small2.zip"))  # Tagalog, held out
    assert {k.split("/")[0] for k in ev}.isdisjoint(k.split("/")[0] for k in pool)
    caps = [1.0, 0.5, 0.25]
    cfg = rb.RaboConfig(inner_steps=2, beta=0.5, alpha=0.05, solver_iters=3, keep_full=("head",)).validate()
    res = {}
    for name, c in (("rabo", cfg), ("fedmbo", fedmbo.configure(cfg))):
        task = FewShotTask(pool, caps, width=16, eval_pool=ev, eval_episodes=5, eval_steps=5)
        exp = replace(BilevelExperiment(), rabo=c, federation=BilevelFederationConfig(clients=3, rounds=2))
        res[name] = run_bilevel(exp, task, tmp_path / name, log=lambda s: None)
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        rounds = [r for r in rows if r["event"] == "round"]
        assert len(rounds) == 2 and len([r for r in rows if r["event"] == "client"]) == 12  # 2 phases
        assert 0 <= rows[-1]["accuracy"] <= 1 and rows[-1]["episodes"] == 5
    rabo_rounds = [r for r in read_jsonl(tmp_path / "rabo" / "metrics.jsonl") if r["event"] == "round"]
    assert all(r["covering_x"] == 1 for r in rabo_rounds)
    assert all(r["covering_x"] == 3 for r in read_jsonl(tmp_path / "fedmbo" / "metrics.jsonl") if r["event"] == "round")
    assert res["rabo"]["bytes_up"] < 0.7 * res["fedmbo"]["bytes_up"]
    assert res["rabo"]["calls"] == res["fedmbo"]["calls"]  # the same evaluations, on smaller sub-models:
    assert res["fedmbo"]["op_estimate"] == res["fedmbo"]["calls"]  # full masks: kept fraction 1
    assert res["rabo"]["op_estimate"] < 0.7 * res["fedmbo"]["op_estimate"]


@pytest.mark.full_data
def test_rotations_make_new_classes_and_disjoint_shards_shrink_with_the_clients():
    pool = om.load_characters(shared("omniglot", "images_background_small1.zip"))
    rot = om.rotations(pool, 4)
    assert len(rot) == 4 * 136 and om.rotations(pool, 1) is not pool and om.rotations(pool, 1).keys() == pool.keys()
    name = sorted(pool)[0]
    assert torch.equal(rot[name], pool[name])
    a = pool[name][0, 0]
    assert torch.equal(rot[f"{name}@rot90"][0, 0], torch.rot90(a, 1)) and not torch.equal(rot[f"{name}@rot90"], pool[name])
    assert torch.equal(rot[f"{name}@rot180"][0, 0], a.flip(0).flip(1))  # 180 degrees: both axes reversed
    for n, size in ((10, 54), (20, 27), (30, 18), (50, 10)):  # the paper's scalability: 544 / N classes each
        shards = om.shard(sorted(rot), n, seed=0)
        assert min(len(s) for s in shards) == size and len({c for s in shards for c in s}) == 544
    with pytest.raises(om.CidersError, match="rotations must be 1, 2, 3 or 4"):
        om.rotations(pool, 5)


@pytest.mark.full_data
def test_vendored_slice_is_a_verbatim_subset_of_the_shared_omniglot():
    """data/omniglot-slice (SOURCE.md): whole alphabets of the upstream zips, every entry byte for byte."""
    import zipfile

    for name, alphabet in (("images_background_small1.zip", "Balinese"), ("images_background_small2.zip", "Tagalog")):
        with zipfile.ZipFile(vendored("omniglot-slice", name)) as mine, zipfile.ZipFile(shared("omniglot", name)) as up:
            want = [i.filename for i in up.infolist() if i.filename.split("/")[1:2] in ([alphabet], [""])]
            assert mine.namelist() == want and len([n for n in want if n.endswith(".png")]) >= 17 * 20
            assert all(mine.read(n) == up.read(n) for n in want)
