"""The server side of a RABO-family round (docs/rabo.md#one-round): `BilevelServer`, the family's strategy for the
round loop of every method (`federation.loop.run_rounds`), in-process and on Flower alike: both engines move the
same bytes through the same functions, so they give the same numbers. The client side is
`federation.bilevel_client`; the messages and records are `federation.bilevel_codec`'s.

A method is a sequence of phases; each phase is one message to each client and one reply:
  rabo / rafbo / fedmbo   inner: down x_q, y_q (kept entries + kept units)  -> up G^i (kept entries of y)
                          outer: down y_{q+1} (kept entries + kept units)   -> up grad f_i (kept entries of x)
  ... rabo.head: episode  outer only: down x_q, y_q's sub-model -> up grad f_i at the client's own head y_T, fitted
                          from 0 on its episode (`rabo.episode_head`); y is never aggregated
  static / fedrolex /     local: down the sub-model its rule extracts -> up the kept entries of its change
  fiarse / oap            after the ProtoNet steps on it; the server takes each coordinate's mean over its holders
  dist-protonet /         local: down the full (x, y) -> up the client's model after its local steps
  dist-maml / fedavg      (`algorithms.fedmeta`: FedAvg of the meta-learner / of the untuned classifier)
Server (explicit state): `begin(q)` computes every client's masks M(x_q, R_i), M(y_q, R_i) from the global weights;
`down(phase, i)` is client i's message; `absorb(phase, replies)` checks each reply against the masks the server
sent (a malformed one is rejected and logged, never applied; so is one whose step is above
federation.max_step_ratio x max(r, 1), r the norm at the run's start of what it moves: ||y_0||, ||x_0|| or
||(x_0, y_0)||, `BilevelState.ref`, docs/security.md#aggregation) and takes the server step over the clients that
answered (per-coordinate 1/C^k means, `algorithms.rabo`); `close_round` makes the round's state the state. The
strategy's verbs (`configure`, `aggregate`, `finish`, `evaluate`, `to_record`) wrap them for the loop, which
counts the bytes, admits the replies and writes the records, evaluations and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ciders.algorithms import rabo as rb
from ciders.algorithms.registry import get
from ciders.core import aggregate as agg
from ciders.core import masks as mk
from ciders.core import submodel as sm
from ciders.core.tensors import device_of
from ciders.core.wire import PayloadError
from ciders.federation.bilevel_codec import decode_reply, encode_message, flat, from_record
from ciders.federation import console
from ciders.federation.rundir import RunDir
from ciders.federation.exchange import client_id, client_index

REF_XY = "||(x_0, y_0)||"  # how a local baseline's rejection names its bound's reference


def _ones(st: dict) -> dict:
    return {k: torch.ones_like(v) for k, v in st.items()}


def kept_fraction(m: rb.ClientMasks) -> float:
    return mk.masked_fraction({**{f"x/{k}": v for k, v in m.x.items()}, **{f"y/{k}": v for k, v in m.y.items()}})


def submodel_cost(task, m: rb.ClientMasks) -> dict:
    """What client m's sub-model costs, from the shapes of what it holds (`core.submodel.sub_shapes`):
    `flops_fraction`, its forward FLOPs per example over the full model's (`task.flops`; a task without
    one: the kept fraction of coordinates), and `param_bytes`, the bytes of its x and y tensors (an
    unstructured mask leaves them full-size: dense compute and memory save nothing)."""
    xs, ys = sm.sub_shapes(m.x), sm.sub_shapes(m.y)
    nbytes = sum(int(torch.Size(sh).numel()) * m.x[k].element_size() for k, sh in xs.items()) + \
        sum(int(torch.Size(sh).numel()) * m.y[k].element_size() for k, sh in ys.items())
    flops = getattr(task, "flops", None)
    if flops is None:
        frac = kept_fraction(m)
    else:
        full = flops({k: tuple(v.shape) for k, v in m.x.items()}, {k: tuple(v.shape) for k, v in m.y.items()})
        frac = flops(xs, ys) / max(full, 1)
    return {"flops_fraction": frac, "param_bytes": nbytes}


@dataclass(frozen=True)
class BilevelRound:
    """One round between `begin` and `finish`: every client's masks, y_{q+1} after the inner phase (`mid`),
    the state the round will commit (`next`) and its statistics. Replaced, never mutated, phase by phase."""

    q: int
    masks: dict  # client id -> rb.ClientMasks
    costs: dict = field(default_factory=dict)  # client id -> submodel_cost(task, masks[id])
    mid: rb.BilevelState | None = None
    next: rb.BilevelState | None = None
    stats: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)  # the phase's downlink bytes per client


class BilevelServer:
    """The RABO family's server, and its strategy for `federation.loop.run_rounds` when given a run directory
    (`out`; `federation.bilevel_loop.run_bilevel`). Its state is explicit: `state` (x_q, y_q and the step bound's
    references, the norms of x_0 and y_0: what the last commit holds), `round` (BilevelRound) and, in a run, the
    totals summary.json reports and the last evaluation; every other attribute is fixed for the run. Without
    `out` it is the bare server step by step (`begin`, `down`, `absorb`, `close_round`), as the tests drive it."""

    def __init__(self, exp, task, log: Callable[[str], None] = print, out=None):
        self.exp, self.cfg, self.task, self.log = exp, exp.rabo, task, log
        self.experiment, self.extends_rounds = exp, False
        self.run = None if out is None else RunDir(out)
        x0, y0 = task.initial()
        self.state = rb.init_state(x0, y0)
        self.caps = task.clients()
        self.method = exp.method
        self.spec = get(exp.method, "bilevel")
        # rabo.head: episode drops the inner phase: each client fits its own head inside the outer one
        episode = self.cfg.head == "episode" and tuple(self.spec.phases) == ("inner", "outer")
        self.round_phases = ("outer",) if episode else self.spec.phases
        self.round: BilevelRound | None = None
        nbytes = {k: sum(v.numel() * v.element_size() for v in getattr(self.state, k).values()) for k in "xy"}
        self.full = {"down": nbytes["x"] + 2 * nbytes["y"], "up": nbytes["y"] + nbytes["x"]}  # FedMBO's, per round
        self.totals = {"seconds": 0.0, "calls": 0, "op_estimate": 0.0, "bytes_up": 0, "bytes_down": 0}
        self.ev = {}

    def from_record(self, t: int, tensors: dict, meta: dict) -> None:
        """A resumed run: the state, totals and last evaluation of committed round t's checkpoint."""
        where = f"{self.run.root}: " if self.run is not None else ""
        self.state, self.totals, self.ev = from_record(tensors, meta, self.state, f"{where}the checkpoint of round {t}")
        self.log(f"{where}resuming after round {t}")

    @property
    def first_round(self) -> int:
        return self.state.round

    def phases(self, q: int) -> tuple[str, ...]:
        return self.round_phases

    @property
    def masks(self) -> dict:
        return self.round.masks

    @property
    def stats(self) -> dict:
        return self.round.stats

    @property
    def ids(self) -> list[str]:
        return [client_id(i) for i in range(len(self.caps))]

    def begin(self, q: int) -> None:
        if self.state.round != q:
            raise ValueError(f"the server is at round {self.state.round}, asked to begin round {q}")
        self.state = rb.with_ref(self.state)  # a state set without references gets its own norms, fixed from now
        if self.spec.local_update is not None and not self.spec.submodel_local:
            masks = [rb.ClientMasks(_ones(self.state.x), _ones(self.state.y), 1.0) for _ in self.caps]
        else:
            masks = [rb.client_masks(self.cfg, self.state, r, units=self.task.units(), client=i,
                                     capacities=self.caps) for i, r in enumerate(self.caps)]
        self.round = BilevelRound(q, dict(zip(self.ids, masks)),
                                  {i: submodel_cost(self.task, m) for i, m in zip(self.ids, masks)})

    def cost(self, i: str) -> dict:
        """Client i's sub-model cost this round (`submodel_cost`)."""
        return self.round.costs[i]

    def down(self, phase: str, i: str) -> bytes:
        m, s = self.masks[i], self.state
        if phase == "outer" and self.round_phases != ("outer",):  # y_{q+1}'s sub-model
            comps = {"y": sm.pack(self.round.mid.y, m.y)}
        elif phase in ("inner", "outer") or (phase == "local" and self.spec.submodel_local):
            # x_q and y_q's sub-models (rabo.head episode's outer phase: y's values unused; a sub-model baseline)
            comps = {"x": sm.pack(s.x, m.x), "y": sm.pack(s.y, m.y)}
        elif phase == "local":  # a full-model baseline: the whole model down, the client's model up
            comps = {"x": s.x, "y": s.y}
        else:
            raise ValueError(f"unknown phase {phase!r}")
        return encode_message(comps, s.round, i, phase)

    def _read(self, phase: str, i: str, msg: bytes, name: str, mask: dict, ref: dict):
        comps = decode_reply(msg, self.state.round, i, phase, (name,))
        return sm.scatter(comps[name], mask, ref, f"{i} {name}")

    def absorb(self, phase: str, replies: dict[str, bytes]) -> dict:
        """The server step of `phase` over the clients whose replies are valid (taken in client order);
        returns {client: reason} of the rejected ones."""
        replies = {i: replies[i] for i in self.ids if i in replies}
        if phase == "local":
            return self._absorb_local_sub(replies) if self.spec.submodel_local else self._absorb_local(replies)
        rejected, vals, used = {}, [], []
        name, field = ("G", "y") if phase == "inner" else ("h", "x")
        ref = self.state.y if phase == "inner" else self.state.x
        lr = self.cfg.beta if phase == "inner" else self.cfg.alpha
        for i in replies:
            m = self.masks[i]
            try:
                v = self._read(phase, i, replies[i], name, getattr(m, field), ref)
                why = agg.step_check({k: lr * t for k, t in v.items()}, self.state.ref[field],
                                     self.exp.federation.max_step_ratio, f"||{field}_0||")
                if why is not None:
                    raise PayloadError(why)
                vals.append(v)
                used.append(m)
            except PayloadError as exc:
                rejected[i] = str(exc)
                self.log(console.rejected(self.state.round, phase, i, exc))
        base = self.state if phase == "inner" or self.round.mid is None else self.round.mid
        step = rb.server_inner if phase == "inner" else rb.server_outer
        nxt, st = step(self.cfg, base, vals, used) if vals else (None, {})
        if nxt is not None and not agg.all_finite(nxt.x, nxt.y):
            rejected.update(self._aggregate_rejected(phase, [i for i in replies if i not in rejected]))
            nxt = None
        if nxt is None:  # nobody (valid) answered: the state stays
            nxt = base if phase == "inner" else replace(base, round=base.round + 1)
            st = {"covering_y": 0, "trained_y": 0.0} if phase == "inner" else {"covering_x": 0, "trained_x": 0.0}
        if phase == "outer" and self.round_phases == ("outer",):  # rabo.head: episode: no coordinate of y is trained
            st = {"covering_y": 0, "trained_y": 0.0, **st}
        stats = {**self.round.stats, f"{phase}_clients": [i for i in replies if i not in rejected], **st}
        self.round = replace(self.round, **({"mid": nxt} if phase == "inner" else {"next": nxt}), stats=stats)
        return rejected

    def _aggregate_rejected(self, phase: str, ids: list[str]) -> dict:
        why = "the round's aggregate is not finite: the step is rejected, the state stays as it was"
        self.log(f"round {self.state.round} {phase}: {why} (clients {', '.join(ids)})")
        return {i: why for i in ids}

    def _absorb_local(self, replies: dict[str, bytes]) -> dict:
        """FedAvg (`algorithms.fedmeta.server_mean`, uniform weights) of the valid client models."""
        from ciders.algorithms.fedmeta import server_mean

        s, rejected, xs, ys = self.state, {}, [], []
        for i in replies:
            try:
                comps = decode_reply(replies[i], s.round, i, "local", ("x", "y"), {"x": s.x, "y": s.y},
                                     device_of(s.x))
                moved = rb.joined({k: v - s.x[k] for k, v in comps["x"].items()},
                                  {k: v - s.y[k] for k, v in comps["y"].items()})
                why = agg.step_check(moved, s.ref["xy"], self.exp.federation.max_step_ratio, REF_XY)
                if why is not None:
                    raise PayloadError(why)
                xs.append(comps["x"])
                ys.append(comps["y"])
            except PayloadError as exc:
                rejected[i] = str(exc)
                self.log(console.rejected(s.round, "local", i, exc))
        nxt = replace(s, round=s.round + 1)
        if xs:
            w = [1.0] * len(xs)
            mean = replace(nxt, x=server_mean(s.x, xs, w), y=server_mean(s.y, ys, w))
            if agg.all_finite(mean.x, mean.y):
                nxt = mean
            else:
                rejected.update(self._aggregate_rejected("local", [i for i in replies if i not in rejected]))
                xs = []
        n = len(xs)
        self.round = replace(self.round, next=nxt, stats={
            **self.round.stats, "covering_x": n, "covering_y": n, "trained_x": float(n > 0),
            "trained_y": float(n > 0), "local_clients": [i for i in replies if i not in rejected]})
        return rejected

    def _absorb_local_sub(self, replies: dict[str, bytes]) -> dict:
        """A sub-model baseline's server step (HeteroFL's aggregation): each coordinate becomes the mean of the
        client models that hold it, s^k - (1/C^k) sum_{i in N^k} (s^k - x_i^k); nobody's coordinates stay.
        A reply is the kept entries of the client's change s - x_i (`dx`, `dy`), checked like RABO's."""
        s, rejected, dxs, dys, used = self.state, {}, [], [], []
        for i in replies:
            m = self.masks[i]
            try:
                comps = decode_reply(replies[i], s.round, i, "local", ("dx", "dy"))
                dx, dy = sm.scatter(comps["dx"], m.x, s.x, f"{i} dx"), sm.scatter(comps["dy"], m.y, s.y, f"{i} dy")
                why = agg.step_check(rb.joined(dx, dy), s.ref["xy"], self.exp.federation.max_step_ratio, REF_XY)
                if why is not None:
                    raise PayloadError(why)
                dxs.append(dx)
                dys.append(dy)
                used.append(m)
            except PayloadError as exc:
                rejected[i] = str(exc)
                self.log(console.rejected(s.round, "local", i, exc))
        nxt, st = replace(s, round=s.round + 1), {"covering_x": 0, "covering_y": 0, "trained_x": 0.0,
                                                  "trained_y": 0.0}
        if dxs:
            x, sx = agg.masked_step(s.x, dxs, [m.x for m in used], 1.0)
            y, sy = agg.masked_step(s.y, dys, [m.y for m in used], 1.0)
            if agg.all_finite(x, y):
                nxt = replace(nxt, x=x, y=y)
                st = {"covering_x": sx["covering"], "covering_y": sy["covering"],
                      "trained_x": sx["coordinates_trained"] / sx["coordinates"],
                      "trained_y": sy["coordinates_trained"] / sy["coordinates"]}
            else:
                rejected.update(self._aggregate_rejected("local", [i for i in replies if i not in rejected]))
        self.round = replace(self.round, next=nxt, stats={
            **self.round.stats, **st, "local_clients": [i for i in replies if i not in rejected]})
        return rejected

    def close_round(self) -> dict:
        """The round's state becomes the state; returns the round's statistics."""
        if self.round is None or self.round.next is None:
            raise ValueError("finish: the round has not taken its last server step")
        # the references go on as they were, whatever the step built: never re-taken from the state
        self.state, stats, self.round = replace(self.round.next, ref=self.state.ref), self.round.stats, None
        return stats

    def participants(self, phase: str) -> list[str]:
        """Who gets `phase`'s message: everyone for the first phase; for the outer phase, the clients whose
        inner reply was accepted (the others have no place in this round's y_{q+1})."""
        first = self.round_phases[0]
        return self.ids if phase == first else list(self.round.stats.get(f"{first}_clients", []))

    # ------------------------------------------------------------------ the strategy (federation.loop)
    def prepare(self) -> list[dict]:
        return []  # nothing before the first round but its evaluation

    def configure(self, phase: str, q: int) -> dict[str, bytes]:
        msgs = {i: self.down(phase, i) for i in self.participants(phase)}
        self.round = replace(self.round, sent={i: len(m) for i, m in msgs.items()})
        return msgs

    def count(self, direction: str, phase: str, cid: str, msg: bytes) -> dict:
        return {phase: len(msg)}  # every message and reply, under its phase's name

    def aggregate(self, phase: str, q: int, got, traffic, mark: Callable[[str], None] = lambda p: None) -> list[dict]:
        """The server step over the admitted replies whose client record fits (`client_record`; one that does not
        rejects the reply) -> the records of the clients whose reply the step took, as the server composes them."""
        for who, why in got.refused.items():
            self.log(console.rejected(q, phase, who, why))
        for r in got.others:
            self.log(f"round {q} {phase}: a {r.kind} delivery from {str(r.client_id)[:64]} is not part of the round: "
                     "ignored")
        payloads, recs = {}, {}
        for r in got.replies:
            try:
                recs[r.client_id] = client_record(self, phase, r.client_id, r.record,
                                                  self.round.sent.get(r.client_id, 0), len(r.payload))
                payloads[r.client_id] = r.payload
            except PayloadError as exc:
                self.log(console.rejected(q, phase, r.client_id, exc))
        rejected = self.absorb(phase, payloads)
        out = []
        for i in (c for c in self.ids if c in payloads):
            rec = recs[i]
            secs = float(rec.pop("seconds"))
            self.ledger.timing({"round": q, "client": i, "phase": phase, "seconds": secs})
            if i in rejected:
                continue
            out.append(rec)
            for k in ("calls", "op_estimate", "bytes_up"):
                self.totals[k] += rec[k]
            self.totals["seconds"] += secs
        mark(phase)
        return out

    def finish(self, q: int, traffic) -> list[dict]:
        """The round's record; its state becomes the state (what `evaluate` and `to_record` read). The run's
        downlink total is the loop's count; its uplink total counts the replies the server step took."""
        self.totals["bytes_down"] += sum(traffic.down.values())
        return [{"event": "round", "round": q, **self.close_round(), "full_bytes_per_client": self.full,
                 "bytes_down": dict(traffic.down), "bytes_up": dict(traffic.up)}]

    def evaluate(self, q: int = -1) -> dict:
        """The task's metrics of the global model as it stands (after round q)."""
        self.ev = self.task.evaluate(self.state.x, self.state.y)
        return self.ev

    def to_record(self) -> tuple[dict, dict]:
        s = self.state
        return flat(s), {"round": s.round, "ref_norm": s.ref, "totals": self.totals, "eval": self.ev}

    def commit(self, q: int) -> None:
        pass  # the state moved in `finish`; nothing else is the server's

    def close(self) -> dict:
        from safetensors.torch import save_file

        from ciders.fileio import atomic_path, write_json

        with atomic_path(self.run.root / "final.safetensors") as tmp:
            save_file(flat(self.state), str(tmp))
        summary = {"method": self.exp.method, "rounds": self.exp.federation.rounds, "clients": len(self.caps),
                   "final": self.ev, "final_by_capacity": self.evaluate_capacities(), **self.totals,
                   "full_bytes_per_client_round": self.full}
        write_json(self.run.root / "summary.json", summary)
        return summary

    def evaluate_capacities(self) -> dict:
        """{capacity: the task's metrics on the sub-model a client of that capacity would hold now} for every
        capacity < 1 of the run (the first client of each; `core.submodel.client_view`): what each resource
        level gets out of the global model. Empty for the full-model methods."""
        if (self.spec.local_update is not None and not self.spec.submodel_local) or self.spec.rabo_method == "fedmbo":
            return {}
        out = {}
        for i, r in enumerate(self.caps):
            if r >= 1 or str(r) in out:
                continue
            m = rb.client_masks(self.cfg, self.state, r, units=self.task.units(), client=i, capacities=self.caps)
            (x, _), (y, _) = sm.client_view(self.state.x, m.x), sm.client_view(self.state.y, m.y)
            out[str(r)] = self.task.evaluate(x, y)
        return dict(sorted(out.items(), key=lambda kv: -float(kv[0])))


def client_record(server: "BilevelServer", phase: str, i: str, measured: dict, bytes_down: int, bytes_up: int
                  ) -> dict:
    """A client's metrics record as the server writes it: the server's own fields (round, client, its
    masks' capacity and kept fraction, bytes counted on the wire) around the client's checked
    measurements (`federation.records.BILEVEL`; PayloadError if they do not fit)."""
    from ciders.federation import records

    rec = records.check(measured, records.BILEVEL)
    if "calls" not in rec or "seconds" not in rec:
        raise PayloadError("client record: needs 'calls' and 'seconds'")
    m, cap = server.masks[i], server.caps[client_index(i, len(server.caps))]
    cost = server.cost(i)
    return {"event": "client", "round": server.state.round, "client": i, "phase": phase, "capacity": cap,
            "calls": rec["calls"], "kept_fraction": kept_fraction(m), **cost,
            "op_estimate": rec["calls"] * cost["flops_fraction"], "bytes_down": bytes_down, "bytes_up": bytes_up, **rec}
