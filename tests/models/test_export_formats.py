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


def quantized_like_llama_cpp(m, qtype):
    """`m` with each of its matrices through the gguf package's quantize and dequantize: the model a reader of the
    quantized GGUF should see. Only 2-D weights (norms and biases stay f32, as in llama.cpp's converter) whose rows
    are whole blocks (the others are the caller's to set)."""
    import copy

    import gguf

    block = gguf.GGML_QUANT_SIZES[qtype][0]
    q = copy.deepcopy(m)
    with torch.no_grad():
        for p in q.parameters():
            if p.ndim == 2 and p.shape[-1] % block == 0:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)))
    return q


@pytest.mark.parametrize("name", ARCHS)
def test_gguf_q8_0_quantizes_the_matrices_as_llama_cpps_converter_does(name, tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    d, tok = edge(name)
    export_edge_model(d, tmp_path / "g", fmt="gguf", tokenizer=tok, gguf_dtype="q8_0")
    r = GGUFReader(str(tmp_path / "g" / "model.gguf"))
    types = {t.name: t.tensor_type for t in r.tensors}
    # convert_hf_to_gguf.py's rule: matrices (token embedding and output included) Q8_0; norms, biases F32
    assert {n for n, t in types.items() if t != Q.Q8_0} == {n for n in types if n.endswith(("_norm.weight", ".bias"))}
    assert {t for n, t in types.items() if n.endswith(("_norm.weight", ".bias"))} == {Q.F32}
    assert types["token_embd.weight"] == Q.Q8_0 and r.fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    info = json.loads((tmp_path / "g" / "ciders_export.json").read_text())["gguf"]
    assert info["tensor_types"] == {"Q8_0": sum(t == Q.Q8_0 for t in types.values()),
                                    "F32": sum(t == Q.F32 for t in types.values())} and info["f16_fallback"] == []
    # the file holds exactly the gguf package's Q8_0 of each matrix: transformers' reader of it computes the model
    # whose matrices went through quantize + dequantize (this model's logits move by up to ~0.2 of ~0.7 under Q8_0:
    # random LoRA on tiny matrices; real models move far less, see the slow suite)
    g = AutoModelForCausalLM.from_pretrained(str(tmp_path / "g"), gguf_file="model.gguf", dtype=torch.float32).eval()
    ids = tok(question(2), return_tensors="pt").input_ids[:, :32]
    with torch.no_grad():
        torch.testing.assert_close(g(ids).logits, quantized_like_llama_cpp(merged_copy(d.adapemu), Q.Q8_0)(ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert (tmp_path / "g" / "model.gguf").stat().st_size < 0.4 * _f32_size(d, tok, tmp_path)


def _f32_size(d, tok, tmp_path) -> int:
    export_edge_model(d, tmp_path / "f32", fmt="gguf", tokenizer=tok)
    return (tmp_path / "f32" / "model.gguf").stat().st_size


def test_gguf_q8_0_writes_rows_that_are_not_whole_blocks_f16_and_says_so(tmp_path, caplog):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from ciders.models.gguf_export import write_gguf

    # intermediate 72: ffn_down's rows (72 values) are not whole 32-value Q8_0 blocks; gate/up's (64) are
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    tok = load_tokenizer("tiny-llama")
    with caplog.at_level("WARNING", logger="ciders.models.gguf_export"):
        info = write_gguf(m, tok, tmp_path / "model.gguf", dtype="q8_0")
    assert info["f16_fallback"] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
    assert "blk.0.ffn_down.weight has rows of 72 values, not a multiple of Q8_0's 32-value block" in caplog.text
    types = {t.name: t.tensor_type for t in GGUFReader(str(tmp_path / "model.gguf")).tensors}
    assert types["blk.0.ffn_down.weight"] == Q.F16 and types["blk.0.ffn_up.weight"] == Q.Q8_0
    assert info["tensor_types"] == {"Q8_0": 14, "F16": 2, "F32": 5}  # 2 x (q, k, v, o, gate, up) + embedding + output
    g = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32).eval()
    q = quantized_like_llama_cpp(m, Q.Q8_0)
    for i in range(2):  # the fallback matrices hold the f16 rounding, not the Q8_0 one
        w = m.model.layers[i].mlp.down_proj.weight
        q.model.layers[i].mlp.down_proj.weight.data = w.half().float()
    ids = torch.arange(3, 35)[None]
    with torch.no_grad():
        torch.testing.assert_close(g(ids).logits, q(ids).logits, atol=1e-5, rtol=1e-5)


def test_gguf_refuses_what_it_cannot_write(tmp_path):
    from ciders.models.gguf_export import write_gguf

    d, tok = edge("tiny-qwen2")
    m = merged_copy(d.adapemu)
    m.config.model_type = "phi3"
    with pytest.raises(CidersError, match="GGUF export supports llama, qwen2"):
        write_gguf(m, tok, tmp_path / "x.gguf")
    with pytest.raises(CidersError, match=r"^--gguf-dtype: one of f32, f16, q8_0; got 'q4'$"):
        write_gguf(merged_copy(d.adapemu), tok, tmp_path / "x.gguf", dtype="q4")
    with pytest.raises(CidersError, match="one of f32, f16, q8_0"):  # before the merge and the output directory
        export_edge_model(d, tmp_path / "never", fmt="gguf", tokenizer=tok, gguf_dtype="Q8_0")
    assert not (tmp_path / "never").exists()
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
        if fmt == "gguf":  # the card says what the tensors are stored as
            assert "--gguf-dtype f32, tensor types: " in card and " F32" in card and "Q8_0" not in card
    assert "No evaluation is recorded" in __import__("ciders.models.model_card", fromlist=["x"]).model_card(
        info, __import__("ciders.config", fromlist=["x"]).load_config(run / "config.yaml"), None, None)


def test_cli_gguf_q8_0_card_states_the_tensor_types_and_a_bad_dtype_names_the_choices(tmp_path, capsys):
    from ciders.cli import main

    run = _run(tmp_path)
    assert main(["export", str(run), "--out", str(tmp_path / "q8"), "--format", "gguf", "--gguf-dtype", "q8_0"]) == 0
    info = json.loads((tmp_path / "q8" / "ciders_export.json").read_text())["gguf"]
    card = (tmp_path / "q8" / "README.md").read_text()
    assert f"--gguf-dtype q8_0, tensor types: {info['tensor_types']['Q8_0']} Q8_0, " in card
    assert f"{info['tensor_types']['F32']} F32" in card and "kept F16" not in card
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), "--out", str(tmp_path / "q4"), "--format", "gguf", "--gguf-dtype", "q4_0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--gguf-dtype: invalid choice: 'q4_0' (choose from 'f32', 'f16', 'q8_0')" in err, err
    assert not (tmp_path / "q4").exists()


def test_the_card_names_the_matrices_kept_f16():
    from ciders.models.model_card import _gguf_types

    text = _gguf_types({"dtype": "q8_0", "tensor_types": {"Q8_0": 14, "F16": 2, "F32": 5},
                        "f16_fallback": ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]})
    assert text == ("--gguf-dtype q8_0, tensor types: 14 Q8_0, 5 F32, 2 F16; 2 matrices with rows not a multiple of "
                    "the quantization block kept F16: blk.0.ffn_down.weight, blk.1.ffn_down.weight")


def test_the_cli_offers_the_exporters_dtypes():
    from ciders.cli import parser
    from ciders.models.gguf_export import DTYPES

    export = parser()._subparsers._group_actions[0].choices["export"]
    assert next(a for a in export._actions if a.dest == "gguf_dtype").choices == tuple(DTYPES)


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
