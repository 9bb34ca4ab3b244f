"""Consensus variates and aggregation of CIDERS (Eqs. 8-12; docs/method.md#eq-8-the-displacement-delta_i).

Client, after K local steps from w = w_PM^(t):
  Delta_i   = (w - x_K) / (K * eta_bar)                                  (Eq. 8)
  c_i'      = [1 + alpha (gamma - 1)] c_i + alpha Delta_i - alpha gamma c (Eq. 9)
  dc_i      = c_i' - c_i                                                 (Eq. 10)
Server, from its synchronized copy of c_i:
  Delta_i   = dc_i / alpha - (gamma - 1) c_i + gamma c                   (Eq. 11)
  w'        = w - tau K eta_bar sum_i p_i Delta_i                        (Eq. 12; our decision: not Alg. 2 line 6)
  c'        = (1 - alpha) c + alpha sum_i p_i Delta_i                    (Eq. 12)
The weights p_i and the mean sum_i p_i Delta_i are `ciders.core.aggregate` (client_weights, weighted_sum).
Eq. 12 rather than Alg. 2 line 6, and why: docs/method.md#eq-12-server-aggregation.
"""

from __future__ import annotations

from typing import Sequence

from ciders.core.tensors import State, lincomb, sub


def displacement(w: State, x_k: State, k: int, eta_bar: float) -> State:
    """Eq. 8."""
    if k * eta_bar <= 0:
        raise ValueError(f"Eq. 8 needs K * eta_bar > 0 (got K={k}, eta_bar={eta_bar}): the round's learning rates are zero")
    return lincomb([(1.0 / (k * eta_bar), w), (-1.0 / (k * eta_bar), x_k)])


def client_consensus(c_i: State, delta: State, c: State, alpha: float, gamma: float) -> State:
    """Eq. 9."""
    return lincomb([(1.0 + alpha * (gamma - 1.0), c_i), (alpha, delta), (-alpha * gamma, c)])


def increment(c_i_new: State, c_i: State) -> State:
    """Eq. 10."""
    return sub(c_i_new, c_i)


def reconstruct(dc: State, c_i: State, c: State, alpha: float, gamma: float) -> State:
    """Eq. 11: the server's exact recovery of Delta_i (up to float rounding)."""
    return lincomb([(1.0 / alpha, dc), (-(gamma - 1.0), c_i), (gamma, c)])


def server_messenger(w: State, delta_bar: State, tau: float, k: int, eta_bar: float) -> State:
    """Eq. 12, messenger."""
    return lincomb([(1.0, w), (-tau * k * eta_bar, delta_bar)])


def server_consensus(c: State, delta_bar: State, alpha: float) -> State:
    """Eq. 12, global consensus."""
    return lincomb([(1.0 - alpha, c), (alpha, delta_bar)])


def scaffold_consensus(c: State, dcs: Sequence[State], n_clients: int) -> State:
    """SCAFFOLD's server control variate (Karimireddy et al. 2020, Alg. 1 line 17):
    c' = c + (1/N) sum_{i in S} dc_i over the N registered clients. With gamma = alpha = 1 the client rule
    Eq. 9 is SCAFFOLD's option II, c_i' = c_i - c + Delta_i, and under full participation this equals
    Eq. 12 with alpha = 1 (c' = mean Delta_i); the two differ when only some clients reply."""
    if n_clients < 1:
        raise ValueError(f"scaffold_consensus needs n_clients >= 1, got {n_clients}")
    return lincomb([(1.0, c)] + [(1.0 / n_clients, d) for d in dcs])
