"""`ciders.models.vision`: the functional ResNet12 (shapes, a torch.nn reference, structured sub-models
and the residual add, gradients), Conv4 unchanged, and the few-shot task's `backbone` option."""

import pytest
import torch
import torch.nn.functional as F

from ciders.core import masks as mk
from ciders.models import vision as vz

W = (4, 10, 20, 40)


def _images(n=6, size=28, seed=0):
    return torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(seed))


def test_resnet12_shapes_and_parameters():
    p = vz.resnet12_init(widths=W, seed=0)
    assert vz.resnet12_features(p, _images()).shape == (6, 40)
    assert vz.resnet12_features(p, _images(4, 84)).shape == (4, 40)
    assert vz.resnet12_init(in_channels=3, widths=W)["block0.conv1.weight"].shape == (4, 3, 3, 3)
    assert p["block1.shortcut.conv.weight"].shape == (10, 4, 1, 1) and p["block3.conv3.weight"].shape == (40, 40, 3, 3)
    assert set(vz.resnet12_groups()) <= set(p) and len(p) == 4 * 12
    full = vz.resnet12_init()  # the paper's widths
    assert full["block3.bn3.weight"].shape == (640,) and full["block1.conv1.weight"].shape == (160, 64, 3, 3)
    assert torch.equal(vz.resnet12_init(widths=W, seed=3)["block2.conv2.weight"],
                       vz.resnet12_init(widths=W, seed=3)["block2.conv2.weight"])
    with pytest.raises(ValueError, match="4 positive block widths"):
        vz.resnet12_init(widths=(4, 8))


def test_resnet12_matches_a_torch_nn_reference():
    nn = torch.nn
    p = vz.resnet12_init(widths=W, seed=1)
    for k in p:  # non-trivial BN affine parameters
        if ".bn" in k or "shortcut.bn" in k:
            p[k] = p[k] + 0.1 * torch.randn(p[k].shape, generator=torch.Generator().manual_seed(len(k)))

    class Block(nn.Module):
        def __init__(self, c_in, w):
            super().__init__()
            self.c = nn.ModuleList([nn.Conv2d(c, w, 3, padding=1, bias=False) for c in (c_in, w, w)])
            self.b = nn.ModuleList([nn.BatchNorm2d(w) for _ in range(3)])
            self.sc, self.sb = nn.Conv2d(c_in, w, 1, bias=False), nn.BatchNorm2d(w)

        def forward(self, h):
            m = h
            for j in range(3):
                m = self.b[j](self.c[j](m))
                m = F.leaky_relu(m, 0.1) if j < 2 else m
            return F.max_pool2d(F.leaky_relu(m + self.sb(self.sc(h)), 0.1), 2)

    blocks, c_in = [], 1
    for i, w in enumerate(W):
        b = Block(c_in, w).train()
        with torch.no_grad():
            for j in range(3):
                b.c[j].weight.copy_(p[f"block{i}.conv{j + 1}.weight"])
                b.b[j].weight.copy_(p[f"block{i}.bn{j + 1}.weight"])
                b.b[j].bias.copy_(p[f"block{i}.bn{j + 1}.bias"])
            b.sc.weight.copy_(p[f"block{i}.shortcut.conv.weight"])
            b.sb.weight.copy_(p[f"block{i}.shortcut.bn.weight"])
            b.sb.bias.copy_(p[f"block{i}.shortcut.bn.bias"])
        blocks.append(b)
        c_in = w
    x = _images(5)
    h = x
    for b in blocks:
        h = b(h)
    torch.testing.assert_close(vz.resnet12_features(p, x), h.mean((2, 3)), rtol=1e-5, atol=1e-5)


def _interior(p, i, h):
    """conv1 / conv2 activations (after BN) of block i."""
    b = f"block{i}"
    a1 = vz._bn(p, f"{b}.bn1", F.conv2d(h, p[f"{b}.conv1.weight"], padding=1))
    a2 = vz._bn(p, f"{b}.bn2", F.conv2d(F.leaky_relu(a1, 0.1), p[f"{b}.conv2.weight"], padding=1))
    return a1, a2


def test_masked_resnet12_zeroes_dropped_channels_and_the_residual_add_is_consistent():
    p = vz.resnet12_init(widths=W, seed=0)
    m = mk.structured_masks(p, 0.5, "importance", groups=vz.resnet12_groups())
    sub = mk.apply_mask(p, m)
    h = _images()
    for i, w in enumerate(W):
        b = f"block{i}"
        kept = m[f"{b}.conv3.weight"].reshape(w, -1).amax(1).bool()
        assert int(kept.sum()) == round(0.5 * w)
        # one mask over the two summed branches: conv3, bn3, the shortcut conv and its BN
        for n in ("bn3.weight", "bn3.bias", "shortcut.conv.weight", "shortcut.bn.weight", "shortcut.bn.bias"):
            assert torch.equal(m[f"{b}.{n}"].reshape(w, -1).amax(1).bool(), kept), n
        for j in (1, 2):
            kj = m[f"{b}.conv{j}.weight"].reshape(w, -1).amax(1)
            assert torch.equal(m[f"{b}.bn{j}.weight"], kj) and int(kj.sum()) == round(0.5 * w)
        for a, j in zip(_interior(sub, i, h), (1, 2)):
            kj = m[f"{b}.conv{j}.weight"].reshape(w, -1).amax(1).bool()
            assert bool((a[:, ~kj] == 0).all()) and bool((a[:, kj].abs().amax((0, 2, 3)) > 0).all())
        main, short, out = vz.resnet12_block(sub, i, h)
        for t in (main, short, out):  # dropped channels exactly 0 in both branches and after the add
            assert bool((t[:, ~kept] == 0).all())
            assert bool((t[:, kept].abs().amax((0, 2, 3)) > 0).all())
        h = out
    feats = vz.resnet12_features(sub, _images())
    kept = m["block3.conv3.weight"].reshape(40, -1).amax(1).bool()
    assert bool((feats[:, ~kept] == 0).all()) and bool((feats[:, kept] != 0).any(0).all())


def test_independent_masks_would_split_a_residual_channel():
    """Why the groups merge the branches: masked as separate layers, conv3 and the shortcut keep different
    channels, so some summed channel would be half-masked."""
    p = vz.resnet12_init(widths=W, seed=0)
    naive = {k: v for k, v in vz.resnet12_groups().items() if "shortcut" not in k and "conv3" not in k}
    naive.update({f"block{i}.bn3.{s}": f"block{i}.conv3" for i in range(4) for s in ("weight", "bias")})
    m = mk.structured_masks(p, 0.5, "importance", groups=naive)
    rows = lambda t: t.reshape(t.shape[0], -1).amax(1)  # noqa: E731
    assert any(not torch.equal(rows(m[f"block{i}.conv3.weight"]), rows(m[f"block{i}.shortcut.conv.weight"]))
               for i in range(4))


@pytest.mark.parametrize("rule", ["importance", "static", "rolling"])
def test_gradients_flow_to_every_kept_unit_and_not_outside_the_sub_model(rule):
    p = {k: v.requires_grad_() for k, v in vz.resnet12_init(widths=W, seed=2).items()}
    m = mk.structured_masks(p, 0.5, rule, round_=3, groups=vz.resnet12_groups())
    r = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    loss = (vz.resnet12_features(mk.apply_mask(p, m), _images()) * r).sum()
    g = dict(zip(p, torch.autograd.grad(loss, list(p.values()))))
    for k, gk in g.items():
        assert bool(torch.isfinite(gk).all()), k
        assert bool((gk[m[k] == 0] == 0).all()), k  # nothing outside the sub-model
        kept = m[k].reshape(m[k].shape[0], -1).amax(1).bool()
        assert bool((gk.reshape(gk.shape[0], -1)[kept].abs().amax(1) > 0).all()), k  # every kept unit learns


def test_conv4_unchanged():
    p = vz.conv4_init(width=8, seed=0)
    x = _images(5)
    h = x
    for i in range(4):
        h = F.conv2d(h, p[f"block{i}.conv.weight"], p[f"block{i}.conv.bias"], padding=1)
        h = F.max_pool2d(F.relu(F.batch_norm(h, None, None, p[f"block{i}.bn.weight"], p[f"block{i}.bn.bias"],
                                             training=True)), 2)
    assert torch.equal(vz.conv4_features(p, x), h.flatten(1)) and h.flatten(1).shape == (5, 8)
    assert sorted(p) == sorted(f"block{i}.{m}.{k}" for i in range(4) for m in ("conv", "bn")
                               for k in ("weight", "bias"))
    assert vz.conv4_groups() == {f"block{i}.bn.{k}": f"block{i}.conv" for i in range(4) for k in ("weight", "bias")}


def _pool(n=10):
    g = torch.Generator().manual_seed(0)
    return {f"A/c{j:02d}": torch.rand(20, 1, 28, 28, generator=g) for j in range(n)}


def test_fewshot_task_backbones():
    from ciders.workloads.bilevel import FewShotTask, resnet12_widths

    assert resnet12_widths(64) == (64, 160, 320, 640) and resnet12_widths(4) == W
    pool = _pool()
    conv = FewShotTask(pool, [1.0, 0.5], width=8, eval_episodes=2, eval_steps=2)
    x, y = conv.initial()
    assert conv.backbone == "conv4" and conv.units() == {"x": vz.conv4_units(), "y": vz.linear_units("block3.conv")}
    from ciders.runtime import derive_seed

    init = vz.conv4_init(width=8, seed=derive_seed(0, "bilevel-init"))
    assert all(torch.equal(x[k], v) for k, v in init.items()) and len(x) == 16
    ep = conv.outer_batch(0, 0)
    assert torch.equal(conv.features(x, ep.query), vz.conv4_features(x, ep.query))
    assert y["head.weight"].shape == (5, 8)

    res = FewShotTask(pool, [1.0, 0.5], width=4, eval_episodes=2, eval_steps=2, backbone="resnet12")
    x, y = res.initial()
    assert res.units()["x"] == vz.resnet12_units() and x["block3.conv3.weight"].shape == (40, 40, 3, 3)
    assert y["head.weight"].shape == (5, 40)
    ep = res.outer_batch(1, 0)
    assert res.features(x, ep.support).shape == (5, 40)
    assert float(res.g(x, y, ep)) == pytest.approx(torch.log(torch.tensor(5.0)).item(), rel=1e-5)  # zero head
    assert torch.isfinite(res.f(x, y, ep))
    out = res.evaluate(x, y)
    assert 0 <= out["accuracy"] <= 1 and out["episodes"] == 2
    with pytest.raises(ValueError, match="backbone"):
        FewShotTask(pool, [1.0], backbone="resnet18")


def test_backbone_config_option():
    from ciders.config.bilevel import BilevelTaskConfig
    from ciders.errors import ConfigError

    assert BilevelTaskConfig().backbone == "conv4"
    BilevelTaskConfig(backbone="resnet12").validate()
    with pytest.raises(ConfigError, match=r"task\.backbone: must be one of conv4 \| resnet12, got 'vit'"):
        BilevelTaskConfig(backbone="vit").validate()


def _real_task(backbone):
    from helpers import vendored

    from ciders.tasks import omniglot as om
    from ciders.workloads.bilevel import FewShotTask

    pool = om.load_characters(vendored("omniglot-slice", "images_background_small1.zip"))  # 24 characters
    return FewShotTask(pool, [1.0, 0.5, 0.25, 0.125], width=16 if backbone == "conv4" else 4, backbone=backbone,
                       eval_episodes=2, eval_steps=2)


def _grads(task, x, y, ep):
    from ciders.core.hypergrad import grads

    return grads(lambda a, b: task.f(a, b, ep) + task.g(a, b, ep), x, y)


@pytest.mark.parametrize("backbone", ["conv4", "resnet12"])
@pytest.mark.parametrize("rule", ["importance", "static", "rolling"])
def test_no_kept_coordinate_of_a_sub_model_has_a_structurally_zero_gradient(backbone, rule):
    """Real Omniglot gradients on every capacity's extracted sub-model: every coordinate a client holds
    gets gradient (the old output-only masks kept input columns fed by dropped channels, whose gradient
    is exactly 0). Conv4's conv bias is the one exception, and in the full model too: a batch-statistics
    BN cancels it."""
    from ciders.algorithms import rabo as rb
    from ciders.core import submodel as sm

    task = _real_task(backbone)
    x, y = task.initial()
    y = {k: 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in y.items()}
    ep = task.outer_batch(0, 0)
    cfg, state = rb.RaboConfig(mask_rule=rule).validate(), rb.init_state(x, y)
    gx_full, _ = _grads(task, x, y, ep)
    if backbone == "conv4":
        assert float(gx_full["block1.conv.bias"].abs().max()) < 1e-4 * float(gx_full["block1.conv.weight"].abs().max())
    for r in (0.5, 0.25, 0.125):
        m = rb.client_masks(cfg, rb.BilevelState(3, x, y), r, units=task.units())
        (xs, _), (ys, _) = sm.client_view(x, m.x), sm.client_view(y, m.y)
        gx, gy = _grads(task, xs, ys, ep)
        for k, v in {**gx, **gy}.items():
            if k.endswith("conv.bias"):
                continue
            tiny = 1e-9 * float(v.abs().max())
            assert bool((v.abs() > tiny).all()), f"R={r} {k}: {int((v.abs() <= tiny).sum())} kept coordinates get no gradient"
        # the sub-model is the masked full model, computed small: same losses, same gradients on its coordinates
        loss_sub = float(task.f(xs, ys, ep))
        loss_mask = float(task.f(mk.apply_mask(state.x, m.x), mk.apply_mask(state.y, m.y), ep))
        assert loss_sub == pytest.approx(loss_mask, rel=1e-5)
        gxm, _ = _grads(task, mk.apply_mask(x, m.x), mk.apply_mask(y, m.y), ep)
        for k in gx:  # (float32: the batch-norm sums run in another order; conv4's bias gradient is roundoff)
            tol = 1e-3 * float(gx_full[k.replace("bias", "weight") if k.endswith("conv.bias") else k].abs().max())
            assert torch.allclose(gx[k].reshape(-1), gxm[k].reshape(-1)[m.x[k].reshape(-1) > 0], rtol=1e-2, atol=tol)


def test_output_only_masks_keep_coordinates_without_gradient():
    """What the sub-model plan fixes: pruning output channels only keeps block 1's input columns fed by
    block 0's dropped channels, and their gradient is exactly 0."""
    task = _real_task("conv4")
    x, y = task.initial()
    y = {k: 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in y.items()}
    m = mk.structured_masks(x, 0.5, "importance", groups=vz.conv4_groups())
    gx, _ = _grads(task, mk.apply_mask(x, m), y, task.outer_batch(0, 0))
    kept = m["block1.conv.weight"] > 0
    dead = (gx["block1.conv.weight"] == 0) & kept
    assert int(dead.sum()) == int(kept.sum()) // 2  # half the kept columns read a dropped channel


def test_flops_are_counted_from_the_shapes_and_scale_about_r_squared():
    from ciders.core import submodel as sm

    p = vz.conv4_init(width=8)
    shapes = {k: tuple(v.shape) for k, v in p.items()}
    # by hand: conv3x3 on 28^2, 14^2, 7^2, 3^2 inputs, 1 -> 8 -> 8 -> 8 -> 8 channels
    assert vz.backbone_flops("conv4", shapes) == 2 * 9 * 8 * (28 ** 2 + 8 * (14 ** 2 + 7 ** 2 + 3 ** 2))
    m = mk.structured_masks(p, 0.5, "static", units=vz.conv4_units())
    half = vz.backbone_flops("conv4", sm.sub_shapes(m))
    assert half == 2 * 9 * 4 * (28 ** 2 + 4 * (14 ** 2 + 7 ** 2 + 3 ** 2))
    r = vz.resnet12_init(widths=W)
    mr = mk.structured_masks(r, 0.5, "static", units=vz.resnet12_units())
    frac = vz.backbone_flops("resnet12", sm.sub_shapes(mr)) / vz.backbone_flops("resnet12", {k: tuple(v.shape) for k, v in r.items()})
    assert 0.25 <= frac < 0.3  # R^2 everywhere but the first layer, which reads the image


def test_resnet12_sub_model_keeps_one_channel_set_across_the_residual_add():
    p = vz.resnet12_init(widths=W, seed=2)
    m = mk.structured_masks(p, 0.5, "importance", units=vz.resnet12_units())
    from ciders.core import submodel as sm

    for i in range(4):
        b = f"block{i}"
        rows3, _ = sm.structure(m[f"{b}.conv3.weight"])
        rows_s, cols_s = sm.structure(m[f"{b}.shortcut.conv.weight"])
        assert torch.equal(rows3, rows_s)  # both summed branches keep the same block channels
        if i:
            assert torch.equal(cols_s, sm.structure(m[f"block{i - 1}.conv3.weight"])[0])  # and the next block reads them
            assert torch.equal(sm.structure(m[f"{b}.conv1.weight"])[1], cols_s)
    sub = sm.extract(p, m)
    assert vz.resnet12_features(sub, _images()).shape == (6, 20)  # the extracted network runs at its own widths
