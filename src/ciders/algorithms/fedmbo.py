"""FedMBO (Huang et al., 2023; the full-model baseline of the RABO paper; docs/rabo.md#server-outer-update): RABO with
every mask full, so every client trains all of x and y and the per-coordinate mean is the plain mean over the clients.
Differs from RABO only in the masks (`ciders.algorithms.rabo`)."""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms.rabo import RaboConfig


def configure(cfg: RaboConfig) -> RaboConfig:
    return replace(cfg, method="fedmbo", mask_rule="full").validate()
