"""Edge fidelity (`eval.metrics.top1_agreement`): the share of response positions where two models' greedy next
tokens agree, checked against argmax over the full logits, on both head paths (with and without logits_to_keep)."""

import torch
from torch import nn

from ciders.eval.metrics import keeps_logits, top1_agreement
from ciders.models.load import load_model
from ciders.tasks.text import IGNORE


class NoKeep(nn.Module):
    """A model whose forward does not take logits_to_keep: the metric must slice the full logits itself."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 300, (3, 12), generator=g)
    labels = ids.clone()
    labels[:, :5] = IGNORE  # prompt
    labels[0, 9:] = IGNORE  # a shorter response
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _by_hand(a, b, batch):
    with torch.no_grad():
        ta = a(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].argmax(-1)
        tb = b(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].argmax(-1)
    mask = batch["labels"][:, 1:] != IGNORE
    return int(((ta == tb) & mask).sum()) / int(mask.sum()), int(mask.sum())


def test_agreement_equals_argmax_over_full_logits():
    a, b = load_model("tiny-qwen2", seed=0), load_model("tiny-qwen2", seed=1)
    batches = [_batch(0), _batch(1)]
    same = [_by_hand(a, b, x) for x in batches]
    want = sum(f * n for f, n in same) / sum(n for _, n in same)
    assert 0 < want < 1  # two random models: some agreement, not all
    assert keeps_logits(a) and not keeps_logits(NoKeep(a))
    for x, y in ((a, b), (NoKeep(a), NoKeep(b)), (a, NoKeep(b))):
        got = top1_agreement(x, y, iter(batches))  # a generator: each batch read once by both models
        assert got["tokens"] == sum(n for _, n in same) == 2 * (3 * 7 - 3)
        assert abs(got["agreement"] - want) < 1e-12


def test_a_model_agrees_with_itself_and_modes_are_restored():
    a = load_model("tiny-qwen2", seed=0)
    a.train()
    assert top1_agreement(a, a, [_batch(2)])["agreement"] == 1.0
    assert a.training
    assert top1_agreement(a, a, [])["tokens"] == 0
