"""Where RABO, RAFBO and FedMBO converge on a heterogeneous quadratic bilevel problem, against the closed form
(docs/rabo.md#what-the-local-hessian-form-converges-to).

Client i (y in R^d, x in R^p, both as column matrices so structured masks keep rows):
  g_i(x, y) = 1/2 y'A_i y - y'B_i x - c_i'y          (A_i SPD: strongly convex in y)
  f_i(x, y) = 1/2 |y - t_i|^2 + lam/2 |x|^2
The true problem has y*(x) = A^-1 (B x + c) with the means A, B, c, and Phi(x) = mean_i f_i(x, y*(x)), whose
minimiser x* solves (A^-1 B)'(y*(x) - t) + lam x = 0.

The method (the paper's form) is a different fixed point. Each client takes T local steps on its own g_i and
computes its hypergradient with its OWN Hessians, h_i = lam x + B_i' A_i^-1 (y - t_i), and the server averages
per coordinate. On client i's sub-model (selections E_i of y's rows, F_i of x's rows; A'_i = E_i'A_i E_i, ...):
  sum of its T local gradients = K_i (E_i'y - y'_i(x)),  K_i = (I - (I - beta A'_i)^T) / beta,
                                                      y'_i(x) = A'_i^-1 (B'_i F_i'x + E_i'c_i)
  fixed point:  sum_i E_i K_i (E_i'y - y'_i(x)) = 0,   sum_i F_i (lam F_i'x + B'_i' A'_i^-1 (E_i'y - E_i't_i)) = 0
(the per-coordinate 1/C^k does not move the zero set while every coordinate is covered). It equals x* when every
client has the same A_i and B_i and no masks: then the mean of the local products is the product of the means.
With heterogeneous Hessians it does not, and the test states by how much.
"""

import pytest
import torch

from ciders.algorithms import rabo as rb
from ciders.core import submodel as sm

D, P, LAM = 4, 3, 0.5


def problem(n=3, hetero=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64

    def spd():
        q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=dt))
        return q @ torch.diag(1 + 2 * torch.rand(D, generator=g, dtype=dt)) @ q.T

    A0, B0 = spd(), torch.randn(D, P, generator=g, dtype=dt)
    cl = []
    for _ in range(n):
        A, B = (spd(), torch.randn(D, P, generator=g, dtype=dt)) if hetero else (A0, B0)
        cl.append({"A": A, "B": B, "c": torch.randn(D, generator=g, dtype=dt), "t": torch.randn(D, generator=g, dtype=dt)})
    return cl


def true_solution(cl):
    A, B = sum(c["A"] for c in cl) / len(cl), sum(c["B"] for c in cl) / len(cl)
    c, t = sum(c["c"] for c in cl) / len(cl), sum(c["t"] for c in cl) / len(cl)
    J = torch.linalg.solve(A, B)  # dy*/dx
    y0 = torch.linalg.solve(A, c)
    # (J'J + lam I) x = J'(t - y0)
    return torch.linalg.solve(J.T @ J + LAM * torch.eye(P, dtype=J.dtype), J.T @ (t - y0))


def predicted_fixed_point(cl, kept_y, kept_x, beta, T):
    """The closed-form fixed point (x, y) of the method above; kept_y[i], kept_x[i]: client i's rows."""
    dt = torch.float64
    M = torch.zeros(D + P, D + P, dtype=dt)
    r = torch.zeros(D + P, dtype=dt)
    for c, ky, kx in zip(cl, kept_y, kept_x):
        E, F = torch.eye(D, dtype=dt)[:, ky], torch.eye(P, dtype=dt)[:, kx]
        A, B, cc, t = E.T @ c["A"] @ E, E.T @ c["B"] @ F, E.T @ c["c"], E.T @ c["t"]
        I = torch.eye(len(ky), dtype=dt)
        K = (I - torch.linalg.matrix_power(I - beta * A, T)) / beta
        Ai = torch.linalg.inv(A)
        # y rows: E K (E'y - Ai (B F'x + c)) = 0
        M[:D, :D] += E @ K @ E.T
        M[:D, D:] -= E @ K @ Ai @ B @ F.T
        r[:D] += E @ K @ Ai @ cc
        # x rows: F (lam F'x + B' Ai (E'y - t)) = 0
        M[D:, D:] += LAM * F @ F.T
        M[D:, :D] += F @ B.T @ Ai @ E.T
        r[D:] += F @ B.T @ Ai @ t
    z = torch.linalg.solve(M, r)
    return z[D:], z[:D]


def client_losses(c, ky, kx):
    """g_i and f_i on a client's sub-model: y [len(ky), 1], x [len(kx), 1] (a client knows its kept rows)."""
    A, B, cc, t = c["A"][ky][:, ky], c["B"][ky][:, kx], c["c"][ky], c["t"][ky]

    def g(x, y, _):
        yy, xx = y["y"][:, 0], x["x"][:, 0]
        return 0.5 * yy @ A @ yy - yy @ B @ xx - cc @ yy

    def f(x, y, _):
        return 0.5 * ((y["y"][:, 0] - t) ** 2).sum() + 0.5 * LAM * (x["x"] ** 2).sum()

    return g, f


def run(cl, caps, method, rounds, beta=0.2, alpha=0.3, T=2):
    """`rounds` rounds of `algorithms.rabo`, each client on its extracted sub-model (as `client_phase`)."""
    cfg = rb.RaboConfig(method=method, mask_rule="static", inner_steps=T, beta=beta, alpha=alpha, solver="cg",
                        solver_iters=D, fd_delta=1e-4).validate()
    s = rb.init_state({"x": torch.zeros(P, 1, dtype=torch.float64)}, {"y": torch.zeros(D, 1, dtype=torch.float64)})
    kept = []
    for _ in range(rounds):
        masks = [rb.client_masks(cfg, s, r, client=i, capacities=caps) for i, r in enumerate(caps)]
        kept = [(m.y["y"][:, 0].nonzero().flatten(), m.x["x"][:, 0].nonzero().flatten()) for m in masks]
        views, Gs, hs = [], [], []
        for c, m, (ky, kx) in zip(cl, masks, kept):
            g, f = client_losses(c, ky, kx)
            (x, mx), (y, my) = sm.client_view(s.x, m.x), sm.client_view(s.y, m.y)
            views.append((g, f, x, mx))
            G, _ = rb.inner_update(cfg, rb.BilevelState(s.round, x, y), rb.ClientMasks(mx, my, m.capacity), g, [None] * T)
            Gs.append(sm.scatter(sm.gather(G, my), m.y, s.y))
        mid, _ = rb.server_inner(cfg, s, Gs, masks)
        for (g, f, x, mx), m in zip(views, masks):
            y, my = sm.client_view(mid.y, m.y)
            h, _ = rb.outer_update(cfg, rb.BilevelState(s.round, x, y), rb.ClientMasks(mx, my, m.capacity), f, g, None)
            hs.append(sm.scatter(sm.gather(h, mx), m.x, s.x))
        s, _ = rb.server_outer(cfg, mid, hs, masks)
    return s.x["x"][:, 0], s.y["y"][:, 0], kept


@pytest.mark.parametrize("method", ["fedmbo", "rabo", "rafbo"])
def test_each_method_converges_to_the_predicted_fixed_point(method):
    """Heterogeneous Hessians; RABO / RAFBO with capacities (1, 1/2, 1/2) and the static rule (fixed masks, so
    the fixed point exists), FedMBO with every mask full. Each lands on the closed-form prediction, and the
    prediction is far from x*: the local-Hessian form is biased under heterogeneity."""
    cl = problem()
    caps = [1.0, 1.0, 1.0] if method == "fedmbo" else [1.0, 0.5, 0.5]
    x, y, kept = run(cl, caps, method, rounds=150)
    xp, yp = predicted_fixed_point(cl, [k[0] for k in kept], [k[1] for k in kept], beta=0.2, T=2)
    assert torch.allclose(x, xp, atol=1e-8, rtol=0) and torch.allclose(y, yp, atol=1e-8, rtol=0)
    xs = true_solution(cl)
    assert float((xp - xs).norm() / xs.norm()) > 0.1  # theory: biased under heterogeneous Hessians


def test_homogeneous_hessians_converge_to_the_true_solution():
    """Same A_i, B_i on every client (c_i, t_i still differ): the mean of the local products is the product of
    the means and the T local steps share one contraction, so FedMBO converges to x* itself."""
    cl = problem(hetero=False)
    x, _, kept = run(cl, [1.0] * 3, "fedmbo", rounds=150)
    xs = true_solution(cl)
    assert torch.allclose(x, xs, atol=1e-8, rtol=0)
    xp, _ = predicted_fixed_point(cl, [k[0] for k in kept], [k[1] for k in kept], beta=0.2, T=2)
    assert torch.allclose(xp, xs, atol=1e-10, rtol=0)


def test_the_bias_of_the_heterogeneous_problem_is_the_one_reported():
    """The figure docs/rabo.md quotes for this problem: FedMBO's fixed point relative to x*."""
    cl = problem()
    full = [torch.arange(D)] * 3, [torch.arange(P)] * 3
    xp, _ = predicted_fixed_point(cl, *full, beta=0.2, T=2)
    xs = true_solution(cl)
    rel = float((xp - xs).norm() / xs.norm())
    assert rel == pytest.approx(2.056, abs=0.001)  # FedMBO settles 206% of |x*| away from x*
    # the masked fixed point of the RABO test above is another biased point, further away here
    masked = predicted_fixed_point(cl, [torch.arange(D), torch.arange(2), torch.arange(2)],
                                   [torch.arange(P), torch.arange(2), torch.arange(2)], beta=0.2, T=2)[0]
    assert float((masked - xs).norm() / xs.norm()) == pytest.approx(2.397, abs=0.001)
