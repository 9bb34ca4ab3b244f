"""The client loss of CIDERS as a function of the messenger state alone (docs/method.md#the-client-loss-l_i).

L_i(x; xi) = causal-LM CE on response tokens of M_i = P_M(x) o B_L. B_L is frozen within a round, so a
batch carries B_L(x) computed once (`Decomposition.backbone_hidden`); every gradient evaluation of a
step (look-ahead, meta-gradient, FD probes) then runs only the messenger and the head, functionally
(`torch.func.functional_call`), with the same dropout mask (reseeded from the batch's seed).
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from ciders.core.tensors import State
from ciders.eval.metrics import token_nll
from ciders.models.decompose import MESSENGER, Decomposition


class MessengerLoss:
    def __init__(self, d: Decomposition):
        self.d = d
        self.names = d.param_names(MESSENGER, d.messenger_top)

    def logits(self, params: State, batch: dict) -> torch.Tensor:
        model = self.d.messenger_top
        args = {"inputs_embeds": batch["hidden"], "attention_mask": batch["attention_mask"]}
        devices = [batch["hidden"].device] if batch["hidden"].device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(batch["seed"]))
            return functional_call(model, {self.names[k]: v for k, v in params.items()}, args=(), kwargs=args).logits

    def __call__(self, params: State, batch: dict) -> torch.Tensor:
        nll, n = token_nll(self.logits(params, batch), batch["labels"])
        return nll / max(n, 1)
