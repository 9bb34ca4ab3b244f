"""The in-process engine: one machine, the embedded default. `ciders run CONFIG`.

One round, top to bottom (Algorithm 2):
  sample clients -> broadcast (encoded; bytes counted) -> client_update for each (decoded on the client
  side; its durable state written to the client store) -> uploads over a channel (faults injectable
  for tests) -> server_update (Eq. 11-12) -> task.after_server (TAKD, Eq. 13) -> evaluate -> log ->
  checkpoint + commit.

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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from tqdm.auto import tqdm

from ciders import algorithms
from ciders.algorithms import ciders as alg
from ciders.config import ExperimentConfig
from ciders.core.store import RoundStore
from ciders.engines.rundir import MIB, RunDir, check_same_config, sample_clients, summarize
from ciders.errors import CidersError


# the run directory lives in engines.rundir; these names stay importable from here
__all__ = ["MIB", "Faults", "RunDir", "SimulatedCrash", "Task", "check_same_config", "load_personalized",
           "run_federation", "sample_clients", "summarize"]

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


class SimulatedCrash(RuntimeError):
    """Raised by a Faults plan to emulate a kill at a given point (tests)."""


@dataclass
class Faults:
    """Channel faults and crash points for tests. Sets hold (round, client_id)."""

    drop: set = field(default_factory=set)  # the upload is lost
    duplicate: set = field(default_factory=set)  # the upload arrives twice
    delay: set = field(default_factory=set)  # the upload arrives in the next round
    corrupt: set = field(default_factory=set)  # the upload's increment arrives as NaN
    crash: tuple[int, str] | None = None  # (round, phase): phases client:<k>, server, takd, checkpoint, commit

    def maybe_crash(self, t: int, phase: str) -> None:
        if self.crash == (t, phase):
            raise SimulatedCrash(f"simulated crash at round {t}, {phase}")


def run_federation(cfg: ExperimentConfig, task: Task, out: str | Path, resume: bool = False,
                   faults: Faults | None = None, log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Run (or resume) the federation of `cfg.algorithm.name` (CIDERS or a baseline; `ciders.algorithms`)
    in this process: the Coordinator's rounds with every client called directly (`engines.rounds`)."""
    from ciders.engines.rounds import Coordinator, Reply, client_round, load_personalized_from

    co = Coordinator(cfg, task, out, resume=resume, log=log)
    cfg, fed = co.cfg, co.cfg.federation
    faults = faults or Faults()
    per_round = fed.per_round or len(co.ids)
    bar = tqdm(total=(fed.rounds - co.first_round) * per_round, desc=algorithms.method_name(cfg), unit="client",
               disable=not progress)
    late: list[bytes] = []
    for t in range(co.first_round, fed.rounds):
        sampled = co.begin(t)
        down_extra = dict(co.down_extra)  # the in-process client's references: the server's own tensors
        replies, stray, carried, late = [], [], late, []
        for j, cid in enumerate(sampled):
            bar.set_description(f"round {t + 1}/{fed.rounds} client {cid}")
            msg = co.broadcast(t, cid)
            upmsg, cm = client_round(cfg, task, co.clients_store, cid, co.sizes[cid], msg, down_extra)
            # ---- channel: a dropped reply never arrives; a delayed one arrives next round
            key = (t, cid)
            if key in faults.corrupt and upmsg:
                up = alg.decode_upload(upmsg, co.ref)
                upmsg, _ = alg.encode_upload(alg.Upload(up.client_id, up.round, up.base_version, up.n_examples,
                                                        {k: torch.full_like(v, float("nan")) for k, v in up.dc.items()}))
            if key in faults.delay:
                late.append(upmsg)
            elif key not in faults.drop:
                replies.append(Reply(cid, upmsg, cm))
                if key in faults.duplicate:
                    stray.append(upmsg)
            bar.update(1)
            bar.set_postfix(loss=f"{cm['loss']:.3f}" if "loss" in cm else "resync")
            faults.maybe_crash(t, f"client:{j}")
        co.aggregate(t, replies, [m for m in carried if m], [m for m in stray if m])
        faults.maybe_crash(t, "server")
        co.takd(t)
        faults.maybe_crash(t, "takd")
        pers = {}
        if co.eval_due(t):
            bar.set_description(f"round {t + 1}/{fed.rounds} evaluating")
            pers = load_personalized_from(co.clients_store, co.eval_clients(t))
        co.finish(t, pers, before_checkpoint=lambda: faults.maybe_crash(t, "checkpoint"))
        faults.maybe_crash(t, "commit")
    bar.close()
    return co.close()


def load_personalized(run: str | Path, client: str, d) -> dict:
    """A client's personalized messenger (x_K of its last participation) from a run's client store."""
    from ciders.models.adapters import check_state

    run = Path(run)
    committed = RunDir(run).committed()
    store = run / "clients"
    rec = RoundStore(store, committed if committed is not None else -1).get(client) if store.is_dir() else None
    st = alg.client_from_record(*rec) if rec else None
    if st is None or st.personalized is None:
        where = " (a Flower run keeps client state on the nodes: evaluate there, or export it from the node's state-dir)" \
            if not store.is_dir() else " (never trained in this run)"
        raise CidersError(f"{run}: client {client!r} has no personalized messenger{where}")
    check_state(d.messenger_params(), st.personalized, f"client {client}")
    return {k: v.to(d.device) for k, v in st.personalized.items()}
