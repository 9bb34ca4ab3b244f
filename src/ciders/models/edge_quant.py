"""A quantized emulator for edge clients (`federation.emulator_quantize`; docs/edge.md#a-quantized-emulator).

With `int8`, the emulator's frozen base weights are sent, stored and held as int8 with one scale per output row
(torchao's weight-only int8 tensors; the client trains the messenger's LoRA on top, QLoRA style):

  every 2-D Linear weight W [out, in]   Int8Tensor: qdata int8 [out, in], scale [out, 1], zero_point int8 [out, 1]
                                         (symmetric: the zero point is 0 and W ~ qdata * scale, rounded per row)
  the embedding table E [V, H]           IntxUnpackedToInt8Tensor: qdata int8 [V, H], scale [V, 1], zero_point [V, 1]
                                         (a tied head reads the same table)
  norms (1-D)                            as they are, in the model's dtype

On the wire and on the client's disk the quantized tensors are flattened into plain tensors (torchao's safetensors
layout: `<module>._weight_qdata`, `_weight_scale`, `_weight_zero_point`), so the broadcast codec and its checks are
the same as for plain weights. What the client checks them against and the torchao metadata it stores with them
come from its own skeleton (the spec's config.json quantized on the meta device), never from the server; it loads
them with `from_pretrained` (memory-mapped), a config carrying the quantization config it built itself.

Only what a client receives and holds changes: the server's AdapEmu, B_L and TAKD stay in the run's dtype.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ciders.errors import CidersError, PayloadError

_EMBED, _LINEAR = "model.embed_tokens", "re:.+"


def _torchao():
    """torchao's quantization API (its import-time notices are dropped by `ciders._quiet`)."""
    try:
        import torchao.quantization as q
    except ImportError as exc:  # pragma: no cover - a pinned requirement
        raise CidersError("federation.emulator_quantize needs torchao: pip install torchao==0.18.0 "
                          "(requirements.txt)") from exc
    return q


def ao_config(mode: str):
    """transformers' TorchAoConfig for `mode`: int8 per output row for Linear weights, int8 per row of the
    embedding table (which a tied head shares)."""
    q = _torchao()
    from torchao.quantization.granularity import PerAxis
    from transformers import TorchAoConfig

    if mode != "int8":
        raise ValueError(f"no quantization config for {mode!r} (int8 only)")
    embed = q.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    # the embedding first (fqns are tried in order), then every other module ("_default" is deprecated)
    return TorchAoConfig(q.FqnToConfig({_EMBED: embed, _LINEAR: q.Int8WeightOnlyConfig()}),
                         include_input_output_embeddings=True)


def _quantize(model: torch.nn.Module, mode: str) -> None:
    """torchao's `quantize_` with `ao_config(mode)`'s two configs (the head is the embedding's when tied)."""
    q = _torchao()
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    cfg = ao_config(mode).quant_type.fqn_to_config
    q.quantize_(model, cfg[_LINEAR],
                filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and not (tied and fqn == "lm_head"))
    q.quantize_(model, cfg[_EMBED], filter_fn=lambda m, fqn: fqn == _EMBED)


def _skeleton(config: dict, dtype: torch.dtype):
    _torchao()  # before transformers' torchao integration imports it
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    conf = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    with torch.device("meta"):  # shapes only
        return AutoModelForCausalLM.from_config(conf, dtype=dtype)


def _flat(model: torch.nn.Module, names: list[str]) -> tuple[dict, dict]:
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    params = dict(model.named_parameters(remove_duplicate=False))
    return flatten_tensor_state_dict({n: params[n].data for n in names})


def is_quantized(t: torch.Tensor) -> bool:
    """Whether `t` is a torchao quantized tensor (it has inner tensors: qdata, scale, ...)."""
    return getattr(t, "tensor_data_names", None) is not None


def reference(config: dict, mode: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What a quantized download of `config`'s model holds (name -> meta tensor: shape and dtype), and the torchao
    metadata the client stores with it: both from the model built on the meta device, nothing received. Built
    once per (config, mode, dtype) in a process (load_edge and the client's download check both need it); the
    caller does not modify what it returns."""
    return _reference(json.dumps(config, sort_keys=True), mode, dtype)


@functools.lru_cache(maxsize=4)
def _reference(config_json: str, mode: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    model = _skeleton(json.loads(config_json), dtype)
    names = [n for n, _ in model.named_parameters()]  # tied weights once: the emulator's own names
    _quantize(model, mode)
    return _flat(model, names)


def quantize_state(config: dict, state: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """The server side: the emulator's plain base weights (transformers names, `reference`'s dtype) quantized and
    flattened: the tensors a client's first download carries. The plain tensors are not copied."""
    dtype = next(iter(state.values())).dtype
    model = _skeleton(config, dtype)
    names = [n for n, _ in model.named_parameters()]
    if sorted(names) != sorted(state):
        raise ValueError(f"the emulator's weights do not match its config ({len(state)} vs {len(names)} tensors)")
    model.load_state_dict(state, strict=False, assign=True)
    _quantize(model, mode)
    flat, _ = _flat(model, names)
    return {k: v.contiguous() for k, v in flat.items()}


def check_stored(path: str | Path, ref: dict[str, torch.Tensor]) -> None:
    """A stored quantized file holds exactly `reference`'s tensors (names and shapes, from its header)."""
    from ciders.models.edge_guard import stored_shapes

    got, want = stored_shapes(path), {k: tuple(v.shape) for k, v in ref.items()}
    if got != want:
        odd = sorted(got.keys() ^ want.keys())[:3] or [k for k in want if got[k] != want[k]][:3]
        raise PayloadError(f"{path} does not hold the quantized emulator its config implies (first differences: {odd})")


def save_quantized(path: str | Path, flat: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """The received tensors as the client's model.safetensors (atomically), with the client's own metadata."""
    from safetensors.torch import save_file

    from ciders.fileio import atomic_path

    path = Path(path)
    with atomic_path(path) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in flat.items()}, str(tmp), metadata=metadata)
    return path


def load_quantized(directory: str | Path, mode: str, dtype: torch.dtype, **kw):
    """AdapEmu's quantized base from the client's directory (`from_pretrained`, memory-mapped), with the
    quantization config built here (the spec's config.json carries none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _torchao()
    conf = AutoConfig.from_pretrained(str(directory))
    conf.quantization_config = ao_config(mode).to_dict()
    return AutoModelForCausalLM.from_pretrained(str(directory), config=conf, dtype=dtype, output_loading_info=True,
                                                **kw)


def load_into(params: dict[str, torch.nn.Parameter], flat: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Copy a checked download (`reference`'s layout) into the held quantized weights in place: `params` maps
    transformers names to the model's parameters (an edge model's frozen base)."""
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    new, left = unflatten_tensor_state_dict(dict(flat), metadata)
    if left or new.keys() != params.keys():
        raise PayloadError(f"the quantized emulator does not match this model ({len(new)} vs {len(params)} "
                           f"weights, {len(left)} tensors left over)")
    with torch.no_grad():
        for k, p in params.items():
            if not is_quantized(p):
                p.copy_(new[k])
            else:  # a torchao tensor: its inner tensors (qdata, scale, zero_point)
                for n in p.tensor_data_names:
                    getattr(p, n).copy_(getattr(new[k], n))


def dequantize_(model: torch.nn.Module) -> torch.nn.Module:
    """Every quantized weight of `model` replaced by its dequantized value as a plain frozen Parameter (a tied head
    kept tied): the int8-rounded weights the client trained on, in a form every exporter reads. In place; returns
    `model`."""
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if is_quantized(p):
                setattr(module, name, torch.nn.Parameter(p.dequantize(), requires_grad=False))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    # and transformers' record of the quantized load, so that save_pretrained writes a plain model
    for holder, attr in ((model.config, "quantization_config"), (model, "_weight_conversions")):
        if hasattr(holder, attr):
            delattr(holder, attr)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    return model
