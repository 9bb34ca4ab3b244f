"""Hypergradients of a bilevel problem (docs/rabo.md#outer-phase-the-hypergradient-rabo), over named tensor dicts.

  min_x f(x, y*(x)),   y*(x) = argmin_y g(x, y)
  grad Phi(x) = grad_x f - grad^2_xy g [grad^2_yy g]^{-1} grad_y f          (implicit differentiation)

RABO: v = [grad^2_yy g]^{-1} grad_y f by conjugate gradient or a Neumann series, using Hessian-vector
products (double backward); the cross term grad^2_xy g v = d/dx <grad_y g(x, y), v>.
RAFBO: every second-order product by finite differences of first-order gradients ("second-order
free", docs/rabo.md#rafbo-finite-difference-products), in the paper's forward form with a probe of length d
along u = v / ||v||: H_yy v ~ ||v|| (grad_y g(x, y + d u) - grad_y g(x, y)) / d, and grad^2_xy g v ~
||v|| (grad_x g(x, y + d u) - grad_x g(x, y)) / d, the base gradient grad g(x, y) computed once per hypergradient; for low-dimensional x the
coordinate estimator J(x, e_p) = (grad_y g(x + mu e_p, y) - grad_y g(x, y)) / mu gives the cross term coordinate by
coordinate: (grad^2_xy g v)_p = <J(x, e_p), v>. On a quadratic g every forward difference is exact up to
rounding (the gradients are affine), which the tests use.

Losses are callables `fn(x: State, y: State) -> scalar tensor`.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from ciders.core.tensors import State, dot, lincomb, norm

BiLoss = Callable[[State, State], torch.Tensor]
HVP = Callable[[State], State]


def _leaf(s: Mapping[str, torch.Tensor]) -> State:
    return {k: v.detach().requires_grad_(True) for k, v in s.items()}


def grads(fn: BiLoss, x: State, y: State, create_graph: bool = False) -> tuple[State, State]:
    """(grad_x fn, grad_y fn) at (x, y); detached unless create_graph."""
    xl, yl = _leaf(x), _leaf(y)
    out = fn(xl, yl)
    gs = torch.autograd.grad(out, list(xl.values()) + list(yl.values()), create_graph=create_graph, allow_unused=True)
    gs = [torch.zeros_like(p) if g is None else g for g, p in zip(gs, list(xl.values()) + list(yl.values()))]
    gx = dict(zip(xl, gs[: len(xl)]))
    gy = dict(zip(yl, gs[len(xl) :]))
    if not create_graph:
        gx, gy = {k: v.detach() for k, v in gx.items()}, {k: v.detach() for k, v in gy.items()}
    return gx, gy


def value_and_grad_y(fn: BiLoss, x: State, y: State) -> tuple[float, State]:
    """(fn(x, y), grad_y fn) with x held constant: no backward pass through x's part of the graph (for a
    feature extractor x and a head y, the inner step never differentiates the backbone)."""
    yl = _leaf(y)
    out = fn({k: v.detach() for k, v in x.items()}, yl)
    gs = torch.autograd.grad(out, list(yl.values()), allow_unused=True)
    return float(out.detach()), {k: (torch.zeros_like(p) if g is None else g).detach()
                                 for (k, p), g in zip(yl.items(), gs)}


def _second(g: BiLoss, x: State, y: State, v: State, wrt_x: bool = True) -> tuple[State | None, State]:
    """(grad^2_xy g v, grad^2_yy g v) by one double backward of <grad_y g, v>; with wrt_x False, x is held
    constant and only the y part is computed (no backward pass through x's part of the graph)."""
    xl = _leaf(x) if wrt_x else {k: t.detach() for k, t in x.items()}
    yl = _leaf(y)
    gy = torch.autograd.grad(g(xl, yl), list(yl.values()), create_graph=True)
    inner = sum((a * v[k].detach()).sum() for a, k in zip(gy, yl))
    params = (list(xl.values()) if wrt_x else []) + list(yl.values())
    out = torch.autograd.grad(inner, params, allow_unused=True)
    out = [torch.zeros_like(p) if o is None else o.detach() for o, p in zip(out, params)]
    n = len(xl) if wrt_x else 0
    return (dict(zip(xl, out[:n])) if wrt_x else None), dict(zip(yl, out[n:]))


def hvp_yy(g: BiLoss, x: State, y: State, v: State) -> State:
    return _second(g, x, y, v, wrt_x=False)[1]


def cross_xy(g: BiLoss, x: State, y: State, v: State) -> State:
    """grad^2_xy g v (an x-shaped state)."""
    return _second(g, x, y, v)[0]


def _probe(y: State, v: State, delta: float) -> tuple[float, State] | None:
    """(||v||, y + delta u) with u = v / ||v||: a probe of length `delta` whatever the scale of v (an absolute step
    would make it delta ||v|| long, so the error would follow the scale of f); None when v = 0. u is formed in
    float64 and rounded once: in float32 a late Neumann term can have a subnormal norm (~1e-42), where the old
    step h = delta / ||v|| overflowed to inf and the product came out NaN."""
    nv = norm(v)
    if nv == 0.0:
        return None
    u = {k: (t.double() / nv).to(t.dtype) for k, t in v.items()}
    return nv, lincomb([(1.0, y), (delta, u)])


def _fd_product(g: BiLoss, x: State, y: State, v: State, delta: float, base: tuple[State, State] | None,
                part: str) -> State:
    """The `part` ("x" or "y") of ||v|| (grad g(x, y + delta u) - grad g(x, y)) / delta, u = v / ||v||:
    grad^2_xy g v or grad^2_yy g v. The difference is taken along the unit vector and scaled by ||v|| last,
    so no intermediate over- or underflows for a tiny v (the product of a subnormal v is itself below the
    dtype's resolution and comes out as such). `base` = grads(g, x, y), computed once per point by the caller
    and shared by every product there; a y product's probe differentiates in y only."""
    pr = _probe(y, v, delta)
    if pr is None:
        return {k: torch.zeros_like(t) for k, t in (x if part == "x" else y).items()}
    nv, yp = pr
    g0 = (grads(g, x, y) if base is None else base)[0 if part == "x" else 1]
    g1 = grads(g, x, yp)[0] if part == "x" else value_and_grad_y(g, x, yp)[1]
    # H u in float64, times ||v|| there, rounded once to the state's dtype
    return {k: ((g1[k].double() - g0[k].double()) / delta * nv).to(g1[k].dtype) for k in g1}


def hvp_yy_fd(g: BiLoss, x: State, y: State, v: State, delta: float, base: tuple[State, State] | None = None
              ) -> State:
    """grad^2_yy g v ~ ||v|| (grad_y g(x, y + delta u) - grad_y g(x, y)) / delta, u = v / ||v||."""
    return _fd_product(g, x, y, v, delta, base, "y")


def cross_xy_fd(g: BiLoss, x: State, y: State, v: State, delta: float, base: tuple[State, State] | None = None
                ) -> State:
    """grad^2_xy g v ~ ||v|| (grad_x g(x, y + delta u) - grad_x g(x, y)) / delta (the probe and base of hvp_yy_fd)."""
    return _fd_product(g, x, y, v, delta, base, "x")


def cross_xy_coordinates(g: BiLoss, x: State, y: State, v: State, mu: float,
                         base: tuple[State, State] | None = None) -> State:
    """(grad^2_xy g v)_p = <J(x, e_p), v>, J(x, e_p) = (grad_y g(x + mu e_p, y) - grad_y g(x, y)) / mu:
    one extra gradient per coordinate of x (for low-dimensional x, e.g. loss hyperparameters)."""
    _, g0 = grads(g, x, y) if base is None else base
    out = {k: torch.zeros_like(t) for k, t in x.items()}
    for k, t in x.items():
        flat = out[k].view(-1)
        for p in range(t.numel()):
            xp = {kk: vv.clone() for kk, vv in x.items()}
            xp[k].view(-1)[p] += mu
            _, g1 = grads(g, xp, y)
            flat[p] = dot(lincomb([(1.0 / mu, g1), (-1.0 / mu, g0)]), v)
    return out


# ---------------------------------------------------------------------------------------------- solvers


def solve_cg(hvp: HVP, b: State, iters: int, rtol: float = 1e-12) -> tuple[State, dict]:
    """H v = b for symmetric positive definite H (on the span of b: a masked sub-model's Hessian is
    singular outside its coordinates, where b is zero too) by conjugate gradient from v = 0; stops early
    once |r| <= rtol |b|. Non-positive curvature p'Hp <= 0 along the first direction (b itself) is an
    error: H is not positive definite. Later, it stops at the current iterate (truncated CG, as Steihaug's):
    with finite-difference products (RAFBO) near convergence the product's error can outweigh a tiny p'Hp;
    `breakdown` in the info says it happened."""
    v = {k: torch.zeros_like(t) for k, t in b.items()}
    r = {k: t.clone() for k, t in b.items()}
    p = {k: t.clone() for k, t in b.items()}
    rs = dot(r, r)
    stop = rtol * rtol * rs
    n, breakdown = 0, False
    for n in range(1, iters + 1):
        if rs <= stop or rs == 0:
            n -= 1
            break
        hp = hvp(p)
        php = dot(p, hp)
        if php <= 0 and n == 1:
            raise ValueError(f"conjugate gradient: the Hessian is not positive definite along p (p'Hp = {php:.3g})")
        if php <= 0:
            n, breakdown = n - 1, True
            break
        a = rs / php
        v = lincomb([(1.0, v), (a, p)])
        r = lincomb([(1.0, r), (-a, hp)])
        rs_new = dot(r, r)
        p = lincomb([(1.0, r), (rs_new / rs, p)])
        rs = rs_new
    return v, {"iters": n, "residual": rs ** 0.5, "breakdown": breakdown}


def solve_neumann(hvp: HVP, b: State, iters: int, eta: float) -> tuple[State, dict]:
    """H^{-1} b ~ eta sum_{k=0}^{iters} (I - eta H)^k b (converges when 0 < eta < 2 / lambda_max(H))."""
    term = {k: t.clone() for k, t in b.items()}
    total = {k: t.clone() for k, t in b.items()}
    for _ in range(iters):
        term = lincomb([(1.0, term), (-eta, hvp(term))])
        total = lincomb([(1.0, total), (1.0, term)])
    return {k: eta * t for k, t in total.items()}, {"iters": iters}


def solve_exact(g: BiLoss, x: State, y: State, b: State) -> tuple[State, dict]:
    """The exact solve through the full Hessian of g in y (small problems: tests, references)."""
    keys = list(y)
    shapes = [y[k].shape for k in keys]
    sizes = [y[k].numel() for k in keys]

    def unflat(vec):
        parts = torch.split(vec, sizes)
        return {k: p.view(s) for k, p, s in zip(keys, parts, shapes)}

    flat_y = torch.cat([y[k].detach().reshape(-1) for k in keys])
    h = torch.autograd.functional.hessian(lambda fy: g({k: v.detach() for k, v in x.items()}, unflat(fy)), flat_y)
    sol = torch.linalg.solve(h, torch.cat([b[k].reshape(-1) for k in keys]))
    return unflat(sol), {"iters": 0}


# ---------------------------------------------------------------------------------------------- hypergradient


def hypergradient(f: BiLoss, g: BiLoss, x: State, y: State, *, solver: str = "cg", iters: int = 10,
                  eta: float = 0.1, second_order: str = "autograd", delta: float = 1e-3,
                  coordinates: bool = False) -> tuple[State, dict]:
    """grad Phi(x) at (x, y) (y ~ y*(x)). solver: cg | neumann | exact; second_order: autograd (RABO) |
    fd (RAFBO: finite differences, step `delta`); coordinates: the coordinate-wise cross term (fd only)."""
    if solver not in ("cg", "neumann", "exact"):
        raise ValueError(f"solver must be cg, neumann or exact, got {solver!r}")
    if second_order not in ("autograd", "fd"):
        raise ValueError(f"second_order must be autograd or fd, got {second_order!r}")
    fx, fy = grads(f, x, y)
    base = grads(g, x, y) if second_order == "fd" else None  # shared by every finite difference at (x, y)
    if second_order == "autograd":
        hvp = lambda v: hvp_yy(g, x, y, v)  # noqa: E731
    else:
        hvp = lambda v: hvp_yy_fd(g, x, y, v, delta, base)  # noqa: E731
    if solver == "cg":
        v, info = solve_cg(hvp, fy, iters)
    elif solver == "neumann":
        v, info = solve_neumann(hvp, fy, iters, eta)
    else:
        v, info = solve_exact(g, x, y, fy)
    if second_order == "autograd":
        cross = cross_xy(g, x, y, v)
    elif coordinates:
        cross = cross_xy_coordinates(g, x, y, v, delta, base)
    else:
        cross = cross_xy_fd(g, x, y, v, delta, base)
    return lincomb([(1.0, fx), (-1.0, cross)]), info
