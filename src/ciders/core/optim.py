"""Functional optimizers over named tensor dicts (optax style: explicit state in, new state out).

AdamW follows torch.optim.AdamW (decoupled weight decay, bias correction); tests compare the two."""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ciders.core.tensors import State, norm


def clip_by_global_norm(grads: Mapping[str, torch.Tensor], max_norm: float) -> tuple[State, float]:
    """Scale the whole gradient so that its global L2 norm is at most max_norm (0 = off)."""
    n = norm(grads)
    if max_norm <= 0 or n <= max_norm:
        return dict(grads), n
    s = max_norm / (n + 1e-6)
    return {k: g * s for k, g in grads.items()}, n


def sgd_step(params: Mapping, grads: Mapping, lr: float, weight_decay: float = 0.0) -> State:
    """x - lr * (g + wd * x)."""
    return {k: p - lr * (grads[k] + weight_decay * p) if weight_decay else p - lr * grads[k] for k, p in params.items()}


def adamw_init(params: Mapping[str, torch.Tensor]) -> dict:
    return {"t": 0, "m": {k: torch.zeros_like(p) for k, p in params.items()},
            "v": {k: torch.zeros_like(p) for k, p in params.items()}}


def adamw_step(params: Mapping, grads: Mapping, state: dict, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.01) -> tuple[State, dict]:
    b1, b2 = betas
    t = state["t"] + 1
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        m = state["m"][k] * b1 + g * (1 - b1)
        v = state["v"][k] * b2 + g * g * (1 - b2)
        p = p * (1 - lr * weight_decay)
        denom = (v.sqrt() / math.sqrt(bc2)) + eps
        new_p[k] = p - (lr / bc1) * m / denom
        new_m[k], new_v[k] = m, v
    return new_p, {"t": t, "m": new_m, "v": new_v}
