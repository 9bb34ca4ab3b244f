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

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from tqdm.auto import tqdm

from ciders import algorithms
from ciders.algorithms import ciders as alg
from ciders.config import ExperimentConfig, dump_yaml, load_config, to_dict
from ciders.core.store import RoundStore
from ciders.core.wire import PayloadError
from ciders.errors import CidersError
from ciders.fileio import append_jsonl, atomic_dir, read_jsonl, write_json, write_text
from ciders.runtime import derived_seed

MIB = 2**20


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


def sample_clients(ids: list[str], m: int | None, seed: int, t: int) -> list[str]:
    if m is None or m >= len(ids):
        return list(ids)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(derived_seed(seed, t, 101)))
    return [ids[i] for i in sorted(perm[:m].tolist())]


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.ckpt = self.root / "checkpoints"
        self.metrics = self.root / "metrics.jsonl"
        self.timing = self.root / "timing.jsonl"

    def committed(self) -> int | None:
        p = self.ckpt / "LATEST"
        if not p.is_file():
            return None
        try:
            return int(json.loads(p.read_text())["round"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CidersError(f"{p} is unreadable ({exc}); the run directory is damaged") from exc

    def save_checkpoint(self, t: int, tensors: dict, meta: dict, keep: int) -> None:
        from safetensors.torch import save_file

        with atomic_dir(self.ckpt / f"round_{t + 1:06d}") as tmp:  # round -1 (pre-alignment) -> round_000000
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / "state.safetensors"))
            (tmp / "state.json").write_text(json.dumps(meta, indent=2))
        write_json(self.ckpt / "LATEST", {"round": t})  # the commit point
        for old in sorted(self.ckpt.glob("round_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, t: int) -> tuple[dict, dict]:
        from safetensors.torch import load_file

        d = self.ckpt / f"round_{t + 1:06d}"
        if not d.is_dir():
            raise CidersError(f"checkpoint for round {t} missing in {self.ckpt}; the run directory is damaged")
        tensors = {k: v.clone() for k, v in load_file(str(d / "state.safetensors")).items()}  # aligned (core.wire)
        return tensors, json.loads((d / "state.json").read_text())

    def truncate_metrics(self, committed: int) -> None:
        for path in (self.metrics, self.timing):
            if path.exists():
                keep = [r for r in read_jsonl(path) if r.get("round", -1) <= committed]
                write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def check_same_config(run: RunDir, cfg: ExperimentConfig) -> None:
    saved = load_config(run.root / "config.yaml")
    a, b = to_dict(saved), to_dict(cfg)

    def diff(x, y, path=""):
        if isinstance(x, dict):
            for k in x:
                r = diff(x[k], y.get(k), f"{path}.{k}" if path else k)
                if r:
                    return r
            return None
        return path if x != y else None

    key = diff(a, b)
    if key:
        raise CidersError(f"--resume: the config differs from the run's config.yaml at '{key}'; resume with the same config")


def run_federation(cfg: ExperimentConfig, task: Task, out: str | Path, resume: bool = False,
                   faults: Faults | None = None, log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Run (or resume) the federation of `cfg.algorithm.name` (CIDERS or a baseline; `ciders.algorithms`)."""
    given, cfg = cfg, algorithms.configure(cfg)
    run = RunDir(out)
    run.root.mkdir(parents=True, exist_ok=True)
    faults = faults or Faults()
    fed, acfg = cfg.federation, cfg.algorithm
    committed = run.committed()
    if committed is not None and not resume:
        raise CidersError(f"{run.root} already holds a run (round {committed} committed); pass --resume to continue "
                          "it or choose another --out")
    if resume and committed is not None:
        check_same_config(run, cfg)
    else:
        committed = None
        for p in (run.metrics, run.timing):
            p.unlink(missing_ok=True)
        write_text(run.root / "config.yaml", dump_yaml(cfg))
        for line in algorithms.changes(given, cfg):
            log(f"{algorithms.method_name(cfg)} sets {line}")
    tb = None
    if fed.tensorboard:
        from ciders.engines.tensorboard import Mirror

        tb = Mirror(run.root / "tensorboard")

    def record(rec: dict) -> None:
        append_jsonl(run.metrics, rec)
        if tb is not None:
            tb.write(rec)

    clients_store = RoundStore(run.root / "clients", committed if committed is not None else -1, fed.store_cache)
    server_store = RoundStore(run.root / "server", committed if committed is not None else -1, fed.store_cache)

    sizes = task.clients()
    ids = sorted(sizes)
    messenger0 = task.initial_messenger()
    ref = {k: v for k, v in messenger0.items()}

    if committed is None:
        t0 = time.perf_counter()
        extra_t, extra_m, pre_metrics = task.initial_extra()
        extra = task.extra_from_record(extra_t, extra_m)
        server = alg.init_server(messenger0, fed.rounds)
        log("evaluating before the first round")
        ev = task.evaluate(-1, server, {})
        write_json(run.root / "eval" / "before.json", {"event": "eval", "round": -1, **ev})
        for rec in ({"event": "prealign", "round": -1, **pre_metrics}, {"event": "eval", "round": -1, **ev}):
            record(rec)
        append_jsonl(run.timing, {"round": -1, "prealign_and_eval_s": time.perf_counter() - t0})
        st, sm = alg.server_record(server)
        run.save_checkpoint(-1, {**st, **{f"extra/{k}": v for k, v in extra_t.items()}},
                            {"server": sm, "extra": extra_m}, fed.checkpoint_keep)
        committed = -1
    else:
        log(f"resuming {run.root} after round {committed}")
        n = clients_store.recover(committed) + server_store.recover(committed)
        if n:
            log(f"  removed {n} records of the interrupted round {committed + 1}")
        run.truncate_metrics(committed)
        tensors, meta = run.load_checkpoint(committed)
        server = alg.server_from_record({k: v for k, v in tensors.items() if not k.startswith("extra/")}, meta["server"])
        extra = task.extra_from_record({k[6:]: v for k, v in tensors.items() if k.startswith("extra/")}, meta["extra"])
        server = _to_device(server, messenger0)

    per_round = fed.per_round or len(ids)
    static = set(getattr(task, "static_extra", lambda: ())())
    bar = tqdm(total=(fed.rounds - committed - 1) * per_round, desc=algorithms.method_name(cfg), unit="client",
               disable=not progress)
    late: list[bytes] = []
    for t in range(committed + 1, fed.rounds):
        t_round = time.perf_counter()
        sampled = sample_clients(ids, fed.per_round, cfg.seed, t)
        down_extra = task.downlink_extra(extra)
        bytes_down: dict[str, int] = {}
        bytes_up: dict[str, int] = {}
        delivered: list[bytes] = list(late)
        late = []
        begun = False
        losses = []
        for j, cid in enumerate(sampled):
            bar.set_description(f"round {t + 1}/{fed.rounds} client {cid}")
            copy = _load_copy(server_store, cid, messenger0)
            b = alg.make_broadcast(acfg, server, copy)
            saved = _maybe_client(clients_store, cid)
            first_contact = saved is None
            mine = down_extra if first_contact else {k: v for k, v in down_extra.items() if k not in static}
            msg, sizes_d = alg.encode_broadcast(b, mine)
            if acfg.communicate or first_contact:  # without communication only the first download happens
                _count(bytes_down, sizes_d)
            # ---- client side
            b_c, extra_c = alg.decode_broadcast(msg, ref, dict(down_extra), device=_dev(ref))
            if not begun:
                task.begin_round(t, extra_c)
                begun = True
            cstate = _on_device(saved, cid, sizes[cid], messenger0)
            batches = task.batches(cid, t, acfg.local_steps * acfg.grad_accum, cfg.seed)
            up, cstate, cm = alg.client_update(acfg, b_c, cstate, task.loss_fn(cid), batches)
            clients_store.put(cid, t, *alg.client_record(cstate))
            upmsg, sizes_u = alg.encode_upload(up)
            if not acfg.communicate:
                upmsg, sizes_u = b"", {}
            _count(bytes_up, sizes_u)
            losses.append(cm.get("loss"))
            record({"event": "client", **cm, "round": t, "bytes_up": len(upmsg),
                                       "bytes_down": len(msg) if acfg.communicate or first_contact else 0})
            # ---- channel
            key = (t, cid)
            if key in faults.corrupt and up.dc is not None:
                upmsg, _ = alg.encode_upload(alg.Upload(up.client_id, up.round, up.base_version, up.n_examples,
                                                        {k: torch.full_like(v, float("nan")) for k, v in up.dc.items()}))
            if not acfg.communicate:
                pass
            elif key in faults.delay:
                late.append(upmsg)
            elif key not in faults.drop:
                delivered.append(upmsg)
                if key in faults.duplicate:
                    delivered.append(upmsg)
            bar.update(1)
            bar.set_postfix(loss=f"{cm['loss']:.3f}" if "loss" in cm else "resync")
            faults.maybe_crash(t, f"client:{j}")
        # ---- server side
        uploads, malformed = [], {}
        for m in delivered:
            try:
                uploads.append(alg.decode_upload(m, ref, device=_dev(ref)))
            except PayloadError as exc:
                malformed[f"#{len(malformed)}"] = str(exc)
        known = [u for u in uploads if u.client_id in sizes]
        for u in uploads:
            if u.client_id not in sizes:
                malformed[u.client_id] = "unknown client id"
        copies = {u.client_id: _load_copy(server_store, u.client_id, messenger0) for u in known}
        server, new_copies, sm = alg.server_update(acfg, server, known, copies, n_clients=len(ids))
        for cid, cp in new_copies.items():
            if cp is not copies[cid]:
                server_store.put(cid, t, *alg.copy_record(cp))
        if malformed:
            sm["rejected"] = {**sm["rejected"], **malformed}
            for who, why in malformed.items():
                log(f"round {t}: rejected upload from {who}: {why}")
        faults.maybe_crash(t, "server")
        extra, tm = task.after_server(t, server, extra)
        faults.maybe_crash(t, "takd")
        recs = [{"event": "server", **sm, "round": t},
                {"event": "takd", "round": t, **tm},
                {"event": "round", "round": t, "clients": sampled,
                 "loss": sum(x for x in losses if x is not None) / max(sum(x is not None for x in losses), 1),
                 "bytes_down": bytes_down, "bytes_up": bytes_up}]
        last = t == fed.rounds - 1
        if last or (fed.eval_every and (t + 1) % fed.eval_every == 0):
            bar.set_description(f"round {t + 1}/{fed.rounds} evaluating")
            who = ids if fed.eval_clients == "all" else sampled
            pers = {cid: s.personalized for cid in who if (s := _maybe_client(clients_store, cid)) and s.personalized}
            recs.append({"event": "eval", "round": t, **task.evaluate(t, server, pers)})
            write_json(run.root / "eval" / f"round_{t:04d}.json", recs[-1])
        for r in recs:
            record(r)
        append_jsonl(run.timing, {"round": t, "seconds": time.perf_counter() - t_round})
        faults.maybe_crash(t, "checkpoint")
        st, smeta = alg.server_record(server)
        et, em = task.extra_record(extra)
        run.save_checkpoint(t, {**st, **{f"extra/{k}": v for k, v in et.items()}}, {"server": smeta, "extra": em},
                            fed.checkpoint_keep)
        clients_store.commit(t, sampled)
        server_store.commit(t, [u.client_id for u in known])
        faults.maybe_crash(t, "commit")
    bar.close()
    if tb is not None:
        tb.close()
    task.finalize(run.root, server, extra)
    summary = summarize(run, cfg)
    write_json(run.root / "summary.json", summary)
    return summary


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


def _maybe_client(store: RoundStore, cid: str) -> alg.ClientState | None:
    rec = store.get(cid)
    return None if rec is None else alg.client_from_record(*rec)


def _on_device(s: alg.ClientState | None, cid: str, n: int, ref: dict) -> alg.ClientState:
    """A client's saved state on the messenger's device (a fresh one if it never trained)."""
    if s is None:
        return alg.init_client(cid, n, ref)
    dev = _dev(ref)

    def mv(st):
        return None if st is None else {k: v.to(dev) for k, v in st.items()}

    pending = None if s.pending is None else alg.Pending(mv(s.pending.dc), s.pending.base_version, s.pending.round)
    return alg.ClientState(s.client_id, s.n_examples, mv(s.c_i), s.version, pending, mv(s.personalized))


def summarize(run: RunDir, cfg: ExperimentConfig) -> dict:
    rows = read_jsonl(run.metrics)
    rounds = [r for r in rows if r["event"] == "round"]
    evals = [r for r in rows if r["event"] == "eval"]
    down = sum(sum(r["bytes_down"].values()) for r in rounds)
    up = sum(sum(r["bytes_up"].values()) for r in rounds)
    n_cr = sum(len(r["clients"]) for r in rounds)
    by_comp: dict[str, dict[str, float]] = {"down": {}, "up": {}}
    for r in rounds:
        for d, key in (("down", "bytes_down"), ("up", "bytes_up")):
            for k, v in r[key].items():
                by_comp[d][k] = by_comp[d].get(k, 0) + v / MIB
    return {
        "rounds": len(rounds), "client_rounds": n_cr,
        "loss_first_round": rounds[0]["loss"] if rounds else None, "loss_last_round": rounds[-1]["loss"] if rounds else None,
        "eval_before": evals[0] if evals else None, "eval_after": evals[-1] if len(evals) > 1 else None,
        "mib": {"down_total": down / MIB, "up_total": up / MIB,
                "down_per_client_round": down / MIB / max(n_cr, 1), "up_per_client_round": up / MIB / max(n_cr, 1),
                "by_component": by_comp},
    }


def load_personalized(run: str | Path, client: str, d) -> dict:
    """A client's personalized messenger (x_K of its last participation) from a run's client store."""
    from ciders.models.adapters import check_state

    run = Path(run)
    committed = RunDir(run).committed()
    store = run / "clients"
    rec = RoundStore(store, committed if committed is not None else -1).get(client) if store.is_dir() else None
    st = alg.client_from_record(*rec) if rec else None
    if st is None or st.personalized is None:
        raise CidersError(f"{run}: client {client!r} has no personalized messenger (never trained in this run)")
    check_state(d.messenger_params(), st.personalized, f"client {client}")
    return {k: v.to(d.device) for k, v in st.personalized.items()}
