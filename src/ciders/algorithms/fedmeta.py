"""Shared blocks of the full-model federated baselines of the RABO paper (the RABO paper, Table II and
Fig. 6: Dist-ProtoNet, Dist-MAML, ..., FedAvg without loss tuning; docs/rabo.md#full-model-baselines).

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

from typing import Mapping, Sequence

import torch

from ciders.config.bilevel import FedMetaConfig  # noqa: F401 - the config lives in the config layer
from ciders.core import aggregate as agg
from ciders.core.tensors import State


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
