"""FedAvg without loss tuning: the single-level, full-model baseline of the RABO paper's loss-tuning
experiment (the RABO paper, Sec. V and Fig. 6, the brown dashed line; docs/rabo.md#full-model-baselines), i.e.
FedAvg (McMahan et al., AISTATS 2017) of the classifier y on the long-tailed training set with the loss
hyperparameters left at their untuned values.

x (the VS-loss hyperparameters w, l, Delta per class) stays at what the round loop passes in, which for
this baseline is `task.initial()`'s x: w = 1, l = 0, Delta = 1, where the VS loss
-w_k log softmax(Delta f + l)_k is plain cross-entropy. It is never updated and comes back unchanged.
Each local step is one SGD step on the task's inner (training) loss, weight decay included:

  y <- y - lr * grad_y g(x, y, batch)          (calls += 1: one backward pass)

on the batches `task.batches(i, q, local_steps)`; the server step is `fedmeta.server_mean` on y.
"""

from __future__ import annotations

from ciders.algorithms.fedmeta import FedMetaConfig, sgd
from ciders.core.hypergrad import grads
from ciders.core.tensors import State, clone


def local_update(cfg: FedMetaConfig, task, x: State, y: State, i: int, q: int) -> tuple[State, State, dict]:
    """Client i of round q: `cfg.local_steps` SGD steps on y of g at the fixed (untuned) x."""
    x, y = clone(x), clone(y)
    losses = []
    for batch in task.batches(i, q, cfg.local_steps):
        out = {}

        def loss(a, b, batch=batch, out=out):
            val = task.g(a, b, batch)
            out["loss"] = float(val.detach())
            return val

        _, gy = grads(loss, x, y)
        y = sgd(y, gy, cfg.lr)
        losses.append(out["loss"])
    n = len(losses)
    return x, y, {"loss": sum(losses) / n, "calls": n, "steps": n}
