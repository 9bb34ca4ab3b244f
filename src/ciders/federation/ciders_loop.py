"""`run_federation`, the CIDERS run behind `ciders run CONFIG`: the `Coordinator`'s rounds (`federation.rounds`)
through the round loop of every method (`federation.loop.run_rounds`), in-process by default (the Flower
ServerApp passes its own transport).

One CIDERS round, top to bottom (Algorithm 2, docs/method.md):
  sample clients -> broadcast (encoded; bytes counted) -> the transport -> client_update for each (decoded
  on the client side; its durable state written to the client's store) -> uploads -> server_update
  (Eq. 11-12) -> task.after_server (TAKD, Eq. 13) -> [report: personalized messengers] -> evaluate -> log
  -> checkpoint + commit.

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
from ciders.config import ExperimentConfig
from ciders.errors import ConfigError
from ciders.federation import codec, console
from ciders.federation.exchange import Exchange
from ciders.federation.inprocess import Faults, InProcess
from ciders.federation.loop import run_rounds
from ciders.fileio import locked


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
    from ciders.federation.rounds import Coordinator
    from ciders.federation.ciders_client import client_phase, client_report
    from ciders.federation.secure import Sessions

    if exchange is None and cfg.federation.partition == "nodes":
        raise ConfigError("federation.partition=nodes: the clients' data lives on their SuperNodes (data-file); run "
                          "it on a Flower deployment (`ciders flower launch` / `loopback`), not in-process")
    co = Coordinator(cfg, task, out, log=log, engine="local" if exchange is None else "remote")
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
        return run_rounds(co, exchange, fed.rounds, faults, progress=lambda t, phase: bars.phase(t, phase, co),
                          resume=resume)
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
