"""Export an edge model: AdapEmu (personalized or global messenger + B_L) with every LoRA merged, as a plain HF
model directory that `AutoModelForCausalLM.from_pretrained` loads (`hf`), as ONNX with a KV cache (`onnx`,
`models.onnx_export`) or as GGUF for llama.cpp (`gguf`, `models.gguf_export`). Each export carries a model card
(README.md, `models.model_card`) and ciders_export.json (what it is, the split, the format's details)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ciders.errors import CidersError
from ciders.fileio import check_out_path, output_dir
from ciders.models.adapters import State
from ciders.models.decompose import Decomposition


def merged_copy(model: nn.Module) -> nn.Module:
    """An independent copy of `model` with each LoRA layer merged into its base Linear and removed.
    Works on a deep copy: the composite paths share base weights, so merging in place would change
    the teacher too."""
    from peft.tuners.lora import LoraLayer

    m = copy.deepcopy(model)
    for name, module in list(m.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)
            parent_name, _, child = name.rpartition(".")
            setattr(m.get_submodule(parent_name), child, module.get_base_layer())
    if hasattr(m, "peft_config"):
        del m.peft_config
    for p in m.parameters():
        p.requires_grad_(False)
    return m.eval()


FORMATS = ("hf", "onnx", "gguf")


def export_edge_model(
    d: Decomposition,
    out_dir: str | Path,
    *,
    fmt: str = "hf",
    messenger: State | None = None,
    student: State | None = None,
    tokenizer: Any = None,
    meta: dict | None = None,
    card: Callable[[dict], str] | None = None,
    gguf_dtype: str = "f32",
) -> Path:
    """Write AdapEmu with the given adapter states (default: those currently loaded) to `out_dir` in `fmt`.
    `card(info)` gives README.md's text. An existing `out_dir` keeps every file this export does not write
    (`fileio.output_dir`)."""
    if fmt not in FORMATS:
        raise CidersError(f"export format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt != "hf" and tokenizer is None:
        raise CidersError(f"a {fmt} export needs the tokenizer")
    if fmt == "gguf":
        from ciders.models.gguf_export import check_dtype

        check_dtype(gguf_dtype)  # now, not after the merge
    check_out_path(out_dir, beside=True)  # a bad out_dir fails now, not after the merge and the conversion
    if messenger is not None:
        d.load_messenger(messenger)
    if student is not None:
        d.load_student(student)
    model = merged_copy(d.adapemu)
    s = d.split
    info = {"kind": "ciders AdapEmu edge model (LoRA merged)", "format": fmt, "source_model": d.model_name,
            "architecture": model.config.model_type,
            "split": {"n_layers": s.n_layers, "messenger_layers": s.messenger_layers,
                      "student_layers": s.student_layers, "edge_layers": s.edge_layers,
                      "student_indices": list(s.student_indices)},
            # kept at the top level too, as earlier exports wrote them
            "n_layers": s.n_layers, "messenger_layers": s.messenger_layers,
            "student_indices": list(s.student_indices),
            "eos_token_ids": _eos_ids(model, tokenizer), **(meta or {})}
    out_dir = Path(out_dir)
    with output_dir(out_dir, "export") as tmp:
        if fmt == "hf":
            model.save_pretrained(str(tmp))
        elif fmt == "onnx":
            from ciders.models.onnx_export import write_onnx

            model.config.save_pretrained(str(tmp))  # the architecture, for readers that want it
            info["onnx"] = write_onnx(model, tmp)  # converts `model`, this export's own copy, in place
        else:
            from ciders.models.gguf_export import FILE, write_gguf

            info["gguf"] = write_gguf(model, tokenizer, tmp / FILE, gguf_dtype, name=f"{d.model_name} edge (ciders)")
        if tokenizer is not None and fmt != "gguf":  # GGUF carries its tokenizer inside
            tokenizer.save_pretrained(str(tmp))
        (tmp / "ciders_export.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if card is not None:
            (tmp / "README.md").write_text(card(info), encoding="utf-8")
    return out_dir


def _eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
    tok = getattr(tokenizer, "eos_token_id", None)
    return sorted({int(i) for i in ids} | ({int(tok)} if tok is not None else set()))
