"""The takd-only control: the run's own TAKD schedule with no client learning (docs/method.md#the-control-takd-only).

Every CIDERS-family method shares the server-side distillation: pre-alignment, then takd.round_steps warm-started
TAKD steps per round (Eq. 13) against the current global messenger. This control runs exactly that schedule in the
real round loop, but samples no client in any round (algorithm.client_learning = false), so the messenger stays
the initial one and only B_L moves. A method whose figures do not beat this control beyond the seed spread has not
shown that its client rule adds anything: whatever it gained came from the distillation every method gets.
Without client learning a client's model is the global one, so its "personalized" figure is the global messenger
on its own held-out part. TAKD is as configured (no baseline's own TAKD settings), so the control shares its
pre-alignment with CIDERS, FedAvg, FedProx and SCAFFOLD.
"""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms import fedavg
from ciders.config import ExperimentConfig


def configure(cfg: ExperimentConfig) -> ExperimentConfig:
    a = replace(fedavg.client_knobs(cfg.algorithm), client_learning=False, name="takd-only")
    return replace(cfg, algorithm=a)
