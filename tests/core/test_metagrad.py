"""The FD meta-gradient of Eq. 7 on a loss that is NOT quadratic (so its Hessian depends on where it is
taken) against torch.autograd.functional.hessian, float64: the probes sit at x_k, r_FD is divided by the
FO norm, the probe length does not depend on the scale of v, and the exact HVP is the Hessian product."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ciders.core.metagrad import exact_grad_hvp, exact_hvp, fd_hvp, metagrad
from ciders.core.tensors import norm
from ciders.errors import CidersError

G = torch.Generator().manual_seed(0)
A = torch.randn(7, 5, generator=G, dtype=torch.float64)
Y = (torch.rand(7, generator=G, dtype=torch.float64) > 0.5).double()
X0 = torch.randn(5, generator=G, dtype=torch.float64)


def loss_of(x):
    """Logistic regression plus a quartic term: the third derivative is far from zero."""
    z = A @ x
    return torch.nn.functional.softplus(z).sum() - (Y * z).sum() + 0.25 * (x**4).sum()


def loss_fn(params, batch):
    return loss_of(params["x"])


def grad_fn(p):
    x = p["x"].detach().requires_grad_(True)
    loss = loss_of(x)
    return loss.detach(), {"x": torch.autograd.grad(loss, x)[0]}


def hessian(x):
    return torch.autograd.functional.hessian(loss_of, x)


def fo(x, eta_in):
    look = x - eta_in * grad_fn({"x": x})[1]["x"]
    return grad_fn({"x": look})[1]["x"]


ETA_IN, ETA_HVP = 0.1, 0.05


def test_fd_metagrad_is_v_minus_eta_hvp_times_the_hessian_at_x_k_not_at_the_look_ahead():
    v = fo(X0, ETA_IN)
    want = v - ETA_HVP * hessian(X0) @ v
    g, info = metagrad(grad_fn, {"x": X0}, ETA_IN, "fd", eps_fd=1e-4, eta_hvp=ETA_HVP)
    torch.testing.assert_close(g["x"], want, rtol=1e-7, atol=1e-7)
    # the Hessian at the look-ahead point is measurably different: probing there would miss by this much
    look = X0 - ETA_IN * grad_fn({"x": X0})[1]["x"]
    wrong = v - ETA_HVP * hessian(look) @ v
    assert (wrong - want).norm() > 1e3 * 1e-7 * want.norm()
    assert info["evals"] == 4 and info["hvp"] == "fd"
    # the two states a caller needs for a step-level r_FD under accumulation
    torch.testing.assert_close(info["v"]["x"], v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(info["corr"]["x"], ETA_HVP * hessian(X0) @ v, rtol=1e-7, atol=1e-9)


def test_r_fd_is_the_correction_over_the_first_order_norm():
    v = fo(X0, ETA_IN)
    corr = ETA_HVP * hessian(X0) @ v
    _, info = metagrad(grad_fn, {"x": X0}, ETA_IN, "fd", eta_hvp=ETA_HVP)
    assert info["r_fd"] == pytest.approx(float(corr.norm() / v.norm()), rel=1e-6)
    # dividing by the FD result's norm instead would be this far off
    assert abs(float(corr.norm() / (v - corr).norm()) / info["r_fd"] - 1) > 0.05


def test_exact_hvp_is_the_hessian_product_and_plugs_into_metagrad():
    v = {"x": torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)}
    hv = exact_hvp(loss_fn, {"x": X0}, v, None)
    torch.testing.assert_close(hv["x"], hessian(X0) @ v["x"], rtol=1e-12, atol=1e-12)
    calls = []

    def hvp_fn(x, w):
        calls.append(1)
        return exact_hvp(loss_fn, x, w, None)

    g, info = metagrad(grad_fn, {"x": X0}, ETA_IN, "fd", eta_hvp=ETA_HVP, hvp_fn=hvp_fn)
    w = fo(X0, ETA_IN)
    torch.testing.assert_close(g["x"], w - ETA_HVP * hessian(X0) @ w, rtol=1e-12, atol=1e-12)
    assert calls == [1] and info["hvp"] == "exact" and info["evals"] == 3


def test_the_exact_product_shares_the_forward_at_x_k_with_the_first_gradient():
    calls = []

    def counting_loss(params, batch):
        calls.append(1)
        return loss_fn(params, batch)

    def counting_grad(p):
        calls.append(1)
        return grad_fn(p)

    g, info = metagrad(counting_grad, {"x": X0}, ETA_IN, "fd", eta_hvp=ETA_HVP,
                       grad_hvp_fn=lambda x: exact_grad_hvp(counting_loss, x, None))
    w = fo(X0, ETA_IN)
    torch.testing.assert_close(g["x"], w - ETA_HVP * hessian(X0) @ w, rtol=1e-12, atol=1e-12)
    # one forward at x_k (its graph kept for the product) and one at the look-ahead: 2 loss calls, not 3
    assert len(calls) == 2 and info["hvp"] == "exact" and info["evals"] == 3
    assert info["loss"] == pytest.approx(float(loss_of(X0)), rel=1e-12)
    # the shared gradient is the gradient at x_k: the look-ahead moved from it
    loss, g0, hvp = exact_grad_hvp(loss_fn, {"x": X0}, None)
    torch.testing.assert_close(g0["x"], grad_fn({"x": X0})[1]["x"], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="not both"):
        metagrad(grad_fn, {"x": X0}, ETA_IN, "fd", hvp_fn=lambda x, v: v, grad_hvp_fn=lambda x: None)


def test_relative_probe_does_not_depend_on_the_scale_of_v():
    v = {"x": fo(X0, ETA_IN)}
    x = {"x": X0}
    hv = hessian(X0) @ v["x"]
    for s in (1e-3, 1.0, 1e3):
        got = fd_hvp(grad_fn, x, {"x": s * v["x"]}, 1e-4)
        torch.testing.assert_close(got["x"] / s, hv, rtol=1e-6, atol=1e-6 * float(hv.norm()))


def test_a_zero_direction_gives_a_zero_product_without_probing():
    calls = []

    def counting(p):
        calls.append(1)
        return grad_fn(p)

    hv = fd_hvp(counting, {"x": X0}, {"x": torch.zeros(5, dtype=torch.float64)}, 1e-4)
    assert calls == [] and torch.equal(hv["x"], torch.zeros(5, dtype=torch.float64))
    # a stationary look-ahead: v = 0, so g = 0 and r_FD = 0, all finite
    flat = lambda p: (torch.tensor(0.0), {"x": torch.zeros_like(p["x"])})  # noqa: E731
    g, info = metagrad(flat, {"x": X0}, ETA_IN, "fd", eta_hvp=ETA_HVP)
    assert norm(g) == 0.0 and info["r_fd"] == 0.0


def test_exact_hvp_names_the_fix_when_a_kernel_has_no_second_derivative():
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(2))

    def attn_loss(params, batch):
        # the CPU flash kernel called directly, as a backend that bypasses SDPA's kernel choice would
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q * params["s"], q, q)[0]
        return out.square().sum()

    s = {"s": torch.ones(1)}
    with pytest.raises(CidersError, match="model.attn_implementation: eager, or algorithm.hvp: fd"):
        exact_hvp(attn_loss, s, {"s": torch.ones(1)}, None)

    def sdpa_loss(params, batch):  # the public SDPA entry point: run on its math kernel, twice differentiable
        return torch.nn.functional.scaled_dot_product_attention(q * params["s"], q, q).square().sum()

    hv = exact_hvp(sdpa_loss, s, {"s": torch.ones(1)}, None)
    with sdpa_kernel([SDPBackend.MATH]):
        h = torch.autograd.functional.hessian(lambda t: sdpa_loss({"s": t}, None), s["s"])
    torch.testing.assert_close(hv["s"], h.reshape(1), rtol=1e-5, atol=1e-5)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="fo or fd"):
        metagrad(grad_fn, {"x": X0}, ETA_IN, "so")
