"""The federation keys both method families share (`RunFederation`): what the round loop
(`federation.loop.run_rounds`) reads for every run, whichever family: how many clients and rounds, the step bound
on a reply, how many checkpoints are kept, where the records are mirrored, and the evaluation schedule
(`evaluates`). Each family's section (`config.base.FederationConfig`, `config.bilevel.BilevelFederationConfig`)
extends it with its own keys and may change a default or a help text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ciders.config.fields import opt
from ciders.errors import ConfigError


@dataclass(frozen=True)
class RunFederation:
    clients: int = opt(3, "number of registered clients N")
    rounds: int = opt(3, "communication rounds")
    max_step_ratio: float | None = opt(10.0, "reject a reply whose step exceeds this multiple of max(r, 1), r the "
                                             "norm at the run's start of what it moves (docs/security.md#aggregation)"
                                             "; null = accept any finite step")
    eval_every: int = opt(1, "evaluate every N rounds (0 = only before the first and after the last)")
    eval_rounds: int = opt(0, "evaluate only within the last N rounds (0 = in every round eval_every picks); the model "
                              "before the first round is evaluated either way. Evaluation dominates a CPU-scale "
                              "few-shot run: a table that averages the last K rounds (--last-rounds K) needs only "
                              "eval_rounds = K")
    checkpoint_keep: int = opt(2, "checkpoints kept in the run directory")
    tensorboard: bool = opt(False, "also mirror metrics.jsonl's scalars to OUT/tensorboard (needs `tensorboard`): "
                            "per-client figures as mean / p10 / p90, the config as hparams and text")
    tracking: Literal["none", "mlflow"] = opt(
        "none", "also log the run's scalars and config to an MLflow run (needs `mlflow` or `mlflow-skinny`: "
        "pip install 'ciders[mlflow]')")
    tracking_uri: str | None = opt(None, "federation.tracking: mlflow: the MLflow tracking URI (a server, "
                                         "sqlite:///FILE, file:DIR); null = a SQLite file OUT/mlflow.db")

    def validate_shared(self) -> None:
        if self.clients < 1:
            raise ConfigError(f"federation.clients: must be >= 1, got {self.clients}")
        if self.rounds < 1:
            raise ConfigError(f"federation.rounds: must be >= 1, got {self.rounds}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"federation.checkpoint_keep: must be >= 1, got {self.checkpoint_keep}")
        if self.max_step_ratio is not None and not self.max_step_ratio > 0:
            raise ConfigError(f"federation.max_step_ratio: must be > 0 or null, got {self.max_step_ratio}")
        if self.eval_every < 0:
            raise ConfigError(f"federation.eval_every: must be >= 0, got {self.eval_every}")
        if not 0 <= self.eval_rounds <= self.rounds:
            raise ConfigError(f"federation.eval_rounds: must be in 0 .. federation.rounds ({self.rounds}), got "
                              f"{self.eval_rounds}")

    def evaluates(self, t: int) -> bool:
        """Whether round t ends with an evaluation, the one schedule of both families: the model before the first
        round (t = -1) always; after that, every `eval_every` rounds and the last round, within the last
        `eval_rounds` rounds when that is set."""
        if t == -1:
            return True
        every = t == self.rounds - 1 or bool(self.eval_every and (t + 1) % self.eval_every == 0)
        return every and (not self.eval_rounds or t >= self.rounds - self.eval_rounds)
