"""The round loop of RABO / RAFBO / FedMBO (`ciders.algorithms.rabo`) over a bilevel task, for both engines.

Per round q: `BilevelServer.begin(q)` (masks M(x_q, R_i), M(y_q, R_i)), then for each phase (inner, outer)
one message to each participating client and one reply, carried by an `exchange`: `InProcess` (the client
functions called directly) or the Flower engine's (`engines.flower.bilevel`); everything else is this loop,
so both engines write the same metrics.jsonl. Logged per round (one JSON line each in OUT/metrics.jsonl):
one client record per client and phase, the round record (covering numbers C_x*, C_y*, fraction of
coordinates trained, who took part) and the evaluation. Measured seconds go to OUT/timing.jsonl (wall
clock is not reproducible); summary.json has the totals.

Compute is reported three ways, because this implementation trains a sub-model as the full model with
masked (zero) coordinates, so its wall-clock time shows no saving: `seconds` (measured, dense), `calls`
(loss evaluations, including those inside second-order products) and `op_estimate` = calls x the kept
fraction of x and y coordinates (what a physically extracted sub-model would cost, to first order).
Bytes are the lengths of the messages actually sent (`core.submodel`: only kept entries travel, with the
index of the kept units on the downlink).

A task supplies: clients() -> [capacity]; initial() -> (x, y); groups() -> layer groups for masks;
batches(i, q, T) -> inner batches; outer_batch(i, q); g(x, y, batch), f(x, y, batch);
evaluate(x, y) -> metrics.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Callable, Protocol

from safetensors.torch import save_file

from ciders.engines.bilevel_rounds import BilevelServer, client_phase
from ciders.engines.rundir import RunDir
from ciders.fileio import append_jsonl, atomic_path, write_json

Replies = dict[int, tuple[bytes, dict]]


class Exchange(Protocol):
    def __call__(self, phase: str, q: int, messages: dict[int, bytes]) -> Replies: ...


class InProcess:
    """Every client in this process, each with its own scratch space; `drop` = {(round, phase, client)}
    replies that are lost (the fault tests)."""

    def __init__(self, exp, task, drop: set | None = None):
        self.exp, self.task, self.drop = exp, task, set(drop or ())
        self.scratch: dict[int, dict] = {}

    def __call__(self, phase: str, q: int, messages: dict[int, bytes]) -> Replies:
        out = {}
        for i, msg in messages.items():
            rep = client_phase(self.exp, self.task, phase, i, msg, self.scratch.setdefault(i, {}))
            if (q, phase, i) not in self.drop:
                out[i] = rep
        return out


def run_bilevel(exp, task, out: str | Path, log: Callable[[str], None] = print, exchange: Exchange | None = None,
                resume: bool = False) -> dict:
    """One run of `exp.method` (rounds = exp.federation.rounds); returns the summary. Every round ends with
    an atomic checkpoint (OUT/checkpoints: x, y, totals, the config's digest; `engines.rundir`); `resume` continues from it when
    the config is the same (episodes and masks depend only on the seed, the round and the state, so a
    resumed run equals an uninterrupted one), and otherwise starts afresh."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metrics, timing = out / "metrics.jsonl", out / "timing.jsonl"
    exchange = exchange or InProcess(exp, task)
    server = BilevelServer(exp, task, log=log)
    s0 = server.state
    full_x = sum(v.numel() * v.element_size() for v in s0.x.values())
    full_y = sum(v.numel() * v.element_size() for v in s0.y.values())
    full = {"down": full_x + 2 * full_y, "up": full_y + full_x}  # FedMBO's payloads per client and round
    digest = _digest(exp)
    ck = _load_checkpoint(out, digest, s0) if resume else None
    if ck is None:
        if resume and (out / "checkpoints").is_dir():
            log(f"{out}: the checkpoint is of another config; starting afresh")
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        metrics.unlink(missing_ok=True)
        timing.unlink(missing_ok=True)
        ev = server.evaluate()
        append_jsonl(metrics, {"event": "eval", "round": -1, **ev})
        totals = {"seconds": 0.0, "calls": 0, "op_estimate": 0.0, "bytes_up": 0, "bytes_down": 0}
        first = 0
    else:
        server.state, totals, ev = ck
        first = server.state.round
        RunDir(out).truncate_metrics(first - 1)  # records of the round the checkpoint does not hold
        log(f"{out}: resuming after round {first - 1}")
    rounds = exp.federation.rounds
    for q in range(first, rounds):
        server.begin(q)
        for phase in server.phases:
            msgs = {i: server.down(phase, i) for i in server.participants(phase)}
            replies = exchange(phase, q, msgs)
            totals["bytes_down"] += sum(len(m) for m in msgs.values())
            rejected = server.absorb(phase, {i: up for i, (up, _) in replies.items()})
            for i in sorted(replies):
                rec = dict(replies[i][1])
                secs = float(rec.pop("seconds", 0.0))
                append_jsonl(timing, {"round": q, "client": i, "phase": phase, "seconds": secs})
                if i in rejected:
                    continue
                append_jsonl(metrics, rec)
                for k in ("calls", "op_estimate", "bytes_up"):
                    totals[k] += rec[k]
                totals["seconds"] += secs
        rnd = {"event": "round", "round": q, **server.stats, "full_bytes_per_client": full}
        append_jsonl(metrics, rnd)
        ev = server.evaluate()
        append_jsonl(metrics, {"event": "eval", "round": q, **ev})
        _save_checkpoint(out, server.state, totals, ev, digest)
        log(f"round {q + 1}/{rounds}: C_x* {rnd['covering_x']} C_y* {rnd['covering_y']} {ev}")
    s = server.state
    with atomic_path(out / "final.safetensors") as tmp:
        save_file(_flat(s), str(tmp))
    summary = {"method": exp.method, "rounds": rounds, "clients": len(server.caps), "final": ev, **totals,
               "full_bytes_per_client_round": full}
    write_json(out / "summary.json", summary)
    return summary


def _digest(exp) -> str:
    from ciders.config import dump_yaml

    return hashlib.sha256(dump_yaml(exp).encode()).hexdigest()


def _flat(s) -> dict:
    return {**{f"x/{k}": v.detach().cpu().contiguous() for k, v in s.x.items()},
            **{f"y/{k}": v.detach().cpu().contiguous() for k, v in s.y.items()}}


def _save_checkpoint(out: Path, s, totals: dict, ev: dict, digest: str) -> None:
    """Round s.round - 1 committed: checkpoints/round_<n>/ then the LATEST pointer (`engines.rundir`)."""
    RunDir(out).save_checkpoint(s.round - 1, _flat(s), {"round": s.round, "totals": totals, "eval": ev,
                                                        "config": digest}, keep=2)


def _load_checkpoint(out: Path, digest: str, s0):
    """(state, totals, last eval) of the last committed round, or None if there is none or it is of
    another config."""
    from ciders.algorithms.rabo import BilevelState
    from ciders.errors import CidersError

    rd = RunDir(out)
    t = rd.committed()
    if t is None:
        return None
    tensors, meta = rd.load_checkpoint(t)
    if meta.get("config") != digest:
        return None
    try:
        x = {k: tensors[f"x/{k}"].to(v.device) for k, v in s0.x.items()}
        y = {k: tensors[f"y/{k}"].to(v.device) for k, v in s0.y.items()}
    except KeyError as exc:
        raise CidersError(f"{out}: the checkpoint of round {t} lacks {exc}; the run directory is damaged") from exc
    return BilevelState(int(meta["round"]), x, y), meta["totals"], meta["eval"]


def run_experiment(exp, out: str | Path, methods: list[str], log: Callable[[str], None] = print,
                   engine: str = "local", resume: bool = False) -> dict:
    """Every method of `methods` (rabo, rafbo, fedmbo) on the same task and data; writes OUT/<method>/ and
    OUT/bilevel.md: the final metric and compute / communication relative to FedMBO (Table II shape).
    `engine`: local (this process) or flower-sim (Flower's simulation runtime, one virtual SuperNode per
    client; the same numbers). `resume`: each method continues from its checkpoint (same config only)."""
    from ciders.config import dump_yaml
    from ciders.engines.bilevel_rounds import method_config
    from ciders.engines.bilevel_tasks import build
    from ciders.errors import ConfigError
    from ciders.fileio import write_text

    cfgs = {m: method_config(exp, m) for m in methods}  # unknown methods fail before anything runs
    if engine not in ("local", "flower-sim"):
        raise ConfigError(f"unknown engine {engine!r}; choose local or flower-sim")
    out = Path(out)
    task = build(exp) if engine == "local" else None
    results = {}
    for m, cfg in cfgs.items():
        (out / m).mkdir(parents=True, exist_ok=True)
        write_text(out / m / "config.yaml", dump_yaml(cfg))
        log(f"== {m}")
        if engine == "local":
            results[m] = run_bilevel(cfg, task, out / m, log=log, resume=resume)
        else:
            from ciders.engines.flower.server_app import run_simulation

            results[m] = run_simulation(cfg, out / m, resume=resume, log=log)
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
