"""The loss-tuning task: long-tailed CIFAR-10 from the real zips, the VS-loss against its formula, and a
RAFBO round that tunes (w, l, Delta) with the coordinate-wise estimator while masking only y."""

import math

import pytest
import torch
import torch.nn.functional as F

from ciders.algorithms import rabo as rb
from ciders.algorithms import rafbo
from ciders.tasks import longtail as lt
from helpers import shared


def test_long_tail_profile_and_subset():
    # CIFAR-10-LT at ratio 100 (Cao et al., NeurIPS 2019): 5000 ... 50
    assert lt.long_tail_counts(5000, 10, 100) == [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]
    labels = torch.arange(10).repeat_interleave(20)
    idx = lt.per_class_subset(labels, [3] * 10, offset=5)
    assert idx.numel() == 30 and all(int((labels[idx] == c).sum()) == 3 for c in range(10))


def test_vs_loss_reduces_to_cross_entropy_and_matches_its_formula():
    g = torch.Generator().manual_seed(0)
    f, y = torch.randn(6, 4, generator=g), torch.tensor([0, 1, 2, 3, 1, 0])
    one, zero = torch.ones(4), torch.zeros(4)
    assert torch.allclose(lt.vs_loss(f, y, one, zero, one), F.cross_entropy(f, y))
    w, l, d = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    hand = sum(-w[c] * math.log(math.exp(d[c] * f[i, c] + l[c]) / sum(math.exp(d[k] * f[i, k] + l[k]) for k in range(4)))
               for i, c in enumerate(y.tolist())) / 6
    assert abs(float(lt.vs_loss(f, y, w, l, d)) - hand) < 1e-5
    assert lt.balanced_accuracy(torch.eye(4)[[0, 1, 2, 3, 0, 0]], y, 4) == (1 + 0.5 + 1 + 1) / 4


@pytest.mark.full_data
def test_cifar10_long_tailed_and_a_rafbo_round():
    xs, ys = lt.load_cifar10(shared("cifar10", "cifar10_train_500per_class.zip"))
    assert xs.shape == (5000, 3, 32, 32) and [int((ys == c).sum()) for c in range(10)] == [500] * 10
    train = lt.per_class_subset(ys, lt.long_tail_counts(50, 10, 10))
    feats = F.avg_pool2d(xs[train], 8).flatten(1)  # 48-d pooled colours: enough for a round's arithmetic
    labels = ys[train]
    val = lt.per_class_subset(ys, [5] * 10, offset=50)
    vfeats, vlabels = F.avg_pool2d(xs[val], 8).flatten(1), ys[val]
    g_ = torch.Generator().manual_seed(0)
    y0 = {"fc1.weight": torch.randn(16, 48, generator=g_) * 0.1, "fc1.bias": torch.zeros(16),
          "head.weight": torch.randn(10, 16, generator=g_) * 0.1, "head.bias": torch.zeros(10)}
    x0 = {"w": torch.ones(10), "l": torch.zeros(10), "delta": torch.ones(10)}

    def net(y, a):
        return F.linear(torch.relu(F.linear(a, y["fc1.weight"], y["fc1.bias"])), y["head.weight"], y["head.bias"])

    def g(x, y, _):
        return lt.vs_loss(net(y, feats), labels, x["w"], x["l"], x["delta"]) + 1e-3 * sum((v ** 2).sum() for v in y.values())

    def f(x, y, _):
        return F.cross_entropy(net(y, vfeats), vlabels)

    # the MLP makes g non-convex in y, so CG's positive-definiteness check would (rightly) refuse: Neumann
    cfg = rafbo.configure(rb.RaboConfig(mask_target="y", keep_full=("head",), inner_steps=2, solver="neumann",
                                        solver_iters=5, neumann_eta=0.1, coordinates=True, fd_delta=1e-2))
    s = rb.init_state(x0, y0)
    from ciders.workloads.bilevel import LOSSTUNE_UNITS

    masks = [rb.client_masks(cfg, s, r, units=LOSSTUNE_UNITS) for r in (1.0, 0.25)]
    assert all(bool((m.x["w"] == 1).all()) for m in masks)  # hyperparameters: every client tunes all of x
    kept = masks[1].y["fc1.weight"][:, 0]
    assert int(kept.sum()) == 4 and torch.equal(masks[1].y["head.weight"], kept[None, :].expand(10, 16))
    Gs = [rb.inner_update(cfg, s, m, g, [None] * 2)[0] for m in masks]
    mid, si = rb.server_inner(cfg, s, Gs, masks)
    hs = [rb.outer_update(cfg, mid, m, f, g, None)[0] for m in masks]
    new, so = rb.server_outer(cfg, mid, hs, masks)
    assert so["covering_x"] == 2 and si["covering_y"] == 1  # x by both; 12 hidden units only by the full client
    assert all(bool(torch.isfinite(v).all()) for v in new.x.values()) and not torch.equal(new.x["l"], x0["l"])
