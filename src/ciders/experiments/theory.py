"""`ciders theory`: Prop. 2 on synthetic clients, through the real client and server updates
(docs/method.md#prop-2-psi_t-dr-and-ppr).

Clients have linear losses <a_i, x> (constant gradients: the theory holds for any K and eps_prox) or
quadratics 0.5 (x - b_i)^T A (x - b_i) sharing one Hessian A (exact for K = 1). The run uses SGD at a
constant learning rate, full participation, first-order meta-gradients with eta_in = 0 and uniform p_i,
in float64; without clipping or weight decay every `consensus_space` gives the same updates there. Each round reports the mean measured DR and PPR across clients from the actual c and c_i
at the start of that round, beside the prediction psi_t.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ciders.algorithms import ciders as alg
from ciders.config import CidersConfig
from ciders.core.diagnostics import dr_ppr, psi, psi_inf
from ciders.core.tensors import State, lincomb


def synthetic_clients(n: int, dim: int, loss: str, seed: int):
    """Per-client loss functions on {"x": R^dim} and a function giving each client's gradient."""
    g = torch.Generator().manual_seed(seed)
    if loss == "linear":
        a = [torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(n)]
        fns = [(lambda p, _b, ai=ai: (p["x"] * ai).sum()) for ai in a]
        grads = [(lambda x, ai=ai: ai) for ai in a]
    elif loss == "quadratic":
        m = torch.randn(dim, dim, generator=g, dtype=torch.float64)
        hess = m @ m.T / dim + torch.eye(dim, dtype=torch.float64)
        b = [torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(n)]
        fns = [(lambda p, _b, bi=bi: 0.5 * ((p["x"] - bi) @ hess @ (p["x"] - bi))) for bi in b]
        grads = [(lambda x, bi=bi: hess @ (x - bi)) for bi in b]
    else:
        raise ValueError(f"--loss must be linear or quadratic, got {loss!r}")
    return fns, grads


def run_theory(clients: int, dim: int, k: int, eta: float, gamma: float, alpha: float, eps_prox: float,
               rounds: int, loss: str = "linear", seed: int = 0, tau: float = 0.02,
               consensus_space: str = "update") -> Iterator[dict]:
    cfg = CidersConfig(local_steps=k, optimizer="sgd", lr=eta, weight_decay=0.0, max_grad_norm=0.0,
                       schedule="constant", eta_in=0.0, metagrad="fo", gamma=gamma, alpha=alpha, tau=tau,
                       eps_prox=eps_prox, weighting="uniform", consensus_space=consensus_space)
    cfg.validate()
    fns, grads = synthetic_clients(clients, dim, loss, seed)
    w0: State = {"x": torch.zeros(dim, dtype=torch.float64)}
    server = alg.init_server(w0, rounds)
    ids = [f"c{i}" for i in range(clients)]
    copies = {cid: alg.init_copy(w0) for cid in ids}
    states = {cid: alg.init_client(cid, w0) for cid in ids}
    for t in range(rounds + 1):
        x = server.messenger["x"]
        gs = [{"x": gr(x)} for gr in grads]
        big_g = lincomb([(1.0 / clients, gi) for gi in gs])
        drs, pprs = zip(*(dr_ppr(gi, big_g, server.c, copies[cid].c_i, gamma) for gi, cid in zip(gs, ids)))
        p = psi(t, gamma, alpha, k, eta, eps_prox)
        yield {"round": t, "dr": sum(drs) / clients, "ppr": sum(pprs) / clients, "psi": p,
               "dr_pred": 1 - p, "psi_inf": psi_inf(gamma, k, eta, eps_prox)}
        if t == rounds:
            return
        uploads = []
        for cid, fn in zip(ids, fns):
            up, states[cid], _ = alg.client_update(cfg, alg.make_broadcast(cfg, server, copies[cid]), states[cid],
                                                   fn, [None] * k)
            uploads.append(up)
        server, copies, _ = alg.server_update(cfg, server, uploads, copies, {cid: 1 for cid in ids})
