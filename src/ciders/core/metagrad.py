"""Personalized meta-gradients of CIDERS (Eqs. 5-7; docs/method.md#eqs-5-6-look-ahead-and-first-order-meta-gradient).

`grad_fn(x) -> (loss, grad)` evaluates the client loss on one fixed mini-batch. All evaluations of one
step must see the same randomness (dropout), which the caller's grad_fn guarantees.

  look-ahead  x~ = x - eta_in * grad L(x)                                     (Eq. 6)
  FO          g  = grad L(x~)                                                 (Eq. 5, first order)
  FD          v  = g_FO;  Hv ~ (grad L(x + eps v) - grad L(x - eps v)) / (2 eps)   (Eq. 7)
              g  = v - eta_hvp * Hv;  r_FD = ||eta_hvp Hv|| / (||v|| + 1e-12)
Cost in gradient evaluations: FO 2 (1 when eta_in = 0: x~ = x), FD 4.
"""

from __future__ import annotations

from typing import Callable

import torch

from ciders.core.tensors import State, lincomb, norm, scale

GradFn = Callable[[State], tuple[torch.Tensor, State]]


def metagrad(grad_fn: GradFn, x: State, eta_in: float, kind: str = "fo", eps_fd: float = 1e-4,
             eta_hvp: float | None = None) -> tuple[State, dict]:
    """Return (g, info) with info = {loss: L(x), r_fd (FD only), evals}."""
    loss, g0 = grad_fn(x)
    evals = 1
    if eta_in != 0:
        _, g = grad_fn(lincomb([(1.0, x), (-eta_in, g0)]))
        evals += 1
    else:
        g = g0
    info = {"loss": float(loss)}
    if kind == "fo":
        info["evals"] = evals
        return g, info
    if kind != "fd":
        raise ValueError(f"unknown meta-gradient {kind!r} (fo or fd)")
    eta_hvp = eta_in if eta_hvp is None else eta_hvp
    _, gp = grad_fn(lincomb([(1.0, x), (eps_fd, g)]))
    _, gm = grad_fn(lincomb([(1.0, x), (-eps_fd, g)]))
    hv = lincomb([(0.5 / eps_fd, gp), (-0.5 / eps_fd, gm)])
    corr = scale(hv, eta_hvp)
    info["r_fd"] = norm(corr) / (norm(g) + 1e-12)
    info["evals"] = evals + 2
    return lincomb([(1.0, g), (-1.0, corr)]), info


def fd_class(r: float) -> str:
    """small <= 0.1 < moderate <= 0.2 < large (docs/method.md#eq-7-finite-difference-meta-gradient-fd)."""
    return "small" if r <= 0.1 else ("moderate" if r <= 0.2 else "large")
