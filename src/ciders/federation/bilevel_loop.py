"""RABO / RAFBO / FedMBO and the RABO-family baselines (`ciders.algorithms.rabo`) through the round loop of
every method (`federation.loop.run_rounds`), on any transport.

Per round q: `BilevelServer.begin(q)` (masks M(x_q, R_i), M(y_q, R_i)), then for each phase (inner, outer;
or local for the full-model baselines) one message to each participating client and one reply, carried
by the transport: in-process (`in_process`) or Flower (`transports.flower.exchange`). Logged per round
(one JSON line each in OUT/metrics.jsonl): one client record per client and phase, the round record
(covering numbers C_x*, C_y*, fraction of coordinates trained, who took part) and the evaluation. Measured
seconds go to OUT/timing.jsonl (wall clock is not reproducible); summary.json has the totals.

Compute is reported three ways. Each client computes on its extracted sub-model (`core.submodel`: the
dense tensors of the channels / neurons it keeps, so its measured `seconds` are the sub-model's), plus
`calls` (loss evaluations, including those inside second-order products) and `op_estimate` = calls x
`flops_fraction`, the sub-model's forward FLOPs per example over the full model's, counted from its
shapes (`task.flops`; about R^2 for a layer between two pruned ones). `param_bytes` is the size of the
tensors the client holds. Bytes are the lengths of the messages actually sent (only kept entries travel,
with the indices of the kept rows and columns on the downlink).

Run directories behave as CIDERS's (`federation.rundir.start_run`): a directory holding a committed run
needs `resume`, and a resume must use the same config.

A task supplies: clients() -> [capacity]; initial() -> (x, y); units() -> the sub-model plan of x and y;
batches(i, q, T) -> inner batches; outer_batch(i, q); g(x, y, batch), f(x, y, batch);
evaluate(x, y) -> metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from safetensors.torch import save_file

from ciders.errors import CidersError
from ciders.core.wire import PayloadError
from ciders.federation.bilevel_rounds import BilevelServer, client_phase, client_record
from ciders.federation.exchange import Exchange, Reply
from ciders.federation.inprocess import Faults, InProcess
from ciders.federation.loop import run_rounds
from ciders.federation.rundir import RunDir, start_run
from ciders.fileio import append_jsonl, atomic_path, locked, write_json


def in_process(exp, task, faults: Faults | None = None) -> InProcess:
    """Every client in this process, each with its own scratch space between its phases."""
    scratch: dict[str, dict] = {}

    def client(phase: str, cid: str, msg: bytes) -> tuple[bytes, dict]:
        return client_phase(exp, task, phase, cid, msg, scratch.setdefault(cid, {}))

    return InProcess(client, faults)


class BilevelRounds:
    """The RABO family's side of `run_rounds`: BilevelServer's phases, plus the run directory (records,
    totals, checkpoints)."""

    def __init__(self, exp, task, out: str | Path, resume: bool = False, log: Callable[[str], None] = print):
        self.exp, self.log = exp, log
        self.run = run = RunDir(out)
        self.server = server = BilevelServer(exp, task, log=log)
        s0 = server.state
        full_x = sum(v.numel() * v.element_size() for v in s0.x.values())
        full_y = sum(v.numel() * v.element_size() for v in s0.y.values())
        self.full = {"down": full_x + 2 * full_y, "up": full_y + full_x}  # FedMBO's payloads per client and round
        committed = start_run(run, exp, resume, log)
        if committed is None:
            self.ev = {}
            if exp.federation.evaluates(-1):  # the initial model (the learning curve's start)
                self.ev = server.evaluate()
                append_jsonl(run.metrics, {"event": "eval", "round": -1, **self.ev})
            self.totals = {"seconds": 0.0, "calls": 0, "op_estimate": 0.0, "bytes_up": 0, "bytes_down": 0}
        else:
            server.state, self.totals, self.ev = _load_checkpoint(run, committed, s0)
            log(f"{run.root}: resuming after round {committed}")
        self.first_round = server.state.round
        self.sent: dict[str, int] = {}

    def begin(self, q: int) -> None:
        self.server.begin(q)

    def phases(self, q: int) -> tuple[str, ...]:
        return self.server.phases

    def messages(self, phase: str, q: int) -> dict[str, bytes]:
        msgs = {i: self.server.down(phase, i) for i in self.server.participants(phase)}
        self.totals["bytes_down"] += sum(len(m) for m in msgs.values())
        self.sent = {i: len(m) for i, m in msgs.items()}  # this phase's downlink bytes per client
        return msgs

    def absorb(self, phase: str, q: int, replies: list[Reply], mark: Callable[[str], None] = lambda p: None) -> None:
        """Take the valid replies (a client's record is checked first: one that does not fit rejects the
        reply), run the server step, then write each accepted client's record as the server composes it."""
        got: dict[str, Reply] = {}
        recs: dict[str, dict] = {}
        for r in replies:
            why = self._refusal(r, got, phase, self.sent)
            if why is None:
                try:
                    recs[r.client_id] = client_record(self.server, phase, r.client_id, r.record,
                                                      self.sent.get(r.client_id, 0), len(r.payload))
                except PayloadError as exc:
                    why = f"rejected the reply of {r.client_id}: {exc}"
            if why is not None:
                self.log(f"round {q} {phase}: {why}")
                continue
            got[r.client_id] = r
        rejected = self.server.absorb(phase, {i: r.payload for i, r in got.items()})
        for i in (c for c in self.server.ids if c in got):
            rec = recs[i]
            secs = float(rec.pop("seconds"))
            append_jsonl(self.run.timing, {"round": q, "client": i, "phase": phase, "seconds": secs})
            if i in rejected:
                continue
            append_jsonl(self.run.metrics, rec)
            for k in ("calls", "op_estimate", "bytes_up"):
                self.totals[k] += rec[k]
            self.totals["seconds"] += secs
        mark(phase)

    @staticmethod
    def _refusal(r: Reply, got: dict, phase: str, sent: dict) -> str | None:
        if r.client_id not in sent:
            return f"a reply from {str(r.client_id)[:64]!r}, which was sent no {phase} message: ignored"
        if r.error is not None:
            return f"{r.client_id} failed ({str(r.error)[:200]}): rejected"
        if r.rejected is not None:
            return f"rejected the reply of {r.client_id}: {r.rejected}"
        if r.kind != "reply":
            return f"a {r.kind} delivery from {r.client_id} is not part of the round: ignored"
        if r.client_id in got:
            return f"a second reply from {r.client_id}: ignored"
        return None

    def commit(self, q: int, before_checkpoint: Callable[[], None] | None = None) -> None:
        rnd = {"event": "round", "round": q, **self.server.finish(), "full_bytes_per_client": self.full}
        append_jsonl(self.run.metrics, rnd)
        evaluated = self.exp.federation.evaluates(q)
        if evaluated:
            self.ev = self.server.evaluate()
            append_jsonl(self.run.metrics, {"event": "eval", "round": q, **self.ev})
        if before_checkpoint is not None:
            before_checkpoint()
        s = self.server.state  # round q committed: checkpoints/round_<n>/ then the LATEST pointer
        self.run.save_checkpoint(q, _flat(s), {"round": s.round, "ref_norm": s.ref, "totals": self.totals,
                                               "eval": self.ev}, keep=self.exp.federation.checkpoint_keep)
        self.log(f"round {q}/{self.exp.federation.rounds - 1}: C_x* {rnd['covering_x']} C_y* {rnd['covering_y']} "
                 f"{self.ev if evaluated else '(not evaluated: federation.eval_rounds)'}")

    def close(self) -> dict:
        s = self.server.state
        with atomic_path(self.run.root / "final.safetensors") as tmp:
            save_file(_flat(s), str(tmp))
        summary = {"method": self.exp.method, "rounds": self.exp.federation.rounds, "clients": len(self.server.caps),
                   "final": self.ev, "final_by_capacity": self.server.evaluate_capacities(), **self.totals,
                   "full_bytes_per_client_round": self.full}
        write_json(self.run.root / "summary.json", summary)
        return summary


def run_bilevel(exp, task, out: str | Path, log: Callable[[str], None] = print, exchange: Exchange | None = None,
                resume: bool = False, faults: Faults | None = None) -> dict:
    """One run of `exp.method` (rounds = exp.federation.rounds); returns the summary. Every round ends with
    an atomic checkpoint (OUT/checkpoints: x, y, the step bound's references, totals); `resume` continues from
    it (episodes and masks depend only on the seed, the round and the state, so a resumed run equals an
    uninterrupted one)."""
    with locked(out):  # the run directory is this process's until the run ends (`rundir.start_run`)
        rounds = BilevelRounds(exp, task, out, resume=resume, log=log)
        return run_rounds(rounds, exchange or in_process(exp, task, faults), exp.federation.rounds, faults)


def _flat(s) -> dict:
    return {**{f"x/{k}": v.detach().cpu().contiguous() for k, v in s.x.items()},
            **{f"y/{k}": v.detach().cpu().contiguous() for k, v in s.y.items()}}


def _load_checkpoint(rd: RunDir, t: int, s0):
    """(state, totals, last eval) of committed round t. Meta "ref_norm" ({"x": ||x_0||, "y": ||y_0||, "xy":
    ||(x_0, y_0)||}, the step bound's references; floats, exact through JSON) is absent in checkpoints written
    before the bound had fixed references: they become the norms of the x and y the checkpoint holds (the bound of
    the round resumed, as the old rule had it), fixed from then on."""
    from ciders.algorithms.rabo import BilevelState, ref_norms

    tensors, meta = rd.load_checkpoint(t)
    try:
        x = {k: tensors[f"x/{k}"].to(v.device) for k, v in s0.x.items()}
        y = {k: tensors[f"y/{k}"].to(v.device) for k, v in s0.y.items()}
    except KeyError as exc:
        raise CidersError(f"{rd.root}: the checkpoint of round {t} lacks {exc}; the run directory is damaged") from exc
    ref = meta.get("ref_norm")
    ref = ref_norms(x, y) if ref is None else {k: float(ref[k]) for k in ("x", "y", "xy")}
    return BilevelState(int(meta["round"]), x, y, ref), meta["totals"], meta["eval"]
