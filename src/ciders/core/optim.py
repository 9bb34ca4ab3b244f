"""Functional optimizers over named tensor dicts (optax style: explicit state in, new state out).

AdamW follows torch.optim.AdamW (decoupled weight decay, bias correction); tests compare the two."""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True, eq=False)
class AdamWState:
    """AdamW's explicit state: the number of steps taken and the first / second moment of every parameter.

    Frozen: adamw_step returns a new state and never writes into the tensors of the one it was given."""

    step: int
    m: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        if self.m.keys() != self.v.keys():
            raise ValueError(f"AdamWState: m and v name different parameters ({sorted(set(self.m) ^ set(self.v))[:3]})")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"AdamWState: step must be an integer >= 0, got {self.step!r}")

    def to_record(self, prefix: str = "adamw") -> tuple[dict[str, torch.Tensor], dict]:
        """Flat tensors `{prefix}_m/<name>`, `{prefix}_v/<name>` and JSON meta `{prefix}_t` (the step) for a
        safetensors checkpoint; TAKD uses prefix "takd" (the names its checkpoints have always had)."""
        tensors = {f"{prefix}_m/{k}": t for k, t in self.m.items()}
        tensors.update({f"{prefix}_v/{k}": t for k, t in self.v.items()})
        return tensors, {f"{prefix}_t": self.step}

    @classmethod
    def from_record(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping, prefix: str = "adamw"
                    ) -> "AdamWState | None":
        """The inverse of to_record (other keys in `tensors` / `meta` are ignored); None when the record holds
        no optimizer state (meta `{prefix}_t` absent or null: no step was taken yet)."""
        if meta.get(f"{prefix}_t") is None:
            return None

        def part(p: str) -> dict[str, torch.Tensor]:
            return {k[len(p) + 1 :]: t for k, t in tensors.items() if k.startswith(p + "/")}

        return cls(int(meta[f"{prefix}_t"]), part(f"{prefix}_m"), part(f"{prefix}_v"))

    def equal(self, other: "AdamWState") -> bool:
        """Same step and bitwise the same moments (shapes, dtypes, values) under the same names."""
        return (isinstance(other, AdamWState) and self.step == other.step
                and moments_equal((self.m, other.m), (self.v, other.v)))

    __eq__ = equal  # a bool, not an elementwise tensor comparison
    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def moments_equal(*pairs: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]) -> bool:
    """Each (a, b) pair names the same tensors, bitwise equal (shapes, dtypes, values): optimizer-state equality."""
    return all(a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a) for a, b in pairs)


def adamw_init(params: Mapping[str, torch.Tensor]) -> AdamWState:
    return AdamWState(0, {k: torch.zeros_like(p) for k, p in params.items()},
                      {k: torch.zeros_like(p) for k, p in params.items()})


def adamw_step(params: Mapping, grads: Mapping, state: AdamWState, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.01) -> tuple[State, AdamWState]:
    """One AdamW step (torch.optim.AdamW, amsgrad off). With t = state.step + 1:
      m' = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g^2,
      p' = p (1 - lr wd) - (lr / (1 - b1^t)) m' / (sqrt(v' / (1 - b2^t)) + eps)."""
    b1, b2 = betas
    t = state.step + 1
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        m = state.m[k] * b1 + g * (1 - b1)
        v = state.v[k] * b2 + g * g * (1 - b2)
        p = p * (1 - lr * weight_decay)
        denom = (v.sqrt() / math.sqrt(bc2)) + eps
        new_p[k] = p - (lr / bc1) * m / denom
        new_m[k], new_v[k] = m, v
    return new_p, AdamWState(t, new_m, new_v)
