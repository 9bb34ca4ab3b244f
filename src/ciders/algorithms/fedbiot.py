"""FedBiOT (Wu et al., KDD 2024): bilevel offsite-tuning, the main baseline of the CIDERS paper.

Server: before round 0 and again after every aggregation (takd.round_steps steps, warm-started), the
emulator B_L is re-aligned to the full backbone with the current aggregated adapter fixed, using the
loss of FedBiOT's official code: hidden-state MSE normalised by the teacher's mean square
(takd.hidden_loss = teacher_rms) plus lambda_out * KL, with no task cross-entropy (lambda_task = 0 in the
bootstrap and in every round).
Clients: LM cross-entropy plus the proximal term mu (x_k - w) on the adapter (mu = algorithm.eps_prox);
server: FedAvg (tau = 1). Differs from CIDERS in: no look-ahead meta-gradient, no consensus correction or
variates, plain averaging, and a distillation objective without task supervision.
"""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms import fedavg
from ciders.config import ExperimentConfig


def configure(cfg: ExperimentConfig) -> ExperimentConfig:
    a = replace(fedavg.client_knobs(cfg.algorithm), eps_prox=cfg.algorithm.eps_prox, name="fedbiot")
    return replace(cfg, algorithm=a, takd=replace(cfg.takd, hidden_loss="teacher_rms", lambda_task=0.0,
                                                  lambda_task_bootstrap=0.0))
