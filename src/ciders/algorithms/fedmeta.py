"""Shared blocks of the full-model federated baselines of the RABO paper (rabo-paper.txt, Table II and
Fig. 6; SPEC Part 2, "Baselines: Dist-ProtoNet, Dist-MAML, ..., FedAvg without loss tuning").

The paper's distributed baselines are "FedAvg of the meta-learner": every client trains the *full* model
(no masks, no sub-models) for `local_steps` local updates from the current global parameters, and the
server takes the weighted mean of the client models (FedAvg, McMahan et al., AISTATS 2017):

  (x, y)_{q+1} = sum_i p_i (x, y)^i_{q, K},   p_i = w_i / sum_j w_j

Each algorithm is one module exposing the same client step, a pure function over explicit state:

  local_update(cfg, task, x, y, i, q) -> (x_new, y_new, metrics)

  `ciders.algorithms.dist_protonet`  Snell et al. 2017, on x (the feature extractor); y unchanged
  `ciders.algorithms.dist_maml`      Finn et al. 2017, on (x, y) as the meta-learner
  `ciders.algorithms.fedavg_notune`  the loss-tuning task's classifier y on the untuned loss; x unchanged

and `server_mean` (below) is the one server step they share; the round itself (who trains, the
messages, the mean) is `federation.bilevel_rounds`, as for RABO. Client i of round q takes its data from
`task.batches(i, q, cfg.local_steps)`: one batch (an episode, for the few-shot task) per local step.
Metrics of a client: `loss` (mean training loss over its local steps, each at the parameters the step
differentiated), `calls` (loss-gradient evaluations, i.e. backward passes: every Hessian-vector product
inside second-order MAML counts as one more, see `dist_maml`) and `steps`.

There is no `reg` knob: the regularisers belong to the task (FewShotTask.g and LossTuneTask.g already
carry their (reg / 2)|y|^2), so the baselines train on exactly the losses RABO / FedMBO see, and
ProtoNet, which has no head, has nothing to regularise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ciders.config import opt
from ciders.core import aggregate as agg
from ciders.core.tensors import State
from ciders.errors import ConfigError


@dataclass(frozen=True)
class FedMetaConfig:
    local_steps: int = opt(5, "local updates per round on each client (one batch / episode each)")
    lr: float = opt(0.1, "local (meta-)learning rate of the SGD step on the client")
    inner_steps: int = opt(1, "Dist-MAML: adaptation steps on the support (0: plain SGD on the query loss)")
    inner_lr: float = opt(0.5, "Dist-MAML: adaptation learning rate on the support")
    first_order: bool = opt(False, "Dist-MAML: first-order approximation (no second derivatives, FOMAML)")

    def validate(self) -> "FedMetaConfig":
        if not isinstance(self.local_steps, int) or isinstance(self.local_steps, bool) or self.local_steps < 1:
            raise ConfigError(f"fedmeta.local_steps: must be an integer >= 1, got {self.local_steps!r}")
        if not isinstance(self.inner_steps, int) or isinstance(self.inner_steps, bool) or self.inner_steps < 0:
            raise ConfigError(f"fedmeta.inner_steps: must be an integer >= 0, got {self.inner_steps!r}")
        for k in ("lr", "inner_lr"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"fedmeta.{k}: must be a number > 0, got {v!r}")
        if not isinstance(self.first_order, bool):
            raise ConfigError(f"fedmeta.first_order: must be true or false, got {self.first_order!r}")
        return self


def server_mean(global_params: Mapping[str, torch.Tensor], client_params: Sequence[Mapping[str, torch.Tensor]],
                weights: Sequence[float]) -> State:
    """FedAvg's server step, `ciders.core.aggregate.weighted_mean`: sum_i p_i theta_i with p_i = w_i / sum_j w_j
    (sample counts or capacities can be passed as they are). `global_params` fixes the key set, shapes and
    dtypes every client model must match; the result has its keys, shapes and dtypes (the sum is
    accumulated in float64, then cast back)."""
    return agg.weighted_mean(client_params, weights, like=global_params, accumulate=torch.float64, what="server_mean")


def sgd(params: State, grad: Mapping[str, torch.Tensor], lr: float) -> State:
    """params - lr * grad, detached."""
    return {k: (v - lr * grad[k]).detach() for k, v in params.items()}
