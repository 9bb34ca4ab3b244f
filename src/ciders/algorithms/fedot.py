"""FedOT: offsite-tuning (Xiao et al., 2023) with FedAvg, the baseline of the CIDERS paper (Sec. VI).

The emulator B_L is aligned once before round 0 by the same TAKD pre-alignment as CIDERS (so every
method starts from the same emulator) and then never changes (takd.round_steps = 0); clients fine-tune
the messenger with the plain LM cross-entropy on their data and the server takes FedAvg of the messengers.
Differs from CIDERS in: no look-ahead meta-gradient, no consensus correction or variates, no proximal
anchor, tau = 1 (plain averaging) and no per-round re-alignment of B_L.
"""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms import fedavg
from ciders.config import ExperimentConfig


def configure(cfg: ExperimentConfig) -> ExperimentConfig:
    return replace(cfg, algorithm=replace(fedavg.client_knobs(cfg.algorithm), name="fedot"),
                   takd=replace(cfg.takd, round_steps=0))
