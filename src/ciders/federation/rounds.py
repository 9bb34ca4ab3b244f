"""One CIDERS round as messages: the server side (`Coordinator`) and the client side (`client_round`,
`client_report`).

The round loop (`federation.loop.run_rounds`) drives the Coordinator through its phases and a transport
(`federation.exchange`) carries the bytes: in-process (`federation.inprocess`) or over Flower
(`transports.flower.exchange`). Both move the same bytes through the same functions, so they give the
same numbers.

Server side, per round t (Algorithm 2, docs/method.md):
  begin(t) -> sampled ids
  phase "train":  messages: broadcast(t, cid) per sampled client (its own consensus version / resync copy;
                  static components such as a fixed B_L only at first contact)
                  absorb: decode, check, Eq. 11-12 (`aggregate`), then TAKD, Eq. 13 (`takd`)
  phase "report": (rounds that evaluate) the personalized messengers the evaluation reads
  commit(t) -> evaluate, log, checkpoint + commit (one atomic pointer write)
Client side: client_round(...) decodes the broadcast, runs `client_update` (Eq. 4-10) on the client's own
store and returns the upload bytes plus its metrics record; client_report(...) returns its personalized
messenger as wire bytes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from ciders import algorithms
from ciders.algorithms import ciders as alg
from ciders.config import ExperimentConfig
from ciders.core import wire
from ciders.core.store import RoundStore
from ciders.core.wire import PayloadError
from ciders.federation.exchange import Reply
from ciders.federation.rundir import RunDir, sample_clients, start_run, summarize
from ciders.errors import CidersError
from ciders.fileio import append_jsonl, write_json


class Coordinator:
    """The server side of a run (one per run directory). Setup happens in the constructor: a fresh run
    pre-aligns B_L, evaluates and commits round -1; a resumed one drops what a crashed round left and
    reloads the committed checkpoint."""

    def __init__(self, cfg: ExperimentConfig, task, out: str | Path, resume: bool = False,
                 log: Callable[[str], None] = print, engine: str = "local"):
        given, cfg = cfg, algorithms.configure(cfg)
        self.cfg, self.task, self.log = cfg, task, log
        self.run = run = RunDir(out)
        run.root.mkdir(parents=True, exist_ok=True)
        fed = cfg.federation
        committed = start_run(run, cfg, resume, log)
        if committed is None:
            for line in algorithms.changes(given, cfg):
                log(f"{algorithms.method_name(cfg)} sets {line}")
        self.tb = None
        if fed.tensorboard:
            from ciders.federation.tensorboard import Mirror

            self.tb = Mirror(run.root / "tensorboard")
        start = committed if committed is not None else -1
        # in-process, the engine reads client records from run/clients; on Flower they live on the clients
        self.clients_store = RoundStore(run.root / "clients", start, fed.store_cache) if engine == "local" else None
        self.server_store = RoundStore(run.root / "server", start, fed.store_cache)
        self.sizes = task.clients()
        self.ids = sorted(self.sizes)
        self.messenger0 = task.initial_messenger()
        self.static = set(getattr(task, "static_extra", lambda: ())())
        if committed is None:
            t0 = time.perf_counter()
            extra_t, extra_m, pre_metrics = task.initial_extra()
            self.extra = task.extra_from_record(extra_t, extra_m)
            self.server = alg.init_server(self.messenger0, fed.rounds)
            self.contacted: set[str] = set()
            log("evaluating before the first round")
            ev = task.evaluate(-1, self.server, {})
            write_json(run.root / "eval" / "before.json", {"event": "eval", "round": -1, **ev})
            for rec in ({"event": "prealign", "round": -1, **pre_metrics}, {"event": "eval", "round": -1, **ev}):
                self.record(rec)
            append_jsonl(run.timing, {"round": -1, "prealign_and_eval_s": time.perf_counter() - t0})
            self._checkpoint(-1, extra_t, extra_m)
            committed = -1
        else:
            log(f"resuming {run.root} after round {committed}")
            n = self.server_store.recover(committed)
            if self.clients_store is not None:
                n += self.clients_store.recover(committed)
            if n:
                log(f"  removed {n} records of the interrupted round {committed + 1}")
            tensors, meta = run.load_checkpoint(committed)
            server = alg.server_from_record({k: v for k, v in tensors.items() if not k.startswith("extra/")},
                                            meta["server"])
            self.extra = task.extra_from_record({k[6:]: v for k, v in tensors.items() if k.startswith("extra/")},
                                                meta["extra"])
            self.server = _to_device(server, self.messenger0)
            self.contacted = set(meta.get("contacted", []))
        self.committed = committed
        self._t_round = 0.0

    # ------------------------------------------------------------------ helpers
    @property
    def first_round(self) -> int:
        return self.committed + 1

    @property
    def ref(self) -> dict:
        return self.messenger0

    def record(self, rec: dict) -> None:
        append_jsonl(self.run.metrics, rec)
        if self.tb is not None:
            self.tb.write(rec)

    def _checkpoint(self, t: int, extra_t: dict, extra_m: dict) -> None:
        st, sm = alg.server_record(self.server)
        self.run.save_checkpoint(t, {**st, **{f"extra/{k}": v for k, v in extra_t.items()}},
                                 {"server": sm, "extra": extra_m, "contacted": sorted(self.contacted)},
                                 self.cfg.federation.checkpoint_keep)

    # ------------------------------------------------------------------ one round
    def begin(self, t: int) -> list[str]:
        if t != self.committed + 1:
            raise CidersError(f"round {t} cannot start: round {self.committed} is the last committed one")
        self._t_round = time.perf_counter()
        self.sampled = sample_clients(self.ids, self.cfg.federation.per_round, self.cfg.seed, t)
        self.down_extra = self.task.downlink_extra(self.extra)
        self.bytes_down: dict[str, int] = {}
        self.down_len: dict[str, int] = {}
        self._recs: list[dict] = []
        return self.sampled

    def broadcast(self, t: int, cid: str) -> bytes:
        """Client `cid`'s round-t message: its own consensus version (and resync copy if needed); the
        static components only at first contact."""
        acfg = self.cfg.algorithm
        b = alg.make_broadcast(acfg, self.server, _load_copy(self.server_store, cid, self.messenger0))
        first = cid not in self.contacted
        mine = self.down_extra if first else {k: v for k, v in self.down_extra.items() if k not in self.static}
        msg, sizes = alg.encode_broadcast(b, mine)
        counted = acfg.communicate or first  # without communication only the first download happens
        if counted:
            _count(self.bytes_down, sizes)
        self.down_len[cid] = len(msg) if counted else 0
        return msg

    def aggregate(self, t: int, replies: list[Reply], carried: list[bytes] = (), stray: list[bytes] = (),
                  rejected: dict[str, str] | None = None) -> None:
        """Decode and check every upload that arrived (`carried` ones from earlier rounds first, then this
        round's replies, then `stray` copies such as duplicates) and apply Eq. 11-12. Malformed or unexpected payloads are
        rejected and logged with the client id; they never change global state."""
        acfg = self.cfg.algorithm
        bytes_up: dict[str, int] = {}
        order = {cid: j for j, cid in enumerate(self.sampled)}
        got = sorted((r for r in replies if r.client_id in order), key=lambda r: order[r.client_id])
        losses, msgs, malformed = [], [("?", m) for m in carried], dict(rejected or {})
        for r in got:
            self.contacted.add(r.client_id)
            self.record({"event": "client", **r.record, "round": t, "bytes_up": len(r.payload),
                         "bytes_down": self.down_len.get(r.client_id, 0)})
            losses.append(r.record.get("loss"))
            if acfg.communicate:
                msgs.append((r.client_id, r.payload))
        for r in replies:
            if r.client_id not in order:
                malformed[str(r.client_id)] = f"reply from a client not sampled in round {t}"
        msgs += [("?", m) for m in stray]
        uploads = []
        for who, m in msgs:
            try:
                if who != "?":
                    _count(bytes_up, wire.sizes(m))
                up = alg.decode_upload(m, self.ref, device=_dev(self.ref))
            except PayloadError as exc:
                malformed[who if who != "?" else f"#{len(malformed)}"] = str(exc)
                continue
            if who != "?" and up.client_id != who:
                malformed[who] = f"upload claims to be from {up.client_id!r}"
                continue
            uploads.append(up)
        known = [u for u in uploads if u.client_id in self.sizes]
        for u in uploads:
            if u.client_id not in self.sizes:
                malformed[u.client_id] = "unknown client id"
        copies = {u.client_id: _load_copy(self.server_store, u.client_id, self.messenger0) for u in known}
        self.server, new_copies, sm = alg.server_update(acfg, self.server, known, copies, n_clients=len(self.ids))
        for cid, cp in new_copies.items():
            if cp is not copies[cid]:
                self.server_store.put(cid, t, *alg.copy_record(cp))
        self._changed = [u.client_id for u in known]
        if malformed:
            sm["rejected"] = {**sm["rejected"], **malformed}
            for who, why in malformed.items():
                self.log(f"round {t}: rejected upload from {who}: {why}")
        self._after_server = (sm, bytes_up, losses)

    def takd(self, t: int) -> None:
        sm, bytes_up, losses = self._after_server
        self.extra, tm = self.task.after_server(t, self.server, self.extra)
        self._recs = [{"event": "server", **sm, "round": t},
                      {"event": "takd", "round": t, **tm},
                      {"event": "round", "round": t, "clients": self.sampled,
                       "loss": sum(x for x in losses if x is not None) / max(sum(x is not None for x in losses), 1),
                       "bytes_down": self.bytes_down, "bytes_up": bytes_up}]

    def eval_due(self, t: int) -> bool:
        fed = self.cfg.federation
        return t == fed.rounds - 1 or bool(fed.eval_every and (t + 1) % fed.eval_every == 0)

    def eval_clients(self, t: int) -> list[str]:
        """Whose personalized messengers the round-t evaluation reads."""
        return self.ids if self.cfg.federation.eval_clients == "all" else list(self.sampled)

    def finish(self, t: int, personalized: dict | None = None, before_checkpoint: Callable[[], None] | None = None
               ) -> None:
        """Evaluate (when due) with the given personalized messengers {client: State}, log the round,
        checkpoint and commit it."""
        recs = self._recs
        if self.eval_due(t):
            got = personalized or {}  # in client order, whatever order they arrived in (sums are order-sensitive)
            pers = {cid: {k: v.to(_dev(self.ref)) for k, v in got[cid].items()} for cid in self.ids if cid in got}
            recs.append({"event": "eval", "round": t, **self.task.evaluate(t, self.server, pers)})
            write_json(self.run.root / "eval" / f"round_{t:04d}.json", recs[-1])
        for r in recs:
            self.record(r)
        append_jsonl(self.run.timing, {"round": t, "seconds": time.perf_counter() - self._t_round})
        if before_checkpoint is not None:
            before_checkpoint()
        et, em = self.task.extra_record(self.extra)
        self._checkpoint(t, et, em)
        if self.clients_store is not None:
            self.clients_store.commit(t, self.sampled)
        self.server_store.commit(t, self._changed)
        self.committed = t

    # ------------------------------------------------------------------ the round as phases (federation.loop)
    def phases(self, t: int) -> tuple[str, ...]:
        return ("train", "report") if self.eval_due(t) else ("train",)

    def messages(self, phase: str, t: int) -> dict[str, bytes]:
        if phase == "train":
            return {cid: self.broadcast(t, cid) for cid in self.sampled}
        if phase == "report":
            self._pers = {}
            return {cid: b"" for cid in self.eval_clients(t)}
        raise ValueError(f"CIDERS has no phase {phase!r}")

    def absorb(self, phase: str, t: int, replies: list[Reply], mark: Callable[[str], None] = lambda p: None) -> None:
        """Apply what arrived in `phase`. Train: client errors are logged and rejected (a client that failed
        gets its first-contact components again), then Eq. 11-12 over the valid uploads ("server"), then
        TAKD ("takd"); `mark(point)` is called after each (crash points for the fault tests)."""
        if phase == "report":
            for r in replies:
                if r.error is None and r.rejected is None and r.kind == "reply" and \
                        (got := self._read_report(t, r)) is not None:
                    self._pers[r.client_id] = got
            missing = sorted(set(self.eval_clients(t)) - set(self._pers))
            if missing and self.clients_store is None:
                self.log(f"round {t}: evaluating without the personalized messengers of {', '.join(missing)}")
            return
        bad = {}
        for r in replies:
            if r.error is not None:
                bad[r.client_id] = f"client error: {r.error}"
                self.contacted.discard(r.client_id)  # e.g. it lost its static components: send them again
            elif r.rejected is not None:
                bad[r.client_id] = r.rejected
        ok = [r for r in replies if r.error is None and r.rejected is None]
        answered = {r.client_id for r in ok if r.kind == "reply"}
        missing = sorted(set(self.sampled) - answered - set(bad))
        if missing and self.clients_store is None:
            self.log(f"round {t}: no reply from {', '.join(missing)} within the round")
        self.aggregate(t, [r for r in ok if r.kind == "reply"], [r.payload for r in ok if r.kind == "late"],
                       [r.payload for r in ok if r.kind == "copy"], rejected=bad)
        mark("server")
        self.takd(t)
        mark("takd")

    def _read_report(self, t: int, r: Reply) -> dict | None:
        try:
            comps, meta = wire.decode(r.payload, {"personalized": self.ref}, device=_dev(self.ref))
            if meta.get("client_id") != r.client_id:
                raise PayloadError(f"report claims to be from {meta.get('client_id')!r}")
        except PayloadError as exc:
            self.log(f"round {t}: rejected report from {r.client_id}: {exc}")
            return None
        return comps.get("personalized")

    def commit(self, t: int, before_checkpoint: Callable[[], None] | None = None) -> None:
        self.finish(t, getattr(self, "_pers", {}) if self.eval_due(t) else {}, before_checkpoint)
        self._pers = {}


    def close(self) -> dict:
        if self.tb is not None:
            self.tb.close()
        self.task.finalize(self.run.root, self.server, self.extra)
        summary = summarize(self.run, self.cfg, once=self.static)
        write_json(self.run.root / "summary.json", summary)
        return summary


class StaticHolder:
    """A client's durable copy of the components it receives only once (e.g. a fixed B_L), so that a
    restarted client process can still run later rounds. In-process clients share the server's model
    and need none."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def save(self, name: str, st: dict) -> None:
        from safetensors.torch import save_file

        from ciders.fileio import atomic_path

        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.root / f"{name}.safetensors") as tmp:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in st.items()}, str(tmp))

    def load(self, name: str, ref: dict, device) -> dict:
        from safetensors.torch import load_file

        p = self.root / f"{name}.safetensors"
        if not p.is_file():
            raise PayloadError(f"this client does not hold the static component {name!r} the server sent earlier "
                               f"({p} is missing); it is sent again after this failed round")
        st = {k: v.clone() for k, v in load_file(str(p)).items()}
        wire.check(st, ref, name)
        return {k: v.to(device) for k, v in st.items()}


def client_round(cfg: ExperimentConfig, task, store: RoundStore, cid: str, n_examples: int, msg: bytes,
                 extra_ref: dict, held: StaticHolder | None = None) -> tuple[bytes, dict]:
    """The client side of one round: decode the broadcast (validated against the client's own
    references), run `client_update` on the client's saved state, write the new state to its store and
    return (upload bytes, metrics record). `extra_ref` holds the reference shapes of the task's downlink
    extras (e.g. the student LoRA)."""
    acfg = cfg.algorithm
    ref = task.initial_messenger()  # shapes / dtypes / device only
    b, extra = alg.decode_broadcast(msg, ref, dict(extra_ref), device=_dev(ref))
    if held is not None:
        for name in getattr(task, "static_extra", lambda: ())():
            if name in extra:
                held.save(name, extra[name])
            else:
                extra[name] = held.load(name, extra_ref[name], _dev(ref))
    task.begin_round(b.round, extra)
    rec = store.get(cid)
    state = _on_device(None if rec is None else alg.client_from_record(*rec), cid, n_examples, ref)
    batches = task.batches(cid, b.round, acfg.local_steps * acfg.grad_accum, cfg.seed)
    up, state, cm = alg.client_update(acfg, b, state, task.loss_fn(cid), batches)
    store.put(cid, b.round, *alg.client_record(state))
    upmsg = alg.encode_upload(up)[0] if acfg.communicate else b""
    return upmsg, cm


def client_report(store: RoundStore, cid: str) -> bytes:
    """The client side of a "report": its personalized messenger x_K of its last participation (none if
    it never trained or keeps none) as wire bytes."""
    rec = store.get(cid)
    pers = alg.client_from_record(*rec).personalized if rec else None
    return wire.encode({"personalized": pers} if pers else {}, {"client_id": cid})[0]


def load_personalized_from(store: RoundStore, ids: list[str]) -> dict:
    out = {}
    for cid in ids:
        rec = store.get(cid)
        if rec is not None and (s := alg.client_from_record(*rec)).personalized:
            out[cid] = s.personalized
    return out


# ---------------------------------------------------------------------------------------------- state moves


def _dev(ref: dict) -> torch.device:
    return next(iter(ref.values())).device


def _to_device(s: alg.ServerState, ref: dict) -> alg.ServerState:
    dev = _dev(ref)
    return alg.ServerState(s.round, s.total_rounds, {k: v.to(dev) for k, v in s.messenger.items()},
                           {k: v.to(dev) for k, v in s.c.items()})


def _count(acc: dict, sizes: dict) -> None:
    for k, v in sizes.items():
        acc[k] = acc.get(k, 0) + v


def _load_copy(store: RoundStore, cid: str, ref: dict) -> alg.ServerCopy:
    rec = store.get(cid)
    if rec is None:
        return alg.init_copy(ref)
    cp = alg.copy_from_record(*rec)
    return alg.ServerCopy({k: v.to(_dev(ref)) for k, v in cp.c_i.items()}, cp.version, cp.needs_resync)


def _on_device(s: alg.ClientState | None, cid: str, n: int, ref: dict) -> alg.ClientState:
    """A client's saved state on the messenger's device (a fresh one if it never trained)."""
    if s is None:
        return alg.init_client(cid, n, ref)
    dev = _dev(ref)

    def mv(st):
        return None if st is None else {k: v.to(dev) for k, v in st.items()}

    pending = None if s.pending is None else alg.Pending(mv(s.pending.dc), s.pending.base_version, s.pending.round)
    return alg.ClientState(s.client_id, s.n_examples, mv(s.c_i), s.version, pending, mv(s.personalized))
