"""The paper's single-level sub-model baselines (Static, FedRolex, OAP, FIARSE): the ProtoNet client step on each
one's extracted sub-model, HeteroFL's per-coordinate mean of the client models, and FIARSE's threshold-controlled
step, against direct computations."""

from dataclasses import replace

import pytest
import torch

from ciders.algorithms import dist_protonet as dp
from ciders.algorithms import rabo as rb
from ciders.algorithms.registry import bilevel_config, get
from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig
from ciders.core import submodel as sm
from ciders.federation.bilevel_loop import run_bilevel
from ciders.workloads.bilevel import FewShotTask

CAPS = (1.0, 0.5, 0.25)


def _task():
    g = torch.Generator().manual_seed(0)
    pool = {f"A/c{j:02d}": torch.rand(20, 1, 28, 28, generator=g) for j in range(20)}
    return FewShotTask(pool, list(CAPS), width=8, eval_episodes=2, eval_steps=2)


def _exp(method):
    exp = BilevelExperiment(federation=BilevelFederationConfig(clients=3, capacities=CAPS, rounds=1))
    return bilevel_config(replace(exp, fedmeta=replace(exp.fedmeta, local_steps=2, lr=0.1)), method)


@pytest.mark.parametrize("method", ["static", "fedrolex", "oap", "fiarse"])
def test_they_are_single_level_sub_model_training(method):
    spec = get(method, "bilevel")
    assert spec.phases == ("local",) and spec.submodel_local and spec.local_update is dp.local_update
    assert _exp(method).rabo.mask_rule == spec.mask_rule


@pytest.mark.parametrize("method", ["static", "fedrolex", "oap", "fiarse"])
def test_a_round_is_the_per_coordinate_mean_of_protonet_steps_on_each_sub_model(tmp_path, method):
    exp, task = _exp(method), _task()
    res = run_bilevel(exp, task, tmp_path, log=lambda s: None)
    x0, y0 = task.initial()
    s = rb.init_state(x0, y0)
    num = {k: torch.zeros_like(v) for k, v in x0.items()}
    cnt = {k: torch.zeros_like(v) for k, v in x0.items()}
    for i, r in enumerate(CAPS):
        m = rb.client_masks(exp.rabo, s, r, units=task.units(), client=i, capacities=list(CAPS))
        (xs, mxs), (ys, _) = sm.client_view(x0, m.x), sm.client_view(y0, m.y)
        if method == "fiarse":  # unstructured: full-shape tensors, FIARSE's threshold-controlled steps on the mask
            assert xs["block1.conv.weight"].shape == x0["block1.conv.weight"].shape
            xn, _, _ = dp.local_update(exp.fedmeta, task, xs, ys, i, 0, mask=mxs, threshold=True)
        else:  # a real sub-model, computed at its own widths
            assert xs["block1.conv.weight"].shape[:2] == (max(1, round(8 * r)),) * 2
            xn, _, _ = dp.local_update(exp.fedmeta, task, xs, ys, i, 0)
        full = sm.scatter(sm.gather(xn, mxs), m.x, x0)
        num = {k: num[k] + full[k] for k in num}
        cnt = {k: cnt[k] + m.x[k] for k in cnt}
    want = {k: torch.where(cnt[k] > 0, num[k] / cnt[k].clamp(min=1), x0[k]) for k in x0}
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "final.safetensors"))
    assert all(torch.allclose(got[f"x/{k}"], v, atol=1e-6, rtol=1e-5) for k, v in want.items())
    assert all(torch.equal(got[f"y/{k}"], v) for k, v in y0.items())  # ProtoNet has no head: y stays
    assert set(res["final_by_capacity"]) == {"0.5", "0.25"}
    # each capacity's row: the final model cut to the sub-model that capacity's first client would hold next
    final = rb.BilevelState(1, {k: got[f"x/{k}"] for k in x0}, {k: got[f"y/{k}"] for k in y0})
    for i, r in ((1, 0.5), (2, 0.25)):
        m = rb.client_masks(exp.rabo, final, r, units=task.units(), client=i, capacities=list(CAPS))
        (xs, _), (ys, _) = sm.client_view(final.x, m.x), sm.client_view(final.y, m.y)
        assert res["final_by_capacity"][str(r)] == task.evaluate(xs, ys)


def test_fiarse_threshold_controlled_step_by_hand():
    x = {"w": torch.tensor([[0.5, -2.0], [0.1, 1.0]])}
    mask = {"w": torch.tensor([[1.0, 1.0], [0.0, 1.0]])}
    tau = dp.thresholds(x, mask)
    assert float(tau["w"]) == 0.5  # the smallest kept |x|, fixed for the round
    m, scale = dp.threshold_controlled(x, mask, tau)
    assert m["w"].tolist() == [[1.0, 1.0], [0.0, 1.0]]
    f = lambda a: 1 + 2 * 0.5 * a / (a + 0.5) ** 2  # noqa: E731
    assert torch.allclose(scale["w"], torch.tensor([[f(0.5), f(2.0)], [0.0, f(1.0)]]))
    # an entry that shrinks below tau during the local steps leaves the sub-model
    m2, s2 = dp.threshold_controlled({"w": torch.tensor([[0.5, -0.2], [0.1, 1.0]])}, mask, tau)
    assert m2["w"].tolist() == [[1.0, 0.0], [0.0, 1.0]] and float(s2["w"][0, 1]) == 0.0
    # tau = 0 (the mask keeps a zero entry): plain masked gradients
    b = {"b": torch.tensor([0.0, 3.0])}
    _, s3 = dp.threshold_controlled(b, {"b": torch.ones(2)}, dp.thresholds(b, {"b": torch.ones(2)}))
    assert s3["b"].tolist() == [1.0, 1.0]


def test_fiarse_local_step_uses_the_surrogate_gradient():
    """One local step by hand: x - lr * grad_{x m} L(x m) * m (1 + 2 tau |x| / (|x| + tau)^2)."""
    from ciders.core.hypergrad import grads

    exp, task = _exp("fiarse"), _task()
    cfg = replace(exp.fedmeta, local_steps=1)
    x0, y0 = task.initial()
    m = rb.client_masks(exp.rabo, rb.init_state(x0, y0), 0.5)
    x = {k: v * m.x[k] for k, v in x0.items()}
    got, _, _ = dp.local_update(cfg, task, x, y0, 1, 0, mask=m.x, threshold=True)
    ep = task.batches(1, 0, 1)[0]
    g, _ = grads(lambda a, _b: dp.protonet_loss(task.features, a, ep), x, {})  # x is already x * m at round start
    tau = dp.thresholds(x, m.x)
    for k in x:
        a, t = x[k].abs(), tau[k]
        factor = m.x[k] * (1 + 2 * t * a / (a + t) ** 2) if float(t) > 0 else m.x[k]
        assert torch.allclose(got[k], x[k] - cfg.lr * g[k] * factor, atol=1e-7, rtol=1e-5), k
    assert any(float(tau[k]) > 0 for k in x)  # the surrogate factor is in play


def test_a_clients_compute_is_counted_from_its_sub_models_flops():
    from ciders.federation.bilevel_rounds import BilevelServer, kept_fraction
    from ciders.models import vision as vz

    exp, task = bilevel_config(BilevelExperiment(federation=BilevelFederationConfig(clients=3, capacities=CAPS)),
                               "rabo"), _task()
    server = BilevelServer(exp, task, log=lambda s: None)
    server.begin(0)
    m = server.masks["client1"]  # R = 1/2
    xs, ys = sm.sub_shapes(m.x), sm.sub_shapes(m.y)
    full = vz.backbone_flops("conv4", {k: tuple(v.shape) for k, v in m.x.items()}) + 2 * 5 * 8
    want = (vz.backbone_flops("conv4", xs) + 2 * 5 * ys["head.weight"][1]) / full
    cost = server.cost("client1")
    assert cost["flops_fraction"] == pytest.approx(want) and cost["flops_fraction"] != pytest.approx(kept_fraction(m))
    assert cost["param_bytes"] == 4 * sum(torch.Size(s).numel() for s in {**xs, **ys}.values())
