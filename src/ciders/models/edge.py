"""The edge model: AdapEmu = P_M o B_L built on a device that never holds the full model M*
(docs/edge.md, docs/method.md#algorithm-1-model-decomposition-modelprep).

The server writes an **edge spec** once per run: AdapEmu's Hugging Face `config.json` (the base model's
architecture with `num_hidden_layers = n' + a`), the tokenizer files and `ciders_edge.json` (the base
model's name and layer count, the split). A client receives the spec at first contact, then the
emulator's base weights in its first broadcast (the `emulator` static component), and stores both as one
Hugging Face model directory (`model.safetensors` in plain transformers names). From then on it loads
that directory (memory-mapped safetensors, `from_pretrained`), injects the messenger and student LoRA
and builds the same composite paths as `decompose`:

  edge layers 0 .. n'-1      B_L (student LoRA), the base layers at `split.student_indices`
  edge layers n' .. n'+a-1   P_M (messenger LoRA), the base layers n-a .. n-1

Adapter keys follow the server's conventions, so the wire, the client store and saved adapters are the
same: the student uses AdapEmu's indices 0 .. n'-1, the messenger the ORIGINAL model's indices n-a .. n-1
(edge layer n'+j is base layer n-a+j). Nothing here reads `model.name`: only the spec and the weights.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch
from torch import nn

from ciders.config import LoraConfig
from ciders.errors import CidersError
from ciders.fileio import atomic_path
from ciders.models import adapters as ad
from ciders.models.decompose import MESSENGER, STUDENT, Decomposition, composite
from ciders.models.edge_guard import check_config, stored_shapes
from ciders.models.edge_spec import META, SPEC_FILES, WEIGHTS, check_spec
from ciders.models.split import Split
from ciders.runtime import derive_seed

_LAYER = re.compile(r"^(model\.layers\.)(\d+)\.")


def edge_spec(d: Decomposition, tok, emulator_dtype: torch.dtype | None = None,
              quantize: str = "none") -> dict[str, bytes]:
    """The files (name -> bytes) an edge client needs besides the weights, from the server's decomposition:
    AdapEmu's config.json, the tokenizer's files, ciders_edge.json (the base model, the split, the dtype the
    emulator weights travel in, their quantization: `models.edge_quant`)."""
    s = d.split
    meta = {"format": 1, "model": d.model_name, "n_layers": s.n_layers, "messenger_layers": s.messenger_layers,
            "student_indices": list(s.student_indices), "dtype": _name(d.base.dtype),
            "emulator_dtype": _name(emulator_dtype or d.base.dtype), "quantize": quantize}
    with tempfile.TemporaryDirectory() as tmp:
        d.adapemu.config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (Path(tmp) / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file() and p.name in SPEC_FILES}
    check_spec(files)
    return files


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- the model


class EdgeDecomposition(Decomposition):
    """A Decomposition with AdapEmu only: `base` is AdapEmu itself (there is no AdapFu, no B_F)."""

    @property
    def adapfu(self) -> nn.Module:
        raise CidersError("an edge client holds no full model (AdapFu, B_F); only AdapEmu = P_M o B_L")

    @property
    def backbone_full(self) -> nn.ModuleList:
        raise CidersError("an edge client holds no full backbone B_F")

    @property
    def messenger(self) -> nn.ModuleList:
        return self.adapemu.model.layers[self.split.student_layers:]

    def messenger_params(self) -> dict[str, nn.Parameter]:
        """Canonical messenger keys in the ORIGINAL model's layer indices (edge layer n'+j -> n-a+j)."""
        shift = self.split.teacher_layers - self.split.student_layers

        def orig(m: re.Match) -> str:
            return f"{m.group(1)}{int(m.group(2)) + shift}."

        return {_LAYER.sub(orig, k, count=1): p for k, p in ad.adapter_params(self.adapemu, MESSENGER).items()}


def edge_decompose(model: nn.Module, split: Split, messenger_lora: LoraConfig | None, student_lora: LoraConfig | None,
                   seed: int = 0, model_name: str | None = None) -> EdgeDecomposition:
    """LoRA and the composite paths on a loaded AdapEmu base (`model` has n' + a decoder layers)."""
    n_s, a = split.student_layers, split.messenger_layers
    if len(model.model.layers) != n_s + a:
        raise CidersError(f"the edge model has {len(model.model.layers)} layers, the split needs {n_s + a}")
    for p in model.parameters():
        p.requires_grad_(False)
    msg_idx = list(range(n_s, n_s + a))
    messenger_lora = None if messenger_lora is None else ad.resolve_targets(model.model.layers[0], messenger_lora)
    student_lora = None if student_lora is None else ad.resolve_targets(model.model.layers[0], student_lora)
    if messenger_lora is not None:  # the same order and seeds as `decompose` (values come from the server)
        ad.inject_lora(model, messenger_lora, msg_idx, MESSENGER, seed=derive_seed(seed, "messenger-lora-init"))
    if student_lora is not None:
        ad.inject_lora(model, student_lora, range(n_s), STUDENT, seed=derive_seed(seed, "student-lora-init"))
    messenger_top = composite(model, msg_idx, model.model.layers)
    student_stack = composite(model, list(range(n_s)), model.model.layers)
    student_stack.config.tie_last_hidden_states = False
    for m in (model, messenger_top, student_stack):
        m.eval()
    d = EdgeDecomposition(model, model, messenger_top, student_stack, split, messenger_lora, student_lora, model_name)
    d.set_trainable(messenger=True, student=True)
    return d


def load_edge(directory: str | Path, device: torch.device, dtype: torch.dtype,
              attn_implementation: str | None = None, quantize: str = "none") -> tuple[nn.Module, bool]:
    """AdapEmu's plain base from the edge directory: loaded memory-mapped when its weights are stored
    (True), else built from config.json with placeholder weights that the first broadcast replaces (False).
    Either way only after `edge_guard.check_config` (a PayloadError for a config over the size limit or unlike
    the stored weights). `quantize` != none: the weights are held quantized (`models.edge_quant`), placeholders
    included, so the client never allocates the emulator in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    kw = {"dtype": dtype, **({"attn_implementation": attn_implementation} if attn_implementation else {})}
    stored = (directory / WEIGHTS).is_file()
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    if quantize != "none":
        return _load_quantized(directory, config, quantize, device, stored, kw), stored
    # before anything is allocated: config.json's size against the limit and the weights stored with it
    check_config(config, stored_shapes(directory / WEIGHTS) if stored else None)
    if stored:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True, **kw)
        except Exception as exc:  # a torn or foreign file: say which, never train on it
            raise CidersError(f"cannot load the edge model in {directory}: {str(exc).splitlines()[0][:200]}") from exc
        _loaded_all(directory, info)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(directory)), **kw)
    model.to(device)
    model.eval()
    return model, stored


def _loaded_all(directory: Path, info: dict) -> None:
    if info.get("missing_keys") or info.get("unexpected_keys"):
        raise CidersError(f"{directory / WEIGHTS} does not match config.json (missing "
                          f"{sorted(info['missing_keys'])[:3]}, unexpected {sorted(info['unexpected_keys'])[:3]})")


def _load_quantized(directory: Path, config: dict, mode: str, device: torch.device, stored: bool, kw: dict):
    """`load_edge` for a quantized emulator: the stored file checked against the client's own skeleton, or, before
    the first broadcast, a placeholder of zeros in the quantized layout (loaded the same way)."""
    from ciders.models import edge_quant as eq

    check_config(config)  # the size limit, before the skeleton is built
    ref, metadata = eq.reference(config, mode, kw["dtype"])
    src = directory
    with tempfile.TemporaryDirectory() as tmp:
        if stored:
            eq.check_stored(directory / WEIGHTS, ref)
        else:  # int8 zeros and zero scales: replaced in place by the first broadcast (`edge_quant.load_into`)
            src = Path(tmp)
            (src / "config.json").write_bytes((directory / "config.json").read_bytes())
            eq.save_quantized(src / WEIGHTS, {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in ref.items()},
                              metadata)
        try:
            model, info = eq.load_quantized(src, mode, **kw)
        except Exception as exc:
            raise CidersError(f"cannot load the quantized edge model in {directory}: "
                              f"{str(exc).splitlines()[0][:200]}") from exc
    _loaded_all(directory, info)
    model.to(device)
    model.eval()
    return model


def plain_names(state: dict) -> dict:
    """The emulator's base weights under plain transformers names: PEFT's `<module>.base_layer.weight` of a
    LoRA-wrapped layer is `<module>.weight` (what `from_pretrained` loads and `edge_quant` quantizes)."""
    return {k.replace(".base_layer.", "."): v for k, v in state.items()}


def save_edge_weights(d: Decomposition, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """The emulator's base weights as `model.safetensors` in plain transformers names (atomically), in `dtype`
    (the dtype they were received in: a bfloat16 download is stored as such, loaded in the model's dtype)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous()
             for k, v in plain_names(d.emulator_base_state()).items()}
    path = Path(directory) / WEIGHTS
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    return path
