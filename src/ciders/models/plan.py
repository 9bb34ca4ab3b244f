"""`ciders plan`: the decomposition and its sizes from a model config alone (meta device, no weights).

Reproduces Table II (docs/method.md#algorithm-1-model-decomposition-modelprep): LoRA on a Linear(in, out) has
r*(in+out) parameters in 2 tensors; the consensus state c (and c_i, dc_i) has the messenger LoRA's shape, in FP32.

It also predicts the peak training memory of the two machines (`memory_plan`, README "Sizing machines"): the edge
client's during one client step (FO and exact-HVP FD) and the server's during one TAKD step, as the sum of
  weights       the frozen base weights the machine holds, each Parameter once: B_L's layers reuse B_F's
                Parameters (decompose.composite), so the server holds M* once and the client AdapEmu only;
  lora          messenger and student LoRA (FP32 even on a bfloat16 base);
  optimizer     AdamW's m and v (FP32, adapter-shaped): the messenger's on the client, the student's on the server;
  states        the step's other FP32 adapter-shaped working copies (iterate, broadcast, consensus, gradients);
  cache         the server's teacher cache B_F(x) over the public data (in memory up to cache_memory_mib);
  activations   what autograd keeps for the backward pass at the given batch and length, per layer and token
                (`_layer_bytes`), plus the LM head's chunked loss and, for the exact HVP, the double-backward graph.
`benchmarks/paper_shape.py` runs each step at paper shape and prints measured beside predicted.
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
    edge_base_mib_int8: float  # the same as int8 with a scale per row (federation.emulator_quantize)
    downlink_mib: dict = field(default_factory=dict)
    uplink_mib: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)  # `memory_plan`: predicted peak training memory, MiB

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


def _edge_base(cfg: object, m: nn.Module, stu: list[nn.Module], msg: list[nn.Module]) -> tuple[int, torch.dtype, int, int]:
    """Edge base weights (sent once): B_L + P_M layers plus embeddings / norm / head (tied counted once).
    Returns their parameter count, the checkpoint dtype, its bytes per parameter and the bytes of the same weights
    under federation.emulator_quantize: int8 (models.edge_quant: a matrix as int8 plus, per row, a scale in the
    checkpoint dtype and an int8 zero point; vectors as they are)."""
    dtype = getattr(cfg, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    nbytes = torch.empty((), dtype=dtype).element_size()
    seen: set[int] = set()
    edge = int8 = 0
    for mod in stu + msg + [mod for n, mod in m.model.named_children() if n != "layers"] + [m.lm_head]:
        for p in mod.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                edge += p.numel()
                int8 += p.numel() + p.shape[0] * (nbytes + 1) if p.dim() == 2 else p.numel() * nbytes
    return edge, dtype, nbytes, int8


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
    workload: Workload | None = None,
) -> Plan:
    """The split, the adapter and payload sizes and, at `workload` (default: `Workload()`), the peak memory."""
    cfg, m, layers = _meta_model(model)
    split: Split = split_layers(len(layers), messenger_layers, beta=beta, drop_ratio=drop_ratio,
                                student_layers=student_layers, rounding=rounding)
    msg = [layers[i] for i in split.messenger_indices]
    stu = [layers[i] for i in split.student_indices]
    mp, mt = _lora_sizes(msg, messenger_lora.targets, messenger_lora.r)
    sp, st = _lora_sizes(stu, student_lora.targets, student_lora.r)
    if mt == 0:
        raise CidersError(f"{model}: LoRA targets {list(messenger_lora.targets)} match no Linear in the messenger layers")
    edge, dtype, nbytes, int8 = _edge_base(cfg, m, stu, msg)
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
        edge_base_mib_16=_mib(edge, 2), edge_base_mib_int8=int8 / 2**20,
        downlink_mib=down, uplink_mib=up,
        memory=memory_plan(cfg, m, split, edge, mp, sp, workload or Workload()),
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
        + (f" ({p.edge_base_mib_16:.1f} MiB with federation.emulator_dtype: bfloat16)" if p.edge_base_mib != p.edge_base_mib_16 else "")
        + f" ({p.edge_base_mib_int8:.1f} MiB with federation.emulator_quantize: int8)",
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
    return "\n".join(lines + _render_memory(p.memory))


def _render_memory(mem: dict) -> list[str]:
    if not mem:
        return []
    w = mem["workload"]
    rows = [("edge client, FO step", mem["client"]["fo"]), ("edge client, FD step", mem["client"]["fd"]),
            ("server, TAKD step", mem["server"])]
    lines = [f"  peak training memory ({mem['dtype']} base; client batch {w['batch_size']} x {w['seq_len']}, TAKD batch "
             f"{w['takd_batch_size']}, {w['public_examples']} public examples cached), MiB:"]
    for label, terms in rows:
        parts = " + ".join(f"{k} {v:.0f}" for k, v in terms.items() if k != "total")
        lines.append(f"    {label:<22}{terms['total']:9.0f}  = {parts}")
    return lines


# ------------------------------------------------------------------------------------------ peak training memory

ADAMW_STATES = 2  # AdamW's m and v, FP32, adapter-shaped (core.optim.adamw_init), on the client and in TAKD
# Other FP32 messenger-shaped states alive while a client step's activations are held (algorithms/ciders.py):
# the broadcast w, c, c_i, the correction gamma (c - c_i), the iterate x, and inside the meta-step the first
# gradient, the look-ahead point x~ and the gradient there. FD adds the Hessian-vector product and the step's
# running sums of v and eta Hv.
CLIENT_STEP_STATES = {"fo": 8, "fd": 11}
# Other FP32 student-shaped states alive during a TAKD backward pass (models/distill.py): the student copy the
# optimizer updates and the gradients being accumulated.
TAKD_STATES = 2
# The exact HVP keeps the forward's saved tensors, the first backward's graph (create_graph: about twice as much
# again, each backward op saving its inputs and the forward's) until the double backward runs.
DOUBLE_BACKWARD = 3
CE_CHUNK_ELEMENTS = 2**24  # eval.chunked.CHUNK_ELEMENTS: logits per chunk of the chunked cross-entropy


@dataclass(frozen=True)
class Workload:
    """The sizes a memory prediction is made at (the defaults are the paper's Protocol A)."""

    dtype: str | None = None  # the base weights' dtype; None = the checkpoint's (config.json's torch_dtype)
    batch_size: int = 2  # client micro-batch (algorithm.batch_size)
    seq_len: int = 512  # tokens per example (data.max_length)
    response_len: int | None = None  # response tokens per example (the loss's positions); None = seq_len / 2
    takd_batch_size: int = 4  # takd.batch_size
    public_examples: int = 500  # data.public_size: examples in the teacher cache
    public_len: int | None = None  # mean tokens per public example; None = seq_len
    cache_memory_mib: float = 2048.0  # takd.cache_memory_mib: a larger teacher cache goes to disk


@dataclass(frozen=True)
class _Shapes:
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, cfg: object) -> "_Shapes":
        from ciders.models.load import attention_shape

        heads, kv, hd = attention_shape(cfg)
        return cls(cfg.hidden_size, cfg.intermediate_size, heads, kv, hd, cfg.vocab_size)


def _layer_bytes(s: _Shapes, b: int, *, lora_trains: bool, dropout: bool, math_len: int | None = None) -> float:
    """Bytes one decoder layer keeps for backward per token, in a forward that autograd records (base weights frozen).
    b: the base dtype's bytes. lora_trains: its LoRA's A matrices need weight gradients, so each LoRA keeps its
    input, in FP32 (PEFT casts activations to the adapter's dtype), plus a 1-byte dropout mask when dropout is on.
    math_len: attention on the math kernel (the exact HVP), which keeps the [heads, T, T] scores and probabilities."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    norms = 2 * 4 * h  # Qwen2 / Llama RMSNorm keep their FP32 input, two norms a layer
    attn = (2 * q + 2 * kv) * b + 4 * s.heads  # rotated q and k, v, the output, FP32 log-sum-exp (fused SDPA)
    if math_len is not None:
        attn += 2 * s.heads * math_len * b + 2 * q * b  # scores, probabilities; k and v repeated to all heads
    mlp = 3 * s.inter * b  # SiLU's input and output, and up_proj's output for the product
    lora_inputs = (3 * h + q + 2 * h + s.inter) if lora_trains else 0  # q k v | o | gate up | down
    lora = lora_inputs * (4 + (1 if dropout else 0))
    return norms + attn + mlp + lora


def _head_chunk_bytes(s: _Shapes, rows: int, buffers: int, b: int) -> float:
    """The chunked loss's largest transient (eval.chunked): `buffers` FP32 [rows, V] buffers of one chunk and, on a
    16-bit base, the chunk's logits and gradient in the base dtype besides."""
    per_chunk = min(rows, max(1, CE_CHUNK_ELEMENTS // s.vocab))
    per_logit = buffers * 4 + (2 * b if b < 4 else 0)
    return per_logit * per_chunk * s.vocab


def _client_activations(s: _Shapes, split: Split, b: int, w: Workload, kind: str) -> float:
    """A client step's peak activation bytes: B_L(x) [B, T, H] kept for the round, then the messenger layers' saved
    tensors (LoRA trains, dropout on) and the head. FD (exact HVP): the first gradient's backward is recorded too
    (create_graph, `DOUBLE_BACKWARD`), on math attention, through the full-vocabulary logits at the response
    positions."""
    tokens = w.batch_size * w.seq_len
    resp = w.batch_size * (w.response_len if w.response_len is not None else w.seq_len // 2)
    hidden = tokens * s.hidden * b
    if kind == "fo":
        layers = split.messenger_layers * _layer_bytes(s, b, lora_trains=True, dropout=True) * tokens
        return hidden + layers + 4 * tokens * s.hidden + _head_chunk_bytes(s, resp, 2, b)
    per = _layer_bytes(s, b, lora_trains=True, dropout=True, math_len=w.seq_len)
    layers = DOUBLE_BACKWARD * split.messenger_layers * per * tokens
    logits = resp * s.vocab * (b + 2 * 4)  # the logits, and two FP32 [P, V] tensors of the recorded backward
    return hidden + layers + 2 * 4 * tokens * s.hidden + logits


def _takd_activations(s: _Shapes, split: Split, b: int, w: Workload) -> float:
    """A TAKD step's peak activation bytes: the teacher batch from the cache, the teacher's final hidden states
    (no grad), AdapEmu's forward with B_L's LoRA training (dropout on) and the messenger's layers passing the
    gradient through (frozen LoRA, eval mode), and the fused KL + CE over every position (four [rows, V] buffers)."""
    tokens = w.takd_batch_size * w.seq_len
    student = split.student_layers * _layer_bytes(s, b, lora_trains=True, dropout=True)
    messenger = split.messenger_layers * _layer_bytes(s, b, lora_trains=False, dropout=False)
    teacher = 2 * tokens * s.hidden * b  # B_F(x) from the cache and the teacher's final hidden states
    final = 2 * 4 * s.hidden  # the final norm's FP32 input and the gradient in the final hidden states
    return teacher + (student + messenger + final) * tokens + _head_chunk_bytes(s, tokens, 4, b)


def _unique_params(modules: list[nn.Module]) -> int:
    """Parameters of `modules`, each Parameter once (a tied head is the embedding)."""
    seen: dict[int, int] = {}
    for mod in modules:
        for p in mod.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def _dtype_bytes(name: str | None, checkpoint: torch.dtype) -> tuple[str, int]:
    dt = checkpoint if name is None else getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CidersError(f"unknown dtype {name!r} (float32, bfloat16, float16)")
    return str(dt).replace("torch.", ""), torch.empty((), dtype=dt).element_size()


def _with_total(terms: dict[str, float]) -> dict[str, float]:
    return {**terms, "total": sum(terms.values())}


def client_memory(s: _Shapes, split: Split, edge_params: int, msg_params: int, stu_params: int, b: int,
                  w: Workload) -> dict[str, dict[str, float]]:
    """Bytes an edge client holds at the peak of one FO and one FD (exact HVP) step, term by term."""
    out = {}
    for kind in ("fo", "fd"):
        out[kind] = _with_total({
            "weights": edge_params * b,  # AdapEmu's frozen base: embeddings, B_L and messenger layers, norm, head
            "lora": (msg_params + stu_params) * FP32,  # the client runs B_L with the student LoRA it was sent
            "optimizer": ADAMW_STATES * msg_params * FP32,
            "states": CLIENT_STEP_STATES[kind] * msg_params * FP32,
            "activations": _client_activations(s, split, b, w, kind),
        })
    return out


def server_memory(s: _Shapes, split: Split, model_params: int, msg_params: int, stu_params: int, b: int,
                  w: Workload) -> dict[str, float]:
    """Bytes the server holds at the peak of one TAKD step, term by term. `model_params` counts M* once: B_L's layers
    are B_F's Parameters, so they add only their LoRA."""
    public_len = w.public_len if w.public_len is not None else w.seq_len
    cache = w.public_examples * public_len * s.hidden * b
    return _with_total({
        "weights": model_params * b,
        "lora": (msg_params + stu_params) * FP32,
        "optimizer": ADAMW_STATES * stu_params * FP32,
        "states": TAKD_STATES * stu_params * FP32,
        "teacher_cache": cache if cache <= w.cache_memory_mib * MIB else 0.0,  # above it, on disk (memory-mapped)
        "activations": _takd_activations(s, split, b, w),
    })


def memory_plan(cfg: object, m: nn.Module, split: Split, edge: int, msg_params: int, stu_params: int,
                w: Workload) -> dict:
    """Predicted peak training memory in MiB (module docstring) of the (meta) model `m`: `client` {fo, fd} and
    `server` term by term, with the workload it was evaluated at. `edge`: AdapEmu's base parameters."""
    dtype, b = _dtype_bytes(w.dtype, getattr(cfg, "dtype", None) or torch.float32)
    s = _Shapes.of(cfg)

    def mib(terms: dict) -> dict:
        return {k: v / MIB for k, v in terms.items()}

    client = client_memory(s, split, edge, msg_params, stu_params, b, w)
    server = server_memory(s, split, _unique_params([m]), msg_params, stu_params, b, w)
    return {"dtype": dtype, "workload": {**asdict(w), "dtype": dtype},
            "client": {k: mib(v) for k, v in client.items()}, "server": mib(server)}
