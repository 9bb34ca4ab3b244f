"""FedAvg on the messenger (McMahan et al., AISTATS 2017), composed from the CIDERS blocks.

Differs from CIDERS (docs/method.md#baselines-as-knob-settings) in: plain gradients (eta_in = 0: no look-ahead, FO
only), no consensus correction (gamma = 0, so c is not broadcast), no proximal term, and tau = 1, so Eq. 12 gives w' = w
- K eta_bar sum_i p_i Delta_i = sum_i p_i x_K,i: the weighted average of the client messengers.
The upload stays the CIDERS increment dc_i = Delta_i - c_i (alpha = 1), from which the server recovers
Delta_i exactly (Eq. 11); it is the same size as FedAvg's model delta. TAKD as configured.
"""

from __future__ import annotations

from dataclasses import replace

from ciders.config import ExperimentConfig


def client_knobs(a):
    return replace(a, metagrad="fo", eta_in=0.0, gamma=0.0, gamma_schedule="constant", eps_prox=0.0, alpha=1.0,
                   tau=1.0, consensus_update="ema", client_start="global", communicate=True)


def configure(cfg: ExperimentConfig) -> ExperimentConfig:
    return replace(cfg, algorithm=replace(client_knobs(cfg.algorithm), name="fedavg"))
