"""Dist-ProtoNet: prototypical networks (Snell, Swersky and Zemel, NeurIPS 2017) federated by FedAvg, the
RABO paper's full-model few-shot baseline (the RABO paper, Table II; docs/rabo.md#full-model-baselines).

On an episode with support S (labels 0..N-1) and query Q, with the feature extractor phi_x:

  c_k = (1 / |S_k|) sum_{(s, k) in S} phi_x(s)                       (prototype: class mean of the support)
  p(k | z) = softmax_k( -|phi_x(z) - c_k|^2 )                        (negative squared Euclidean distance)
  L(x) = -(1 / |Q|) sum_{(z, k) in Q} log p(k | z)

Each local step is one SGD step x <- x - lr grad_x L(x) on the step's episode (`task.batches`), one
backward pass (calls += 1). ProtoNet has no head: y is not used and comes back unchanged (the task's
evaluation still fits its own head on the learnt features). The server step is `fedmeta.server_mean`.

Features are `task.features(x, images)` when the task has such a method (e.g. a ResNet-12 backbone),
else `ciders.models.vision.conv4_features(x, images)`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ciders.algorithms.fedmeta import FedMetaConfig, sgd
from ciders.core.hypergrad import grads
from ciders.core.tensors import State, clone

Features = Callable[[State, torch.Tensor], torch.Tensor]


def feature_fn(task) -> Features:
    """The task's feature extractor: `task.features` if it has one, else Conv4."""
    f = getattr(task, "features", None)
    if callable(f):
        return f
    from ciders.models.vision import conv4_features

    return conv4_features


def prototypes(feats: torch.Tensor, labels: torch.Tensor, n_way: int) -> torch.Tensor:
    """[n_way, d]: the mean support feature of each class 0..n_way-1 (every class needs a support shot)."""
    onehot = F.one_hot(labels, n_way).to(feats.dtype)  # [S, N]
    counts = onehot.sum(0)
    if bool((counts == 0).any()):
        missing = [int(k) for k in torch.nonzero(counts == 0).flatten()]
        raise ValueError(f"prototypes: classes {missing} have no support example")
    return (onehot.T @ feats) / counts[:, None]


def logits(features: Features, x: State, ep) -> torch.Tensor:
    """[|Q|, N]: -|phi_x(query) - c_k|^2 for the episode's prototypes c_k."""
    n_way = int(torch.cat([ep.support_labels, ep.query_labels]).max()) + 1
    protos = prototypes(features(x, ep.support), ep.support_labels, n_way)
    fq = features(x, ep.query)
    return -((fq[:, None, :] - protos[None, :, :]) ** 2).sum(-1)


def protonet_loss(features: Features, x: State, ep) -> torch.Tensor:
    """The prototypical loss of an episode: query cross-entropy of negative squared distances."""
    return F.cross_entropy(logits(features, x, ep), ep.query_labels)


def thresholds(x: State, mask: State) -> dict:
    """FIARSE's per-tensor threshold tau: the smallest |x| the client's mask keeps (0 for an empty mask)."""
    return {k: v.detach().abs()[mask[k] > 0].min() if bool((mask[k] > 0).any()) else v.new_zeros(())
            for k, v in x.items()}


def threshold_controlled(x: State, mask: State, tau: dict) -> tuple[State, State]:
    """FIARSE's threshold-controlled sub-model (Wu et al., NeurIPS 2024; docs/rabo.md#sub-model-baselines): with
    tau fixed when the round starts (`thresholds`), the sub-model at the current x is m = mask * 1{|x| >= tau},
    so an entry that shrinks below tau during the local steps leaves it, and the gradient of the loss at x * m
    is taken to x through a smooth surrogate of that step, d m / d|x| = 2 tau / (|x| + tau)^2 on the kept entries:
      d (x m) / d x = m (1 + 2 tau |x| / (|x| + tau)^2)      (= m where tau = 0: a tensor kept whole)
    Returns (m, that factor)."""
    ms, scale = {}, {}
    for k, v in x.items():
        a, t = v.detach().abs(), tau[k]
        m = ((mask[k] > 0) & (a >= t)).to(v.dtype)
        ms[k] = m
        scale[k] = m * (1 + (2 * t * a / (a + t) ** 2 if float(t) > 0 else torch.zeros_like(a)))
    return ms, scale


def local_update(cfg: FedMetaConfig, task, x: State, y: State, i: int, q: int, mask: State | None = None,
                 threshold: bool = False) -> tuple[State, State, dict]:
    """Client i of round q: `cfg.local_steps` SGD steps on the prototypical loss of its episodes. `mask`: the
    client trains only those entries of x (an unstructured sub-model held at full shape); `threshold`: FIARSE's
    threshold-controlled steps on it (`threshold_controlled`)."""
    phi = feature_fn(task)
    x = clone(x)
    tau = thresholds(x, mask) if threshold and mask is not None else None
    losses, accs = [], []
    for ep in task.batches(i, q, cfg.local_steps):
        out = {}

        def loss(a, _b, ep=ep, out=out):
            lg = logits(phi, a, ep)
            out["acc"] = float((lg.argmax(1) == ep.query_labels).float().mean())
            val = F.cross_entropy(lg, ep.query_labels)
            out["loss"] = float(val.detach())
            return val

        if mask is None:
            gx, _ = grads(loss, x, {})
        elif threshold:  # the loss at x * m, its gradient through the surrogate factor
            m, scale = threshold_controlled(x, mask, tau)
            g_eff, _ = grads(loss, {k: v * m[k] for k, v in x.items()}, {})
            gx = {k: g_eff[k] * scale[k] for k in x}
        else:
            g_eff, _ = grads(loss, {k: v * mask[k] for k, v in x.items()}, {})
            gx = {k: g_eff[k] * mask[k] for k in x}
        x = sgd(x, gx, cfg.lr)
        losses.append(out["loss"])
        accs.append(out["acc"])
    n = len(losses)
    return x, clone(y), {"loss": sum(losses) / n, "train_accuracy": sum(accs) / n, "calls": n, "steps": n}
