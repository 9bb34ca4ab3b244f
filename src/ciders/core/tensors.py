"""Arithmetic on named tensor dicts (`State`): the unit algorithms, checkpoints and the wire use.

Every binary operation requires identical key sets (a silent mismatch would corrupt an update)."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

State = dict[str, torch.Tensor]


def _same_keys(a: Mapping, b: Mapping) -> None:
    if a.keys() != b.keys():
        missing = sorted(set(a) ^ set(b))
        raise KeyError(f"state key sets differ ({len(missing)} keys, e.g. {missing[0]!r})")


def device_of(a: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of a state's tensors (its first one: a state lives on one device)."""
    return next(iter(a.values())).device


def zeros_like(a: Mapping[str, torch.Tensor]) -> State:
    return {k: torch.zeros_like(v) for k, v in a.items()}


def clone(a: Mapping[str, torch.Tensor]) -> State:
    return {k: v.detach().clone() for k, v in a.items()}


def add(a: Mapping, b: Mapping) -> State:
    _same_keys(a, b)
    return {k: a[k] + b[k] for k in a}


def sub(a: Mapping, b: Mapping) -> State:
    _same_keys(a, b)
    return {k: a[k] - b[k] for k in a}


def scale(a: Mapping, s: float) -> State:
    return {k: v * s for k, v in a.items()}


def lincomb(terms: Iterable[tuple[float, Mapping[str, torch.Tensor]]]) -> State:
    """sum_j coef_j * state_j, accumulated in the order given."""
    out: State | None = None
    for coef, st in terms:
        if out is None:
            out = {k: v * coef for k, v in st.items()}
        else:
            _same_keys(out, st)
            out = {k: out[k] + v * coef for k, v in st.items()}
    if out is None:
        raise ValueError("lincomb of no terms")
    return out


# Reductions across keys run in sorted key order: dict order differs between a state built in memory
# and one read back from safetensors (whose order varies between processes), and float sums depend
# on order. Sorted order makes every norm bitwise reproducible, in any process, after any resume.


def dot(a: Mapping, b: Mapping) -> float:
    _same_keys(a, b)
    return float(sum((a[k].double() * b[k].double()).sum() for k in sorted(a)))


def norm(a: Mapping) -> float:
    return float(sum((a[k].double() ** 2).sum() for k in sorted(a))) ** 0.5


def equal(a: Mapping, b: Mapping) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_abs_diff(a: Mapping, b: Mapping) -> float:
    _same_keys(a, b)
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)


def digest(a: Mapping[str, torch.Tensor]) -> str:
    """A short content hash of a state (keys in sorted order, each key's dtype, shape and raw bytes): two
    states have the same digest only if they are bitwise equal (up to SHA-256 collisions)."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(a):
        v = a[k].detach().to("cpu").contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
