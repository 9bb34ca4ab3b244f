"""Dist-MAML: model-agnostic meta-learning (Finn, Abbeel and Levine, ICML 2017) federated by FedAvg of the
meta-learner, the RABO paper's full-model few-shot baseline (the RABO paper, Table II;
docs/rabo.md#full-model-baselines).

The meta-learner is the whole model theta = (x, y) (feature extractor and head). As in the original MAML,
the adaptation updates *all* parameters, not only the head (ANIL-style head-only adaptation would be a
different baseline). On an episode, with the task's inner loss g (support) and outer loss f (query):

  theta_0 = (x, y),   theta_{s+1} = theta_s - inner_lr * grad_theta g(theta_s, ep),   s < inner_steps
  meta-gradient     G = d f(theta_K, ep) / d theta_0
                      = prod_{s=K-1..0} (I - inner_lr * grad^2 g(theta_s)) grad f(theta_K)   (second order)
                      ~ grad f(theta_K)                                                      (first_order)
  step              theta_0 <- theta_0 - lr * G

one step per episode of `task.batches(i, q, local_steps)` (each episode is both the support of g and the
query of f, as the few-shot task defines them; `task.outer_batch` is not needed). With inner_steps = 0
the step is plain SGD on f. The server step is `fedmeta.server_mean` on x and y.

Calls (backward passes) of one step: inner_steps gradients of g + 1 gradient of f, and, second order, one
Hessian-vector product of g per inner step that the meta-gradient back-propagates through:
first order K + 1, second order 2K + 1.
"""

from __future__ import annotations

import torch

from ciders.algorithms.fedmeta import FedMetaConfig, sgd
from ciders.core.tensors import State, clone


def _grad(out: torch.Tensor, params: list[torch.Tensor], create_graph: bool) -> list[torch.Tensor]:
    gs = torch.autograd.grad(out, params, create_graph=create_graph, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)]


def meta_gradient(cfg: FedMetaConfig, task, x: State, y: State, ep) -> tuple[State, State, dict]:
    """(G_x, G_y) of one episode at theta_0 = (x, y), and {loss: f at theta_K, support_loss: g at
    theta_0, calls}. Second order unless cfg.first_order."""
    kx, ky = list(x), list(y)
    leaves = [v.detach().clone().requires_grad_(True) for v in list(x.values()) + list(y.values())]
    split = lambda ps: ({k: p for k, p in zip(kx, ps)}, {k: p for k, p in zip(ky, ps[len(kx):])})  # noqa: E731
    theta = list(leaves)
    second = not cfg.first_order
    support_loss = None
    for _ in range(cfg.inner_steps):
        a, b = split(theta)
        lg = task.g(a, b, ep)
        if support_loss is None:
            support_loss = float(lg.detach())
        gs = _grad(lg, theta, create_graph=second)
        if not second:
            gs = [g.detach() for g in gs]
        theta = [p - cfg.inner_lr * g for p, g in zip(theta, gs)]
    a, b = split(theta)
    lf = task.f(a, b, ep)
    meta = _grad(lf, leaves, create_graph=False)
    gx, gy = split([m.detach() for m in meta])
    k = cfg.inner_steps
    calls = 2 * k + 1 if (second and k > 0) else k + 1
    return gx, gy, {"loss": float(lf.detach()), "support_loss": support_loss, "calls": calls}


def local_update(cfg: FedMetaConfig, task, x: State, y: State, i: int, q: int) -> tuple[State, State, dict]:
    """Client i of round q: `cfg.local_steps` MAML meta-updates of (x, y), one per episode."""
    x, y = clone(x), clone(y)
    losses, sup, calls = [], [], 0
    for ep in task.batches(i, q, cfg.local_steps):
        gx, gy, m = meta_gradient(cfg, task, x, y, ep)
        x, y = sgd(x, gx, cfg.lr), sgd(y, gy, cfg.lr)
        losses.append(m["loss"])
        calls += m["calls"]
        if m["support_loss"] is not None:
            sup.append(m["support_loss"])
    n = len(losses)
    out = {"loss": sum(losses) / n, "calls": calls, "steps": n}
    if sup:
        out["support_loss"] = sum(sup) / len(sup)
    return x, y, out
