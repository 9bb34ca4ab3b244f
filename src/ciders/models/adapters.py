"""PEFT LoRA adapters for the messenger and the learnable backbone
(docs/method.md#algorithm-1-model-decomposition-modelprep).

An adapter's state is a flat, named tensor dict: the unit that algorithms, checkpoints and the wire
use. Keys are the module path without the adapter name, e.g.
`model.layers.28.self_attn.q_proj.lora_A.weight`; the messenger uses the ORIGINAL model's layer
indices (so a saved messenger loads onto the full model with `peft.PeftModel.from_pretrained`), the
student uses AdapEmu's indices 0..n'-1. On disk an adapter is a standard PEFT directory
(`adapter_config.json` + `adapter_model.safetensors`, keys prefixed `base_model.model.`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from ciders.config import DEFAULT_LORA_TARGETS, LoraConfig
from ciders.core.tensors import State
from ciders.errors import CidersError
from ciders.fileio import atomic_dir

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
META_FILE = "ciders_adapter.json"


def target_regex(layer_indices: Iterable[int], targets: Iterable[str], layers_path: str = "model.layers") -> str:
    """A PEFT `target_modules` regex (matched with re.fullmatch) for `targets` inside the given layers."""
    idx = "|".join(str(i) for i in sorted(set(layer_indices)))
    mods = "|".join(re.escape(t) for t in targets)
    return rf"{re.escape(layers_path)}\.({idx})\.(?:.*\.)?({mods})"


def linear_names(layer: nn.Module) -> list[str]:
    """The last path component of every nn.Linear inside a decoder layer, in module order."""
    return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if isinstance(m, nn.Linear)))


def resolve_targets(layer: nn.Module, cfg: LoraConfig) -> LoraConfig:
    """`cfg` with its targets as module names that exist in `layer` (docs/method.md#lora-targets-on-other-architectures).
    `all-linear`, or the default list on a layer that lacks some of its names (fused projections such as Phi-3's
    qkv_proj / gate_up_proj): every linear module of the layer, which is what the
    default means on Llama-style layers. A list the user chose must match fully."""
    from dataclasses import replace

    have = linear_names(layer)
    want = list(cfg.targets)
    if want == ["all-linear"] or (tuple(want) == DEFAULT_LORA_TARGETS and not set(want) <= set(have)):
        if not have:
            raise CidersError(f"{type(layer).__name__} has no linear modules for LoRA")
        return replace(cfg, targets=tuple(have))
    missing = [t for t in want if t not in have]
    if missing:
        raise CidersError(f"LoRA targets {missing} not found in {type(layer).__name__} (its linear modules: "
                          f"{', '.join(have)}); set lora.*.targets to some of them, or to [all-linear]")
    return cfg


def peft_lora_config(cfg: LoraConfig, layer_indices: Iterable[int], base_model: str | None = None):
    import peft

    return peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_regex(layer_indices, cfg.targets),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def inject_lora(model: nn.Module, cfg: LoraConfig, layer_indices: Iterable[int], adapter: str, seed: int) -> None:
    """Inject a LoRA adapter named `adapter` into `targets` of the given decoder layers, in place.
    LoRA A is initialised from `seed` (B starts at zero, so the model's function is unchanged)."""
    import peft

    layer_indices = list(layer_indices)
    pcfg = peft_lora_config(cfg, layer_indices)
    with torch.random.fork_rng(devices=_devices(model)):
        torch.manual_seed(seed)
        try:
            peft.inject_adapter_in_model(pcfg, model, adapter_name=adapter)
        except ValueError as exc:
            layer = model.model.layers[layer_indices[0]]
            names = sorted({n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if isinstance(m, nn.Linear)})
            raise CidersError(
                f"LoRA targets {list(cfg.targets)} not found in decoder layer {layer_indices[0]} "
                f"(its linear modules: {', '.join(names)}); set lora.*.targets accordingly"
            ) from exc
    # LoRA (and so the consensus state built from it) is FP32 even on a bf16/fp16 base, as PEFT's
    # get_peft_model(autocast_adapter_dtype=True) does; PEFT casts activations to the adapter dtype.
    for p in adapter_params(model, adapter).values():
        if p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
    restore_active_adapters(model)


def restore_active_adapters(model: nn.Module) -> None:
    """PEFT activates only the most recently injected adapter on EVERY LoRA layer of the model it is
    given, which silently disables the other adapter (our messenger layers carry 'messenger', the
    student layers 'student'). Each LoRA layer here holds exactly its own adapters: activate them."""
    from peft.tuners.lora import LoraLayer

    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.set_adapter(list(m.lora_A.keys()))


def _devices(model: nn.Module) -> list:
    return sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})


def adapter_params(model: nn.Module, adapter: str) -> dict[str, nn.Parameter]:
    """Canonical key -> Parameter for one adapter, in module order."""
    tag = f".{adapter}."
    out: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():
        if tag in name and (".lora_A." in name or ".lora_B." in name):
            out[name.replace(tag, ".", 1)] = p
    return out


def get_state(params: Mapping[str, nn.Parameter]) -> State:
    """A detached copy (values, not views) of the parameters."""
    return {k: p.detach().clone() for k, p in params.items()}


def check_state(params: Mapping[str, nn.Parameter], state: Mapping[str, torch.Tensor], what: str) -> None:
    """Exact key set and shapes, finite values; otherwise a CidersError that names the first problem."""
    missing = [k for k in params if k not in state]
    extra = [k for k in state if k not in params]
    if missing or extra:
        detail = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise CidersError(
            f"{what}: adapter state does not match this model ({len(missing)} missing, {len(extra)} unexpected keys; "
            f"{detail}); was it saved for another model, messenger depth or LoRA config?"
        )
    for k, p in params.items():
        t = state[k]
        if not isinstance(t, torch.Tensor):
            raise CidersError(f"{what}: {k!r} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != tuple(p.shape):
            raise CidersError(f"{what}: {k!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if not torch.is_floating_point(t):
            raise CidersError(f"{what}: {k!r} has dtype {t.dtype}, expected a floating point tensor")
        if not torch.isfinite(t).all():
            raise CidersError(f"{what}: {k!r} contains NaN or Inf")


def set_state(params: Mapping[str, nn.Parameter], state: Mapping[str, torch.Tensor], what: str = "adapter") -> None:
    """Copy `state` into the parameters; validated first, so a bad state changes nothing."""
    check_state(params, state, what)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(state[k].to(device=p.device, dtype=p.dtype))


def save_adapter(
    path: str | Path,
    state: Mapping[str, torch.Tensor],
    cfg: LoraConfig,
    layer_indices: Iterable[int],
    base_model: str | None,
    meta: dict | None = None,
    readme: str | None = None,
) -> Path:
    """Write a standard PEFT adapter directory atomically (replacing any previous one); `readme`: its README.md
    (which layers of which model it targets)."""
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_dir(path) as tmp:
        tensors = {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        peft_lora_config(cfg, layer_indices, base_model).save_pretrained(str(tmp))
        (tmp / META_FILE).write_text(json.dumps(meta or {}, indent=2) + "\n", encoding="utf-8")
        if readme:
            (tmp / "README.md").write_text(readme, encoding="utf-8")
    return path


def load_adapter(path: str | Path) -> tuple[State, dict]:
    """Read a PEFT adapter directory: (state with canonical keys, ciders metadata or {})."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    f = path / ADAPTER_FILE
    if not f.is_file():
        raise CidersError(f"{path}: no {ADAPTER_FILE}; expected a PEFT adapter directory")
    try:
        raw = load_file(str(f))
    except (SafetensorError, OSError) as exc:
        raise CidersError(f"{f}: unreadable adapter file ({exc})") from exc
    state = {}
    for k, v in raw.items():
        if not k.startswith(PEFT_PREFIX):
            raise CidersError(f"{f}: key {k!r} lacks the PEFT prefix {PEFT_PREFIX!r}")
        state[k[len(PEFT_PREFIX):]] = v
    meta_file = path / META_FILE
    meta = json.loads(meta_file.read_text(encoding="utf-8")) if meta_file.is_file() else {}
    return state, meta


def count_params(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in state.values())
