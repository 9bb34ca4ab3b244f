"""Geometric diagnostics of the consensus correction (paper Sec. V-B and VI-D;
docs/method.md#geometry-of-the-trajectory).

Theory (Prop. 2, Eqs. 20-24, 27-29), for client i with local meta-gradient g_i and global G:
  delta_i = g_i - G,  u_i = g_i + gamma (c - c_i),  r_i = u_i - G = delta_i + gamma (c - c_i)
  DR  = 1 - ||r_i|| / ||delta_i||          PPR = <u_i, g_perp> / ||g_perp||^2,  g_perp = g_i - proj_G(g_i)
  undamped:  psi_t = (1 - gamma) + gamma (1 - alpha)^t,  DR = 1 - psi_t,  PPR = psi_t
  proximal:  psi_{t+1} = [1 - alpha + alpha gamma (1 - sigma_K)] psi_t + alpha (1 - gamma),  psi_0 = 1
             sigma_K = S_K / K,  S_K = sum_{j<K} rho^j,  rho = 1 - eta eps_prox
Empirical (per client-round, Protocol C): the same readouts with the recorded global consensus c as
the reference G (S-DR, S-PPR), on the round's mean local meta-gradient (c, c_i, gamma are fixed within
a round), and E-RAE = sum_k ||g_eff - c||^2 / sum_k (||g||^2 + ||c||^2 + 1e-12), g_eff = g + gamma (c - c_i).
"""

from __future__ import annotations

from ciders.core.tensors import State, dot, lincomb, norm, sub


def psi(t: int, gamma: float, alpha: float, k: int = 1, eta: float = 0.0, eps_prox: float = 0.0) -> float:
    """psi_t of Prop. 2 (closed form without proximal damping, recurrence with it;
    docs/method.md#prop-2-psi_t-dr-and-ppr)."""
    sigma = sigma_k(k, eta, eps_prox)
    if sigma == 1.0:
        return (1 - gamma) + gamma * (1 - alpha) ** t
    p = 1.0
    for _ in range(t):
        p = (1 - alpha + alpha * gamma * (1 - sigma)) * p + alpha * (1 - gamma)
    return p


def psi_inf(gamma: float, k: int = 1, eta: float = 0.0, eps_prox: float = 0.0) -> float:
    """Eq. 29 (equals 1 - gamma without proximal damping)."""
    sigma = sigma_k(k, eta, eps_prox)
    return (1 - gamma) / (1 - gamma * (1 - sigma))


def sigma_k(k: int, eta: float, eps_prox: float) -> float:
    rho = 1 - eta * eps_prox
    return sum(rho**j for j in range(k)) / k


def dr_ppr(g: State, reference: State, c: State, c_i: State, gamma: float) -> tuple[float, float]:
    """(DR, PPR) of one client against a global reference direction (G, or the recorded c)."""
    delta = sub(g, reference)
    corr = lincomb([(gamma, c), (-gamma, c_i)])
    r = lincomb([(1.0, delta), (1.0, corr)])
    u = lincomb([(1.0, g), (1.0, corr)])
    nd = norm(delta)
    dr = 1.0 - norm(r) / nd if nd > 0 else 0.0
    rr = dot(reference, reference)
    g_perp = g if rr == 0 else lincomb([(1.0, g), (-dot(g, reference) / rr, reference)])
    pp = dot(g_perp, g_perp)
    ppr = dot(u, g_perp) / pp if pp > 0 else float("nan")
    return dr, ppr


class RoundStats:
    """Accumulates one client-round's per-step statistics (E-RAE numerator/denominator, mean g)."""

    def __init__(self, c: State, c_i: State, gamma: float):
        self.c, self.c_i, self.gamma = c, c_i, gamma
        self.corr = lincomb([(gamma, c), (-gamma, c_i)])
        self.num = self.den = 0.0
        self.g_sum: State | None = None
        self.k = 0

    def add(self, g: State) -> None:
        g_eff_minus_c = lincomb([(1.0, g), (1.0, self.corr), (-1.0, self.c)])
        self.num += norm(g_eff_minus_c) ** 2
        self.den += norm(g) ** 2 + norm(self.c) ** 2 + 1e-12
        self.g_sum = dict(g) if self.g_sum is None else lincomb([(1.0, self.g_sum), (1.0, g)])
        self.k += 1

    def result(self) -> dict:
        g_mean = {k: v / self.k for k, v in self.g_sum.items()}
        s_dr, s_ppr = dr_ppr(g_mean, self.c, self.c, self.c_i, self.gamma)
        return {"e_rae": self.num / self.den, "s_dr": s_dr, "s_ppr": s_ppr}
