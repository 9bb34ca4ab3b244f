"""What a run writes about itself, one way for both method families, driven by the round loop
(`federation.loop.run_rounds`):

- `Traffic`: one round's bytes, per component and per client, in each direction. The loop counts every message
  it hands to the transport and every reply the transport admits; the family only names a message's components
  (`Strategy.count`), or says it is not counted (e.g. the broadcasts of a method without communication).
- `Ledger`: the records (metrics.jsonl, the source of truth, and the sinks: the console's round line,
  TensorBoard, MLflow), the wall clock (timing.jsonl), the evaluation files and the checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ciders.federation.rundir import MIB, RunDir
from ciders.federation.sinks import Sink, open_sinks
from ciders.fileio import append_jsonl, read_jsonl, write_json


@dataclass
class Traffic:
    """One round's bytes: `down` / `up` per component (summed over the clients), `down_by` / `up_by` per client
    (summed over the round's phases). Counted by the loop alone."""

    down: dict = field(default_factory=dict)
    up: dict = field(default_factory=dict)
    down_by: dict = field(default_factory=dict)
    up_by: dict = field(default_factory=dict)

    def add(self, direction: str, cid: str, msg: bytes, components: dict | None) -> None:
        """Count `msg` (client `cid`, `direction` "down" or "up"), `components` its bytes per component; None:
        a message that is not counted (it is not sent in the method's own terms)."""
        if components is None:
            return
        total, by = (self.down, self.down_by) if direction == "down" else (self.up, self.up_by)
        by[cid] = by.get(cid, 0) + len(msg)
        for k, v in components.items():
            total[k] = total.get(k, 0) + v


class Ledger:
    """Every record, time, evaluation and checkpoint a run writes (see the module docstring)."""

    def __init__(self, run: RunDir, sinks: Sink, keep: int):
        self.run, self.sinks, self.keep = run, sinks, keep
        self.started = time.perf_counter()

    def record(self, rec: dict) -> None:
        append_jsonl(self.run.metrics, rec)
        self.sinks.write(rec)

    def timing(self, rec: dict) -> None:
        append_jsonl(self.run.timing, rec)  # wall clock: not reproducible, so never in metrics.jsonl

    def start_round(self) -> None:
        self.started = time.perf_counter()

    def end_round(self, t: int, key: str = "seconds") -> None:
        """The round's seconds to timing.jsonl, and the sinks' end of round (the console's line; the mirrors
        flushed, so a crash after this keeps them)."""
        secs = time.perf_counter() - self.started
        self.timing({"round": t, key: secs})
        self.sinks.end_round(t, secs)

    def evaluation(self, t: int, metrics: dict) -> dict:
        """Round t's evaluation record, also kept as eval/before.json (t = -1) or eval/round_<t>.json."""
        rec = {"event": "eval", "round": t, **metrics}
        write_json(self.run.root / "eval" / ("before.json" if t < 0 else f"round_{t:04d}.json"), rec)
        return rec

    def checkpoint(self, t: int, tensors: dict, meta: dict) -> None:
        """Round t's state, committed by one atomic pointer write (`RunDir.save_checkpoint`)."""
        self.run.save_checkpoint(t, tensors, meta, self.keep)

    def close(self) -> None:
        self.sinks.close()


def open_ledger(cfg, run: RunDir, committed: int | None, ids: Iterable[str], log: Callable[[str], None]) -> Ledger:
    """The ledger of a run starting (`committed` None) or resuming after round `committed`, with the sinks
    `cfg.federation` asks for (the console's MiB count goes on from the committed rounds)."""
    start = -1 if committed is None else committed
    sinks = open_sinks(cfg, run.root, start + 1, committed is not None, ids, log, mib_so_far(run))
    return Ledger(run, sinks, cfg.federation.checkpoint_keep)


def mib_so_far(run: RunDir) -> float:
    """MiB both ways in the rounds metrics.jsonl holds (a resumed run's console continues the count)."""
    rows = read_jsonl(run.metrics) if run.metrics.is_file() else []
    return sum(sum(r.get("bytes_down", {}).values()) + sum(r.get("bytes_up", {}).values())
               for r in rows if r["event"] == "round") / MIB
