"""An in-process round loop for RABO / RAFBO / FedMBO (`ciders.algorithms.rabo`) over a bilevel task.

Per round q and client i: masks M(x_q, R_i), M(y_q, R_i) -> inner phase (T masked steps, upload G^i) ->
server inner step -> outer phase (masked hypergradient) -> server outer step. Logged per round (one JSON
line each in OUT/metrics.jsonl): covering numbers C_x*, C_y*, fraction of coordinates trained, per-client
compute and bytes per direction. Compute is reported three ways, because this implementation trains a
sub-model as the full model with masked (zero) coordinates, so its wall-clock time shows no saving:
`seconds` (measured, dense), `calls` (loss evaluations, including those inside second-order products)
and `op_estimate` = calls x the kept fraction of x and y coordinates (what a physically extracted
sub-model would cost, to first order). Only the masked coordinates travel: a payload costs its kept entries x item size,
plus the index of kept units per layer (one int32 each).

A task supplies: clients() -> [capacity]; initial() -> (x, y); groups() -> layer groups for masks;
batches(i, q, T) -> inner batches; outer_batch(i, q); g(x, y, batch), f(x, y, batch);
evaluate(x, y) -> metrics.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ciders.algorithms import rabo as rb
from ciders.core import masks as mk
from ciders.fileio import append_jsonl, write_json


def payload_bytes(values: dict, mask: dict) -> int:
    """Bytes of a masked payload: kept entries plus one int32 index per kept output unit."""
    n = 0
    for k, v in values.items():
        m = mask[k]
        n += int(m.sum()) * v.element_size()
        n += 4 * int(m.reshape(m.shape[0], -1).amax(1).sum()) if m.dim() >= 1 else 0
    return n


def _kept_fraction(m: rb.ClientMasks) -> float:
    return mk.masked_fraction({**{f"x/{k}": v for k, v in m.x.items()}, **{f"y/{k}": v for k, v in m.y.items()}})


class _Counter:
    """Counts gradient evaluations of f and g (a second-order product by autograd costs ~2, by finite
    differences 2 gradient calls; both show up here as the calls they make)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a):
        self.calls += 1
        return self.fn(*a)


def run_bilevel(cfg: rb.RaboConfig, task, rounds: int, out: str | Path, log: Callable[[str], None] = print) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    x0, y0 = task.initial()
    s = rb.init_state(x0, y0)
    caps = task.clients()
    full_x = sum(v.numel() * v.element_size() for v in x0.values())
    full_y = sum(v.numel() * v.element_size() for v in y0.values())
    ev = task.evaluate(s.x, s.y)
    append_jsonl(metrics, {"event": "eval", "round": -1, **ev})
    totals = {"seconds": 0.0, "calls": 0, "op_estimate": 0.0, "bytes_up": 0, "bytes_down": 0}
    for q in range(rounds):
        masks = [rb.client_masks(cfg, s, r, groups=task.groups()) for r in caps]
        Gs, t_in, calls = [], [], []
        for i, m in enumerate(masks):
            g = _Counter(task.g)
            t0 = time.perf_counter()
            G, _ = rb.inner_update(cfg, s, m, g, task.batches(i, q, cfg.inner_steps))
            t_in.append(time.perf_counter() - t0)
            calls.append(g.calls)
            Gs.append(G)
        mid, si = rb.server_inner(cfg, s, Gs, masks)
        hs, recs = [], []
        for i, m in enumerate(masks):
            f, g = _Counter(task.f), _Counter(task.g)
            batch = task.outer_batch(i, q)
            t0 = time.perf_counter()
            h, om = rb.outer_update(cfg, mid, m, f, g, batch)
            secs = t_in[i] + time.perf_counter() - t0
            hs.append(h)
            down = payload_bytes(s.x, m.x) + payload_bytes(s.y, m.y) + payload_bytes(mid.y, m.y)
            up = payload_bytes(Gs[i], m.y) + payload_bytes(h, m.x)
            kept = _kept_fraction(m)
            n_calls = calls[i] + f.calls + g.calls
            recs.append({"event": "client", "round": q, "client": i, "capacity": caps[i], "seconds": secs,
                         "calls": n_calls, "kept_fraction": kept, "op_estimate": n_calls * kept,
                         "bytes_up": up, "bytes_down": down, **om})
            totals["seconds"] += secs
            totals["calls"] += n_calls
            totals["op_estimate"] += n_calls * kept
            totals["bytes_up"] += up
            totals["bytes_down"] += down
        s, so = rb.server_outer(cfg, mid, hs, masks)
        for r in recs:
            append_jsonl(metrics, r)
        append_jsonl(metrics, {"event": "round", "round": q, **si, **so,
                               "full_bytes_per_client": {"down": full_x + 2 * full_y, "up": full_y + full_x}})
        ev = task.evaluate(s.x, s.y)
        append_jsonl(metrics, {"event": "eval", "round": q, **ev})
        log(f"round {q + 1}/{rounds}: C_x* {so['covering_x']} C_y* {si['covering_y']} {ev}")
    summary = {"method": cfg.method, "rounds": rounds, "clients": len(caps), "final": ev, **totals,
               "full_bytes_per_client_round": {"down": full_x + 2 * full_y, "up": full_y + full_x}}
    write_json(out / "summary.json", summary)
    return summary


def run_experiment(exp, out: str | Path, methods: list[str], log: Callable[[str], None] = print) -> dict:
    """Every method of `methods` (rabo, rafbo, fedmbo) on the same task and data; writes OUT/<method>/ and
    OUT/bilevel.md: the final metric and compute / communication relative to FedMBO (Table II shape)."""
    from dataclasses import replace

    from ciders.config import dump_yaml
    from ciders.engines.bilevel_tasks import build
    from ciders.errors import ConfigError
    from ciders.fileio import write_text

    bad = [m for m in methods if m not in ("rabo", "rafbo", "fedmbo")]
    if bad:
        raise ConfigError(f"unknown bilevel method {bad[0]!r}; choose from rabo, rafbo, fedmbo")
    out = Path(out)
    task = build(exp)
    results = {}
    for m in methods:
        cfg = replace(exp, rabo=replace(exp.rabo, method=m, mask_rule="full" if m == "fedmbo" else exp.rabo.mask_rule))
        cfg = cfg.validate()
        (out / m).mkdir(parents=True, exist_ok=True)
        write_text(out / m / "config.yaml", dump_yaml(cfg))
        log(f"== {m}")
        results[m] = run_bilevel(cfg.rabo, task, exp.federation.rounds, out / m, log=log)
    write_text(out / "bilevel.md", table(results, out))
    write_json(out / "bilevel.json", results)
    return results


def table(results: dict, out: Path) -> str:
    from ciders.fileio import read_jsonl

    ref = results.get("fedmbo")
    # op estimate = loss evaluations x kept fraction; a double-backward Hessian-vector product counts as one
    # evaluation though it costs about two gradients, so it understates RABO against RAFBO
    lines = ["| method | final | C_x* (min over rounds) | op estimate / FedMBO | measured s / FedMBO "
             "| uplink / FedMBO | downlink / FedMBO |", "|---|---|---|---|---|---|---|"]
    for m, r in results.items():
        rounds = [x for x in read_jsonl(out / m / "metrics.jsonl") if x["event"] == "round"]
        fin = r["final"]
        metric = (f"{100 * fin['accuracy']:.2f} ± {100 * fin['ci95']:.2f} %" if "accuracy" in fin
                  else f"{100 * fin['balanced_accuracy']:.2f} % balanced")

        def rel(k):
            return f"{r[k] / ref[k]:.3f}" if ref and ref[k] else "-"

        lines.append(f"| {m} | {metric} | {min(x['covering_x'] for x in rounds)} | {rel('op_estimate')} "
                     f"| {rel('seconds')} | {rel('bytes_up')} | {rel('bytes_down')} |")
    return "\n".join(lines) + "\n"
