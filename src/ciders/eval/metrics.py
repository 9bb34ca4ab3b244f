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


@torch.no_grad()
def perplexity(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> dict:
    """Corpus perplexity exp(sum NLL / target tokens), with the token count it is over."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for b in batches:
        if b["input_ids"].numel() == 0:
            continue
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        nll, n = token_nll(out.logits, b["labels"])
        total += float(nll)
        count += n
    model.train(was_training)
    nll = total / max(count, 1)
    return {"ppl": math.exp(nll) if count else float("nan"), "nll": nll, "tokens": count}
