"""Batched greedy generation for evaluation: left padding, KV cache, stop strings, progress."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = 256,
             batch_size: int = 8, stops: Sequence[str] = (), progress: Callable[[int], None] | None = None) -> list[str]:
    """Greedy continuations of `prompts` (same order), each cut at the first stop string.
    Prompts are batched by length (less padding); padding is on the left so the KV cache lines up."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[str] = [""] * len(prompts)
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    try:
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, use_cache=True)
            if stops:
                kw.update(stop_strings=list(stops), tokenizer=tokenizer)
            gen = model.generate(**enc, **kw)
            texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for i, t in zip(idx, texts):
                out[i] = cut_at_stops(t, stops)
            if progress:
                progress(len(idx))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out
