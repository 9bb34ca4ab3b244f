"""The full-model baselines of the RABO paper (Table II, Fig. 6): Dist-ProtoNet, Dist-MAML and FedAvg
without loss tuning, checked against the maths on tiny hand-made tasks, plus a smoke round on Omniglot."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ciders.algorithms import dist_maml, dist_protonet, fedavg_notune
from ciders.algorithms import fedmeta as fm
from ciders.errors import ConfigError

# ------------------------------------------------------------------------------------------------ config


def test_config_validates_and_names_the_field():
    assert fm.FedMetaConfig().validate().inner_steps == 1
    assert fm.FedMetaConfig(inner_steps=0).validate().inner_steps == 0
    for kw, name in (({"local_steps": 0}, "local_steps"), ({"inner_steps": -1}, "inner_steps"),
                     ({"lr": 0.0}, "lr"), ({"inner_lr": -1.0}, "inner_lr"), ({"first_order": "yes"}, "first_order"),
                     ({"local_steps": 1.5}, "local_steps")):
        with pytest.raises(ConfigError, match=f"fedmeta.{name}"):
            fm.FedMetaConfig(**kw).validate()


# ------------------------------------------------------------------------------------------- server mean


def test_server_mean_is_the_normalised_weighted_average():
    g = {"a": torch.zeros(2), "b": torch.zeros(1, 2)}
    c1 = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[4.0, 0.0]])}
    c2 = {"a": torch.tensor([5.0, -2.0]), "b": torch.tensor([[0.0, 8.0]])}
    out = fm.server_mean(g, [c1, c2], [1.0, 3.0])  # p = (1/4, 3/4)
    assert torch.allclose(out["a"], torch.tensor([0.25 * 1 + 0.75 * 5, 0.25 * 2 - 0.75 * 2]))
    assert torch.allclose(out["b"], torch.tensor([[1.0, 6.0]]))
    assert out["b"].shape == (1, 2) and out["a"].dtype == torch.float32
    same = fm.server_mean(g, [c1, c2], [10.0, 30.0])  # only the proportions matter
    assert all(torch.equal(same[k], out[k]) for k in out)
    assert torch.equal(fm.server_mean(g, [c1], [2.0])["a"], c1["a"])
    with pytest.raises(ValueError, match="no client"):
        fm.server_mean(g, [], [])
    with pytest.raises(ValueError, match="weights"):
        fm.server_mean(g, [c1, c2], [1.0])
    with pytest.raises(ValueError, match="weights"):
        fm.server_mean(g, [c1, c2], [0.0, 0.0])
    with pytest.raises(KeyError):
        fm.server_mean(g, [{"a": c1["a"]}], [1.0])
    with pytest.raises(ValueError, match="shape"):
        fm.server_mean(g, [{"a": torch.zeros(3), "b": c1["b"]}], [1.0])


# --------------------------------------------------------------------------------------------- protonet


class ProtoTask:
    """Linear features phi_x(z) = z W on flat inputs; one fixed 3-way 2-shot episode per client."""

    def __init__(self, seed=0, n_clients=1):
        g = torch.Generator().manual_seed(seed)
        self.eps = []
        for _ in range(n_clients):
            self.eps.append(SimpleNamespace(support=torch.randn(6, 4, generator=g),
                                            support_labels=torch.tensor([0, 1, 2, 2, 1, 0]),
                                            query=torch.randn(9, 4, generator=g),
                                            query_labels=torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 0])))
        self.x0 = {"W": torch.randn(4, 3, generator=g)}

    def clients(self):
        return [1.0] * len(self.eps)

    def features(self, x, images):
        return images @ x["W"]

    def batches(self, i, q, n):
        return [self.eps[i]] * n


def closed_form_protonet(W, ep):
    fs, fq = ep.support @ W, ep.query @ W
    total = 0.0
    for j in range(fq.shape[0]):
        d = []
        for k in range(3):
            c = fs[ep.support_labels == k].mean(0)  # the class mean of the support
            d.append(-((fq[j] - c) ** 2).sum())
        d = torch.stack(d)
        total = total - (d[ep.query_labels[j]] - torch.logsumexp(d, 0))
    return total / fq.shape[0]


def test_protonet_loss_is_the_closed_form_and_a_step_decreases_it():
    task = ProtoTask()
    ep, W = task.eps[0], task.x0["W"]
    phi = dist_protonet.feature_fn(task)
    assert torch.allclose(dist_protonet.prototypes(phi(task.x0, ep.support), ep.support_labels, 3)[2],
                          (ep.support[2] + ep.support[3]) @ W / 2)
    want = closed_form_protonet(W, ep)
    assert torch.allclose(dist_protonet.protonet_loss(phi, task.x0, ep), want, atol=1e-6)

    cfg = fm.FedMetaConfig(local_steps=1, lr=0.01).validate()
    y = {"unused": torch.tensor([3.0])}
    x1, y1, m = dist_protonet.local_update(cfg, task, task.x0, y, 0, 0)
    Wl = W.clone().requires_grad_(True)
    (gW,) = torch.autograd.grad(closed_form_protonet(Wl, ep), [Wl])
    assert torch.allclose(x1["W"], W - 0.01 * gW, atol=1e-6)  # one SGD step on the closed form
    assert torch.equal(y1["unused"], y["unused"])  # no head
    assert m["calls"] == 1 and m["steps"] == 1 and m["loss"] == pytest.approx(float(want), rel=1e-5)
    assert float(closed_form_protonet(x1["W"], ep)) < float(want)
    assert torch.equal(task.x0["W"], W)  # the input is not modified in place


def test_protonet_falls_back_to_conv4_and_rejects_a_class_without_support():
    from ciders.models import vision as vz

    assert dist_protonet.feature_fn(SimpleNamespace()) is vz.conv4_features
    with pytest.raises(ValueError, match="no support"):
        dist_protonet.prototypes(torch.randn(2, 3), torch.tensor([0, 2]), 3)


# ------------------------------------------------------------------------------------------------- MAML


class MamlTask:
    """theta = (x: 3, y: 2); g and f given as functions of the concatenated theta and the episode."""

    def __init__(self, g, f, n=1, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self._g, self._f = g, f
        self.eps = [SimpleNamespace(t=torch.randn(5, generator=gen), u=torch.randn(5, generator=gen)) for _ in range(n)]
        self.x0, self.y0 = {"a": torch.randn(3, generator=gen)}, {"b": torch.randn(2, generator=gen)}

    def clients(self):
        return [1.0] * len(self.eps)

    def batches(self, i, q, n):
        return [self.eps[i]] * n

    def g(self, x, y, ep):
        return self._g(torch.cat([x["a"], y["b"]]), ep)

    def f(self, x, y, ep):
        return self._f(torch.cat([x["a"], y["b"]]), ep)


def f_nonlinear(th, ep):
    return torch.sin(th).sum() + 0.5 * ((th - ep.t) ** 2).sum()


def grad_f_nonlinear(th, ep):
    return torch.cos(th) + th - ep.t


def test_maml_without_adaptation_is_sgd_on_the_query_loss():
    task = MamlTask(lambda th, ep: (torch.tanh(th * ep.u) ** 2).sum(), f_nonlinear)
    cfg = fm.FedMetaConfig(local_steps=3, lr=0.1, inner_steps=0).validate()
    x, y, m = dist_maml.local_update(cfg, task, task.x0, task.y0, 0, 0)
    th = torch.cat([task.x0["a"], task.y0["b"]])
    for _ in range(3):
        th = th - 0.1 * grad_f_nonlinear(th, task.eps[0])
    assert torch.allclose(torch.cat([x["a"], y["b"]]), th, atol=1e-6)
    assert m["calls"] == 3 and m["steps"] == 3 and "support_loss" not in m


def test_maml_second_order_is_the_closed_form_on_a_quadratic_inner_loss():
    """g = 1/2 th'A th - b'th: th_{s+1} = th_s - a (A th_s - b), so d th_K / d th_0 = (I - a A)^K and the
    second-order meta-gradient is (I - a A)^K grad f(th_K); first order drops the (I - a A)^K."""
    gen = torch.Generator().manual_seed(1)
    M = torch.randn(5, 5, generator=gen)
    A, b = M @ M.T / 5 + torch.eye(5), torch.randn(5, generator=gen)
    task = MamlTask(lambda th, ep: 0.5 * th @ A @ th - b @ th, f_nonlinear)
    a, K = 0.3, 2
    th0 = torch.cat([task.x0["a"], task.y0["b"]])
    th = th0.clone()
    for _ in range(K):
        th = th - a * (A @ th - b)
    J = torch.linalg.matrix_power(torch.eye(5) - a * A, K)
    gfo = grad_f_nonlinear(th, task.eps[0])
    want_so, want_fo = J @ gfo, gfo
    so = dist_maml.meta_gradient(fm.FedMetaConfig(inner_steps=K, inner_lr=a), task, task.x0, task.y0, task.eps[0])
    fo = dist_maml.meta_gradient(fm.FedMetaConfig(inner_steps=K, inner_lr=a, first_order=True), task, task.x0,
                                 task.y0, task.eps[0])
    assert torch.allclose(torch.cat([so[0]["a"], so[1]["b"]]), want_so, atol=1e-5)
    assert torch.allclose(torch.cat([fo[0]["a"], fo[1]["b"]]), want_fo, atol=1e-5)
    assert not torch.allclose(want_so, want_fo, atol=1e-2)
    assert so[2]["calls"] == 2 * K + 1 and fo[2]["calls"] == K + 1
    assert so[2]["loss"] == pytest.approx(float(f_nonlinear(th, task.eps[0])), rel=1e-5)
    assert so[2]["support_loss"] == pytest.approx(float(0.5 * th0 @ A @ th0 - b @ th0), rel=1e-5)


def test_maml_first_and_second_order_agree_iff_the_inner_hessian_vanishes():
    cfg_so = fm.FedMetaConfig(local_steps=2, lr=0.1, inner_steps=3, inner_lr=0.4).validate()
    cfg_fo = fm.FedMetaConfig(local_steps=2, lr=0.1, inner_steps=3, inner_lr=0.4, first_order=True).validate()
    # g affine in theta = (x, y): its Hessian is zero, theta_K = theta_0 - K a u, both orders are exact
    lin = MamlTask(lambda th, ep: ep.u @ th + 1.0, f_nonlinear)
    so, fo = (dist_maml.local_update(c, lin, lin.x0, lin.y0, 0, 0) for c in (cfg_so, cfg_fo))
    assert all(torch.allclose(so[j][k], fo[j][k], atol=1e-6) for j in (0, 1) for k in so[j])
    assert so[2]["calls"] == 2 * (2 * 3 + 1) and fo[2]["calls"] == 2 * (3 + 1)
    th = torch.cat([lin.x0["a"], lin.y0["b"]])
    for _ in range(2):
        th = th - 0.1 * grad_f_nonlinear(th - 3 * 0.4 * lin.eps[0].u, lin.eps[0])
    assert torch.allclose(torch.cat([so[0]["a"], so[1]["b"]]), th, atol=1e-6)
    # a non-linear g (tanh features, with x-y cross terms): the orders differ
    nl = MamlTask(lambda th, ep: (torch.tanh(th * ep.u) ** 2).sum() + th[0] * th[3] ** 2, f_nonlinear)
    so, fo = (dist_maml.local_update(c, nl, nl.x0, nl.y0, 0, 0) for c in (cfg_so, cfg_fo))
    assert not torch.allclose(torch.cat([so[0]["a"], so[1]["b"]]), torch.cat([fo[0]["a"], fo[1]["b"]]), atol=1e-4)


# ------------------------------------------------------------------------------------- FedAvg, no tune


def tiny_losstune(n_clients):
    from ciders.workloads.bilevel import LossTuneTask

    g = torch.Generator().manual_seed(0)
    mk = lambda n: (torch.rand(n, 3, 32, 32, generator=g), torch.arange(n) % 10)  # noqa: E731
    return LossTuneTask(mk(40), mk(20), mk(20), [1.0] * n_clients, width=6, reg=1e-2, seed=0)


def test_fedavg_notune_is_sgd_on_plain_cross_entropy_with_x_fixed():
    task = tiny_losstune(1)
    x0, y0 = task.initial()
    cfg = fm.FedMetaConfig(local_steps=1, lr=0.2).validate()
    x1, y1, m = fedavg_notune.local_update(cfg, task, x0, y0, 0, 0)
    assert all(torch.equal(x1[k], x0[k]) for k in x0)
    a, lab = task.batches(0, 0, 1)[0]
    yl = {k: v.clone().requires_grad_(True) for k, v in y0.items()}
    net = F.linear(torch.relu(F.linear(a, yl["fc1.weight"], yl["fc1.bias"])), yl["head.weight"], yl["head.bias"])
    plain = F.cross_entropy(net, lab) + 0.5 * 1e-2 * sum((v ** 2).sum() for v in yl.values())  # w=1, l=0, D=1
    gs = torch.autograd.grad(plain, list(yl.values()))
    for (k, v), gk in zip(y0.items(), gs):
        assert torch.allclose(y1[k], v - 0.2 * gk, atol=1e-6)
    assert m["calls"] == 1 and m["loss"] == pytest.approx(float(plain.detach()), rel=1e-5)
    # one client: the FedAvg mean is its local model
    yr = fm.server_mean(y0, [y1], [1.0])
    assert all(torch.allclose(yr[k], y1[k]) for k in y1)


def test_fedavg_mean_of_the_client_models():
    task = tiny_losstune(2)
    x0, y0 = task.initial()
    cfg = fm.FedMetaConfig(local_steps=2, lr=0.1).validate()
    locals_ = [fedavg_notune.local_update(cfg, task, x0, y0, i, 0) for i in range(2)]
    yr = fm.server_mean(y0, [lo[1] for lo in locals_], [1.0, 3.0])
    for k in y0:
        assert torch.allclose(yr[k], 0.25 * locals_[0][1][k] + 0.75 * locals_[1][1][k], atol=1e-6)
    assert sum(lo[2]["calls"] for lo in locals_) == 4


# ------------------------------------------------------------------------------------- Omniglot smoke


def test_one_round_of_each_baseline_on_omniglot():
    from ciders.workloads.bilevel import FewShotTask
    from ciders.tasks import omniglot as om
    from helpers import vendored

    pool = om.load_characters(vendored("omniglot-slice", "images_background_small1.zip"))
    pool = {k: pool[k] for k in sorted(pool)[:16]}
    task = FewShotTask(pool, [1.0, 0.5], n_way=5, k_shot=1, q_query=2, width=8, eval_episodes=2, eval_steps=2)
    x0, y0 = task.initial()
    for mod, cfg in ((dist_protonet, fm.FedMetaConfig(local_steps=2, lr=0.05)),
                     (dist_maml, fm.FedMetaConfig(local_steps=2, lr=0.05, inner_steps=1))):
        locs = [mod.local_update(cfg.validate(), task, x0, y0, i, 0) for i in range(2)]
        x1 = fm.server_mean(x0, [lo[0] for lo in locs], [1.0, 1.0])
        y1 = fm.server_mean(y0, [lo[1] for lo in locs], [1.0, 1.0])
        calls = sum(lo[2]["calls"] for lo in locs)
        assert all(bool(torch.isfinite(v).all()) for v in list(x1.values()) + list(y1.values()))
        assert any(not torch.equal(x1[k], x0[k]) for k in x0)
        assert all(lo[2]["steps"] == 2 and lo[2]["loss"] > 0 for lo in locs)
        if mod is dist_protonet:
            assert all(torch.equal(y1[k], y0[k]) for k in y0) and calls == 4
        else:
            assert any(not torch.equal(y1[k], y0[k]) for k in y0) and calls == 2 * 2 * 3
        ev = task.evaluate(x1, y1)
        assert 0 <= ev["accuracy"] <= 1
