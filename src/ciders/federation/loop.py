"""The round loop, one for every method family and every engine (`run_rounds`), and the strategy a family
gives it (`Strategy`). The families' runs: `federation.ciders_loop.run_federation` (`ciders run CONFIG`) and
`federation.bilevel_loop.run_bilevel` (`ciders bilevel CONFIG`); the Flower ServerApp passes either its own
transport.

The loop owns what every run does the same way: the run directory (start, resume), admitting replies
(`exchange.admit`), counting bytes (`ledger.Traffic`), writing records through metrics.jsonl and the sinks, the
evaluation schedule (`federation.evaluates`), and each round's checkpoint and commit (`ledger.Ledger`). A strategy
holds the method: its state (explicit, replaced phase by phase), its messages and its server steps.

Crash safety: everything a round writes is tagged with its round; the round is committed by one atomic
write of checkpoints/LATEST. `--resume` deletes what a crashed round left behind, truncates
metrics.jsonl to the committed rounds, and redoes the round. Every random choice is derived from
(seed, round, client), so the redone round produces the same numbers as an uninterrupted run.
metrics.jsonl holds only reproducible numbers; wall-clock times go to timing.jsonl.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ciders.federation.exchange import Admitted, Exchange, admit
from ciders.federation.inprocess import Faults, SimulatedCrash
from ciders.federation.ledger import Ledger, Traffic, open_ledger
from ciders.federation.rundir import MIB, RunDir, check_same_config, sample_clients, start_run, summarize

# the run directory lives in federation.rundir, the faults in federation.inprocess; these names stay importable here
__all__ = ["MIB", "Faults", "RunDir", "SimulatedCrash", "Strategy", "check_same_config", "run_rounds",
           "sample_clients", "summarize"]


class Strategy(Protocol):
    """One method family's server, driven by `run_rounds` with Flower's verbs over explicit state (CIDERS:
    `federation.rounds.Coordinator`; RABO family: `federation.bilevel_rounds.BilevelServer`). What every run
    does the same way is the loop's, not the strategy's: the run directory, counting bytes, admitting replies,
    writing records, the evaluation schedule, checkpoint and commit."""

    experiment: Any  # the run's whole config (config.yaml); its `federation` section is the loop's
    run: RunDir
    ids: list[str]  # the registered clients (the sinks summarize per-client figures over them)
    log: Callable[[str], None]
    extends_rounds: bool  # a resume may raise federation.rounds (`rundir.check_same_config`)
    first_round: int  # the round after the last committed one (0 for a fresh run)
    ledger: Ledger  # given by run_rounds

    def prepare(self) -> list[dict]: ...
    def from_record(self, t: int, tensors: dict, meta: dict) -> None: ...
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
               progress: Callable[[int, str], None] | None = None, resume: bool = False) -> dict:
    """The round loop of every method on every engine, top to bottom:

        start the run directory (`rundir.start_run`: a committed run continues only with `resume`, with the same
        config), open the ledger
        [a fresh run: round -1, prepare(), evaluate(-1), records, checkpoint + commit]
        [a resumed run: from_record(the last committed round's checkpoint)]
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
    faults, fed = faults or Faults(), strategy.experiment.federation
    committed = start_run(strategy.run, strategy.experiment, resume, strategy.log, strategy.extends_rounds)
    led = strategy.ledger = open_ledger(strategy.experiment, strategy.run, committed, strategy.ids, strategy.log)
    if committed is not None:
        strategy.from_record(committed, *strategy.run.load_checkpoint(committed))
    else:
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
    led.close()  # only after a whole run: an MLflow run is marked finished
    return strategy.close()


def _end(strategy: Strategy, t: int, recs: list[dict], key: str, before_checkpoint=lambda: None) -> None:
    """A round's end: its records, its line and seconds, then the checkpoint and the commit."""
    led = strategy.ledger
    for rec in recs:
        led.record(rec)
    led.end_round(t, key)
    before_checkpoint()
    led.checkpoint(t, *strategy.to_record())
    strategy.commit(t)
