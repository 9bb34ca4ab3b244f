"""The client loss of CIDERS as a function of the messenger state alone (docs/method.md#the-client-loss-l_i).

L_i(x; xi) = causal-LM CE on response tokens of M_i = P_M(x) o B_L. B_L is frozen within a round, so a
batch carries B_L(x) computed once (`Decomposition.backbone_hidden`); every gradient evaluation of a
step (look-ahead, meta-gradient, FD probes) then runs only the messenger and the head, functionally
(`torch.func.functional_call`), with the same dropout mask (reseeded from the batch's seed).

`compute_dtype` (e.g. float32 on a bfloat16 base) runs those evaluations on a copy of the messenger's
base weights, final norm and head in that dtype, with the hidden inputs cast to it: a finite-difference
Hessian-vector product divides a gradient difference by a probe of length ~1e-4, which a bfloat16
gradient (8 significant bits) cannot resolve (docs/method.md#eq-7-finite-difference-meta-gradient-fd).
The copy is made on first use and again whenever a source weight changes (a new emulator load); it costs
the messenger layers, the norm and the head in the compute dtype (the tied head is the embedding matrix).

The LM head runs only at the positions the loss reads: those t where some row's next token labels[:, t+1] is a
response token (`loss_positions`). The head is a V-way matmul (49,152 for SmolLM2) and dominates the messenger's
cost, while prompts are often longer than responses. The cross-entropy is then taken chunk by chunk from the final
hidden states (`eval.chunked.linear_nll`), its gradient formed while each chunk's logits exist, so the [B, P, V]
logits tensor (and its float32 copy and softmax) is never held: at Qwen2.5's 151,936-way vocabulary that is
0.6 MB per kept position. This path needs a plain bias-free head and no logit post-processing (softcapping,
logit_scale); other models, and the forward of the exact HVP (which differentiates twice), take the logits path
through transformers' `logits_to_keep`. Both equal the full-logits loss to float tolerance
(tests/models/test_messenger_loss.py).
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from ciders.core.metagrad import second_order
from ciders.core.tensors import State
from ciders.eval.chunked import linear_nll, plain_head
from ciders.eval.metrics import token_nll_at
from ciders.eval.metrics import target_positions as loss_positions
from ciders.models.decompose import MESSENGER, Decomposition
from ciders.models.edge_quant import is_quantized


class MessengerLoss:
    def __init__(self, d: Decomposition, compute_dtype: torch.dtype | None = None):
        self.d = d
        self.names = d.param_names(MESSENGER, d.messenger_top)
        self.compute_dtype = compute_dtype
        self._cast: tuple[tuple, State] | None = None  # (key of the source weights, their copies)
        self._head_name: str | None = None
        self._plain_head: tuple | None = None  # (a quantized head, its dequantized copy): `reset_head`

    def base_weights(self) -> State:
        """The messenger_top weights the loss needs besides the LoRA state, in `compute_dtype` ({} when
        the model's own weights are used as they are)."""
        dt = self.compute_dtype
        model = self.d.messenger_top
        if dt is None:
            return {}
        lora = set(self.names.values())
        used = {id(p) for m in (model.model.layers, model.model.norm, model.lm_head) for p in m.parameters()}
        src = {n: p for n, p in model.named_parameters() if n not in lora and id(p) in used and p.dtype != dt}
        # data pointer + in-place version counter: load_emulator_base copies into these tensors in place
        key = tuple((n, p.data_ptr(), p._version) for n, p in src.items())
        if self._cast is None or self._cast[0] != key:
            with torch.no_grad():
                self._cast = (key, {n: p.detach().to(dt) for n, p in src.items()})
        return self._cast[1]

    def _weights(self, params: State) -> State:
        weights = dict(self.base_weights())
        weights.update({self.names[k]: v for k, v in params.items()})
        return weights

    def _run(self, module, weights: State, batch: dict, **kw):
        hidden = batch["hidden"]
        if self.compute_dtype is not None:
            hidden = hidden.to(self.compute_dtype)
        devices = [hidden.device] if hidden.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(batch["seed"]))
            return functional_call(module, weights, args=(), kwargs={
                "inputs_embeds": hidden, "attention_mask": batch["attention_mask"], **kw})

    def logits(self, params: State, batch: dict, keep: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, V] logits, or [B, len(keep), V] at sequence positions `keep` only."""
        return self._run(self.d.messenger_top, self._weights(params), batch,
                         logits_to_keep=0 if keep is None else keep).logits  # 0: every position

    def fused(self) -> bool:
        """Whether the loss takes the chunked path (a plain bias-free head, no logit post-processing, and not
        inside a forward that will be differentiated twice)."""
        return plain_head(self.d.messenger_top) and not second_order()

    def _head_weight(self, weights: State) -> torch.Tensor:
        w = self.d.messenger_top.lm_head.weight
        if self._head_name is None:  # the canonical name (a tied head is the embedding's), looked up once
            self._head_name = next(n for n, p in self.d.messenger_top.named_parameters() if p is w)
        got = weights.get(self._head_name, w)
        if not is_quantized(got):
            return got
        # a frozen int8 head (models.edge_quant; as held, or its compute_dtype copy): the chunked head multiplies by
        # a plain matrix, dequantized once (0.18 s for SmolLM2's, as long as a whole loss and gradient)
        if self._plain_head is None or self._plain_head[0] is not got:
            self._plain_head = (got, got.dequantize().detach())
        return self._plain_head[1]

    def reset_head(self) -> None:
        """Forget the dequantized head: the int8 weights it came from were replaced in place (an edge client's first
        download, `edge_quant.load_into`). The compute_dtype copies need no reset: their key sees the change."""
        self._plain_head = None

    def __call__(self, params: State, batch: dict) -> torch.Tensor:
        """Mean CE over response tokens: position t predicts labels[:, t + 1] (as `eval.metrics.token_nll`)."""
        labels = batch["labels"]
        keep = loss_positions(labels)
        if not self.fused():
            nll, n = token_nll_at(self.logits(params, batch, keep), labels, keep)  # logits [B, len(keep), V]
            return nll / max(n, 1)
        weights = self._weights(params)
        inner = {k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")}
        h = self._run(self.d.messenger_top.model, inner, batch, use_cache=False).last_hidden_state  # [B, T, H]
        h = h[:, keep].reshape(-1, h.size(-1))  # [B * P, H]
        nll, n = linear_nll(h, self._head_weight(weights), labels[:, keep + 1].reshape(-1))
        return nll / max(n, 1)


def step_compute_dtype(metagrad: str, hvp: str, base: torch.dtype) -> torch.dtype | None:
    """The dtype of a client step's messenger evaluations: float32 when a finite-difference HVP would
    otherwise difference bfloat16 / float16 gradients (Eq. 7), else None (the model's own dtype).
    The exact HVP (double backward) has no such cancellation and keeps the base dtype."""
    low = base in (torch.bfloat16, torch.float16)
    return torch.float32 if low and metagrad == "fd" and hvp == "fd" else None
