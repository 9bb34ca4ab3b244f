"""`ciders plan`: the decomposition and its sizes from a model config alone (meta device, no weights).

Reproduces Table II (docs/method.md#algorithm-1-model-decomposition-modelprep): LoRA on a Linear(in, out) has
r*(in+out) parameters in 2 tensors; the consensus state c (and c_i, dc_i) has the messenger LoRA's shape, in FP32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ciders.config import LoraConfig
from ciders.errors import CidersError
from ciders.models.load import load_config
from ciders.models.split import Split, split_layers

MIB = 1024 * 1024
FP32 = 4


@dataclass(frozen=True)
class Plan:
    model: str
    model_type: str
    hidden_size: int
    n_layers: int
    messenger_layers: int
    teacher_layers: int
    student_layers: int
    student_indices: list[int]
    messenger_indices: list[int]
    lora_targets: list[str]
    messenger_lora_r: int
    student_lora_r: int
    messenger_lora_params: int
    messenger_lora_tensors: int
    student_lora_params: int
    student_lora_tensors: int
    messenger_lora_mib: float
    student_lora_mib: float
    consensus_mib: float
    edge_base_params: int
    edge_base_mib: float
    edge_base_dtype: str
    edge_base_mib_16: float  # the same in bfloat16 / float16 (federation.emulator_dtype)
    downlink_mib: dict = field(default_factory=dict)
    uplink_mib: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _lora_sizes(layers: list[nn.Module], targets: tuple[str, ...], r: int) -> tuple[int, int]:
    params = tensors = 0
    for layer in layers:
        for name, m in layer.named_modules():
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                params += r * (m.in_features + m.out_features)
                tensors += 2
    return params, tensors


def _mib(n_params: int, nbytes: int = FP32) -> float:
    return n_params * nbytes / MIB


def _meta_model(model: str) -> tuple[object, nn.Module, nn.ModuleList]:
    """The model's config, the model built from it on the meta device (no weights), and its decoder layers."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(model)
    with torch.device("meta"):
        try:
            m = AutoModelForCausalLM.from_config(cfg)
        except ValueError as exc:
            raise CidersError(f"{model}: not a causal LM config ({str(exc).splitlines()[0][:160]})") from exc
    layers = getattr(getattr(m, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise CidersError(f"{model}: {type(m).__name__} has no decoder layer list at model.model.layers")
    return cfg, m, layers


def _edge_base(cfg: object, m: nn.Module, stu: list[nn.Module], msg: list[nn.Module]) -> tuple[int, torch.dtype, int]:
    """Edge base weights (sent once): B_L + P_M layers plus embeddings / norm / head (tied counted once).
    Returns their parameter count, the checkpoint dtype and its bytes per parameter."""
    seen: set[int] = set()
    edge = 0
    for mod in stu + msg + [mod for n, mod in m.model.named_children() if n != "layers"] + [m.lm_head]:
        for p in mod.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                edge += p.numel()
    dtype = getattr(cfg, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    nbytes = torch.empty((), dtype=dtype).element_size()
    return edge, dtype, nbytes


def _traffic(msg_mib: float, stu_mib: float, upload_personalized_messenger: bool) -> tuple[dict, dict]:
    """Per client per round FP32 MiB: downlink and uplink parts, each with its total."""
    down = {"messenger": msg_mib, "consensus": msg_mib, "student_lora": stu_mib}
    down["total"] = sum(down.values())
    up = {"consensus_increment": msg_mib}
    if upload_personalized_messenger:
        up["personalized_messenger"] = msg_mib
    up["total"] = sum(up.values())
    return down, up


def make_plan(
    model: str,
    messenger_layers: int,
    *,
    beta: float | None = None,
    drop_ratio: float | None = None,
    student_layers: int | None = None,
    rounding: str = "round",
    messenger_lora: LoraConfig = LoraConfig(),
    student_lora: LoraConfig = LoraConfig(),
    upload_personalized_messenger: bool = False,
) -> Plan:
    cfg, m, layers = _meta_model(model)
    split: Split = split_layers(len(layers), messenger_layers, beta=beta, drop_ratio=drop_ratio,
                                student_layers=student_layers, rounding=rounding)
    msg = [layers[i] for i in split.messenger_indices]
    stu = [layers[i] for i in split.student_indices]
    mp, mt = _lora_sizes(msg, messenger_lora.targets, messenger_lora.r)
    sp, st = _lora_sizes(stu, student_lora.targets, student_lora.r)
    if mt == 0:
        raise CidersError(f"{model}: LoRA targets {list(messenger_lora.targets)} match no Linear in the messenger layers")
    edge, dtype, nbytes = _edge_base(cfg, m, stu, msg)
    msg_mib, stu_mib = _mib(mp), _mib(sp)
    down, up = _traffic(msg_mib, stu_mib, upload_personalized_messenger)
    return Plan(
        model=model, model_type=cfg.model_type, hidden_size=cfg.hidden_size, n_layers=split.n_layers,
        messenger_layers=split.messenger_layers, teacher_layers=split.teacher_layers,
        student_layers=split.student_layers, student_indices=list(split.student_indices),
        messenger_indices=list(split.messenger_indices), lora_targets=list(messenger_lora.targets),
        messenger_lora_r=messenger_lora.r, student_lora_r=student_lora.r,
        messenger_lora_params=mp, messenger_lora_tensors=mt, student_lora_params=sp, student_lora_tensors=st,
        messenger_lora_mib=msg_mib, student_lora_mib=stu_mib, consensus_mib=msg_mib,
        edge_base_params=edge, edge_base_mib=_mib(edge, nbytes), edge_base_dtype=str(dtype).replace("torch.", ""),
        edge_base_mib_16=_mib(edge, 2),
        downlink_mib=down, uplink_mib=up,
    )


def _ranges(idx: list[int]) -> str:
    return ", ".join(str(i) for i in idx)


def render(p: Plan) -> str:
    w = 24
    lines = [
        f"ciders plan: {p.model}  ({p.model_type}, {p.n_layers} layers, hidden {p.hidden_size})",
        f"  {'messenger P_M':<{w}}layers {p.messenger_indices[0]}..{p.messenger_indices[-1]}  ({p.messenger_layers} layers, LoRA-tuned by clients)",
        f"  {'full backbone B_F':<{w}}layers 0..{p.teacher_layers - 1}  ({p.teacher_layers} layers, frozen teacher)",
        f"  {'learnable backbone B_L':<{w}}{p.student_layers} layers of B_F at [{_ranges(p.student_indices)}]",
        f"  {'AdapEmu (edge model)':<{w}}{p.student_layers + p.messenger_layers} layers; base weights "
        f"{p.edge_base_params:,} params = {p.edge_base_mib:.1f} MiB ({p.edge_base_dtype}), sent once"
        + (f" ({p.edge_base_mib_16:.1f} MiB with federation.emulator_dtype: bfloat16)" if p.edge_base_mib != p.edge_base_mib_16 else ""),
        f"  LoRA on {', '.join(p.lora_targets)}",
        f"  {'messenger LoRA':<{w}}{p.messenger_lora_params:>12,} params  {p.messenger_lora_tensors:>4} tensors  {p.messenger_lora_mib:8.2f} MiB  (r={p.messenger_lora_r}, FP32)",
        f"  {'student LoRA':<{w}}{p.student_lora_params:>12,} params  {p.student_lora_tensors:>4} tensors  {p.student_lora_mib:8.2f} MiB  (r={p.student_lora_r}, FP32)",
        f"  {'consensus state c_i':<{w}}{p.consensus_mib:8.2f} MiB (FP32, messenger-shaped)",
        "  per client per round (FP32 MiB):",
        "    downlink  " + " + ".join(f"{k} {v:.2f}" for k, v in p.downlink_mib.items() if k != "total")
        + f" = {p.downlink_mib['total']:.2f}",
        "    uplink    " + " + ".join(f"{k} {v:.2f}" for k, v in p.uplink_mib.items() if k != "total")
        + f" = {p.uplink_mib['total']:.2f}",
    ]
    return "\n".join(lines)
