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

from ciders.federation.bilevel_client import client_phase
from ciders.federation.bilevel_rounds import BilevelServer
from ciders.federation.exchange import Exchange
from ciders.federation.inprocess import Faults, InProcess
from ciders.federation.loop import run_rounds
from ciders.fileio import locked


def in_process(exp, task, faults: Faults | None = None) -> InProcess:
    """Every client in this process, each with its own scratch space between its phases."""
    scratch: dict[str, dict] = {}

    def client(phase: str, cid: str, msg: bytes) -> tuple[bytes, dict]:
        return client_phase(exp, task, phase, cid, msg, scratch.setdefault(cid, {}))

    return InProcess(client, faults)


def run_bilevel(exp, task, out: str | Path, log: Callable[[str], None] = print, exchange: Exchange | None = None,
                resume: bool = False, faults: Faults | None = None) -> dict:
    """One run of `exp.method` (rounds = exp.federation.rounds); returns the summary. Every round ends with
    an atomic checkpoint (OUT/checkpoints: x, y, the step bound's references, totals); `resume` continues from
    it (episodes and masks depend only on the seed, the round and the state, so a resumed run equals an
    uninterrupted one)."""
    with locked(out):  # the run directory is this process's until the run ends (`rundir.start_run`)
        server = BilevelServer(exp, task, log=log, out=out)
        return run_rounds(server, exchange or in_process(exp, task, faults), exp.federation.rounds, faults,
                          resume=resume)
