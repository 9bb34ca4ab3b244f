"""`ciders bilevel`: every method of the RABO family on the same task and data, side by side (Table II
shape: the final metric, C_x*, compute and communication relative to FedMBO)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ciders.federation.bilevel_loop import run_bilevel
from ciders.fileio import write_json


def run_experiment(exp, out: str | Path, methods: list[str], log: Callable[[str], None] = print,
                   engine: str = "local", resume: bool = False) -> dict:
    """Every method of `methods` (rabo, rafbo, fedmbo) on the same task and data; writes OUT/<method>/ and
    OUT/bilevel.md: the final metric and compute / communication relative to FedMBO (Table II shape).
    `engine`: local (this process) or flower-sim (Flower's simulation runtime, one virtual SuperNode per
    client; the same numbers). `resume`: each method continues from its checkpoint (same config only)."""
    from ciders.algorithms.registry import bilevel_config
    from ciders.workloads.bilevel import build
    from ciders.errors import ConfigError
    from ciders.fileio import write_text

    cfgs = {m: bilevel_config(exp, m) for m in methods}  # unknown methods fail before anything runs
    if engine not in ("local", "flower-sim"):
        raise ConfigError(f"unknown engine {engine!r}; choose local or flower-sim")
    out = Path(out)
    task = build(exp) if engine == "local" else None
    results = {}
    for m, cfg in cfgs.items():
        log(f"== {m}")
        if engine == "local":
            results[m] = run_bilevel(cfg, task, out / m, log=log, resume=resume)
        else:
            from ciders.transports.flower.server_app import run_simulation

            results[m] = run_simulation(cfg, out / m, resume=resume, log=log)
    write_text(out / "bilevel.md", table(results, out))
    write_json(out / "bilevel.json", results)
    return results


UNTRAINED = "untrained (round 0)"  # the label of a table's row for the initial model


def initial_eval(recs: list[dict]) -> dict | None:
    """The evaluation of the initial (untrained) model, round -1 of metrics.jsonl; None in a run made before it
    was always recorded."""
    return next((r for r in recs if r.get("event") == "eval" and r.get("round") == -1), None)


def table(results: dict, out: Path) -> str:
    from ciders.fileio import read_jsonl

    ref = results.get("fedmbo")
    # op estimate = loss evaluations x kept fraction; a double-backward Hessian-vector product counts as one
    # evaluation though it costs about two gradients, so it understates RABO against RAFBO
    lines = ["| method | final | C_x* (min over rounds) | op estimate / FedMBO | measured s / FedMBO "
             "| uplink / FedMBO | downlink / FedMBO |", "|---|---|---|---|---|---|---|"]

    def shown(fin: dict) -> str:
        return (f"{100 * fin['accuracy']:.2f} ± {100 * fin['ci95']:.2f} %" if "accuracy" in fin
                else f"{100 * fin['balanced_accuracy']:.2f} % balanced")

    # the initial model (every method starts from the same weights): what training added is read against it
    recs = {m: read_jsonl(out / m / "metrics.jsonl") for m in results}
    first = {m: initial_eval(recs[m]) for m in results}
    if first and all(v is not None for v in first.values()) and len({shown(v) for v in first.values()}) == 1:
        lines.append(f"| {UNTRAINED} | {shown(next(iter(first.values())))} | - | - | - | - | - |")
    for m, r in results.items():
        rounds = [x for x in recs[m] if x["event"] == "round"]
        metric = shown(r["final"])

        def rel(k):
            return f"{r[k] / ref[k]:.3f}" if ref and ref[k] else "-"

        lines.append(f"| {m} | {metric} | {min(x['covering_x'] for x in rounds)} | {rel('op_estimate')} "
                     f"| {rel('seconds')} | {rel('bytes_up')} | {rel('bytes_down')} |")
    return "\n".join(lines) + "\n"
