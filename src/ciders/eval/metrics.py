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
        if b["labels"].numel() == 0:
            continue
        # a batch gives token ids, or (inputs_embeds) the hidden states a model's first layer reads
        x = {"inputs_embeds": b["inputs_embeds"]} if "inputs_embeds" in b else {"input_ids": b["input_ids"]}
        if keep_ok:
            keep = target_positions(b["labels"])
            out = model(**x, attention_mask=b["attention_mask"], logits_to_keep=keep)
            nll, n = token_nll_at(out.logits, b["labels"], keep)
        else:
            nll, n = token_nll(model(**x, attention_mask=b["attention_mask"]).logits, b["labels"])
        total += float(nll)
        count += n
    model.train(was_training)
    nll = total / max(count, 1)
    return {"ppl": math.exp(nll) if count else float("nan"), "nll": nll, "tokens": count}


@torch.inference_mode()
def top1_agreement(model_a: nn.Module, model_b: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict:
    """Edge fidelity: the fraction of target (response) positions at which the two models' greedy next tokens
    agree, argmax model_a(x)[t] == argmax model_b(x)[t] where labels[t + 1] is a target, with the count it is over
    (docs/method.md#edge-fidelity). Both heads run only at the positions a target follows (`target_positions`)
    where the models take `logits_to_keep`. Every batch is read once by both models, so it may be a generator."""
    modes = [(m, m.training) for m in (model_a, model_b)]
    for m, _ in modes:
        m.eval()
    same, count = 0, 0
    for b in batches:
        if b["labels"].numel() == 0:
            continue
        keep = target_positions(b["labels"])
        mask = b["labels"][:, keep + 1] != IGNORE  # [B, P]
        tops = []
        for m in (model_a, model_b):
            kw = {"logits_to_keep": keep} if keeps_logits(m) else {}
            lg = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], **kw).logits
            tops.append(lg.argmax(-1) if kw else lg[:, keep].argmax(-1))
        same += int(((tops[0] == tops[1]) & mask).sum())
        count += int(mask.sum())
    for m, was in modes:
        m.train(was)
    return {"agreement": same / count if count else float("nan"), "tokens": count}
