"""FedProx on the messenger (Li et al., MLSys 2020): FedAvg plus the proximal term mu (x_k - w) in every
local gradient, with mu = `algorithm.eps_prox` (the same term as Eq. 4's anchoring). Differs from CIDERS
as FedAvg does (no look-ahead, no consensus correction, tau = 1), keeping only the proximal anchor.
"""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms import fedavg
from ciders.config import ExperimentConfig


def configure(cfg: ExperimentConfig) -> ExperimentConfig:
    a = cfg.algorithm
    return replace(cfg, algorithm=replace(fedavg.client_knobs(a), eps_prox=a.eps_prox, name="fedprox"))
