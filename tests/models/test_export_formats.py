"""`ciders export --format onnx|gguf`: the ONNX graph (KV cache as inputs/outputs) against the PyTorch AdapEmu on
real text, logits and greedy tokens; the GGUF file through two independent readers (the `gguf` package's reader
and transformers' GGUF loader, which implements llama.cpp's conventions); the model card and the adapters'
notes on which layers they target."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from ciders.errors import CidersError
from ciders.models.decompose import decompose
from ciders.models.export import export_edge_model, merged_copy
from ciders.models.load import load_model, load_tokenizer
from conftest import ROOT
from helpers import ARCHS, randomize_lora

pytest.importorskip("onnxruntime")


def question(i=0) -> str:
    rows = [json.loads(x) for x in (ROOT / "data" / "gsm8k-slice" / "eval.jsonl").read_text().splitlines()]
    return rows[i]["question"]


def edge(name):
    d = decompose(load_model(name), 2, drop_ratio=0.5)
    randomize_lora(d)
    return d, load_tokenizer(name)


@pytest.mark.parametrize("name", ARCHS)
def test_onnx_logits_and_greedy_tokens_match_pytorch(name, tmp_path):
    from ciders.models.onnx_run import EdgeSession

    d, tok = edge(name)
    export_edge_model(d, tmp_path / "onnx", fmt="onnx", tokenizer=tok)
    assert sorted(p.name for p in (tmp_path / "onnx").glob("model.onnx*")) == ["model.onnx", "model.onnx.data"]
    s = EdgeSession(tmp_path / "onnx")
    ids = tok(question(), return_tensors="pt").input_ids[:, :48]
    with torch.no_grad():
        ref = d.adapemu(ids).logits[0].numpy()
    # prefill 40 positions, then one token at a time through the cache: each position's logits match
    logits, cache = s.step(ids[:, :40].numpy(), s.empty_cache())
    got = [logits[0]]
    for j in range(40, ids.shape[1]):
        logits, cache = s.step(ids[:, j:j + 1].numpy(), cache)
        got.append(logits[0])
    np.testing.assert_allclose(np.concatenate(got), ref, atol=1e-4, rtol=1e-4)
    assert cache[0].shape[2] == ids.shape[1]
    new = s.generate(ids[0].tolist(), max_new_tokens=16, stop_at_eos=False)
    with torch.no_grad():
        want = d.adapemu.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    assert new == want[0, ids.shape[1]:].tolist() and len(set(new)) > 1


def test_the_onnx_runner_needs_no_torch(tmp_path):
    d, tok = edge("tiny-llama")
    export_edge_model(d, tmp_path / "onnx", fmt="onnx", tokenizer=tok)
    code = ("import sys; sys.modules['torch'] = None\n"  # any torch import now fails
            "from ciders.models.onnx_run import EdgeSession\n"
            f"print(EdgeSession({str(tmp_path / 'onnx')!r}).generate([1, 2, 3], 5, stop_at_eos=False))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with torch.no_grad():
        want = d.adapemu.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert json.loads(r.stdout) == want[0, 3:].tolist()


def test_a_directory_that_is_not_an_onnx_export_is_a_clear_error(tmp_path):
    from ciders.models.onnx_run import EdgeSession

    d, tok = edge("tiny-qwen2")
    export_edge_model(d, tmp_path / "hf", tokenizer=tok)
    with pytest.raises(ValueError, match="not an ONNX export"):
        EdgeSession(tmp_path / "hf")


def test_qk_permutation_is_llama_cpps_and_inverts():
    from ciders.models.gguf_export import permute_qk, unpermute_qk

    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of head_dim 8
    p = permute_qk(w, 2)
    # within a head, rows [0..3] and [4..7] (the two rotary halves) are interleaved: 0, 4, 1, 5, ...
    assert p[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    assert torch.equal(unpermute_qk(p, 2), w) and torch.equal(unpermute_qk(permute_qk(w[:, 0], 2), 2), w[:, 0])


@pytest.mark.parametrize("name", ARCHS)
def test_gguf_round_trips_through_the_gguf_reader_and_transformers(name, tmp_path):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from ciders.models.gguf_export import unpermute_qk

    d, tok = edge(name)
    export_edge_model(d, tmp_path / "g", fmt="gguf", tokenizer=tok)
    m = merged_copy(d.adapemu)
    c = m.config
    r = GGUFReader(str(tmp_path / "g" / "model.gguf"))
    arch = r.fields["general.architecture"].contents()
    assert arch == c.model_type
    assert r.fields[f"{arch}.block_count"].contents() == d.split.edge_layers
    assert r.fields[f"{arch}.attention.head_count_kv"].contents() == c.num_key_value_heads
    assert len(r.fields["tokenizer.ggml.tokens"].data) == c.vocab_size
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_id
    names = {t.name: t for t in r.tensors}
    assert ("output.weight" in names) != c.tie_word_embeddings
    sd = m.state_dict()
    for i in range(d.split.edge_layers):
        for g, hf, heads in ((f"blk.{i}.attn_q.weight", f"model.layers.{i}.self_attn.q_proj.weight", c.num_attention_heads),
                             (f"blk.{i}.attn_k.weight", f"model.layers.{i}.self_attn.k_proj.weight", c.num_key_value_heads),
                             (f"blk.{i}.ffn_down.weight", f"model.layers.{i}.mlp.down_proj.weight", None)):
            t = torch.from_numpy(np.array(names[g].data)).reshape(sd[hf].shape)
            if heads and c.model_type == "llama":
                t = unpermute_qk(t, heads)
            assert torch.equal(t, sd[hf]), g
    assert torch.equal(torch.from_numpy(np.array(names["token_embd.weight"].data)).reshape(c.vocab_size, -1),
                       sd["model.embed_tokens.weight"])
    # an independent reader of llama.cpp's layout: the same model, the same logits
    g = AutoModelForCausalLM.from_pretrained(str(tmp_path / "g"), gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = tok(question(1), return_tensors="pt").input_ids[:, :32]
    with torch.no_grad():
        torch.testing.assert_close(g(ids).logits, m(ids).logits, atol=1e-5, rtol=1e-5)


def test_gguf_f16_halves_the_matrices_and_keeps_norms_f32(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader

    d, tok = edge("tiny-llama")
    export_edge_model(d, tmp_path / "g", fmt="gguf", tokenizer=tok, gguf_dtype="f16")
    types = {t.name: t.tensor_type for t in GGUFReader(str(tmp_path / "g" / "model.gguf")).tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32


def test_gguf_refuses_what_it_cannot_write(tmp_path):
    from ciders.models.gguf_export import write_gguf

    d, tok = edge("tiny-qwen2")
    m = merged_copy(d.adapemu)
    m.config.model_type = "phi3"
    with pytest.raises(CidersError, match="GGUF export supports llama, qwen2"):
        write_gguf(m, tok, tmp_path / "x.gguf")
    with pytest.raises(CidersError, match="f32 or f16"):
        write_gguf(merged_copy(d.adapemu), tok, tmp_path / "x.gguf", dtype="q4")
    m = merged_copy(d.adapemu)
    m.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(CidersError, match="plain RoPE only"):
        write_gguf(m, tok, tmp_path / "x.gguf")


def _run(tmp_path, summary=None):
    from helpers import run_dir_without_run

    run = run_dir_without_run(tmp_path)
    if summary:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_cli_exports_each_format_with_a_model_card(tmp_path, capsys):
    from ciders.cli import main

    ev = lambda ppl: {"ppl": ppl, "nll": float(np.log(ppl)), "tokens": 64}  # noqa: E731
    run = _run(tmp_path, {"eval_before": {"round": -1, "global": ev(310.0)},
                          "eval_after": {"round": 1, "global": ev(290.5), "clients": {}}})
    for fmt, files in (("hf", {"model.safetensors", "config.json"}), ("onnx", {"model.onnx", "model.onnx.data"}),
                       ("gguf", {"model.gguf"})):
        out = tmp_path / fmt
        assert main(["export", str(run), "--out", str(out), "--format", fmt]) == 0
        names = {p.name for p in out.iterdir()}
        assert files | {"README.md", "ciders_export.json"} <= names, names
        assert ("tokenizer.json" in names) == (fmt != "gguf")
        info = json.loads((out / "ciders_export.json").read_text())
        assert info["format"] == fmt and info["messenger"] == "global" and info["split"]["student_indices"] == [0, 3]
        card = (out / "README.md").read_text()
        assert "tiny-qwen2" in card and "layers [0, 3]" in card and "`ciders`" in card
        assert "| global messenger, final | global eval set | 290.500 |" in card and "| before training |" in card
    assert "No evaluation is recorded" in __import__("ciders.models.model_card", fromlist=["x"]).model_card(
        info, __import__("ciders.config", fromlist=["x"]).load_config(run / "config.yaml"), None, None)


def test_adapters_say_which_layers_they_target(tmp_path):
    from ciders.models.adapters import load_adapter

    d, _ = edge("tiny-qwen2")
    d.save_student(tmp_path / "student")
    d.save_messenger(tmp_path / "messenger")
    _, meta = load_adapter(tmp_path / "student")
    assert meta["targets"] == "AdapEmu (B_L)" and meta["base_layer_indices"] == [0, 3] and meta["layer_indices"] == [0, 1]
    note = (tmp_path / "student" / "README.md").read_text()
    assert "not the base model's" in note and "[0, 3]" in note
    _, meta = load_adapter(tmp_path / "messenger")
    assert meta["targets"] == "base model" and meta["layer_indices"] == [4, 5]
    d.read_adapter(tmp_path / "student", "student")  # still a valid adapter of this split
