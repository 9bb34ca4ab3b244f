"""RAFBO (the RABO paper, Sec. III-B; docs/rabo.md#rafbo-finite-difference-products): RABO with a second-order free
hypergradient. Every Hessian- and Jacobian-vector product is a finite difference of first-order gradients (step
`fd_delta`), and `coordinates: true` uses the coordinate-wise Jacobian estimator J(x, e_p) for low-dimensional x (e.g.
loss hyperparameters). Masks, rounds and aggregation are RABO's (`ciders.algorithms.rabo`)."""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms.rabo import RaboConfig


def configure(cfg: RaboConfig) -> RaboConfig:
    return replace(cfg, method="rafbo").validate()
