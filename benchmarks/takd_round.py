"""Per-round TAKD time with and without the teacher cache, side by side (Eq. 13; docs/method.md#eq-13-per-round-takd).

B_F(x) on the public data never changes, so the cache computes it once; each round then runs only the
messenger on it for M*(x), instead of the full n-layer teacher. Rounds of T_L steps alternate between
the two modes from the same start state (so machine noise hits both), and the losses of the two modes
are compared to show the cache changes nothing but the time.

A third mode adds `takd.activation_checkpointing` to the cache (B_L's activations recomputed in the backward pass).
Peak memory of one TAKD step in each mode: the process's peak RSS (CUDA: the allocator's peak) and the tensor
storage the step itself holds at once (`common.peak_tensor_mib`).

    python benchmarks/takd_round.py [--model smollm2-135m] [--rounds 4] [--steps 5]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from common import parser, peak_memory_mib, peak_tensor_mib, setup

from ciders.config import TAKDConfig
from ciders.models.distill import TeacherCache, distill, init_state


def main() -> None:
    ap = parser(__doc__, batch_size=4)
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="T_L: TAKD steps per round")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()

    torch.manual_seed(0)
    d, tok, feats = setup(a, "public.jsonl", a.examples)
    pad = tok.pad_token_id
    cfg = TAKDConfig(lr=2e-3, batch_size=a.batch_size)
    s = d.split
    print(f"{a.model} on {d.device} ({d.base.dtype}): {s.n_layers} layers, messenger {s.messenger_layers}, "
          f"B_L {s.student_layers}; {len(feats)} public examples x <= {a.max_length} tokens; "
          f"T_L = {a.steps} steps of batch {a.batch_size} per round")

    def sync():
        if d.device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    cache = TeacherCache.build(d, feats, pad, batch_size=8)
    sync()
    build_s = time.perf_counter() - t0

    msg = d.messenger_state()
    modes = {"no cache": (None, cfg), "cache": (cache, cfg),
             "cache + ckpt": (cache, replace(cfg, activation_checkpointing=True))}
    state = {m: init_state(d) for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(a.rounds + 1):  # round 0 is a warm-up, not timed
        for mode in list(modes) if r % 2 == 0 else list(reversed(modes)):
            sync()
            t = time.perf_counter()
            state[mode], hist = distill(d, state[mode], msg, feats, modes[mode][1], a.steps, pad_id=pad, seed=0,
                                        cache=modes[mode][0])
            sync()
            if r > 0:
                times[mode].append(time.perf_counter() - t)
            losses[mode] += [h["loss"] for h in hist]

    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"\n{'mode':<14}{'median s/round':>16}{'min':>9}{'max':>9}")
    for m in modes:
        print(f"{m:<14}{med[m]:>16.3f}{min(times[m]):>9.3f}{max(times[m]):>9.3f}")
    saved = med["no cache"] - med["cache"]
    print(f"\nspeed-up per round (no cache / cache): {med['no cache'] / med['cache']:.2f}x")
    print(f"one-time cache build: {build_s:.2f} s ({cache.storage}); pays for itself after "
          f"{build_s / saved:.1f} rounds" if saved > 0 else f"one-time cache build: {build_s:.2f} s")
    print(f"activation checkpointing: {med['cache + ckpt'] / med['cache']:.2f}x the time per round")
    for m in modes:
        def one(m=m):
            distill(d, state[m], msg, feats, modes[m][1], 1, pad_id=pad, seed=0, cache=modes[m][0])
        print(f"one TAKD step ({m}): peak RSS {peak_memory_mib(one, d.device):.0f} MiB, "
              f"tensors held {peak_tensor_mib(one):.1f} MiB")
    for m in ("no cache", "cache + ckpt"):
        diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(losses[m], losses["cache"]))
        print(f"max relative loss difference, {m} vs cache, over {len(losses['cache'])} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
