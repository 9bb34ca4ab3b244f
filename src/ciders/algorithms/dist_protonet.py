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


def local_update(cfg: FedMetaConfig, task, x: State, y: State, i: int, q: int) -> tuple[State, State, dict]:
    """Client i of round q: `cfg.local_steps` SGD steps on the prototypical loss of its episodes."""
    phi = feature_fn(task)
    x = clone(x)
    losses, accs = [], []
    for ep in task.batches(i, q, cfg.local_steps):
        out = {}

        def loss(a, _b, ep=ep, out=out):
            lg = logits(phi, a, ep)
            out["acc"] = float((lg.argmax(1) == ep.query_labels).float().mean())
            val = F.cross_entropy(lg, ep.query_labels)
            out["loss"] = float(val.detach())
            return val

        gx, _ = grads(loss, x, {})
        x = sgd(x, gx, cfg.lr)
        losses.append(out["loss"])
        accs.append(out["acc"])
    n = len(losses)
    return x, clone(y), {"loss": sum(losses) / n, "train_accuracy": sum(accs) / n, "calls": n, "steps": n}
