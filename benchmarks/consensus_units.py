"""In which units do the consensus variates live? (docs/method.md#the-consensus-space)

On the demo decomposition (SmolLM2-135M, 2-layer messenger, B_L = 14 layers, 3 IID GSM8K clients, AdamW at
the demo's lr), two rounds of CIDERS-FO per `algorithm.consensus_space`, from the same start and batches:

  round 0 (c = c_i = 0): |Delta_i| / |mean_k g_k|        Delta_i = what Eq. 8 / the gradient rule reports,
                                                          g_k = the raw meta-gradient of step k
  round 1 (c, c_i != 0): |gamma (c - c_i)| / |mean_k g_k| the correction against the raw gradient
                         |gamma (c - c_i)| / |mean_k u_k| ... against the optimizer's direction u_k
                                                          (u_k = (x_k - OPTIM(x_k, d_k)) / eta_k)

Each figure is the median over the clients. The correction is added to g in `paper` and `gradient` and to u
in `update`: the ratio that says whether it is in the right units is the one against what it is added to.

--smoke: the tiny model, one local step, 2 clients (SMOKE).

--json keys: delta_over_grad_paper, delta_over_grad_gradient, delta_over_grad_update, corr_over_target_paper,
corr_over_target_gradient, corr_over_target_update, delta_over_step_update, modes.*

    python benchmarks/consensus_units.py [--config configs/demo.yaml] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

from ciders.algorithms import ciders as alg
from ciders.config import load_config
from ciders.workloads.llm import LLMTask
from common import ROOT, SMOKE_MODEL, add_output_flags, emit

MODES = ("paper", "gradient", "update")
SMOKE = [f"model.name={SMOKE_MODEL}", "algorithm.local_steps=1", "federation.clients=2", "data.clients_limit=12",
         "data.eval_limit=4", "data.max_length=64"]


def run_mode(task: LLMTask, cfg, space: str, seed: int) -> dict:
    a = replace(cfg.algorithm, consensus_space=space)
    msg = task.initial_messenger()
    ids = sorted(task.clients())
    server = alg.init_server(msg, 2)
    copies = {i: alg.init_copy(msg) for i in ids}
    states = {i: alg.init_client(i, msg) for i in ids}
    rows = []
    for t in range(2):
        task.begin_round(t, {})
        ups, ms = [], []
        for cid in ids:
            bs = task.batches(cid, t, a.local_steps * a.grad_accum, seed)
            up, states[cid], m = alg.client_update(a, alg.make_broadcast(a, server, copies[cid]), states[cid],
                                                   task.loss_fn(cid), bs)
            ups.append(up)
            ms.append(m)
        server, copies, _ = alg.server_update(a, server, ups, copies, task.clients())
        rows.append(ms)

    def med(ms, num, den):
        return statistics.median(m[num] / m[den] for m in ms)

    return {"delta_over_grad": med(rows[0], "delta_norm", "g_mean_norm"),
            "delta_over_step": med(rows[0], "delta_norm", "step_mean_norm"),
            "corr_over_grad": med(rows[1], "corr_norm", "g_mean_norm"),
            "corr_over_step": med(rows[1], "corr_norm", "step_mean_norm"),
            "step_over_grad": med(rows[0], "step_mean_norm", "g_mean_norm"),
            "loss_round1": statistics.mean(m["loss"] for m in rows[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    a = add_output_flags(ap).parse_args()
    over = ["takd.bootstrap_steps=0", "takd.teacher_cache=off", "data.public_limit=8", *(SMOKE if a.smoke else []),
            *a.set]
    cfg = load_config(a.config, over)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        task = LLMTask(cfg, out, log=lambda *_: None)
        res = {space: run_mode(task, cfg, space, cfg.seed) for space in MODES}
    out = {"model": cfg.model.name, "clients": len(task.clients()), "K": cfg.algorithm.local_steps,
           "optimizer": cfg.algorithm.optimizer, "lr": cfg.algorithm.lr, "gamma": cfg.algorithm.gamma,
           "alpha": cfg.algorithm.alpha, "seconds": round(time.perf_counter() - t0, 1), "modes": res}
    for space in MODES:
        out[f"delta_over_grad_{space}"] = res[space]["delta_over_grad"]
        # the correction against what it is added to: g in paper / gradient, the optimizer's direction in update
        out[f"corr_over_target_{space}"] = res[space]["corr_over_step" if space == "update" else "corr_over_grad"]
    out["delta_over_step_update"] = res["update"]["delta_over_step"]
    emit(out, a.json, lambda: report(out))


def report(out: dict) -> None:
    res = out["modes"]
    print(f"{out['model']}: {out['clients']} clients, K={out['K']}, {out['optimizer']} lr {out['lr']}, "
          f"gamma {out['gamma']}, alpha {out['alpha']} ({out['seconds']} s)")
    print(f"{'mode':10s} {'|D|/|g|':>10s} {'|D|/|u|':>10s} {'|corr|/|g|':>11s} {'|corr|/|u|':>11s} {'|u|/|g|':>9s}")
    for space in MODES:
        r = res[space]
        print(f"{space:10s} {r['delta_over_grad']:10.3f} {r['delta_over_step']:10.3f} {r['corr_over_grad']:11.4f} "
              f"{r['corr_over_step']:11.4f} {r['step_over_grad']:9.3f}")


if __name__ == "__main__":
    main()
