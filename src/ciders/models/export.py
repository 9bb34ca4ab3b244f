"""Export an edge model: AdapEmu (personalized or global messenger + B_L) with every LoRA merged,
written as a plain HF model directory that `AutoModelForCausalLM.from_pretrained` loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from torch import nn

from ciders.fileio import output_dir
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


def export_edge_model(
    d: Decomposition,
    out_dir: str | Path,
    *,
    messenger: State | None = None,
    student: State | None = None,
    tokenizer: Any = None,
    meta: dict | None = None,
) -> Path:
    """Write AdapEmu with the given adapter states (default: those currently loaded) to `out_dir`. An
    existing `out_dir` keeps every file this export does not write (`fileio.output_dir`)."""
    if messenger is not None:
        d.load_messenger(messenger)
    if student is not None:
        d.load_student(student)
    model = merged_copy(d.adapemu)
    out_dir = Path(out_dir)
    with output_dir(out_dir, "export") as tmp:
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        info = {"kind": "ciders AdapEmu edge model (LoRA merged)", "source_model": d.model_name,
                "n_layers": d.split.n_layers, "messenger_layers": d.split.messenger_layers,
                "student_indices": list(d.split.student_indices), **(meta or {})}
        (tmp / "ciders_export.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out_dir
