"""Likelihood metrics over target (response) tokens only."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ciders.tasks.text import IGNORE


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over positions whose label is not IGNORE, and their count.
    logits [B, T, V], labels [B, T]; position t predicts labels[t+1]."""
    lg = logits[:, :-1].float()
    tg = labels[:, 1:]
    nll = F.cross_entropy(lg.reshape(-1, lg.size(-1)), tg.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return nll, int((tg != IGNORE).sum())


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions t whose next token labels[:, t + 1] is a target in at least one row, ascending: [P]."""
    return (labels[:, 1:] != IGNORE).any(0).nonzero().squeeze(1)


def token_nll_at(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`token_nll` from the logits at positions `keep` only ([B, P, V], `target_positions`): the same sum."""
    tg = labels[:, keep + 1]
    lg = logits.float()
    nll = F.cross_entropy(lg.reshape(-1, lg.size(-1)), tg.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return nll, int((tg != IGNORE).sum())


# Rows of logits per chunk of `linear_nll`: about 2^24 fp32 logits (64 MiB) at a time, whatever the vocabulary.
CHUNK_ELEMENTS = 2**24


def chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, H] x [V, H] -> [n, V] logits of one chunk, in float32 or above (a function of its own so tests can watch
    the shapes)."""
    return (h @ weight.t()).to(torch.promote_types(h.dtype, torch.float32))


class _LinearNLL(torch.autograd.Function):
    """Summed next-token NLL of logits h W^T, chunk by chunk, with the gradients taken in the forward pass: a
    chunk's softmax gives d(loss)/d(logits) = softmax - onehot at once, so d/dh = (softmax - onehot) W and
    d/dW = (softmax - onehot)^T h are formed while the chunk's logits exist, and only those ([N, H], [V, H])
    are kept for backward. The full [N, V] logits are never held; the matmuls are the ones an unchunked
    forward + backward does. Not twice differentiable (double backward uses the logits path)."""

    @staticmethod
    def forward(ctx, h, weight, targets, rows):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32))
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(weight) if need_w else None
        for i in range(0, h.size(0), rows):
            hc, tc = h[i : i + rows], targets[i : i + rows]
            logits = chunk_logits(hc, weight)  # [n, V]
            valid = (tc != IGNORE).to(logits.dtype)
            safe = tc.clamp_min(0)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            m = logits.amax(dim=-1)
            e = logits.sub_(m[:, None]).exp_()  # in place: the chunk's only [n, V] buffer
            z = e.sum(dim=-1)
            total += ((m + z.log() - picked) * valid).sum()
            if need_h or need_w:
                p = e.mul_((valid / z)[:, None])  # softmax on valid rows, 0 on ignored ones
                p[torch.arange(p.size(0), device=p.device), safe] -= valid
                p = p.to(h.dtype)
                if need_h:
                    gh[i : i + rows] = p @ weight
                if need_w:
                    gw += p.t() @ hc
        ctx.save_for_backward(*(t for t in (gh, gw) if t is not None))
        ctx.has = (need_h, need_w)
        return total

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        gh = next(saved) * grad if ctx.has[0] else None  # a 0-dim float32 grad keeps the saved dtype
        gw = next(saved) * grad if ctx.has[1] else None
        return gh, gw, None, None


def linear_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               chunk_elements: int | None = None) -> tuple[torch.Tensor, int]:
    """`token_nll_at` without the logits tensor: h [N, H] (the final hidden states at the kept positions),
    the head's weight [V, H] (no bias), targets [N] (IGNORE skipped). The same sum and count; the logits are
    formed chunk_elements (default CHUNK_ELEMENTS) / V rows at a time, in float32 (float64 stays float64)."""
    rows = max(1, (chunk_elements or CHUNK_ELEMENTS) // weight.size(0))
    return _LinearNLL.apply(h, weight, targets, rows), int((targets != IGNORE).sum())


def keeps_logits(model: nn.Module) -> bool:
    """Whether `model`'s forward takes transformers' `logits_to_keep` (or passes keywords on, as PEFT's does)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "logits_to_keep" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@torch.inference_mode()
def perplexity(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict:
    """Corpus perplexity exp(sum NLL / target tokens), with the token count it is over. The LM head runs only at
    the positions a target follows (`target_positions`) where the model takes `logits_to_keep`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    keep_ok = keeps_logits(model)
    for b in batches:
        if b["input_ids"].numel() == 0:
            continue
        if keep_ok:
            keep = target_positions(b["labels"])
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], logits_to_keep=keep)
            nll, n = token_nll_at(out.logits, b["labels"], keep)
        else:
            nll, n = token_nll(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
        total += float(nll)
        count += n
    model.train(was_training)
    nll = total / max(count, 1)
    return {"ppl": math.exp(nll) if count else float("nan"), "nll": nll, "tokens": count}
