import gzip
import json
import math

import pytest
import torch

from ciders.errors import CidersError
from ciders.eval.metrics import perplexity, token_nll
from ciders.models.load import build_tiny, byte_tokenizer
from ciders.tasks.sources import load_examples
from ciders.tasks.text import IGNORE, DataReport, batches, collate, tokenize
from conftest import ROOT


def test_vendored_slice_loads_and_is_disjoint():
    pub, rp = load_examples(ROOT / "data" / "gsm8k-slice" / "public.jsonl")
    ev, re_ = load_examples(ROOT / "data" / "gsm8k-slice" / "eval.jsonl")
    assert (rp.kept, re_.kept) == (400, 100) and not rp.skipped
    assert pub[0].prompt.startswith("Question: ") and pub[0].prompt.endswith("\nAnswer:")
    assert "####" in pub[0].response
    assert not {e.prompt for e in pub} & {e.prompt for e in ev}


def test_malformed_records_are_counted(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    lines = [json.dumps({"instruction": "Say hi", "context": "", "response": "hi"}).encode(),
             b"{broken", b"\xff\xfe not utf8", b"[1, 2]",
             json.dumps({"instruction": "x", "response": "  "}).encode(),
             json.dumps({"instruction": 3, "response": "y"}).encode(),
             json.dumps({"instruction": "Use ctx", "context": "C", "response": "ok"}).encode()]
    with gzip.open(p, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    ex, rep = load_examples(p)
    assert rep.records == 7 and rep.kept == 2
    assert dict(rep.skipped) == {"invalid JSON": 1, "non-UTF-8": 1, "not a JSON object": 1,
                                 "empty response": 1, "missing instruction/response": 1}
    assert "### Input:\nC" in ex[1].prompt
    assert "2/7 records used" in rep.summary()
    with pytest.raises(CidersError, match="no usable records"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text("{broken\n")
        load_examples(bad)
    with pytest.raises(CidersError, match="data file not found"):
        load_examples(tmp_path / "none.jsonl")


def test_tokenize_masks_prompt_and_counts_truncation():
    tok = byte_tokenizer()
    from ciders.tasks.text import Example

    rep = DataReport("x")
    feats = tokenize([Example("ab", "cd"), Example("a" * 50, "b"), Example("p", "r" * 40)], tok, 20, rep)
    assert feats[0]["input_ids"][:2] == tok("ab")["input_ids"] and feats[0]["input_ids"][-1] == tok.eos_token_id
    assert feats[0]["labels"][:2] == [IGNORE, IGNORE] and feats[0]["labels"][2:] == feats[0]["input_ids"][2:]
    assert len(feats) == 3 and rep.truncated == 2 and rep.kept == 3 and not rep.skipped
    # a long prompt loses its beginning and keeps the whole short response
    assert len(feats[1]["input_ids"]) == 20 and feats[1]["input_ids"][-2:] == tok("b")["input_ids"] + [tok.eos_token_id]
    assert sum(x != IGNORE for x in feats[1]["labels"]) == 2
    # a long response keeps the prompt and is cut at max_length
    assert len(feats[2]["input_ids"]) == 20 and feats[2]["labels"][0] == IGNORE and feats[2]["labels"][1] != IGNORE
    b = collate(feats, tok.pad_token_id)
    assert b["input_ids"].shape == (3, 20) and b["attention_mask"][0].sum() == 5
    assert (b["labels"][0, 5:] == IGNORE).all()


def test_perplexity_counts_target_tokens_only():
    m = build_tiny("tiny-llama").eval()
    tok = byte_tokenizer()
    from ciders.tasks.text import Example

    feats = tokenize([Example("Question: 1+1?", " 2"), Example("Hi", " there friend")], tok, 64)
    r = perplexity(m, batches(feats, 1, tok.pad_token_id))
    total, n = 0.0, 0
    for f in feats:  # per example, by hand: -log p(token) over response tokens
        ids = torch.tensor([f["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(m(ids).logits[0], -1)
        for t in range(1, ids.size(1)):
            if f["labels"][t] != IGNORE:
                total -= float(logp[t - 1, ids[0, t]])
                n += 1
    assert r["tokens"] == n == sum(sum(l != IGNORE for l in f["labels"]) for f in feats)
    assert r["nll"] == pytest.approx(total / n, rel=1e-5) and r["ppl"] == pytest.approx(math.exp(total / n), rel=1e-5)
    # batching with padding gives the same corpus figure
    assert perplexity(m, batches(feats, 2, tok.pad_token_id))["nll"] == pytest.approx(r["nll"], rel=1e-5)
    nll, cnt = token_nll(torch.zeros(1, 3, 5), torch.tensor([[IGNORE, 1, IGNORE]]))
    assert cnt == 1 and float(nll) == pytest.approx(math.log(5))


@pytest.mark.full_data
def test_vendored_slice_is_a_verbatim_prefix_of_the_shared_gsm8k():
    from helpers import shared

    src = shared("gsm8k")
    for mine, theirs, lo, hi in (("public.jsonl", "train.jsonl", 0, 400), ("clients.jsonl", "train.jsonl", 400, 700),
                                 ("eval.jsonl", "test.jsonl", 0, 100)):
        with open(src / theirs, "rb") as f:
            lines = f.readlines()
        assert (ROOT / "data" / "gsm8k-slice" / mine).read_bytes() == b"".join(lines[lo:hi])


def test_batches_by_length_cover_every_example_once_and_pad_less():
    from ciders.tasks.text import length_order

    feats = [{"input_ids": [1] * n, "labels": [1] * n} for n in (3, 9, 4, 9, 1, 7, 2)]
    order = length_order(feats)
    assert sorted(order) == list(range(7)) and [len(feats[i]["input_ids"]) for i in order] == [9, 9, 7, 4, 3, 2, 1]
    assert order[:2] == [1, 3]  # ties keep their order
    by_len = list(batches(feats, 3, 0))
    plain = list(batches(feats, 3, 0, by_length=False))
    assert sum(int(b["attention_mask"].sum()) for b in by_len) == sum(len(f["input_ids"]) for f in feats)
    assert sum(b["input_ids"].numel() for b in by_len) < sum(b["input_ids"].numel() for b in plain)
    assert [b["input_ids"].shape[1] for b in plain] == [9, 9, 2]
