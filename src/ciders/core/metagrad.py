"""Personalized meta-gradients of CIDERS (Eqs. 5-7; docs/method.md#eqs-5-6-look-ahead-and-first-order-meta-gradient).

`grad_fn(x) -> (loss, grad)` evaluates the client loss on one fixed mini-batch. All evaluations of one
step must see the same randomness (dropout), which the caller's grad_fn guarantees.

  look-ahead  x~ = x - eta_in grad L(x)                                       (Eq. 6)
  FO          g  = grad L(x~)                                                 (Eq. 5, first order)
  FD          v  = g_FO;  h = eps_fd / ||v||   (the probe x +- h v has length eps_fd)
              Hv ~ (grad L(x + h v) - grad L(x - h v)) / (2 h)                (Eq. 7, at x = x_k, not at x~)
              or Hv = hvp_fn(x, v) (e.g. `exact_hvp`: double backward)
              g  = v - eta_hvp Hv;  r_FD = ||eta_hvp Hv|| / (||v|| + 1e-12)
Cost in gradient evaluations: FO 2 (1 when eta_in = 0: x~ = x), FD 4 (FO + the two probes).
The exact product is taken at x_k, where the step's first gradient is taken too: with `grad_hvp_fn`
(`exact_grad_hvp`) that gradient's backward keeps its graph, and Hv is one more backward through it, so an exact
FD step costs FO plus one double backward (3 evaluations, not 4: no second forward at x_k).
Why the probe is relative: docs/method.md#eq-7-finite-difference-meta-gradient-fd.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ciders.core.tensors import State, lincomb, norm, scale, zeros_like
from ciders.errors import CidersError

# True while `exact_grad_hvp` builds a graph it will differentiate twice: a loss with a faster path that is
# differentiable only once (MessengerLoss's fused chunked CE) takes its plain path then.
_SECOND_ORDER = contextvars.ContextVar("ciders_second_order", default=False)


def second_order() -> bool:
    """Whether the current forward will be differentiated twice (inside `exact_grad_hvp`)."""
    return _SECOND_ORDER.get()


GradFn = Callable[[State], tuple[torch.Tensor, State]]
HvpFn = Callable[[State, State], State]
GradHvpFn = Callable[[State], tuple[torch.Tensor, State, Callable[[State], State]]]


def metagrad(grad_fn: GradFn, x: State, eta_in: float, kind: str = "fo", eps_fd: float = 1e-4,
             eta_hvp: float | None = None, hvp_fn: HvpFn | None = None,
             grad_hvp_fn: GradHvpFn | None = None) -> tuple[State, dict]:
    """Return (g, info) with info = {loss: L(x), evals} and, for FD, r_fd, v (= g_FO) and corr
    (= eta_hvp Hv): a caller averaging micro-batches forms the step's r_FD from the means of v and corr.
    `grad_hvp_fn(x) -> (L(x), grad L(x), v -> H(x) v)` (FD only) replaces the first grad_fn call and the HVP."""
    if hvp_fn is not None and grad_hvp_fn is not None:
        raise ValueError("give hvp_fn or grad_hvp_fn, not both")
    hvp_at_x = None
    if kind == "fd" and grad_hvp_fn is not None:
        loss, g0, hvp_at_x = grad_hvp_fn(x)
    else:
        loss, g0 = grad_fn(x)
    evals = 1
    if eta_in != 0:
        _, g = grad_fn(lincomb([(1.0, x), (-eta_in, g0)]))
        evals += 1
    else:
        g = g0
    info: dict[str, Any] = {"loss": float(loss)}
    if kind == "fo":
        info["evals"] = evals
        return g, info
    if kind != "fd":
        raise ValueError(f"unknown meta-gradient {kind!r} (fo or fd)")
    eta_hvp = eta_in if eta_hvp is None else eta_hvp
    if hvp_at_x is not None or hvp_fn is not None:
        hv = hvp_at_x(g) if hvp_at_x is not None else hvp_fn(x, g)
        info["hvp"], info["evals"] = "exact", evals + 1
    else:
        hv = fd_hvp(grad_fn, x, g, eps_fd)
        info["hvp"], info["evals"] = "fd", evals + 2
    corr = scale(hv, eta_hvp)
    info.update(r_fd=norm(corr) / (norm(g) + 1e-12), v=g, corr=corr)
    return lincomb([(1.0, g), (-1.0, corr)]), info


def fd_hvp(grad_fn: GradFn, x: State, v: State, eps_fd: float) -> State:
    """Central difference of the gradient along v at x, with a probe of length eps_fd: h = eps_fd / ||v||.

    An absolute step (h = eps_fd) would make the probe as long as eps_fd ||v||, so its accuracy would
    depend on the scale of the meta-gradient (rounding dominates when v is small, curvature change when
    it is large). v = 0 gives Hv = 0 without evaluating anything."""
    nv = norm(v)
    if nv == 0.0:
        return zeros_like(v)
    h = eps_fd / nv
    _, gp = grad_fn(lincomb([(1.0, x), (h, v)]))
    _, gm = grad_fn(lincomb([(1.0, x), (-h, v)]))
    return lincomb([(0.5 / h, gp), (-0.5 / h, gm)])


def exact_hvp(loss_fn: Callable[[State, Any], torch.Tensor], x: State, v: State, batch: Any) -> State:
    """H(x) v by double backward: grad_x <grad_x L(x; batch), v>, v held constant (detached); see `exact_grad_hvp`."""
    return exact_grad_hvp(loss_fn, x, batch)[2](v)


def exact_grad_hvp(loss_fn: Callable[[State, Any], torch.Tensor], x: State, batch: Any
                   ) -> tuple[torch.Tensor, State, Callable[[State], State]]:
    """(L(x), grad L(x), v -> H(x) v) from one forward: the gradient's backward keeps its graph
    (create_graph), and the returned product is one backward of <grad L(x), v> through it. Call it once: it
    frees the graph. The graph is held until then, so peak memory is about that of the double backward.

    Fused attention kernels (PyTorch's flash / memory-efficient SDPA, on CPU and CUDA) have no second
    derivative, so the forward runs with SDPA on its math kernel (differentiable twice; it holds the full
    attention matrix). Another backend without one (e.g. flash_attention_2) is a one-line CidersError."""
    p = {k: t.detach().requires_grad_(True) for k, t in x.items()}
    with _second_derivative_errors():
        token = _SECOND_ORDER.set(True)
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                loss = loss_fn(p, batch)
        finally:
            _SECOND_ORDER.reset(token)
        grads = torch.autograd.grad(loss, list(p.values()), create_graph=True)

    def hvp(v: State) -> State:
        with _second_derivative_errors():
            inner = sum((gk * v[k].detach()).sum() for gk, k in zip(grads, p))
            out = torch.autograd.grad(inner, list(p.values()), allow_unused=True)
        return {k: (torch.zeros_like(p[k]) if o is None else o.detach()) for k, o in zip(p, out)}

    return loss.detach(), {k: g.detach() for k, g in zip(p, grads)}, hvp


@contextlib.contextmanager
def _second_derivative_errors():
    """A kernel without a second derivative becomes a CidersError that names the fix; other errors pass."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if "not implemented" in first or "differentiate twice" in first:  # no second derivative
            raise CidersError(f"algorithm.hvp: exact needs a second derivative the model's kernels lack ({first}); "
                              "set model.attn_implementation: eager, or algorithm.hvp: fd") from exc
        raise


def fd_class(r: float) -> str:
    """small <= 0.1 < moderate <= 0.2 < large (docs/method.md#eq-7-finite-difference-meta-gradient-fd)."""
    return "small" if r <= 0.1 else ("moderate" if r <= 0.2 else "large")
