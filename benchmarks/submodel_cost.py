"""What a client's sub-model costs at each capacity R, measured on the extracted sub-model through the real client
phases (docs/rabo.md#sub-model-masks): Omniglot few-shot, RABO's importance extraction, one inner and one outer phase
per client (`federation.bilevel_client.client_phase`), interleaved, medians of `--repeats`. Per capacity, relative to
R = 1 (the full model, FedMBO's client):

  flops      forward FLOPs per example of the sub-model, counted from its shapes (`task.flops`)
  params     bytes of the tensors the client holds
  seconds    measured seconds of the client's inner + outer phases
  down, up   bytes of the messages actually sent (downlink: kept entries + indices; uplink: kept entries)

and the means over the config's capacity mix (the paper's 1, 1/2, 1/4, 1/8, 1/16 gives mean R^2 = 0.266: its
"26.7% of FedMBO's computation and 73.3% less communication").

--smoke: one repeat at the smallest sizes on generated stand-in images (common.smoke_fewshot): no dataset needed.

--json keys: mean_over_mix.*, rows.*.flops_fraction, rows.*.params_fraction, rows.*.seconds_fraction,
rows.*.down_fraction, rows.*.up_fraction, rows.*.seconds

    python benchmarks/submodel_cost.py [--config configs/cpu/rabo_fewshot.yaml] [--set task.width=64] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from ciders.config import load_experiment
from ciders.federation.bilevel_client import client_phase
from ciders.federation.bilevel_rounds import BilevelServer
from ciders.workloads.bilevel import build
from common import ROOT, add_output_flags, emit, interleaved_medians, smoke_fewshot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu" / "rabo_fewshot.yaml"))
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. task.backbone=resnet12")
    ap.add_argument("--repeats", type=int, default=5)
    a = add_output_flags(ap).parse_args()
    with smoke_fewshot(a.smoke) as sets:
        emit(*measure(load_experiment(a.config, [*sets, *a.set]), 1 if a.smoke else a.repeats, a))


def measure(exp, repeats: int, a: argparse.Namespace):
    """(result, --json, report) of every capacity level's client phases."""
    caps = sorted(set(exp.federation.client_capacities()), reverse=True)
    # one client per capacity level, in decreasing order (client i gets capacities[i])
    mix = exp.federation.capacities
    exp = replace(exp, federation=replace(exp.federation, clients=len(caps), capacities=tuple(caps))).validate()
    task = build(exp)
    server = BilevelServer(exp, task, log=lambda s: None)
    server.begin(0)
    ids = server.ids

    def one_client(i: str):
        scratch: dict = {}
        up_in, _ = client_phase(exp, task, "inner", i, server.down("inner", i), scratch)
        return up_in, scratch

    # the outer phase needs y_{q+1}: take the inner step once, as the server would
    ups = {i: one_client(i)[0] for i in ids}
    server.absorb("inner", ups)

    def phases(i: str):
        def run():
            scratch: dict = {}
            client_phase(exp, task, "inner", i, server.down("inner", i), scratch)
            client_phase(exp, task, "outer", i, server.down("outer", i), scratch)
        return run

    sync = torch.cuda.synchronize if torch.cuda.is_available() and task.device.type == "cuda" else (lambda: None)
    secs = interleaved_medians({i: phases(i) for i in ids}, repeats, sync)
    rows = []
    for i, r in zip(ids, caps):
        cost = server.cost(i)
        scratch: dict = {}
        up_in, _ = client_phase(exp, task, "inner", i, server.down("inner", i), scratch)
        up_out, _ = client_phase(exp, task, "outer", i, server.down("outer", i), scratch)
        rows.append({"capacity": r, "flops_fraction": cost["flops_fraction"], "param_bytes": cost["param_bytes"],
                     "seconds": secs[i], "bytes_down": len(server.down("inner", i)) + len(server.down("outer", i)),
                     "bytes_up": len(up_in) + len(up_out)})
    full = rows[0]
    if full["capacity"] != 1.0:
        raise SystemExit("the config's capacities need a 1.0 (the full model) to compare against")
    for row in rows:
        row["params_fraction"] = row["param_bytes"] / full["param_bytes"]
        row["seconds_fraction"] = row["seconds"] / full["seconds"]
        row["down_fraction"] = row["bytes_down"] / full["bytes_down"]
        row["up_fraction"] = row["bytes_up"] / full["bytes_up"]
    by = {row["capacity"]: row for row in rows}
    summary = {k: statistics.fmean(by[c][k] for c in mix) for k in
               ("flops_fraction", "params_fraction", "seconds_fraction", "down_fraction", "up_fraction")}
    summary["mean_r_squared"] = statistics.fmean(c * c for c in mix)
    out = {"config": a.config, "set": a.set, "backbone": exp.task.backbone, "width": exp.task.width,
           "rows": rows, "mix": list(mix), "mean_over_mix": summary}
    return out, a.json, lambda: report(out, exp, repeats)


def report(out: dict, exp, repeats: int) -> None:
    rows, mix, summary = out["rows"], out["mix"], out["mean_over_mix"]
    print(f"{exp.task.backbone} width {exp.task.width}, {exp.task.n_way}-way {exp.task.k_shot}-shot; medians of "
          f"{repeats} interleaved inner + outer client phases; fractions of the R = 1 client")
    print(f"{'R':>8} {'flops':>7} {'params':>7} {'seconds':>8} {'down':>7} {'up':>7}   seconds (abs)")
    for row in rows:
        print(f"{row['capacity']:>8.4f} {row['flops_fraction']:>7.3f} {row['params_fraction']:>7.3f} "
              f"{row['seconds_fraction']:>8.3f} {row['down_fraction']:>7.3f} {row['up_fraction']:>7.3f}   "
              f"{row['seconds']:.4f}")
    s = summary
    print(f"mean over the mix {list(mix)}: flops {s['flops_fraction']:.3f}, params {s['params_fraction']:.3f}, "
          f"seconds {s['seconds_fraction']:.3f}, down {s['down_fraction']:.3f}, up {s['up_fraction']:.3f} "
          f"(mean R^2 = {s['mean_r_squared']:.3f})")


if __name__ == "__main__":
    main()
