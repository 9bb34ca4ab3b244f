"""Task-aware knowledge distillation, TAKD (Eq. 2), on the server's public data
(docs/method.md#eq-2-task-aware-knowledge-distillation-takd).

  L_KD(w_BL; w_PM) = E[ H(B_L(x), B_F(x)) + lambda * KL(M*(x) || M(x)) + lambda_task * CE(M(x), y) ]

B_L(x), B_F(x): hidden states at the messenger input; M = P_M o B_L (AdapEmu), M* = P_M o B_F (AdapFu),
both with the current global messenger held fixed. H is the hidden-state term (`hidden_loss`):
  mean        sum_t m_t ||h_L - h_F||^2 / (H * sum_t m_t)   (MSE; Eq. 2 divided by the hidden size)
  sum         sum_t m_t ||h_L - h_F||^2 / sum_t m_t          (Eq. 2 literally)
  teacher_rms sum_t m_t ||h_L - h_F||^2 / sum_t m_t ||h_F||^2 (FedBiOT's normalised MSE)
KL is forward KL over the vocabulary per position, teacher first, averaged over the same mask m
(`kd_tokens`: all attended tokens, or response tokens only). CE is next-token CE on response tokens.

B_F(x) does not depend on anything that trains, so it is computed once per public example
(`TeacherCache`) and M*(x) is then recomputed each step from it through the messenger alone
(`Decomposition.messenger_top`), skipping the n-a backbone layers.

The KL and CE terms need both models' logits at every position (KL over all tokens is the default). With plain
heads they are taken from the final hidden states in chunks (`eval.chunked.linear_kl_ce`), each chunk's
gradient formed while its logits exist, so no [B, T, V] tensor is held (`takd_loss(fused=...)`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ciders.config import TAKDConfig
from ciders.core import optim
from ciders.errors import CidersError
from ciders.eval.chunked import linear_kl_ce, plain_head
from ciders.eval.metrics import token_nll
from ciders.fileio import atomic_dir
from ciders.models.adapters import State
from ciders.models.decompose import Decomposition
from ciders.runtime import derive_seed
from ciders.tasks.text import IGNORE, collate, length_order
from ciders.phases import phase


# ------------------------------------------------------------------------------------------ loss terms


def takd_terms(
    h_student: torch.Tensor,
    h_teacher: torch.Tensor,
    student_logits: torch.Tensor | None,
    teacher_logits: torch.Tensor | None,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    cfg: TAKDConfig,
) -> dict[str, torch.Tensor]:
    """The three Eq. 2 terms and their weighted sum. Shapes: h_* [B, T, H], logits [B, T, V],
    attention_mask / labels [B, T]. Any term whose weight is 0 may be given None inputs."""
    mf = kd_mask(attention_mask, labels, cfg)
    hidden = hidden_term(h_student, h_teacher, mf, cfg)
    denom = mf.sum().clamp_min(1.0)
    zero = hidden.new_zeros(())
    kl = zero
    if cfg.lambda_out > 0:
        log_p = F.log_softmax(teacher_logits.float(), dim=-1)
        log_q = F.log_softmax(student_logits.float(), dim=-1)
        per_pos = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # [B, T]
        kl = (per_pos * mf).sum() / denom
    ce = zero
    if cfg.lambda_task > 0:
        nll, n = token_nll(student_logits, labels)
        ce = nll / max(n, 1)
    loss = hidden + cfg.lambda_out * kl + cfg.lambda_task * ce
    return {"loss": loss, "hidden": hidden, "kl": kl, "ce": ce}


def kd_mask(attention_mask: torch.Tensor, labels: torch.Tensor, cfg: TAKDConfig) -> torch.Tensor:
    """m [B, T] as float: the tokens the hidden and KL terms average over (`kd_tokens`)."""
    return ((labels != IGNORE) if cfg.kd_tokens == "response" else attention_mask.bool()).float()


def hidden_term(h_student: torch.Tensor, h_teacher: torch.Tensor, mf: torch.Tensor, cfg: TAKDConfig) -> torch.Tensor:
    """H(B_L(x), B_F(x)) of Eq. 2 in the `hidden_loss` form (module docstring); h_* [B, T, H], mf = `kd_mask`."""
    denom = mf.sum().clamp_min(1.0)
    sq = ((h_student.float() - h_teacher.float()) ** 2).sum(-1)  # [B, T]
    if cfg.hidden_loss == "sum":
        return (sq * mf).sum() / denom
    if cfg.hidden_loss == "mean":
        return (sq * mf).sum() / (denom * h_teacher.size(-1))
    ref = ((h_teacher.float() ** 2).sum(-1) * mf).sum().clamp_min(1e-12)  # teacher_rms
    return (sq * mf).sum() / ref


def teacher_forward(d: Decomposition, batch: dict, need_logits: bool,
                    h_teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """B_F(x) and M*(x). With `h_teacher` (from the cache) only the messenger runs."""
    k = d.split.teacher_layers
    with torch.no_grad():
        if h_teacher is None:
            if not need_logits:
                out = d.base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   output_hidden_states=[k])
                return out.hidden_states[k], None
            out = d.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         output_hidden_states=[k])
            return out.hidden_states[k], out.logits
        if not need_logits:
            return h_teacher, None
        logits = d.messenger_top(inputs_embeds=h_teacher.to(d.base.dtype), attention_mask=batch["attention_mask"]).logits
        return h_teacher, logits


def takd_loss(d: Decomposition, batch: dict, cfg: TAKDConfig, h_teacher: torch.Tensor | None = None,
              fused: bool | None = None) -> dict[str, torch.Tensor]:
    """Eq. 2 on one batch with the messenger currently loaded in `d`; differentiable in B_L's LoRA.

    fused (default: whenever both heads are plain, `eval.chunked.plain_head`): the KL and CE terms come from the
    final hidden states chunk by chunk (`eval.chunked.linear_kl_ce`), so neither model's [B, T, V] logits nor their
    softmaxes are held; otherwise from the logits (`takd_terms`). The same terms to float tolerance."""
    teacher = d.messenger_top if h_teacher is not None else d.base
    head = cfg.lambda_out > 0 or cfg.lambda_task > 0
    if fused is None:
        fused = plain_head(d.adapemu) and plain_head(teacher)
    if not (fused and head):
        h_f, t_logits = teacher_forward(d, batch, cfg.lambda_out > 0, h_teacher)
        n_s = d.split.student_layers
        out = d.adapemu(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_hidden_states=[n_s], use_cache=False)
        return takd_terms(out.hidden_states[n_s], h_f, out.logits, t_logits,
                          batch["attention_mask"], batch["labels"], cfg)
    return _fused_takd_loss(d, teacher, batch, cfg, h_teacher)


def _fused_takd_loss(d: Decomposition, teacher, batch: dict, cfg: TAKDConfig,
                     h_teacher: torch.Tensor | None) -> dict[str, torch.Tensor]:
    mask, labels = batch["attention_mask"], batch["labels"]
    k, n_s = d.split.teacher_layers, d.split.student_layers
    with torch.no_grad():  # B_F(x) and the teacher's final hidden states (only the KL term reads the latter)
        if h_teacher is None:
            t_out = d.base.model(input_ids=batch["input_ids"], attention_mask=mask, output_hidden_states=[k])
            h_f, t_final = t_out.hidden_states[k], t_out.last_hidden_state
        else:
            h_f = h_teacher
            t_final = (d.messenger_top.model(inputs_embeds=h_teacher.to(d.base.dtype), attention_mask=mask)
                       .last_hidden_state if cfg.lambda_out > 0 else None)
    out = d.adapemu.model(input_ids=batch["input_ids"], attention_mask=mask, output_hidden_states=[n_s],
                          use_cache=False)
    mf = kd_mask(mask, labels, cfg)
    hidden = hidden_term(out.hidden_states[n_s], h_f, mf, cfg)
    kl_w = cfg.lambda_out * mf / mf.sum().clamp_min(1.0)  # [B, T]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], 1)  # position t predicts t + 1
    valid = (targets != IGNORE).float()
    ce_w = cfg.lambda_task * valid / valid.sum().clamp_min(1.0)
    hs = out.last_hidden_state
    H = hs.size(-1)
    ht = t_final if t_final is not None else hs
    kl_w, ce_w = kl_w.reshape(-1), ce_w.reshape(-1)
    rows = ((kl_w > 0) | (ce_w > 0)).nonzero().squeeze(1)  # the heads run only where a term reads them
    both, kl, ce = linear_kl_ce(hs.reshape(-1, H)[rows], ht.reshape(-1, H)[rows], d.adapemu.lm_head.weight,
                                teacher.lm_head.weight, targets.reshape(-1)[rows], kl_w[rows], ce_w[rows])
    zero = hidden.new_zeros(())
    kl = kl / cfg.lambda_out if cfg.lambda_out > 0 else zero
    ce = ce / cfg.lambda_task if cfg.lambda_task > 0 else zero
    return {"loss": hidden + both, "hidden": hidden, "kl": kl, "ce": ce}


# ------------------------------------------------------------------------------------------ teacher cache


class TeacherCache:
    """B_F(x) per public example ([len_i, H], model dtype), in host memory or in safetensors files
    on disk (memory-mapped on read). Built once; `gather(indices)` pads to a batch."""

    CHUNK = 256

    def __init__(self, hidden: list[torch.Tensor] | None, files: list[Path] | None, lengths: list[int], hidden_size: int):
        self._hidden, self._files, self.lengths, self.hidden_size = hidden, files, lengths, hidden_size

    @property
    def storage(self) -> str:
        return "memory" if self._hidden is not None else "disk"

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    @phase("teacher cache")
    def build(cls, d: Decomposition, features: Sequence[dict], pad_id: int, batch_size: int = 8,
              mode: str = "auto", directory: str | Path | None = None, memory_limit_mib: float = 2048.0,
              progress: Callable[[int, int], None] | None = None) -> "TeacherCache":
        hs = d.base.config.hidden_size
        itemsize = torch.empty((), dtype=d.base.dtype).element_size()
        lengths = [len(f["input_ids"]) for f in features]
        mib = sum(lengths) * hs * itemsize / 2**20
        if mode == "auto":
            mode = "memory" if mib <= memory_limit_mib or directory is None else "disk"
        if mode == "disk" and directory is None:
            raise CidersError("takd.teacher_cache=disk needs a directory (the run directory provides one)")
        slots: list[torch.Tensor | None] = [None] * len(features)
        order = length_order(features)  # batches of similar lengths pad little; stored in the given order
        for i in range(0, len(order), batch_size):
            part = order[i : i + batch_size]
            batch = collate([features[k] for k in part], pad_id, d.device)
            h, _ = teacher_forward(d, batch, need_logits=False)
            for j, k in enumerate(part):
                slots[k] = h[j, : lengths[k]].to("cpu").clone()
            if progress:
                progress(min(i + batch_size, len(features)), len(features))
        hidden: list[torch.Tensor] = slots  # type: ignore[assignment]  # every slot is filled
        if mode == "memory":
            return cls(hidden, None, lengths, hs)
        from safetensors.torch import save_file

        directory = Path(directory)
        with atomic_dir(directory) as tmp:
            for c in range(0, len(hidden), cls.CHUNK):
                save_file({f"e{k}": hidden[k].contiguous() for k in range(c, min(c + cls.CHUNK, len(hidden)))},
                          str(tmp / f"chunk{c // cls.CHUNK:05d}.safetensors"))
            (tmp / "index.json").write_text(json.dumps({"lengths": lengths, "hidden_size": hs, "mib": mib}))
        files = sorted(directory.glob("chunk*.safetensors"))
        return cls(None, files, lengths, hs)

    def _one(self, k: int) -> torch.Tensor:
        if self._hidden is not None:
            return self._hidden[k]
        from safetensors import safe_open

        with safe_open(str(self._files[k // self.CHUNK]), framework="pt") as f:
            return f.get_tensor(f"e{k}").clone()

    def gather(self, indices: Sequence[int], device: torch.device) -> torch.Tensor:
        """[B, max len, H] right-padded with zeros (padding positions are masked in every loss)."""
        parts = [self._one(k) for k in indices]
        t = max(p.size(0) for p in parts)
        out = torch.zeros((len(parts), t, self.hidden_size), dtype=parts[0].dtype)
        for i, p in enumerate(parts):
            out[i, : p.size(0)] = p
        return out.to(device, non_blocking=True)


# ------------------------------------------------------------------------------------------ distill


@dataclass(frozen=True)
class TAKDState:
    """Explicit state of the server's distillation: the student LoRA, AdamW moments, step count."""

    student: State
    optimizer: optim.AdamWState | None = None  # None before the first step
    step: int = 0


def init_state(d: Decomposition) -> TAKDState:
    return TAKDState(student=d.student_state())


def takd_record(s: TAKDState) -> tuple[dict, dict]:
    """Flat tensors + JSON meta for checkpoints."""
    t = {f"student/{k}": v for k, v in s.student.items()}
    meta = {"takd_step": s.step, "takd_t": None}
    if s.optimizer is not None:
        ot, om = s.optimizer.to_record("takd")  # takd_m/<name>, takd_v/<name>, meta takd_t
        t.update(ot)
        meta.update(om)
    return t, meta


def takd_from_record(t: dict, meta: dict) -> TAKDState:
    def part(p):
        return {k[len(p) + 1 :]: v for k, v in t.items() if k.startswith(p + "/")}

    return TAKDState(part("student"), optim.AdamWState.from_record(t, meta, "takd"), meta["takd_step"])


def sample_indices(n: int, batch_size: int, seed: int, position: int) -> list[int]:
    """Examples for the micro-batch at `position`: epochs of seeded permutations, so any step can be
    recomputed (resume) without replaying earlier ones."""
    out = []
    for g in range(position * batch_size, (position + 1) * batch_size):
        epoch, k = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, "takd-order", epoch)))
        out.append(int(perm[k]))
    return out


def _enter_student_training(d: Decomposition, params: dict) -> dict[int, bool]:
    """Make B_L's LoRA the only trainable part, with dropout on B_L alone; returns the previous
    requires_grad flags of the student and messenger parameters for `_leave_student_training`."""
    flags = {id(p): p.requires_grad for p in list(params.values()) + list(d.messenger_params().values())}
    d.set_trainable(messenger=False, student=True)
    d.adapemu.eval()
    for layer in d.student:
        layer.train()  # LoRA dropout on B_L only; the messenger is a fixed function here
    return flags


def _leave_student_training(d: Decomposition, params: dict, flags: dict[int, bool]) -> None:
    """Undo `_enter_student_training`: eval mode, the saved requires_grad flags, no gradients left."""
    for layer in d.student:
        layer.eval()
    for p in list(params.values()) + list(d.messenger_params().values()):
        p.requires_grad_(flags[id(p)])
        p.grad = None


def _accumulate(d: Decomposition, params: dict, features: Sequence[dict], cfg: TAKDConfig, s: int, *,
                pad_id: int, seed: int, cache: TeacherCache | None, devices: list) -> dict[str, float]:
    """Gradients of step `s` over its cfg.grad_accum micro-batches into `params[*].grad`; returns the
    step's mean loss terms. Raises on a non-finite loss."""
    for p in params.values():
        p.grad = None
    acc = {"loss": 0.0, "hidden": 0.0, "kl": 0.0, "ce": 0.0}
    for micro in range(cfg.grad_accum):
        idx = sample_indices(len(features), cfg.batch_size, seed, s * cfg.grad_accum + micro)
        batch = collate([features[i] for i in idx], pad_id, d.device)
        h_t = cache.gather(idx, d.device) if cache is not None else None
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(seed, "takd-dropout", s, micro))
            terms = takd_loss(d, batch, cfg, h_t)
        (terms["loss"] / cfg.grad_accum).backward()
        for k in acc:
            acc[k] += float(terms[k].detach()) / cfg.grad_accum
    if not math.isfinite(acc["loss"]):
        raise CidersError(f"TAKD step {s}: loss is {acc['loss']}; lower takd.lr or check the data")
    return acc


def distill(
    d: Decomposition,
    state: TAKDState,
    messenger: State,
    features: Sequence[dict],
    cfg: TAKDConfig,
    steps: int,
    *,
    pad_id: int,
    seed: int = 0,
    cache: TeacherCache | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> tuple[TAKDState, list[dict]]:
    """Run `steps` AdamW steps of Eq. 2 on B_L's LoRA with `messenger` fixed, from `state`.

    Pure over explicit state: the same (state, messenger, data, cfg, seed) give the same result;
    the models in `d` are only the compute the states are loaded into. Returns the new state and
    one metrics dict per step. Dropout randomness is derived from (seed, step)."""
    if not features:
        raise CidersError("TAKD needs public data, got none")
    if cache is not None and len(cache) != len(features):
        raise CidersError(f"teacher cache holds {len(cache)} examples but {len(features)} were given")
    d.load_messenger(messenger)
    d.load_student(state.student)
    params = d.student_params()
    opt_state = state.optimizer if state.optimizer is not None else optim.adamw_init(state.student)
    flags = _enter_student_training(d, params)
    if cfg.activation_checkpointing:  # B_L's layers (the ones in train mode) recompute in the backward pass
        d.adapemu.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    history = []
    devices = [d.device] if d.device.type == "cuda" else []
    student = {k: p.detach().clone() for k, p in params.items()}
    try:
        for s in range(state.step, state.step + steps):
            t0 = time.perf_counter()
            acc = _accumulate(d, params, features, cfg, s, pad_id=pad_id, seed=seed, cache=cache, devices=devices)
            grads = {k: p.grad for k, p in params.items()}
            grads, gn = optim.clip_by_global_norm(grads, cfg.max_grad_norm)
            student, opt_state = optim.adamw_step(student, grads, opt_state, cfg.lr, weight_decay=cfg.weight_decay)
            d.load_student(student)
            rec = {"step": s, **acc, "grad_norm": gn, "lr": cfg.lr, "seconds": time.perf_counter() - t0}
            history.append(rec)
            if on_step:
                on_step(rec)
    finally:
        if cfg.activation_checkpointing:
            d.adapemu.activation_checkpointing_disable()
        _leave_student_training(d, params, flags)
    new = TAKDState(student=student, optimizer=opt_state, step=state.step + steps)
    return new, history
