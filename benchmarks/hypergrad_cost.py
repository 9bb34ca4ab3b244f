"""What one outer-phase hypergradient costs, RABO (implicit differentiation with double-backward products) against
RAFBO (finite differences of first-order gradients), on the few-shot task (docs/rabo.md#rafbo-finite-difference-products):
Omniglot 5-way 1-shot, Conv4, the head y fitted by the inner phase first. Measured in one process, interleaved,
medians of `--repeats`:

  calls     evaluations of the inner loss g (including those inside the products) and of f
  seconds   wall-clock seconds of one hypergradient
  rel_err   ||h_RAFBO - h_RABO|| / ||h_RABO|| (the two estimate the same hypergradient)

--smoke: one repeat at the smallest sizes on generated stand-in images (common.smoke_fewshot): no dataset needed.

--json keys: rabo.seconds, rafbo.seconds, rabo.calls_g, rafbo.calls_g, rel_err, rafbo_over_rabo_seconds

    python benchmarks/hypergrad_cost.py [--config configs/cpu/rabo_fewshot.yaml] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ciders.config import load_experiment
from ciders.core import hypergrad as hg
from ciders.core.tensors import lincomb, norm
from ciders.workloads.bilevel import build
from common import ROOT, add_output_flags, emit, smoke_fewshot


def counted(fn, box: list):
    def wrapped(*a):
        box.append(1)
        return fn(*a)

    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu" / "rabo_fewshot.yaml"))
    ap.add_argument("--repeats", type=int, default=5)
    a = add_output_flags(ap).parse_args()
    with smoke_fewshot(a.smoke) as sets:
        cfg = load_experiment(a.config, sets)
        task = build(cfg)
    res = measure(cfg, task, 1 if a.smoke else a.repeats)
    emit(res, a.json, lambda: report(res))


def measure(cfg, task, repeats: int) -> dict:
    """Both hypergradients at the same (x, y) on client 0's episode, interleaved `repeats` times."""
    x, y = task.initial()
    ep = task.outer_batch(0, 0)
    for b in task.batches(0, 0, cfg.rabo.inner_steps):  # the inner phase: y near y*(x) on this client's episode
        _, gy = hg.value_and_grad_y(lambda p, q, b=b: task.g(p, q, b), x, y)
        y = lincomb([(1.0, y), (-cfg.rabo.beta, gy)])
    r = cfg.rabo
    runs = {"rabo": "autograd", "rafbo": "fd"}
    out: dict = {m: {"seconds": [], "calls_g": 0, "calls_f": 0} for m in runs}
    hs = {}
    for _ in range(repeats):
        for m, second in runs.items():
            cg, cf = [], []
            t0 = time.perf_counter()
            h, info = hg.hypergradient(counted(lambda p, q: task.f(p, q, ep), cf),
                                       counted(lambda p, q: task.g(p, q, ep), cg), x, y, solver=r.solver,
                                       iters=r.solver_iters, eta=r.neumann_eta, second_order=second, delta=r.fd_delta)
            out[m]["seconds"].append(time.perf_counter() - t0)
            out[m].update(calls_g=len(cg), calls_f=len(cf), solver_iters=info["iters"])
            hs[m] = h
    res = {m: {"seconds": statistics.median(v["seconds"]), "calls_g": v["calls_g"], "calls_f": v["calls_f"],
               "solver_iters": v["solver_iters"]} for m, v in out.items()}
    diff = lincomb([(1.0, hs["rafbo"]), (-1.0, hs["rabo"])])
    res.update(rel_err=norm(diff) / norm(hs["rabo"]), rafbo_over_rabo_seconds=res["rafbo"]["seconds"] / res["rabo"]["seconds"],
               solver=r.solver, fd_delta=r.fd_delta, threads=torch.get_num_threads())
    return res


def report(res: dict) -> None:
    for m in ("rabo", "rafbo"):
        print(f"{m:6s} {res[m]['seconds']:.3f} s, {res[m]['calls_g']} g calls + {res[m]['calls_f']} f calls "
              f"({res[m]['solver_iters']} {res['solver']} iterations)")
    print(f"RAFBO / RABO seconds {res['rafbo_over_rabo_seconds']:.2f}; relative difference of the hypergradients "
          f"{res['rel_err']:.2e}")


if __name__ == "__main__":
    main()
