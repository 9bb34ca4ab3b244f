"""The server side of a CIDERS round: `Coordinator`, the CIDERS family's strategy for the round loop of every
method (`federation.loop.run_rounds`), and the pure steps it is made of (`broadcast_message`, `check_uploads`,
`round_records`). The client side is `federation.ciders_client`; the records and messages are `federation.codec`'s.

In-process (`federation.inprocess`) or over Flower (`transports.flower.exchange`), the same bytes go through the
same functions, so both engines give the same numbers.

Per round t (Algorithm 2, docs/method.md):
  begin(t) -> the sampled ids
  phase "train":  configure: broadcast_message(t, cid) per sampled client (its own consensus version / resync
                  copy; static components such as a fixed B_L only at first contact)
                  aggregate: check (`check_uploads`), Eq. 11-12 (`server_update`), then TAKD, Eq. 13
  phase "report": (rounds that evaluate) the personalized messengers the evaluation reads
  finish(t), evaluate(t), to_record(): the round's records, evaluation and checkpoint, which the loop writes
  commit(t): the stores commit the round; its state becomes the state
Under secure aggregation the train phase is wrapped by the protocol phases of `federation.secure_rounds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ciders import algorithms
from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import ExperimentConfig
from ciders.core import wire
from ciders.core.store import RoundStore
from ciders.core.tensors import device_of
from ciders.core.wire import PayloadError
from ciders.federation import console, dp, records
from ciders.federation.exchange import Admitted, Reply
from ciders.federation.ledger import Traffic
from ciders.federation.secure_rounds import SecurePhases, load_version
from ciders.federation.rundir import RunDir, sample_clients, summarize
from ciders.errors import CidersError
from ciders.fileio import write_json
from ciders import phases as timing


@dataclass(frozen=True)
class RunState:
    """The server's state between rounds: what a checkpoint holds (the per-client server copies of c_i live
    in the round-tagged server store beside it)."""

    committed: int
    server: alg.ServerState
    extra: Any  # the task's server-side extras (e.g. the student LoRA and its TAKD optimizer state)
    contacted: frozenset[str]  # clients that have received their first-contact components
    excluded: tuple = ()  # (client, round, why): clients proven to cheat, never sampled again (secure rounds)

    def excluded_ids(self) -> frozenset[str]:
        return frozenset(c for c, _, _ in self.excluded)


@dataclass(frozen=True)
class InFlight:
    """One round between `begin` and `commit`: the state it will commit (`next`), what was sent, and the
    records it will write. Replaced, never mutated, as the phases go."""

    t: int
    sampled: tuple[str, ...]
    down_extra: dict
    next: RunState
    sent: dict = field(default_factory=dict)  # the phase's messages: client -> bytes per component (None: not counted)
    changed: tuple[str, ...] = ()  # clients whose server copy this round rewrote
    result: tuple = ()  # the train phase's (server record, TAKD record, Checked): `finish` writes them
    personalized: dict = field(default_factory=dict)  # client -> messenger (evaluation rounds)
    secure: Any = None  # secure_rounds.Protocol: the secure-aggregation phases' state (a secure round only)


@dataclass(frozen=True)
class Checked:
    """The uploads of a round that passed every check, and what was rejected, with why."""

    uploads: list
    rejected: dict
    client_records: list
    losses: list
    replied: tuple  # the sampled clients whose reply was accepted by the transport (in sampling order)


# ---------------------------------------------------------------------------------------------- pure steps


def broadcast_message(acfg, state: RunState, copy: alg.ServerCopy, cid: str, down_extra: dict,
                      static: set, secure: bool = False, adapter_dtype: str = "model") -> tuple[bytes, dict, bool]:
    """Client `cid`'s message (its own consensus version, and a resync copy if needed; the static
    components only at first contact) -> (bytes, bytes per component, counted). Without communication
    only the first download happens, so only it is counted. The messenger and the student LoRA travel in
    `adapter_dtype`; c and a resync copy never do (the client's Eq. 9 and the server's Eq. 11 need them exact)."""
    b = alg.make_broadcast(acfg, state.server, copy, secure=secure)
    b = replace(b, messenger=codec.wire_dtype(b.messenger, adapter_dtype))
    first = cid not in state.contacted
    mine = down_extra if first else {k: v for k, v in down_extra.items() if k not in static}
    mine = {k: codec.wire_dtype(v, adapter_dtype) if k in codec.ADAPTERS else v for k, v in mine.items()}
    msg, sizes = codec.encode_broadcast(b, mine)
    return msg, sizes, acfg.communicate or first


def check_uploads(acfg, ref: dict, known_ids, t: int, sampled: tuple, got: Admitted, down_by: dict,
                  schema=records.CIDERS) -> Checked:
    """Decode and check what the loop admitted in a train phase (`federation.exchange.admit`: it refused client
    errors, replies the transport could not accept, replies from clients not sampled this round and second
    replies): this round's replies (in sampling order: sums are order-sensitive), uploads delayed from earlier
    rounds (kind "late", first) and duplicated deliveries (kind "copy", last). A metrics record that does not fit
    its schema (`federation.records`), a payload that does not decode against the messenger's shapes and dtypes
    (or is not finite), an upload that claims another client's id and an unknown client id are rejected with the
    reason; none of them reaches the server update. The server's own record fields (event, round, client, bytes)
    are written after the client's; `down_by` holds the bytes each client was sent this round."""
    rejected: dict[str, str] = dict(got.refused)
    recs, ok, order = [], [], {cid: j for j, cid in enumerate(sampled)}
    for r in sorted(got.replies, key=lambda r: order[r.client_id]):
        try:
            rec = records.check(r.record, schema)
        except PayloadError as exc:
            rejected[r.client_id] = str(exc)
            continue
        ok.append(r)
        recs.append({"event": "client", **rec, "client": r.client_id, "round": t, "bytes_up": len(r.payload),
                     "bytes_down": down_by.get(r.client_id, 0)})
    msgs = [("?", r.payload) for r in got.others if r.kind == "late"]
    msgs += [(r.client_id, r.payload) for r in ok if acfg.communicate]
    msgs += [("?", r.payload) for r in got.others if r.kind == "copy"]
    uploads = []
    for who, m in msgs:
        try:
            up = codec.decode_upload(m, ref, device=device_of(ref))
        except PayloadError as exc:
            rejected[who if who != "?" else f"#{len(rejected)}"] = str(exc)
            continue
        if who != "?" and up.client_id != who:
            rejected[who] = f"upload claims to be from {up.client_id!r}"
        elif up.client_id not in known_ids:
            rejected[up.client_id] = "unknown client id"
        else:
            uploads.append(up)
    return Checked(uploads, rejected, recs, [rec.get("loss") for rec in recs], tuple(r.client_id for r in ok))


def upload_sizes(acfg, msg: bytes) -> dict | None:
    """An upload's bytes per component (None: nothing is uploaded without communication, or the bytes are no
    message: the check that decodes them rejects them)."""
    if not acfg.communicate:
        return None
    try:
        return wire.sizes(msg)
    except PayloadError:
        return None


def round_records(rnd: InFlight, server_metrics: dict, takd_metrics: dict, checked: Checked,
                  traffic: Traffic) -> tuple[dict, ...]:
    losses = [x for x in checked.losses if x is not None]
    return ({"event": "server", **server_metrics, "round": rnd.t},
            {"event": "takd", "round": rnd.t, **takd_metrics},
            {"event": "round", "round": rnd.t, "clients": list(rnd.sampled),
             "loss": sum(losses) / max(len(losses), 1), "bytes_down": dict(traffic.down), "bytes_up": dict(traffic.up)})


# ---------------------------------------------------------------------------------------------- the server


class Coordinator:
    """The CIDERS family's strategy (`federation.loop.Strategy`; one per run directory). Its state is explicit:
    `state` (RunState, what the last commit holds) and `round` (InFlight, the round between begin and commit);
    every other attribute is fixed for the run (config, task, stores, ids, the ledger). A fresh run's round -1
    (`prepare`) pre-aligns B_L; a resumed one (`from_record`) drops what a crashed round left in the stores and
    takes the committed checkpoint."""

    def __init__(self, cfg: ExperimentConfig, task, out: str | Path, log: Callable[[str], None] = console.info,
                 engine: str = "local"):
        self.given, cfg = cfg, algorithms.configure(cfg)
        self.cfg = self.experiment = cfg
        self.task, self.log, self.engine = task, log, engine
        self.run = RunDir(out)
        self.extends_rounds = True  # a resume may add rounds (the lr schedule follows: rundir.SCHEDULES)
        self.sizes = task.clients()
        self.ids = sorted(self.sizes)
        self.ref = task.initial_messenger()  # the messenger's keys, shapes, dtypes and device
        self.static = set(getattr(task, "static_extra", lambda: ())())
        # secure aggregation's phases around train, when the config asks for them
        self.secure = SecurePhases(cfg, self.sizes, self.ref, log) if cfg.federation.secure_aggregation else None
        self.state: RunState | None = None  # set by prepare (a fresh run) or from_record (a resumed one)
        self.round: InFlight | None = None
        self._initial = None
        self.clients_store = self.server_store = None

    def _open_stores(self, start: int) -> None:
        # in-process, the engine reads client records from run/clients; on Flower they live on the clients
        fed, root = self.cfg.federation, self.run.root
        self.clients_store = RoundStore(root / "clients", start, fed.store_cache) if self.engine == "local" else None
        self.server_store = RoundStore(root / "server", start, fed.store_cache)

    def prepare(self) -> list[dict]:
        """Round -1 of a fresh run: the task's initial extras (TAKD pre-alignment of B_L) and the initial state."""
        for line in algorithms.changes(self.given, self.cfg):
            self.log(f"{self.cfg.algorithm.method} sets {line}")
        self._open_stores(-1)
        extra_t, extra_m, pre_metrics = self.task.initial_extra()
        self._initial = (extra_t, extra_m)  # checkpointed as built
        self.state = RunState(-1, alg.init_server(self.ref, self.cfg.federation.rounds),
                              self.task.extra_from_record(extra_t, extra_m), frozenset())
        return [{"event": "prealign", "round": -1, **pre_metrics}]

    def from_record(self, committed: int, tensors: dict, meta: dict) -> None:
        """A resumed run: the stores drop what the interrupted round wrote; the state is the checkpoint's."""
        self.log(f"resuming {self.run.root} after round {committed}")
        self._open_stores(committed)
        n = self.server_store.recover(committed)
        if self.clients_store is not None:
            n += self.clients_store.recover(committed)
        if n:
            self.log(f"  removed {n} records of the interrupted round {committed + 1}")
        server = codec.server_from_record({k: v for k, v in tensors.items() if not k.startswith("extra/")},
                                          meta["server"])
        extra = self.task.extra_from_record({k[6:]: v for k, v in tensors.items() if k.startswith("extra/")},
                                            meta["extra"])
        # a resume that extends federation.rounds: the lr schedule is over the new total (rundir.SCHEDULES)
        server = replace(server, total_rounds=self.cfg.federation.rounds)
        self.state = RunState(committed, _to_device(server, self.ref), extra, frozenset(meta.get("contacted", [])),
                              tuple(tuple(e) for e in meta.get("excluded", [])))

    # ------------------------------------------------------------------ helpers
    @property
    def first_round(self) -> int:
        return 0 if self.state is None else self.state.committed + 1

    def eval_clients(self, t: int) -> list[str]:
        """Whose personalized messengers the round-t evaluation reads (none under secure aggregation: they never
        leave the clients)."""
        if self.secure is not None:
            return []
        return self.ids if self.cfg.federation.eval_clients == "all" else list(self.round.sampled)

    # ------------------------------------------------------------------ the round as phases (federation.loop)
    def begin(self, t: int) -> InFlight:
        if t != self.state.committed + 1:
            raise CidersError(f"round {t} cannot start: round {self.state.committed} is the last committed one")
        # the takd-only control samples nobody: the round is TAKD on the unchanged messenger, then evaluation
        pool = self._pool(t) if self.cfg.algorithm.client_learning else []
        sampled = tuple(sample_clients(pool, self.cfg.federation.per_round, self.cfg.seed, t))
        self.round = InFlight(t, sampled, self.task.downlink_extra(self.state.extra), next=self.state)
        return self.round

    def _pool(self, t: int) -> list[str]:
        """The clients round t samples from: all but those excluded for cheating (which do not count toward
        per_round: it takes all that are left when fewer remain); an error when too few are left."""
        out = self.state.excluded_ids()
        pool = [c for c in self.ids if c not in out]
        need = 3 if self.cfg.federation.secure_aggregation else 1
        if out and len(pool) < need:
            raise CidersError(f"round {t}: {len(pool)} clients left after excluding {len(out)} proven cheaters "
                              f"({', '.join(sorted(out))}); a round needs at least {need}")
        return pool

    def phases(self, t: int) -> tuple[str, ...]:
        if self.secure is not None:
            return self.secure.phases
        # in a private mode the personalized messengers stay on the clients (docs/privacy.md); without client
        # learning (takd-only) there are none to report
        report = (self.cfg.federation.evaluates(t) and not dp.private_records(self.cfg)
                  and self.cfg.algorithm.client_learning)
        return ("train", "report") if report else ("train",)

    def configure(self, phase: str, t: int) -> dict[str, bytes]:
        if phase == "report":
            return {cid: b"" for cid in self.eval_clients(t)}
        if self.secure is not None:
            rnd, out, sent = self.secure.configure(phase, t, self.round, self._secure_broadcast)
            self.round = replace(rnd, sent=sent)
            return out
        if phase != "train":
            raise ValueError(f"CIDERS has no phase {phase!r}")
        rnd, out, counted = self.round, {}, {}
        for cid in rnd.sampled:
            copy = _load_copy(self.server_store, cid, self.ref)
            out[cid], sizes, yes = broadcast_message(self.cfg.algorithm, self.state, copy, cid, rnd.down_extra,
                                                     self.static, adapter_dtype=self.cfg.federation.adapter_dtype)
            counted[cid] = sizes if yes else None
        self.round = replace(rnd, sent=counted)
        return out

    def _secure_broadcast(self, cid: str) -> tuple[bytes, bool]:
        msg, _, counted = broadcast_message(self.cfg.algorithm, self.state, load_version(self.server_store, cid), cid,
                                            self.round.down_extra, self.static, secure=True,
                                            adapter_dtype=self.cfg.federation.adapter_dtype)
        return msg, counted

    def count(self, direction: str, phase: str, cid: str, msg: bytes) -> dict | None:
        """What the loop counts: the broadcasts the method sends (`broadcast_message`) and the uploads; a report
        (the evaluation's reading of a personalized messenger) is not traffic of the method. Under secure
        aggregation, every protocol message and reply too."""
        if self.secure is not None:
            return self.round.sent.get(cid) if direction == "down" else self.secure.up_sizes(phase, msg)
        if phase != "train":
            return None
        return self.round.sent.get(cid) if direction == "down" else upload_sizes(self.cfg.algorithm, msg)

    def aggregate(self, phase: str, t: int, got: Admitted, traffic: Traffic,
                  mark: Callable[[str], None] = lambda p: None) -> list[dict]:
        """Apply what arrived in `phase` -> the client records to write now. Train: the checks
        (`check_uploads`), Eq. 11-12 over the valid uploads ("server"), then TAKD, Eq. 13 ("takd"); `mark(point)`
        is called after each (crash points for the fault tests). Report: the personalized messengers the
        evaluation reads."""
        if self.secure is not None:
            self.round, summed = self.secure.aggregate(phase, t, self.round, got, quiet=self.clients_store is not None)
            return [] if summed is None else self._unmasked(t, summed, got, traffic, mark)
        if phase == "report":
            pers = {r.client_id: p for r in got.replies if (p := self._read_report(t, r)) is not None}
            missing = sorted(set(self.eval_clients(t)) - set(pers))
            if missing and self.clients_store is None:
                self.log(f"round {t}: evaluating without the personalized messengers of {', '.join(missing)}")
            self.round = replace(self.round, personalized=pers)
            return []
        rnd, acfg = self.round, self.cfg.algorithm
        missing = sorted(set(rnd.sampled) - {r.client_id for r in got.replies} - set(got.refused))
        if missing and self.clients_store is None:
            self.log(f"round {t}: no reply from {', '.join(missing)} within the round")
        with timing.phase("aggregation"):
            checked = check_uploads(acfg, self.ref, self.sizes, t, rnd.sampled, got, traffic.down_by,
                                    records.CIDERS_PRIVATE if dp.private_records(self.cfg) else records.CIDERS)
        # a client that failed gets its first-contact components again; one that replied is contacted
        contacted = (rnd.next.contacted - got.failed) | set(checked.replied)
        copies = {u.client_id: _load_copy(self.server_store, u.client_id, self.ref) for u in checked.uploads}
        with timing.phase("aggregation"):
            server, new_copies, sm = alg.server_update(acfg, rnd.next.server, checked.uploads, copies, self.sizes,
                                                       self.cfg.federation.max_step_ratio,
                                                       dp.server_privacy(self.cfg, t))
        for cid, cp in new_copies.items():
            if cp is not copies[cid]:
                self.server_store.put(cid, t, *codec.copy_record(cp))
        if checked.rejected:
            sm["rejected"] = {**sm["rejected"], **checked.rejected}
            for who, why in checked.rejected.items():
                self.log(console.rejected(t, phase, who, why))
        self._after_server(t, server, sm, checked, contacted, tuple(u.client_id for u in checked.uploads), mark)
        return checked.client_records

    def _unmasked(self, t: int, summed, got: Admitted, traffic: Traffic, mark: Callable[[str], None]) -> list[dict]:
        """The secure round's last phase: Eq. 12 on the unmasked sum (`SecurePhases.server_step`), the new versions
        stored, the included clients' records (written once the round unmasks, with every phase's bytes), then the
        plain round's TAKD."""
        rnd = self.round
        copies = {c: load_version(self.server_store, c) for c in summed.included}
        u = self.secure.server_step(t, rnd, summed, copies)
        changed = tuple(c for c in u.included if u.new_copies[c] is not copies[c])
        for cid in changed:
            self.server_store.put(cid, t, *codec.copy_record(u.new_copies[cid]))
        recs = [{"event": "client", **rnd.secure.records[c], "client": c, "round": t,
                 "bytes_up": traffic.up_by.get(c, 0), "bytes_down": traffic.down_by.get(c, 0)} for c in u.included]
        self.round = replace(rnd, next=replace(rnd.next, excluded=u.excluded))
        contacted = (rnd.next.contacted - got.failed) | set(u.included)
        checked = Checked([], u.metrics["rejected"], recs, [r.get("loss") for r in recs], tuple(u.included))
        self._after_server(t, u.server, u.metrics, checked, contacted, changed, mark)
        return recs

    def _after_server(self, t: int, server: alg.ServerState, sm: dict, checked: Checked, contacted: set,
                      changed: tuple, mark: Callable[[str], None]) -> None:
        """TAKD (Eq. 13) after the server update, and the round's records (with the privacy spent so far)."""
        rnd = self.round
        sm.update(dp.spent(self.cfg, t))
        mark("server")
        with timing.phase("TAKD"):
            extra, tm = self.task.after_server(t, server, rnd.next.extra)
        self.round = replace(rnd, next=replace(rnd.next, committed=t, server=server, extra=extra,
                                               contacted=frozenset(contacted)), changed=changed,
                             result=(sm, tm, checked))
        mark("takd")

    def _read_report(self, t: int, r: Reply) -> dict | None:
        try:
            comps, meta = wire.decode(r.payload, {"personalized": self.ref}, device=device_of(self.ref))
            if meta.get("client_id") != r.client_id:
                raise PayloadError(f"report claims to be from {meta.get('client_id')!r}")
        except PayloadError as exc:
            self.log(f"round {t}: rejected report from {r.client_id}: {exc}")
            return None
        return comps.get("personalized")

    def finish(self, t: int, traffic: Traffic) -> list[dict]:
        """The round's server, TAKD and round records (the round's bytes: every phase's, as `count` counts them)."""
        return list(round_records(self.round, *self.round.result, traffic))

    def evaluate(self, t: int) -> dict:
        """The task's evaluation of the state round t commits, with the personalized messengers the report phase
        brought, in client order (sums are order-sensitive); t = -1: the initial state, before the first round."""
        if t < 0:
            self.log("round -1: evaluating before the first round")
            with timing.phase("evaluation"):
                return self.task.evaluate(-1, self.state.server, {})
        got = self.round.personalized
        pers = {cid: {k: v.to(device_of(self.ref)) for k, v in got[cid].items()} for cid in self.ids if cid in got}
        with timing.phase("evaluation"):
            return self.task.evaluate(t, self.round.next.server, pers)

    def to_record(self) -> tuple[dict, dict]:
        """The checkpoint of the state the round commits (tensors, meta)."""
        state = self.state if self.round is None else self.round.next
        et, em = self._initial if self.round is None else self.task.extra_record(state.extra)
        st, sm = codec.server_record(state.server)
        return ({**st, **{f"extra/{k}": v for k, v in et.items()}},
                {"server": sm, "extra": em, "contacted": sorted(state.contacted),
                 **({"excluded": [list(e) for e in state.excluded]} if state.excluded else {})})

    def commit(self, t: int) -> None:
        """After the checkpoint: the stores commit the round; its `next` state becomes the state."""
        rnd = self.round
        if rnd is None:  # round -1 writes no store
            return
        if self.clients_store is not None:
            self.clients_store.commit(t, list(rnd.sampled))
        self.server_store.commit(t, list(rnd.changed))
        self.state, self.round = rnd.next, None

    def close(self) -> dict:
        self.task.finalize(self.run.root, self.state.server, self.state.extra)
        summary = summarize(self.run, self.cfg, once=self.static)
        if hasattr(self.task, "model_sizes"):
            summary["model_mib"] = self.task.model_sizes()
        write_json(self.run.root / "summary.json", summary)
        return summary


# ---------------------------------------------------------------------------------------------- state moves


def _to_device(s: alg.ServerState, ref: dict) -> alg.ServerState:
    return codec.server_to(s, device_of(ref))  # every field, the server optimizer's moments included


def _load_copy(store: RoundStore, cid: str, ref: dict) -> alg.ServerCopy:
    rec = store.get(cid)
    if rec is None:
        return alg.init_copy(ref)
    cp = codec.copy_from_record(*rec)
    return replace(cp, c_i={k: v.to(device_of(ref)) for k, v in cp.c_i.items()})
