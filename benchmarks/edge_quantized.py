"""A quantized emulator on the edge (docs/edge.md#a-quantized-emulator): the same loopback Flower deployment (2
SuperNodes, warm clients, benchmarks/edge_client.py) run with `federation.emulator_quantize: none` and `int8`, over
seeds, side by side:

  first_contact_mib      the emulator's bytes in a client's first download (round 0's `emulator` component / clients)
  client_peak_rss_mib    the largest peak resident memory a client process reported (whole run)
  process_baseline_mib   peak RSS of a process that imports what a client imports and loads nothing
  compute_s              a client round's own compute (client_update and its batches), median of rounds >= 1
  server_nll             the server's AdapEmu (run's dtype) with the final global messenger, held-out NLL
  edge_nll               the AdapEmu each node holds (int8 or not), with its own personalized messenger, on the same
                         held-out set (mean over the nodes): what the device runs

and the int8 - none differences paired by seed (mean and the half-width of a 95% t interval).

--smoke: the tiny model, one seed, 1 round of 1 step (a Flower deployment: the smoke test is marked `flower`).

--json keys: baseline_mib, modes.*.first_contact_mib, modes.*.client_peak_rss_mib, modes.*.compute_s,
modes.*.server_nll, modes.*.edge_nll, diff.*.mean, diff.*.ci95

    python benchmarks/edge_quantized.py [--model smollm2-135m] [--seeds 0,1,2] [--rounds 3] [--lr 1e-3]
                                        [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, add_output_flags, emit, smoke
from edge_client import CONFIG, deploy, model_dir

MODES = ("none", "int8")
KEYS = ("first_contact_mib", "client_peak_rss_mib", "compute_s", "server_nll", "edge_nll")
BASELINE = ("import resource, torch, transformers, flwr, ciders.workloads.edge, ciders.models.edge_quant; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


def run_once(mdir: Path, tmp: Path, mode: str, seed: int, a: argparse.Namespace) -> dict:
    from ciders.fileio import read_jsonl

    tag = f"{mode}-s{seed}"
    cfg = tmp / f"{tag}.yaml"
    text = CONFIG.format(model=mdir, rounds=a.rounds, steps=a.steps, root=ROOT)
    assert "lr: 0.0001}" in text  # edge_client's client learning rate, replaced by --lr
    text = text.replace("lr: 0.0001}", f"lr: {a.lr}}}")
    cfg.write_text(text.replace("federation: {", f"federation: {{emulator_quantize: {mode}, ") + f"seed: {seed}\n")
    out, work = tmp / tag, tmp / f"{tag}-work"
    clients = deploy(cfg, out, work, True, None)
    recs = list(read_jsonl(out / "metrics.jsonl"))
    r0 = next(r for r in recs if r["event"] == "round" and r["round"] == 0)
    final = [r for r in recs if r["event"] == "eval"][-1]
    later = [r for r in clients if r["round"] >= 1] or clients
    return {"first_contact_mib": r0["bytes_down"]["emulator"] / 2 / 2**20,
            "client_peak_rss_mib": max(r["peak_rss_mib"] for r in clients),
            "compute_s": statistics.median(r["compute_s"] for r in later),
            "server_nll": final["global"]["nll"], "edge_nll": edge_nll(work / "nodes", out)}


def edge_nll(nodes: Path, out: Path) -> float:
    """Each node's own AdapEmu (as stored on it) with its personalized messenger, NLL on the run's global held-out
    set, in a fresh process per node: the mean over the nodes."""
    vals = []
    for node in sorted(nodes.iterdir()):
        code = ("import json, sys; from ciders.workloads.edge import node_model; from ciders.tasks import federated; "
                "from ciders.eval.metrics import perplexity; from ciders.tasks.text import batches; "
                f"d, tok, cfg, pers, cid, r = node_model({str(node)!r}); d.load_messenger(pers); "
                "data = federated.build(cfg, tok); "
                "rec = perplexity(d.adapemu, batches(data.global_eval, 4, tok.pad_token_id, d.device)); "
                "print(json.dumps(rec))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                             env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        if res.returncode != 0:
            raise SystemExit(f"edge NLL of {node} failed:\n{res.stderr[-3000:]}")
        vals.append(json.loads(res.stdout.strip().splitlines()[-1])["nll"])
    return sum(vals) / len(vals)


def paired(rows: dict, key: str) -> dict:
    """int8 - none per seed: mean and the half-width of its 95% t interval (`eval.stats.mean_ci95`)."""
    from ciders.eval.stats import mean_ci95

    return mean_ci95([q[key] - n[key] for n, q in zip(rows["none"], rows["int8"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="tiny or smollm2-135m")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="local steps per round")
    ap.add_argument("--lr", type=float, default=1e-3, help="the clients' learning rate (configs/demo.yaml's)")
    a = smoke(add_output_flags(ap).parse_args(), model="tiny", seeds="0", rounds=1, steps=1)
    seeds = [int(s) for s in a.seeds.split(",")]
    base = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, check=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    res = {"model": a.model, "seeds": seeds, "rounds": a.rounds, "steps": a.steps, "lr": a.lr,
           "baseline_mib": float(base.stdout.strip().splitlines()[-1]), "modes": {}, "diff": {}}
    with tempfile.TemporaryDirectory() as t:
        mdir = model_dir(a.model, Path(t))
        rows = {m: [] for m in MODES}
        for s in seeds:  # seed-major: both modes of a seed back to back, so a machine's drift cancels in the pairs
            for m in MODES:
                rows[m].append(run_once(mdir, Path(t), m, s, a))
    res["modes"] = {m: {k: statistics.fmean(r[k] for r in rows[m]) for k in KEYS} for m in MODES}
    res["runs"] = rows
    res["diff"] = {k: paired(rows, k) for k in KEYS}
    emit(res, a.json, lambda: report(res))


def report(res: dict) -> None:
    n, q = res["modes"]["none"], res["modes"]["int8"]
    print(f"{res['model']}, {len(res['seeds'])} seeds, {res['rounds']} rounds of {res['steps']} steps at lr "
          f"{res['lr']:g}; a client process that loads nothing: "
          f"{res['baseline_mib']:.0f} MiB")
    print(f"{'':22}{'none':>10}{'int8':>10}{'int8 - none (95% CI)':>28}")
    for k in KEYS:
        d = res["diff"][k]
        print(f"{k:22}{n[k]:10.4f}{q[k]:10.4f}{d['mean']:+16.4f} +- {d['ci95']:.4f}")
    print(f"int8 first download / fp32: {q['first_contact_mib'] / n['first_contact_mib']:.3f}")


if __name__ == "__main__":
    main()
