"""The round loop, one for every method family and every engine (`run_rounds`), and `run_federation`, the
CIDERS run behind `ciders run CONFIG` (in-process by default; the Flower ServerApp passes its own
transport).

One CIDERS round, top to bottom (Algorithm 2, docs/method.md):
  sample clients -> broadcast (encoded; bytes counted) -> the transport -> client_update for each (decoded
  on the client side; its durable state written to the client's store) -> uploads -> server_update
  (Eq. 11-12) -> task.after_server (TAKD, Eq. 13) -> [report: personalized messengers] -> evaluate -> log
  -> checkpoint + commit.

Crash safety: everything a round writes is tagged with its round; the round is committed by one atomic
write of checkpoints/LATEST. `--resume` deletes what a crashed round left behind, truncates
metrics.jsonl to the committed rounds, and redoes the round. Every random choice is derived from
(seed, round, client), so the redone round produces the same numbers as an uninterrupted run.
metrics.jsonl holds only reproducible numbers; wall-clock times go to timing.jsonl.

A *task* supplies the model-specific parts (an LLM decomposition, or synthetic vectors in tests):
  clients() -> {client_id: n_examples};  initial_messenger() -> State
  initial_extra() -> (extra tensors, extra meta, metrics)     e.g. TAKD pre-alignment of B_L
  extra_from_record(tensors, meta)                            restore it from a checkpoint
  downlink_extra(extra) -> {component: State}                 e.g. the student LoRA, broadcast each round
  static_extra() -> set of those components that never change after initial_extra (sent at first contact
                    only; optional, default none: e.g. the student LoRA when takd.round_steps = 0)
  begin_round(t, extra)                                       e.g. load the student LoRA
  loss_fn(client_id) -> LossFn;  batches(client_id, t, n, seed) -> list of n batches
  after_server(t, server_state, extra) -> (extra', metrics)   e.g. TAKD warm-started steps
  evaluate(t, server_state, personalized: {id: State}) -> metrics
  finalize(out_dir, server_state, extra)                      e.g. write the final adapters
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import ExperimentConfig
from ciders.errors import ConfigError
from ciders.federation import console
from ciders.federation.exchange import Admitted, Exchange, admit
from ciders.federation.ledger import Ledger, Traffic
from ciders.federation.inprocess import Faults, InProcess, SimulatedCrash
from ciders.fileio import locked
from ciders.federation.rundir import MIB, RunDir, check_same_config, sample_clients, summarize


# the run directory lives in federation.rundir; these names stay importable from here
__all__ = ["MIB", "Faults", "RunDir", "SimulatedCrash", "Strategy", "Task", "check_same_config",
           "run_federation", "run_rounds", "sample_clients", "summarize"]

class Task(Protocol):  # see the module docstring
    def clients(self) -> dict[str, int]: ...
    def initial_messenger(self) -> dict: ...
    def initial_extra(self) -> tuple[dict, dict, dict]: ...
    def extra_from_record(self, tensors: dict, meta: dict) -> Any: ...
    def extra_record(self, extra: Any) -> tuple[dict, dict]: ...
    def downlink_extra(self, extra: Any) -> dict: ...
    def begin_round(self, t: int, downlink_extra: dict) -> None: ...
    def loss_fn(self, client_id: str) -> Callable: ...
    def batches(self, client_id: str, t: int, n: int, seed: int) -> list: ...
    def after_server(self, t: int, server: alg.ServerState, extra: Any) -> tuple[Any, dict]: ...
    def evaluate(self, t: int, server: alg.ServerState, personalized: dict) -> dict: ...
    def finalize(self, out: Path, server: alg.ServerState, extra: Any) -> None: ...


class Strategy(Protocol):
    """One method family's server, driven by `run_rounds` with Flower's verbs over explicit state (CIDERS:
    `federation.rounds.Coordinator`; RABO family: `federation.bilevel_rounds.BilevelServer`). What every run
    does the same way is the loop's, not the strategy's: counting bytes, admitting replies, writing records,
    the evaluation schedule, checkpoint and commit."""

    first_round: int  # the round after the last committed one (0 for a fresh run)
    fresh: bool  # nothing committed yet: the loop starts with round -1 (`prepare`, the first evaluation)
    federation: Any  # the run's federation section (`config.federation.RunFederation`)
    ledger: Ledger

    def prepare(self) -> list[dict]: ...
    def begin(self, t: int) -> None: ...
    def phases(self, t: int) -> tuple[str, ...]: ...
    def configure(self, phase: str, t: int) -> dict[str, bytes]: ...
    def count(self, direction: str, phase: str, cid: str, msg: bytes) -> dict[str, int] | None: ...
    def aggregate(self, phase: str, t: int, got: Admitted, traffic: Traffic,
                  mark: Callable[[str], None]) -> list[dict]: ...
    def finish(self, t: int, traffic: Traffic) -> list[dict]: ...
    def evaluate(self, t: int) -> dict: ...
    def to_record(self) -> tuple[dict, dict]: ...
    def commit(self, t: int) -> None: ...
    def close(self) -> dict: ...


def run_rounds(strategy: Strategy, exchange: Exchange, rounds: int, faults: Faults | None = None,
               progress: Callable[[int, str], None] | None = None) -> dict:
    """The round loop of every method on every engine, top to bottom:

        [round -1, a fresh run: prepare(), evaluate(-1), records, checkpoint + commit]
        for each round t not yet committed:
            begin(t)                                       sampling, masks
            for each phase of the round:
                msgs = configure(phase, t)                 {client: bytes}; counted (`Traffic`)
                got = admit(exchange(phase, t, msgs))      the transport moves the bytes; replies admitted, counted
                records += aggregate(phase, t, got)        checks, aggregation, server steps
            records += finish(t) [+ evaluate(t) when federation.evaluates(t)]
            ledger: records, end of round; checkpoint (to_record) and commit (one atomic pointer write)

    `faults` names crash points for the tests (client:<k> inside the in-process transport, the strategy's own
    points, checkpoint, commit)."""
    faults, led, fed = faults or Faults(), strategy.ledger, strategy.federation
    if strategy.fresh:
        recs = strategy.prepare()
        if fed.evaluates(-1):
            recs.append(led.evaluation(-1, strategy.evaluate(-1)))
        _end(strategy, -1, recs, "prealign_and_eval_s")
    for t in range(strategy.first_round, rounds):
        led.start_round()
        strategy.begin(t)
        traffic = Traffic()
        for phase in strategy.phases(t):
            if progress is not None:
                progress(t, phase)
            msgs = strategy.configure(phase, t)
            for cid, m in msgs.items():
                traffic.add("down", cid, m, strategy.count("down", phase, cid, m))
            got = admit(exchange(phase, t, msgs), msgs, phase, t)
            for r in got.replies:
                traffic.add("up", r.client_id, r.payload, strategy.count("up", phase, r.client_id, r.payload))
            for rec in strategy.aggregate(phase, t, got, traffic, lambda point: faults.maybe_crash(t, point)):
                led.record(rec)
        recs = strategy.finish(t, traffic)
        if fed.evaluates(t):
            recs.append(led.evaluation(t, strategy.evaluate(t)))
        _end(strategy, t, recs, "seconds", lambda: faults.maybe_crash(t, "checkpoint"))
        faults.maybe_crash(t, "commit")
    try:
        return strategy.close()
    finally:
        led.close()


def _end(strategy: Strategy, t: int, recs: list[dict], key: str, before_checkpoint=lambda: None) -> None:
    """A round's end: its records, its line and seconds, then the checkpoint and the commit."""
    led = strategy.ledger
    for rec in recs:
        led.record(rec)
    led.end_round(t, key)
    before_checkpoint()
    led.checkpoint(t, *strategy.to_record())
    strategy.commit(t)


def run_federation(cfg: ExperimentConfig, task: Task, out: str | Path, resume: bool = False,
                   faults: Faults | None = None, log: Callable[[str], None] = console.info, progress: bool = True,
                   exchange: Exchange | None = None) -> dict:
    """Run (or resume) the federation of `cfg.algorithm.name` (CIDERS or a baseline; `ciders.algorithms`):
    the Coordinator's rounds (`federation.rounds`) over `exchange`, by default every client called in this
    process (`federation.inprocess`). `log` gets one line per event worth reading (by default the `ciders`
    logger, whose lines also go to OUT/run.log); `progress`: a bar over each round's clients where stderr
    is a terminal (`federation.console`)."""
    with locked(out), console.run_log(out):  # the run directory is this process's until the run ends
        return _run_federation(cfg, task, out, resume, faults, log, progress, exchange)


def _run_federation(cfg, task, out, resume, faults, log, progress, exchange) -> dict:
    from ciders.federation.rounds import Coordinator, client_phase, client_report
    from ciders.federation.secure import Sessions

    if exchange is None and cfg.federation.partition == "nodes":
        raise ConfigError("federation.partition=nodes: the clients' data lives on their SuperNodes (data-file); run "
                          "it on a Flower deployment (`ciders flower launch` / `loopback`), not in-process")
    co = Coordinator(cfg, task, out, resume=resume, log=log, engine="local" if exchange is None else "remote")
    cfg, fed = co.cfg, co.cfg.federation
    faults = faults or Faults()
    bars = _RoundBars(progress, fed.rounds, cfg.algorithm.method)
    if exchange is None:
        sessions = Sessions(Path(out) / "clients-secagg")  # the in-process clients' own protocol secrets

        def client(phase: str, cid: str, msg: bytes) -> tuple[bytes, dict]:
            if phase == "report":
                return client_report(co.clients_store, cid), {}
            # the in-process client's references: the server's own tensors
            return client_phase(phase, cfg, task, co.clients_store, cid, msg, dict(co.round.down_extra),
                                sessions=sessions)

        exchange = InProcess(client, faults, corrupt=lambda up: _nan_upload(up, co.ref), on_reply=bars.reply)

    try:
        return run_rounds(co, exchange, fed.rounds, faults, progress=lambda t, phase: bars.phase(t, phase, co))
    finally:
        bars.close()


class _RoundBars:
    """One progress bar per train phase, over the round's sampled clients (numbered as metrics.jsonl)."""

    def __init__(self, enabled: bool, rounds: int, method: str):
        self.enabled, self.rounds, self.method, self.bar = enabled, rounds, method, None

    def phase(self, t: int, phase: str, co) -> None:
        self.close()
        if phase == "train":
            self.bar = console.bar(self.enabled, total=len(co.round.sampled), unit="client", leave=False,
                                   desc=f"{self.method} {console.round_label(t, self.rounds)} client steps")

    def reply(self, cid: str, rec: dict) -> None:
        if rec and self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.3f}" if "loss" in rec else "resync")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _nan_upload(upmsg: bytes, ref: dict) -> bytes:
    """Faults.corrupt for CIDERS: the same upload with a NaN increment (the finite check must reject it)."""
    up = codec.decode_upload(upmsg, ref)
    return codec.encode_upload(alg.Upload(up.client_id, up.round, up.base_version,
                                          {k: torch.full_like(v, float("nan")) for k, v in up.dc.items()}))[0]
