"""One client optimizer step, measured in one process on the same AdapEmu model and batches (Eq. 4;
docs/method.md#eq-4-the-consensus-corrected-local-step):

  (i)   plain PEFT LoRA step: full AdapEmu forward + backward + AdamW (what a FedOT client does)
  (ii)  CIDERS-FO step: B_L(x) once, look-ahead gradient + meta-gradient on the messenger, AdamW
  (iii) CIDERS-FD step, algorithm.hvp: exact (the default): (ii) with the gradient at x_k taken with its graph
        kept, and one double backward through it for Hv
  (iv)  CIDERS-FD step, algorithm.hvp: fd: (ii) plus the two central-difference probes
  pieces: B = one no-grad B_L forward;  M = one messenger + head forward + backward;
          D = one forward, a backward with create_graph and the double backward (`exact_hvp` alone)

Within a round B_L is frozen, so the floors are FO = B + 2M, FD-exact = B + M + D (the forward at x_k is shared
by the first gradient and the product) and FD-probes = B + 4M; an implementation that reran the backbone per
gradient evaluation would sit near 2x and 4x of (i) instead. Measurements are interleaved and the medians of
`--repeats` runs are reported. `fd_over_plain` is the default (exact) FD step's; `fd_probes_over_plain` the
other's. Peak memory of one call of each: `peak_rss_mib`, the process's peak resident set (CUDA: the allocator's
peak), which on CPU includes the model and whatever freed memory the allocator kept; and `peak_tensor_mib`, the
tensor storage the call itself holds at once (activations, autograd's saved tensors, logits), counted op by op.

`mfu`: the plain step's achieved FLOP/s over that of one matmul of the model's MLP shape ([tokens, hidden] x
[hidden, intermediate], same dtype and device), measured in the same run. The step's FLOPs are counted from the
shapes: every Linear's forward and its input gradient, 2 x 2 x tokens x in x out (the frozen base needs no
weight gradient; LoRA's are included as Linears), plus attention scores and values, forward and twice that
backward (3 x 4 x B x heads x T^2 x head_dim per layer).

--json keys: seconds.*, fo_over_plain, fd_over_plain, fd_probes_over_plain, fo_over_floor, fd_over_floor,
fd_probes_over_floor, plain_gflops_per_s, matmul_gflops_per_s, mfu, peak_rss_mib.*, peak_tensor_mib.*

    python benchmarks/client_step.py [--model smollm2-135m] [--repeats 7] [--json] [--smoke]
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ciders.algorithms import ciders as alg
from ciders.algorithms.ciders import grad_of
from ciders.core.metagrad import exact_hvp
from ciders.config import CidersConfig
from ciders.models.messenger_loss import MessengerLoss
from ciders.tasks.text import collate
from common import SMOKE_MODEL, emit, interleaved_medians, parser, peak_memory_mib, peak_tensor_mib, setup, smoke


def main() -> None:
    ap = parser(__doc__, batch_size=2)
    ap.add_argument("--repeats", type=int, default=7)
    a = smoke(ap.parse_args(), model=SMOKE_MODEL, repeats=1)

    d, tok, feats = setup(a, "clients.jsonl", a.batch_size)
    b = collate(feats, tok.pad_token_id, d.device)
    loss = MessengerLoss(d)
    base = CidersConfig(local_steps=1, lr=1e-4, eta_in=1e-4, gamma=0.01, alpha=0.002, tau=0.02)
    cfgs = {"fo": replace(base, metagrad="fo"), "fd": replace(base, metagrad="fd", hvp="exact"),
            "fd_probes": replace(base, metagrad="fd", hvp="fd")}
    msg = d.messenger_state()
    server = alg.init_server(msg, 10)
    bc = alg.make_broadcast(base, server, alg.init_copy(msg))
    client = alg.init_client("c", msg)
    params = d.messenger_params()
    d.set_trainable(messenger=True, student=False)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, weight_decay=0.01)
    d.adapemu.train()
    d.messenger_top.train()

    def sync():
        if d.device.type == "cuda":
            torch.cuda.synchronize()

    def plain():
        opt.zero_grad(set_to_none=True)
        d.adapemu(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss.backward()
        opt.step()

    def backbone():
        return d.backbone_hidden(b["input_ids"], b["attention_mask"])

    hidden = backbone()
    batch = {"hidden": hidden, "attention_mask": b["attention_mask"], "labels": b["labels"], "seed": 0}

    def messenger():
        grad_of(loss, msg, batch)

    def double():
        exact_hvp(loss, msg, msg, batch)

    def step(kind):
        def run():
            h = backbone()
            alg.client_update(cfgs[kind], bc, client, loss, [dict(batch, hidden=h)])
        return run

    tokens = b["input_ids"].numel()
    c = d.adapemu.config
    x_mm = torch.randn(tokens, c.hidden_size, device=d.device, dtype=d.base.dtype)
    w_mm = torch.randn(c.hidden_size, c.intermediate_size, device=d.device, dtype=d.base.dtype)

    def matmul():
        for _ in range(10):
            x_mm @ w_mm

    fns = {"plain": plain, "B": backbone, "M": messenger, "D": double, "fo": step("fo"), "fd": step("fd"),
           "fd_probes": step("fd_probes"), "matmul": matmul}
    for _ in range(2):  # warm-up
        for f in fns.values():
            f()
    med = interleaved_medians(fns, a.repeats, sync)
    peak = {k: peak_memory_mib(fns[k], d.device) for k in ("plain", "M", "fo", "fd", "fd_probes")}
    held = {k: peak_tensor_mib(fns[k]) for k in peak}
    floor_fo, floor_fd, floor_probes = med["B"] + 2 * med["M"], med["B"] + med["M"] + med["D"], med["B"] + 4 * med["M"]
    mm_flops = 10 * 2 * tokens * c.hidden_size * c.intermediate_size / med["matmul"]
    achieved = plain_flops(d, b["input_ids"].shape) / med["plain"]
    res = {"model": a.model, "device": str(d.device), "dtype": str(d.base.dtype).replace("torch.", ""),
           "batch": [a.batch_size, int(b["input_ids"].shape[1])], "seconds": med,
           "fo_over_plain": med["fo"] / med["plain"], "fd_over_plain": med["fd"] / med["plain"],
           "fd_probes_over_plain": med["fd_probes"] / med["plain"],
           "fo_over_floor": med["fo"] / floor_fo, "fd_over_floor": med["fd"] / floor_fd,
           "fd_probes_over_floor": med["fd_probes"] / floor_probes,
           "plain_gflops_per_s": achieved / 1e9, "matmul_gflops_per_s": mm_flops / 1e9, "mfu": achieved / mm_flops,
           "peak_rss_mib": peak, "peak_tensor_mib": held}
    emit(res, a.json, lambda: report(res, d, a.repeats, med, peak, held, (floor_fo, floor_fd, floor_probes)))


def report(res: dict, d, repeats: int, med: dict, peak: dict, held: dict, floors: tuple) -> None:
    floor_fo, floor_fd, floor_probes = floors
    s = d.split
    print(f"{res['model']} on {d.device} ({res['dtype']}): AdapEmu = {s.student_layers} B_L + {s.messenger_layers} "
          f"messenger layers; batch {res['batch'][0]} x {res['batch'][1]} tokens; medians of {repeats}")
    print(f"  {'measurement':<38}{'seconds':>9}{'/ plain':>9}{'/ floor':>9}{'RSS MiB':>9}{'held MiB':>9}")
    rows = [("(i)   plain PEFT LoRA step", "plain", None), ("      B  (no-grad B_L forward)", "B", None),
            ("      M  (messenger fwd+bwd)", "M", None), ("      D  (exact HVP alone)", "D", None),
            ("(ii)  CIDERS-FO step (B + 2M)", "fo", floor_fo), ("(iii) FD, hvp exact (B + M + D)", "fd", floor_fd),
            ("(iv)  FD, hvp fd (B + 4M)", "fd_probes", floor_probes)]
    for label, k, floor in rows:
        f = f"{med[k] / floor:>9.2f}" if floor else " " * 9
        m = f"{peak[k]:>9.0f}{held[k]:>9.1f}" if k in peak else ""
        print(f"  {label:<38}{med[k]:>9.4f}{med[k] / med['plain']:>9.2f}{f}{m}")
    print(f"  plain step {res['plain_gflops_per_s']:.1f} GFLOP/s against a matmul's {res['matmul_gflops_per_s']:.1f}: "
          f"mfu {res['mfu']:.2f}")


def plain_flops(d, shape) -> float:
    """FLOPs of one plain LoRA step on AdapEmu (see the module docstring), from the shapes alone."""
    from torch import nn

    from ciders.models.load import attention_shape

    batch, T = shape
    c = d.adapemu.config
    linear = sum(m.in_features * m.out_features for m in d.adapemu.modules() if isinstance(m, nn.Linear))
    heads, _, hd = attention_shape(c)
    attn = 4 * batch * heads * T * T * hd * c.num_hidden_layers
    return 2 * 2 * batch * T * linear + 3 * attn


if __name__ == "__main__":
    main()
