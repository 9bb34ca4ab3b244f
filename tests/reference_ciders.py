"""A hand-written CIDERS round (docs/method.md#algorithm-2-one-round) for tests/algorithms/test_ciders_reference.py.

Written independently of ciders.algorithms and ciders.core: parameters are torch.nn.Parameters stepped by
torch.optim.SGD / torch.optim.AdamW, clipping is torch.nn.utils.clip_grad_norm_, the first-order meta-gradient,
the learning-rate schedule and Eqs. 8-12 are written out again here. A fault in the library therefore cannot
hide in both sides of a comparison. The only thing shared is the configuration (plain numbers) and the loss.

consensus_space (K steps, eta_k, corr = gamma (c - c_i), prox_k = eps_prox (x_k - w)):
  paper     d_k = clip(g_k + corr + prox_k),  x_{k+1} = OPT(x_k, d_k, eta_k),             Delta = (w - x_K) / (K eta_bar)
  gradient  the same trajectory,                                                      Delta = sum eta_k d_k / sum eta_k
  update    d_k = clip(g_k + prox_k),         x_{k+1} = OPT(x_k, d_k, eta_k) - eta_k corr, Delta = (w - x_K) / (K eta_bar)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------ a non-quadratic client loss with mini-batches


def loss(W: torch.Tensor, v: torch.Tensor, batch) -> torch.Tensor:
    """A one-hidden-layer tanh classifier with a logistic loss and an L2 term on W."""
    X, y = batch
    return F.softplus(-y * (torch.tanh(X @ W) @ v)).mean() + 0.05 * (W * W).sum()


def loss_fn(params, batch) -> torch.Tensor:
    """The same loss in the library's form: a named tensor dict."""
    return loss(params["W"], params["v"], batch)


def client_batches(client: int, t: int, n: int, size: int = 5, d_in: int = 4) -> list:
    """n micro-batches (X [size, d_in], y in {-1, 1}) of client `client` in round t; each client's inputs are shifted."""
    g = torch.Generator().manual_seed(1000 * client + t)
    out = []
    for _ in range(n):
        X = torch.randn(size, d_in, generator=g, dtype=torch.float64) + 0.5 * client
        y = torch.where(torch.rand(size, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0).to(torch.float64)
        out.append((X, y))
    return out


def initial_messenger(d_in: int = 4, hidden: int = 3, seed: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"W": torch.randn(d_in, hidden, generator=g, dtype=torch.float64) * 0.5,
            "v": torch.randn(hidden, generator=g, dtype=torch.float64)}


# ------------------------------------------------------------------ schedule


def lr_at(cfg, step: int, total: int) -> float:
    """warmup_cosine written out: linear warmup to lr over warmup_steps, then cosine to lr * min_lr_ratio at total."""
    base, warm, floor = cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return base
    assert cfg.schedule == "warmup_cosine"
    if step < warm:
        return base * (step + 1) / warm
    frac = min((step - warm) / max(total - warm, 1), 1.0)
    return base * floor + base * (1 - floor) * (1 + math.cos(math.pi * frac)) / 2


def round_lrs(cfg, t: int, rounds: int) -> tuple[list[float], list[float]]:
    """The K learning rates of round t (global client steps t K + k) and the look-ahead steps eta_in * eta_k / lr."""
    K = cfg.local_steps
    lrs = [lr_at(cfg, t * K + k, rounds * K) for k in range(K)]
    eta_in = cfg.lr if cfg.eta_in is None else cfg.eta_in
    return lrs, [eta_in * lr / cfg.lr for lr in lrs]


# ------------------------------------------------------------------ client


def fo_metagrad(params: list[torch.Tensor], eta_in: float, batch) -> list[torch.Tensor]:
    """g = grad L(x - eta_in grad L(x; xi); xi) at the current parameter values (Eqs. 5-6)."""
    x = [p.detach().clone().requires_grad_(True) for p in params]
    g0 = torch.autograd.grad(loss(*x, batch), x)
    look = [(xi - eta_in * gi).detach().requires_grad_(True) for xi, gi in zip(x, g0)]
    return [g.detach() for g in torch.autograd.grad(loss(*look, batch), look)]


@dataclass
class ClientResult:
    x: dict  # x_K
    delta: dict  # Eq. 8 (or the eta-weighted mean of d_k for consensus_space = gradient)
    c_i_new: dict  # Eq. 9
    dc: dict  # Eq. 10
    e_rae: float
    clip_norms: list  # the norm of what was clipped, per step


def _sq(ts) -> float:
    return float(sum((t * t).sum() for t in ts))


def client_round(cfg, mode: str, w: dict, c: dict, c_i: dict, gamma: float, lrs, eta_ins, batches,
                 metagrad=fo_metagrad) -> ClientResult:
    names = list(w)
    params = [torch.nn.Parameter(w[n].clone()) for n in names]
    if cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lrs[0], betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lrs[0], weight_decay=cfg.weight_decay)
    corr = [gamma * (c[n] - c_i[n]) for n in names]
    K, A = cfg.local_steps, cfg.grad_accum
    fed = [torch.zeros_like(w[n]) for n in names]  # sum_k eta_k d_k
    num = den = 0.0
    norms = []
    for k in range(K):
        gs = [metagrad(params, eta_ins[k], batches[k * A + a]) for a in range(A)]
        g = [sum(parts) / A for parts in zip(*gs)]
        in_clip = corr if mode in ("paper", "gradient") else [torch.zeros_like(cj) for cj in corr]
        for p, gj, cj, n in zip(params, g, in_clip, names):
            p.grad = gj + cj + cfg.eps_prox * (p.detach() - w[n])
        if cfg.max_grad_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
        for group in opt.param_groups:
            group["lr"] = lrs[k]
        fed = [f + lrs[k] * p.grad for f, p in zip(fed, params)]
        before = [p.detach().clone() for p in params]
        opt.step()
        # E-RAE compares c with the direction in c's units: the raw g, or in `update` the optimizer's own
        # direction (x_k - OPT(x_k, d_k)) / eta_k, the correction added after it not included
        dirs = g if mode != "update" else [(b - p.detach()) / lrs[k] for b, p in zip(before, params)]
        num += _sq([gj + cj - c[n] for gj, cj, n in zip(dirs, corr, names)])
        den += _sq(dirs) + _sq([c[n] for n in names]) + 1e-12
        if mode == "update":
            with torch.no_grad():
                for p, cj in zip(params, corr):
                    p.sub_(lrs[k] * cj)
    x = {n: p.detach().clone() for n, p in zip(names, params)}
    if mode == "gradient":
        delta = {n: f / sum(lrs) for n, f in zip(names, fed)}
    else:
        delta = {n: (w[n] - x[n]) / (K * (sum(lrs) / K)) for n in names}
    a = cfg.alpha
    c_i_new = {n: (1 + a * (gamma - 1)) * c_i[n] + a * delta[n] - a * gamma * c[n] for n in names}
    return ClientResult(x, delta, c_i_new, {n: c_i_new[n] - c_i[n] for n in names}, num / den, norms)


# ------------------------------------------------------------------ server


def server_round(cfg, w: dict, c: dict, copies: dict, dcs: dict, sizes: dict, gamma: float, lrs):
    """Eq. 11 from the server's copies of c_i, then Eq. 12 with p_i = |D_i| / sum |D_j| over the uploaders.
    Returns (w', c', the updated copies, the reconstructed Delta_i)."""
    a, K = cfg.alpha, cfg.local_steps
    deltas = {i: {n: dc[n] / a - (gamma - 1) * copies[i][n] + gamma * c[n] for n in w} for i, dc in dcs.items()}
    total = sum(sizes[i] for i in dcs)
    bar = {n: sum(sizes[i] / total * deltas[i][n] for i in dcs) for n in w}
    eta_bar = sum(lrs) / K
    w_new = {n: w[n] - cfg.tau * K * eta_bar * bar[n] for n in w}
    c_new = {n: (1 - a) * c[n] + a * bar[n] for n in w}
    new_copies = {**copies, **{i: {n: copies[i][n] + dcs[i][n] for n in w} for i in dcs}}
    return w_new, c_new, new_copies, deltas


# ------------------------------------------------------------------ config


def fd_metagrad_exact(eta_hvp: float):
    """The FD meta-gradient with the exact product: v - eta_hvp H(x_k) v, v = the FO meta-gradient and H at the
    current iterate x_k (not at the look-ahead point), by torch.autograd.functional.hvp."""

    def g(params: list[torch.Tensor], eta_in: float, batch) -> list[torch.Tensor]:
        v = fo_metagrad(params, eta_in, batch)
        x = tuple(p.detach().clone() for p in params)
        _, hv = torch.autograd.functional.hvp(lambda *q: loss(*q, batch), x, tuple(v))
        return [vi - eta_hvp * hi for vi, hi in zip(v, hv)]

    return g
