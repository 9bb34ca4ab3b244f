"""Accuracy and cost of the Hessian-vector product of the FD meta-gradient (Eq. 7;
docs/method.md#eq-7-finite-difference-meta-gradient-fd), per model and base dtype:

  rel_err = ||Hv - Hv_ref|| / ||Hv_ref||, Hv_ref = double backward in float64 on the same weights, batch
  and dropout mask; v = the FO meta-gradient (Eq. 5) at the messenger state x, the same v for every rule.

Rules:  old            x +- eps v in the base dtype (the rule before the relative probe)
        new            x +- (eps / ||v||) v, evaluations in fp32 on a bf16/fp16 base (what ciders runs)
        rel_base       the relative probe, evaluations in the base dtype (the probe change alone)
        abs_fp32       the absolute probe, fp32 evaluations (the dtype change alone)
        rel_xnorm      x +- (eps max(1, ||x||) / ||v||) v, fp32 evaluations (a probe scaled with ||x||)
        exact_base     double backward in the base dtype (algorithm.hvp: exact)
        exact_fp32     double backward with fp32 evaluations
r_FD = eta_hvp ||Hv|| / ||v|| per rule and for the reference. Cost: seconds per HVP (medians of --repeats,
interleaved) of fd (the new rule: two gradients) and exact (one double backward), beside one gradient, and
of a whole FD step (two gradients for the look-ahead and v, plus the HVP; fd runs all four in its dtype).
The LoRA B matrices are drawn N(0, 0.01^2) (seeded; --lora-b-std), so the messenger is not at its identity
initialisation (B = 0).
The real text is the vendored GSM8K slice.

--json keys: rel_err_fp32, rel_err_bf16, old_rel_err_fp32, old_rel_err_bf16, runs.*.rel_err.*, runs.*.r_fd.*,
runs.*.r_fd_exact, runs.*.seconds.*  (rel_err_<dtype> / old_rel_err_<dtype>: the new / old rule's error on the
headline model, SmolLM2 when it is among --models)

    python benchmarks/fd_accuracy.py [--models tiny-qwen2,smollm2-135m] [--json] [--smoke]
"""

from __future__ import annotations

import argparse

import torch

from ciders.algorithms.ciders import grad_of
from ciders.core.metagrad import exact_hvp, fd_hvp
from ciders.core.tensors import lincomb, norm
from ciders.models.messenger_loss import MessengerLoss, step_compute_dtype
from ciders.tasks.text import collate
from common import SMOKE_MODEL, emit, interleaved_medians, parser, setup, smoke


def prepare(a: argparse.Namespace, model: str, dtype: str):
    """(decomposition, messenger state x, one batch with B_L(x) cached)."""
    d, tok, feats = setup(argparse.Namespace(**{**vars(a), "model": model, "dtype": dtype}), "clients.jsonl",
                          a.batch_size)
    g = torch.Generator().manual_seed(1)
    x = {k: (t + a.lora_b_std * torch.randn(t.shape, generator=g).to(t)) if "lora_B" in k else t
         for k, t in d.messenger_state().items()}
    d.messenger_top.train()  # LoRA dropout as in a client step (one mask: the batch's seed)
    b = collate(feats, tok.pad_token_id, d.device)
    hidden = d.backbone_hidden(b["input_ids"], b["attention_mask"])
    return d, x, {"hidden": hidden, "attention_mask": b["attention_mask"], "labels": b["labels"], "seed": 3}


def absolute_hvp(loss, x, v, batch, eps):
    _, gp = grad_of(loss, lincomb([(1.0, x), (eps, v)]), batch)
    _, gm = grad_of(loss, lincomb([(1.0, x), (-eps, v)]), batch)
    return lincomb([(0.5 / eps, gp), (-0.5 / eps, gm)])


def products(d, x, batch, a):
    """(v, reference Hv, {rule: Hv}, {name: loss})."""
    base = MessengerLoss(d)
    fd_dtype = step_compute_dtype("fd", "fd", d.base.dtype)
    f32 = MessengerLoss(d, fd_dtype) if fd_dtype is not None else base
    _, g0 = grad_of(f32, x, batch)
    _, v = grad_of(f32, lincomb([(1.0, x), (-a.eta_in, g0)]), batch)  # FO meta-gradient at the look-ahead
    ref = exact_hvp(MessengerLoss(d, torch.float64), {k: t.double() for k, t in x.items()},
                    {k: t.double() for k, t in v.items()}, batch)
    ref = {k: t.to(v[k].dtype) for k, t in ref.items()}
    eps = a.eps

    def fd(loss, e):
        return fd_hvp(lambda p: grad_of(loss, p, batch), x, v, e)

    rules = {"old": absolute_hvp(base, x, v, batch, eps), "new": fd(f32, eps), "rel_base": fd(base, eps),
             "abs_fp32": absolute_hvp(f32, x, v, batch, eps), "rel_xnorm": fd(f32, eps * max(1.0, norm(x))),
             "exact_base": exact_hvp(base, x, v, batch), "exact_fp32": exact_hvp(f32, x, v, batch)}
    for e in a.sweep:
        rules[f"new@{e:g}"] = fd(f32, e)
    return v, ref, rules, {"base": base, "fd": f32}


def timings(losses, x, v, batch, repeats: int) -> dict:
    dev = batch["hidden"].device

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    fns = {"grad_base": lambda: grad_of(losses["base"], x, batch),
           "grad_fd_dtype": lambda: grad_of(losses["fd"], x, batch),
           "fd": lambda: fd_hvp(lambda p: grad_of(losses["fd"], p, batch), x, v, 1e-4),
           "exact": lambda: exact_hvp(losses["base"], x, v, batch)}
    peak: dict[str, float] = {}
    for k, f in fns.items():  # warm-up; on CUDA also the peak memory of each
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        f()
        if dev.type == "cuda":
            peak[f"{k}_peak_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
    out = {f"{k}_s": v for k, v in interleaved_medians(fns, repeats, sync).items()}
    # a whole FD step: look-ahead + FO gradient (in the fd dtype for fd) and the HVP
    out["step_fd_s"] = 2 * out["grad_fd_dtype_s"] + out["fd_s"]
    out["step_exact_s"] = 2 * out["grad_base_s"] + out["exact_s"]
    return {**out, **peak}


def measure(a: argparse.Namespace, model: str, dtype: str) -> dict:
    d, x, batch = prepare(a, model, dtype)
    v, ref, rules, losses = products(d, x, batch, a)
    nref, nv = norm(ref), norm(v)
    copy = losses["fd"].base_weights()
    return {"model": model, "dtype": dtype, "device": str(d.device), "tokens": list(batch["labels"].shape),
            "x_norm": norm(x), "v_norm": nv, "hv_norm": nref,
            "rel_err": {k: norm(lincomb([(1.0, h), (-1.0, ref)])) / nref for k, h in rules.items()},
            "r_fd_exact": a.eta_hvp * nref / nv,
            "r_fd": {k: a.eta_hvp * norm(h) / nv for k, h in rules.items()},
            "fd_copy_mib": sum(t.numel() * t.element_size() for t in copy.values()) / 2**20,
            "seconds": timings(losses, x, v, batch, a.repeats)}


def main() -> None:
    ap = parser(__doc__, batch_size=2)
    ap.add_argument("--models", default="tiny-qwen2,smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--eps", type=float, default=1e-4, help="eps_fd (the probe length)")
    ap.add_argument("--sweep", default="1e-3,1e-5", help="other eps_fd values for the new rule")
    ap.add_argument("--eta-in", type=float, default=1e-4)
    ap.add_argument("--eta-hvp", type=float, default=1e-3, help="eta_HVP of r_FD (paper 0.001)")
    ap.add_argument("--lora-b-std", type=float, default=0.01, help="std of the LoRA B draw (0 = as initialised)")
    ap.add_argument("--repeats", type=int, default=3)
    a = smoke(ap.parse_args(), models=SMOKE_MODEL, repeats=1, sweep="")
    a.sweep = [float(e) for e in a.sweep.split(",") if e]
    torch.manual_seed(0)
    runs = [measure(a, m, dt) for m in a.models.split(",") for dt in a.dtypes.split(",")]
    head = [r for r in runs if r["model"] == "smollm2-135m"] or [r for r in runs if r["model"] == runs[-1]["model"]]
    res = {"headline_model": head[0]["model"], "eps_fd": a.eps, "eta_hvp": a.eta_hvp,
           **{f"{old}rel_err_{'fp32' if r['dtype'] == 'float32' else 'bf16'}": r["rel_err"][rule]
              for r in head for old, rule in (("", "new"), ("old_", "old"))},
           "runs": runs}
    emit(res, a.json, lambda: report(runs))


def report(runs: list[dict]) -> None:
    for r in runs:
        s = r["seconds"]
        print(f"{r['model']} {r['dtype']} on {r['device']}: ||v|| {r['v_norm']:.3g}, ||Hv|| {r['hv_norm']:.3g}, "
              f"r_FD exact {r['r_fd_exact']:.4f}; fp32 copy {r['fd_copy_mib']:.1f} MiB")
        for k, e in r["rel_err"].items():
            print(f"  {k:<12} rel_err {e:9.2e}   r_FD {r['r_fd'][k]:.4f}")
        print(f"  seconds: grad {s['grad_base_s']:.3f} (fd dtype {s['grad_fd_dtype_s']:.3f}), "
              f"fd HVP {s['fd_s']:.3f}, exact HVP {s['exact_s']:.3f}; step fd {s['step_fd_s']:.3f}, "
              f"exact {s['step_exact_s']:.3f}")


if __name__ == "__main__":
    main()
