"""Hypergradients of a quadratic bilevel problem against its closed form
(docs/rabo.md#outer-phase-the-hypergradient-rabo).

g(x, y) = 1/2 y'Ay - y'Bx + c'y  (A SPD)  ->  y*(x) = A^{-1}(Bx - c)
f(x, y) = 1/2 |y - t|^2 + lam/2 |x|^2     ->  grad Phi(x) = lam x + B' A^{-1} (y*(x) - t)
x and y are split over two keys each so the dict plumbing is exercised. Tolerances (float64): the exact
solve and CG with dim(y) iterations are exact up to rounding (1e-9); Neumann with 400 terms at
eta = 1/lambda_max converges geometrically (1e-6); the forward differences are exact on a quadratic
(affine gradients), leaving rounding / delta (1e-6)."""

import pytest
import torch

from ciders.core import hypergrad as hg
from ciders.core.tensors import max_abs_diff

torch.manual_seed(0)
DX, DY = 3, 5


def problem(seed=0, dtype=torch.float64):
    """The problem in `dtype` (its data drawn in float64 and rounded; the closed form stays float64)."""
    g_ = torch.Generator().manual_seed(seed)
    m = torch.randn(DY, DY, generator=g_, dtype=torch.float64)
    A = m @ m.T + 0.5 * torch.eye(DY, dtype=torch.float64)
    B = torch.randn(DY, DX, generator=g_, dtype=torch.float64)
    c = torch.randn(DY, generator=g_, dtype=torch.float64)
    t = torch.randn(DY, generator=g_, dtype=torch.float64)
    lam = 0.3
    A_, B_, c_, t_ = (v.to(dtype) for v in (A, B, c, t))

    def cat_x(x):
        return torch.cat([x["a"], x["b"]])

    def cat_y(y):
        return torch.cat([y["u"], y["w"]])

    def g(x, y):
        yy, xx = cat_y(y), cat_x(x)
        return 0.5 * yy @ A_ @ yy - yy @ B_ @ xx + c_ @ yy

    def f(x, y):
        yy, xx = cat_y(y), cat_x(x)
        return 0.5 * (yy - t_) @ (yy - t_) + 0.5 * lam * xx @ xx

    x = torch.randn(DX, generator=g_, dtype=torch.float64)
    ystar = torch.linalg.solve(A, B @ x - c)
    truth = lam * x + B.T @ torch.linalg.solve(A, ystar - t)
    X = {"a": x[:1].to(dtype), "b": x[1:].to(dtype)}
    Y = {"u": ystar[:2].to(dtype), "w": ystar[2:].to(dtype)}
    T = {"a": truth[:1], "b": truth[1:]}
    return f, g, X, Y, T, float(torch.linalg.eigvalsh(A).max())


@pytest.mark.parametrize("solver,second,kw,tol", [
    ("exact", "autograd", {}, 1e-9),
    ("cg", "autograd", {"iters": DY}, 1e-9),
    ("neumann", "autograd", {"iters": 400}, 1e-6),
    ("cg", "fd", {"iters": DY, "delta": 1e-3}, 1e-6),
    ("neumann", "fd", {"iters": 400, "delta": 1e-3}, 1e-6),
    ("cg", "fd", {"iters": DY, "delta": 1e-3, "coordinates": True}, 1e-6),
])
def test_hypergradient_matches_the_closed_form(solver, second, kw, tol):
    f, g, x, y, truth, lmax = problem()
    if solver == "neumann":
        kw = {**kw, "eta": 1.0 / lmax}
    h, info = hg.hypergradient(f, g, x, y, solver=solver, second_order=second, **kw)
    assert max_abs_diff(h, truth) < tol * (1 + max(float(v.abs().max()) for v in truth.values()))


def test_second_order_products_by_differences_equal_autograd_on_a_quadratic():
    f, g, x, y, _, _ = problem(1)
    v = {k: torch.randn_like(t) for k, t in y.items()}
    assert max_abs_diff(hg.hvp_yy_fd(g, x, y, v, 1e-3), hg.hvp_yy(g, x, y, v)) < 1e-8
    assert max_abs_diff(hg.cross_xy_fd(g, x, y, v, 1e-3), hg.cross_xy(g, x, y, v)) < 1e-8
    assert max_abs_diff(hg.cross_xy_coordinates(g, x, y, v, 1e-3), hg.cross_xy(g, x, y, v)) < 1e-8


def test_truncated_solvers_are_worse_and_bad_input_fails():
    f, g, x, y, truth, lmax = problem(2)
    h1, _ = hg.hypergradient(f, g, x, y, solver="cg", iters=1)
    h5, info = hg.hypergradient(f, g, x, y, solver="cg", iters=DY)
    assert max_abs_diff(h1, truth) > 100 * max_abs_diff(h5, truth) and info["residual"] < 1e-8
    with pytest.raises(ValueError, match="solver"):
        hg.hypergradient(f, g, x, y, solver="lbfgs")
    with pytest.raises(ValueError, match="positive definite"):
        hg.solve_cg(lambda v: {k: -t for k, t in v.items()}, {"z": torch.ones(3, dtype=torch.float64)}, 3)


def test_value_and_grad_y_is_grads_y_without_the_backward_through_x():
    g_ = torch.Generator().manual_seed(3)
    x = {"W": torch.randn(4, 3, generator=g_, dtype=torch.float64)}
    y = {"V": torch.randn(2, 4, generator=g_, dtype=torch.float64)}
    a = torch.randn(3, 5, generator=g_, dtype=torch.float64)

    def fn(xx, yy):
        return (torch.tanh(yy["V"] @ torch.tanh(xx["W"] @ a)) ** 2).sum()

    value, gy = hg.value_and_grad_y(fn, x, y)
    _, want = hg.grads(fn, x, y)
    assert torch.equal(gy["V"], want["V"]) and value == float(fn(x, y))
    seen = []
    hg.value_and_grad_y(lambda xx, yy: seen.append(xx["W"].requires_grad) or fn(xx, yy), x, y)
    assert seen == [False]  # x is a constant of the step


def test_cg_stops_at_later_non_positive_curvature_and_says_so():
    """p'Hp <= 0 after the first step (a finite-difference product's error near convergence) stops CG at
    the current iterate with `breakdown`; along b itself it is an error (test above)."""
    H = torch.diag(torch.tensor([2.0, 1.0], dtype=torch.float64))
    calls = []

    def hvp(v):
        calls.append(1)
        out = {"z": H @ v["z"]}
        return out if len(calls) == 1 else {"z": -out["z"]}  # the second product has the wrong sign

    b = {"z": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    v, info = hg.solve_cg(hvp, b, 5)
    a = 2.0 / 3.0  # the first CG step: |b|^2 / b'Hb
    assert info["breakdown"] and info["iters"] == 1 and torch.allclose(v["z"], a * b["z"])
    _, ok = hg.solve_cg(lambda u: {"z": H @ u["z"]}, b, 5)
    assert not ok["breakdown"] and ok["residual"] < 1e-12


def _counted(fn):
    calls = []

    def wrapped(*a):
        calls.append(1)
        return fn(*a)

    return wrapped, calls


def test_rafbo_computes_the_base_gradient_once_per_hypergradient():
    f, g, x, y, truth, _ = problem(3)
    for iters in (1, 3, DY):
        gc, calls = _counted(g)
        h, info = hg.hypergradient(f, gc, x, y, solver="cg", iters=iters, second_order="fd", delta=1e-4)
        # one base gradient, one probe per CG product, one probe for the cross term (was 2 per product)
        assert len(calls) == 1 + info["iters"] + 1
    assert max_abs_diff(h, truth) < 1e-6 * (1 + max(float(t.abs().max()) for t in truth.values()))


def test_the_fd_probe_has_a_fixed_length_so_its_error_does_not_follow_the_scale_of_v():
    # a non-quadratic inner loss: the forward difference has a truncation error that grows with the probe length
    def g(x, y):
        return (torch.log(torch.cosh(y["u"] - x["a"][:1])) ** 2).sum() + 0.5 * (y["u"] ** 2).sum() * x["a"].sum()

    x = {"a": torch.tensor([0.3, 0.8], dtype=torch.float64)}
    y = {"u": torch.tensor([0.5, -1.2, 2.0], dtype=torch.float64)}
    v = {"u": torch.tensor([0.2, 0.1, -0.3], dtype=torch.float64)}
    exact = hg.hvp_yy(g, x, y, v)
    for s in (1e-4, 1.0, 1e4):  # f scaled by 1e4 makes v 1e4 times larger: the probe must not grow with it
        sv = {"u": v["u"] * s}
        est = hg.hvp_yy_fd(g, x, y, sv, 1e-6)
        assert max_abs_diff({"u": est["u"] / s}, exact) < 1e-4 * float(exact["u"].abs().max())
    zero = {"u": torch.zeros(3, dtype=torch.float64)}
    gc, calls = _counted(g)
    assert max_abs_diff(hg.hvp_yy_fd(gc, x, y, zero, 1e-6), zero) == 0 and not calls  # v = 0: Hv = 0, no calls


@pytest.mark.parametrize("seed", [2, 3, 5])
def test_fd_probe_survives_subnormal_neumann_terms_in_float32(seed, monkeypatch):
    """2,000 Neumann terms in float32 shrink the term v below float32's smallest normal (~1e-38, down to
    ~1e-44 here); the probe goes along v / ||v|| and scales the difference by ||v|| last, so the hypergradient
    stays finite and as accurate as the 300-term one (a step h = delta / ||v|| overflowed to inf: NaN)."""
    f, g, x, y, truth, lmax = problem(seed, torch.float32)
    seen = []
    real = hg._probe
    monkeypatch.setattr(hg, "_probe", lambda yy, v, d: seen.append(hg.norm(v)) or real(yy, v, d))
    h, _ = hg.hypergradient(f, g, x, y, solver="neumann", iters=2000, eta=1.0 / lmax, second_order="fd", delta=1e-3)
    assert 0 < min(seen) < torch.finfo(torch.float32).tiny  # the case arose
    scale = max(float(v.abs().max()) for v in truth.values())
    got = {k: v.double() for k, v in h.items()}
    assert all(torch.isfinite(v).all() for v in got.values())
    assert max_abs_diff(got, truth) < 5e-3 * scale
