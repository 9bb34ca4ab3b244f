"""SCAFFOLD on the messenger (Karimireddy et al., ICML 2020, option II control variates).

SCAFFOLD's local step y <- y - lr (g - c_i + c) is Eq. 4 with gamma = 1 and no look-ahead or proximal
term; its control-variate update c_i' = c_i - c + (x - y)/(K lr) is Eq. 9 with gamma = alpha = 1; the
server takes x' = x + lr_g mean(y_i - x), Eq. 12 with tau = lr_g = 1 and uniform weights, and
c' = c + (1/N) sum dc_i (`core.consensus.scaffold_consensus`; equal to Eq. 12's EMA with alpha = 1
under full participation). Differences from the original: the server recovers Delta_i = dc_i + c from
the increment alone (Eq. 11), so the uplink is one messenger-sized tensor set instead of two; the local
optimizer is the configured one (SCAFFOLD analyses SGD; set algorithm.optimizer: sgd for the original). The
correction is added to the gradient before the optimizer, as SCAFFOLD writes it (consensus_space: paper).
"""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms import fedavg
from ciders.config import ExperimentConfig


def configure(cfg: ExperimentConfig) -> ExperimentConfig:
    a = replace(fedavg.client_knobs(cfg.algorithm), gamma=1.0, alpha=1.0, consensus_update="scaffold",
                weighting="uniform", consensus_space="paper", name="scaffold")
    return replace(cfg, algorithm=a)
