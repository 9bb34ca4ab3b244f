"""LocalOT: each client fine-tunes the messenger alone on the aligned emulator (the CIDERS paper's
no-communication baseline, Sec. VI).

After the shared TAKD pre-alignment and the first download, nothing is exchanged: every round a client
continues from its own last x_K (client_start = personalized) with plain LM cross-entropy, uploads
nothing (communicate = false), and B_L is never re-aligned. The server's messenger stays the initial
one, so "global" evaluations of LocalOT average over the clients' own messengers. Differs from CIDERS
in everything that crosses the network, and in using no look-ahead, correction or anchor.
"""

from __future__ import annotations

from dataclasses import replace

from ciders.algorithms import fedavg
from ciders.config import ExperimentConfig


def configure(cfg: ExperimentConfig) -> ExperimentConfig:
    a = replace(fedavg.client_knobs(cfg.algorithm), client_start="personalized", communicate=False, name="localot")
    return replace(cfg, algorithm=a, takd=replace(cfg.takd, round_steps=0))
