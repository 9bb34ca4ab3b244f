"""Per-round TAKD time with and without the teacher cache, side by side (Eq. 13; docs/method.md#eq-13-per-round-takd).

B_F(x) on the public data never changes, so the cache computes it once; each round then runs only the
messenger on it for M*(x), instead of the full n-layer teacher. Rounds of T_L steps alternate between
the two modes from the same start state (so machine noise hits both), and the losses of the two modes
are compared to show the cache changes nothing but the time.

A third mode adds `takd.activation_checkpointing` to the cache (B_L's activations recomputed in the backward pass).
Peak memory of one TAKD step in each mode: the process's peak RSS (CUDA: the allocator's peak) and the tensor
storage the step itself holds at once (`common.peak_tensor_mib`).

--json keys: build_s, seconds_per_round.*, speedup_cache, ckpt_over_cache, peak_rss_mib.*, peak_tensor_mib.*,
max_rel_loss_diff.*

    python benchmarks/takd_round.py [--model smollm2-135m] [--rounds 4] [--steps 5] [--json] [--smoke]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from common import SMOKE_MODEL, emit, parser, peak_memory_mib, peak_tensor_mib, setup, smoke

from ciders.config import TAKDConfig
from ciders.models.distill import TeacherCache, distill, init_state


MODES = ("no_cache", "cache", "cache_ckpt")


def main() -> None:
    ap = parser(__doc__, batch_size=4)
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="T_L: TAKD steps per round")
    ap.add_argument("--rounds", type=int, default=4)
    a = smoke(ap.parse_args(), model=SMOKE_MODEL, examples=8, steps=1, rounds=1)

    torch.manual_seed(0)
    d, tok, feats = setup(a, "public.jsonl", a.examples)
    pad = tok.pad_token_id
    cfg = TAKDConfig(lr=2e-3, batch_size=a.batch_size)
    build_s, cache = timed(d, lambda: TeacherCache.build(d, feats, pad, batch_size=8))
    modes = {"no_cache": (None, cfg), "cache": (cache, cfg),
             "cache_ckpt": (cache, replace(cfg, activation_checkpointing=True))}

    msg = d.messenger_state()

    def run(mode, state, steps):
        return distill(d, state, msg, feats, modes[mode][1], steps, pad_id=pad, seed=0,
                       cache=modes[mode][0])

    times, losses, state = rounds(d, run, a.rounds, a.steps)
    med = {m: statistics.median(v) for m, v in times.items()}
    res = {"model": a.model, "device": str(d.device), "dtype": str(d.base.dtype).removeprefix("torch."),
           "examples": len(feats), "steps_per_round": a.steps, "batch_size": a.batch_size, "rounds": a.rounds,
           "build_s": build_s, "cache_storage": cache.storage, "seconds_per_round": med,
           "min_s": {m: min(v) for m, v in times.items()}, "max_s": {m: max(v) for m, v in times.items()},
           "speedup_cache": med["no_cache"] / med["cache"], "ckpt_over_cache": med["cache_ckpt"] / med["cache"],
           "peak_rss_mib": {}, "peak_tensor_mib": {},
           "max_rel_loss_diff": {m: max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(losses[m], losses["cache"]))
                                 for m in ("no_cache", "cache_ckpt")}}
    for m in MODES:  # one TAKD step from each mode's own state
        res["peak_rss_mib"][m] = peak_memory_mib(lambda m=m: run(m, state[m], 1), d.device)
        res["peak_tensor_mib"][m] = peak_tensor_mib(lambda m=m: run(m, state[m], 1))
    emit(res, a.json, lambda: report(res, d, len(losses["cache"])))


def timed(d, fn):
    """(seconds, fn()) with the device synchronised on either side."""
    sync(d)
    t0 = time.perf_counter()
    out = fn()
    sync(d)
    return time.perf_counter() - t0, out


def sync(d) -> None:
    if d.device.type == "cuda":
        torch.cuda.synchronize()


def rounds(d, run, n_rounds: int, steps: int):
    """Rounds of `steps` TAKD steps per mode, interleaved with the order reversed every other round (machine noise
    hits every mode alike), each mode from the same start state; round 0 is a warm-up, not timed.
    (seconds per round, losses of every step, final state) per mode."""
    state = {m: init_state(d) for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    losses: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(n_rounds + 1):
        for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
            t, (state[mode], hist) = timed(d, lambda mode=mode: run(mode, state[mode], steps))
            if r > 0:
                times[mode].append(t)
            losses[mode] += [h["loss"] for h in hist]
    return times, losses, state


def report(res: dict, d, steps: int) -> None:
    s, med = d.split, res["seconds_per_round"]
    print(f"{res['model']} on {res['device']} ({res['dtype']}): {s.n_layers} layers, messenger {s.messenger_layers}, "
          f"B_L {s.student_layers}; {res['examples']} public examples; T_L = {res['steps_per_round']} steps of batch "
          f"{res['batch_size']} per round, {res['rounds']} timed rounds")
    print(f"\n{'mode':<14}{'median s/round':>16}{'min':>9}{'max':>9}{'RSS MiB':>9}{'held MiB':>9}")
    for m in MODES:
        print(f"{m:<14}{med[m]:>16.3f}{res['min_s'][m]:>9.3f}{res['max_s'][m]:>9.3f}{res['peak_rss_mib'][m]:>9.0f}"
              f"{res['peak_tensor_mib'][m]:>9.1f}")
    saved = med["no_cache"] - med["cache"]
    print(f"\nspeed-up per round (no cache / cache): {res['speedup_cache']:.2f}x")
    print(f"one-time cache build: {res['build_s']:.2f} s ({res['cache_storage']})"
          + (f"; pays for itself after {res['build_s'] / saved:.1f} rounds" if saved > 0 else ""))
    print(f"activation checkpointing: {res['ckpt_over_cache']:.2f}x the time per round")
    for m, diff in res["max_rel_loss_diff"].items():
        print(f"max relative loss difference, {m} vs cache, over {steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
