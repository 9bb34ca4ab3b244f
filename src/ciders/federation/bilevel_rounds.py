"""One bilevel-family round as messages (docs/rabo.md#one-round), shared by the in-process loop
(`federation.bilevel_loop`) and the Flower engine (`transports.flower.bilevel`): both move the same bytes through the
same functions, so they give the same numbers.

A method is a sequence of phases; each phase is one message to each client and one reply:
  rabo / rafbo / fedmbo   inner: down x_q, y_q (kept entries + kept units)  -> up G^i (kept entries of y)
                          outer: down y_{q+1} (kept entries + kept units)   -> up grad f_i (kept entries of x)
  ... rabo.head: episode  outer only: down x_q, y_q's sub-model -> up grad f_i at the client's own head y_T, fitted
                          from 0 on its episode (`rabo.episode_head`); y is never aggregated
  static / fedrolex /     local: down the sub-model its rule extracts -> up the kept entries of its change
  fiarse / oap            after the ProtoNet steps on it; the server takes each coordinate's mean over its holders
  dist-protonet /         local: down the full (x, y) -> up the client's model after its local steps
  dist-maml / fedavg      (`algorithms.fedmeta`: FedAvg of the meta-learner / of the untuned classifier)
Server (`BilevelServer`, explicit state): `begin(q)` computes every client's masks M(x_q, R_i), M(y_q, R_i)
from the global weights; `down(phase, i)` is client i's message; `absorb(phase, replies)` checks each
reply against the masks the server sent (a malformed one is rejected and logged, never applied; so is one whose
step is above federation.max_step_ratio x max(r, 1), r the norm at the run's start of what it moves: ||y_0||,
||x_0|| or ||(x_0, y_0)||, `BilevelState.ref`, docs/security.md#aggregation) and takes the server step over the
clients that answered (per-coordinate 1/C^k means, `algorithms.rabo`); `finish`
evaluates and returns the round's records.
Client (`client_phase`): decodes its message, runs `rabo.inner_update` / `rabo.outer_update`, replies
with wire bytes and a JSON-able record (loss, loss-evaluation count `calls`, measured `seconds`). Between
the two phases it keeps what it was sent (x_q and its masks) in `scratch` (a dict in-process, a state
directory on a Flower node).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, MutableMapping

import torch

from ciders.algorithms import rabo as rb
from ciders.algorithms.registry import get
from ciders.core import aggregate as agg
from ciders.core import masks as mk
from ciders.core import submodel as sm
from ciders.core.wire import PayloadError, decode, encode
from ciders.federation.exchange import client_id, client_index

class _Counter:
    """Counts loss evaluations (a second-order product by autograd costs ~2 gradients, by finite
    differences 2 gradient calls; both show up here as the calls they make)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a):
        self.calls += 1
        return self.fn(*a)


_REFS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
REF_XY = "||(x_0, y_0)||"  # how a local baseline's rejection names its bound's reference


def _reference(task) -> tuple[dict, dict]:
    """task.initial(), built once per task (a paper-scale backbone's init is not free): only its shapes,
    dtypes and device are read."""
    if task not in _REFS:
        _REFS[task] = task.initial()
    return _REFS[task]


def _device(st: dict) -> torch.device:
    return next(iter(st.values())).device


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


class BilevelServer:
    """The server of one run. Its state is explicit: `state` (x_q, y_q and the step bound's references, the
    norms of x_0 and y_0: what the last commit holds) and `round` (BilevelRound); every other attribute is fixed
    for the run."""

    def __init__(self, exp, task, log: Callable[[str], None] = print):
        self.exp, self.cfg, self.task, self.log = exp, exp.rabo, task, log
        x0, y0 = task.initial()
        self.state = rb.init_state(x0, y0)
        self.caps = task.clients()
        self.method = exp.method
        self.spec = get(exp.method, "bilevel")
        # rabo.head: episode drops the inner phase: each client fits its own head inside the outer one
        episode = self.cfg.head == "episode" and tuple(self.spec.phases) == ("inner", "outer")
        self.phases = ("outer",) if episode else self.spec.phases
        self.round: BilevelRound | None = None

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
        meta = {"round": s.round, "client": i, "phase": phase}
        if phase == "inner":
            return encode({"x": sm.pack(s.x, m.x), "y": sm.pack(s.y, m.y)}, meta)[0]
        if phase == "outer" and self.phases == ("outer",):  # x and the head's sub-model (its values unused)
            return encode({"x": sm.pack(s.x, m.x), "y": sm.pack(s.y, m.y)}, meta)[0]
        if phase == "outer":
            return encode({"y": sm.pack(self.round.mid.y, m.y)}, meta)[0]
        if phase == "local" and self.spec.submodel_local:  # a sub-model baseline: its sub-model down
            return encode({"x": sm.pack(s.x, m.x), "y": sm.pack(s.y, m.y)}, meta)[0]
        if phase == "local":  # a full-model baseline: the whole model down, the client's model up
            return encode({"x": s.x, "y": s.y}, meta)[0]
        raise ValueError(f"unknown phase {phase!r}")

    def _read(self, phase: str, i: str, msg: bytes, name: str, mask: dict, ref: dict):
        comps, meta = decode(msg)
        self._check_meta(meta, phase, i)
        if set(comps) != {name}:
            raise PayloadError(f"reply must hold exactly the component {name!r}, got {sorted(comps)}")
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
                self.log(f"round {self.state.round} {phase}: rejected the reply of {i}: {exc}")
        base = self.state if phase == "inner" or self.round.mid is None else self.round.mid
        step = rb.server_inner if phase == "inner" else rb.server_outer
        nxt, st = step(self.cfg, base, vals, used) if vals else (None, {})
        if nxt is not None and not agg.all_finite(nxt.x, nxt.y):
            rejected.update(self._aggregate_rejected(phase, [i for i in replies if i not in rejected]))
            nxt = None
        if nxt is None:  # nobody (valid) answered: the state stays
            nxt = base if phase == "inner" else replace(base, round=base.round + 1)
            st = {"covering_y": 0, "trained_y": 0.0} if phase == "inner" else {"covering_x": 0, "trained_x": 0.0}
        if phase == "outer" and self.phases == ("outer",):  # rabo.head: episode: no coordinate of y is trained
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
                comps, meta = decode(replies[i], {"x": s.x, "y": s.y}, device=_device(s.x))
                self._check_meta(meta, "local", i)
                if set(comps) != {"x", "y"}:
                    raise PayloadError(f"reply must hold x and y, got {sorted(comps)}")
                moved = rb.joined({k: v - s.x[k] for k, v in comps["x"].items()},
                                  {k: v - s.y[k] for k, v in comps["y"].items()})
                why = agg.step_check(moved, s.ref["xy"], self.exp.federation.max_step_ratio, REF_XY)
                if why is not None:
                    raise PayloadError(why)
                xs.append(comps["x"])
                ys.append(comps["y"])
            except PayloadError as exc:
                rejected[i] = str(exc)
                self.log(f"round {s.round} local: rejected the reply of {i}: {exc}")
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
                comps, meta = decode(replies[i])
                self._check_meta(meta, "local", i)
                if set(comps) != {"dx", "dy"}:
                    raise PayloadError(f"reply must hold dx and dy, got {sorted(comps)}")
                dx, dy = sm.scatter(comps["dx"], m.x, s.x, f"{i} dx"), sm.scatter(comps["dy"], m.y, s.y, f"{i} dy")
                why = agg.step_check(rb.joined(dx, dy), s.ref["xy"], self.exp.federation.max_step_ratio, REF_XY)
                if why is not None:
                    raise PayloadError(why)
                dxs.append(dx)
                dys.append(dy)
                used.append(m)
            except PayloadError as exc:
                rejected[i] = str(exc)
                self.log(f"round {s.round} local: rejected the reply of {i}: {exc}")
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

    def finish(self) -> dict:
        """The round's state becomes the state; returns the round's statistics."""
        if self.round is None or self.round.next is None:
            raise ValueError("finish: the round has not taken its last server step")
        # the references go on as they were, whatever the step built: never re-taken from the state
        self.state, stats, self.round = replace(self.round.next, ref=self.state.ref), self.round.stats, None
        return stats

    def _check_meta(self, meta: dict, phase: str, i: str) -> None:
        if meta.get("round") != self.state.round or meta.get("client") != i or meta.get("phase") != phase:
            raise PayloadError(f"reply is for round {meta.get('round')} client {meta.get('client')} phase "
                               f"{meta.get('phase')!r}, expected round {self.state.round} {i} phase {phase!r}")

    def participants(self, phase: str) -> list[str]:
        """Who gets `phase`'s message: everyone for the first phase; for the outer phase, the clients whose
        inner reply was accepted (the others have no place in this round's y_{q+1})."""
        return self.ids if phase == self.phases[0] else list(self.round.stats.get(f"{self.phases[0]}_clients", []))

    def evaluate(self) -> dict:
        return self.task.evaluate(self.state.x, self.state.y)

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


def client_phase(exp, task, phase: str, cid: str, msg: bytes, scratch: MutableMapping[str, dict]
                 ) -> tuple[bytes, dict]:
    """Client `cid`'s reply to the server's `phase` message (see the module docstring)."""
    cfg = exp.rabo
    try:
        ci = client_index(cid, len(task.clients()))
    except ValueError as exc:
        raise PayloadError(f"this run has no client {cid!r}: {exc}") from exc
    i = cid
    x0, y0 = _reference(task)  # shapes, dtypes and device the client expects (its copy of the architecture)
    comps, meta = decode(msg)
    q = meta.get("round")
    if meta.get("client") != i or meta.get("phase") != phase or not isinstance(q, int):
        raise PayloadError(f"{i}: message is for client {meta.get('client')} phase {meta.get('phase')!r}")
    t0 = time.perf_counter()
    if phase == "inner":
        x, mx = sm.unpack(comps["x"], x0, "x")
        y, my = sm.unpack(comps["y"], y0, "y")
        m = rb.ClientMasks(mx, my, task.clients()[ci])
        g = _Counter(task.g)
        G, info = rb.inner_update(cfg, rb.BilevelState(q, x, y), m, g, task.batches(ci, q, cfg.inner_steps))
        scratch.clear()
        scratch.update({"round": {"q": torch.tensor(q)}, "x": x, "mx": mx, "my": my})
        up, calls = encode({"G": sm.gather(G, my)}, {"round": q, "client": i, "phase": phase})[0], g.calls
    elif phase == "outer" and cfg.head == "episode":  # rabo.head: episode, the round's only phase
        if set(comps) != {"x", "y"}:
            raise PayloadError(f"{i}: rabo.head episode's outer message must hold x and y, got {sorted(comps)}")
        x, mx = sm.unpack(comps["x"], x0, "x")
        y_sub, my = sm.unpack(comps["y"], y0, "y")  # the head's sub-model: its shapes and mask, not its values
        m = rb.ClientMasks(mx, my, task.clients()[ci])
        f, g = _Counter(task.f), _Counter(task.g)
        eps = task.round_episodes(ci, q) if hasattr(task, "round_episodes") else [task.outer_batch(ci, q)]
        hs, infos = [], []
        for ep in eps:  # one head per episode, fitted on its support; the hypergradients averaged
            y, inner = rb.episode_head(cfg, x, y_sub, m, g, [ep] * cfg.inner_steps)
            h, info = rb.outer_update(cfg, rb.BilevelState(q, x, y), m, f, g, ep)
            hs.append(h)
            infos.append({**inner, **info})
        h = {k: sum(t[k] for t in hs) / len(hs) for k in hs[0]}
        info = {k: _merge([d[k] for d in infos]) for k in infos[0]}
        up, calls = encode({"h": sm.gather(h, m.x)}, {"round": q, "client": i, "phase": phase})[0], f.calls + g.calls
    elif phase == "outer":
        if "round" not in scratch or int(scratch["round"]["q"]) != q:
            raise PayloadError(f"{i}: outer message of round {q} without this round's inner phase")
        y, my = sm.unpack(comps["y"], y0, "y")
        if any(my[k].shape != v.shape for k, v in scratch["my"].items()):
            raise PayloadError(f"{i}: outer message's y sub-model differs from this round's inner one")
        m = rb.ClientMasks(scratch["mx"], my, task.clients()[ci])
        f, g = _Counter(task.f), _Counter(task.g)
        h, info = rb.outer_update(cfg, rb.BilevelState(q, scratch["x"], y), m, f, g, task.outer_batch(ci, q))
        up, calls = encode({"h": sm.gather(h, m.x)}, {"round": q, "client": i, "phase": phase})[0], f.calls + g.calls
    elif phase == "local" and (spec := get(exp.method, "bilevel")).local_update is not None:
        up, calls, info = _local_phase(exp, spec, task, comps, (x0, y0), ci, i, q)
    else:
        raise PayloadError(f"{i}: phase {phase!r} is not a phase of {exp.method}")
    # only what the client measured; the server adds what it knows itself (`client_record`)
    return up, {"calls": calls, "seconds": time.perf_counter() - t0, **info}


def _merge(vals: list):
    """One record value from one per episode: counts add up, measurements average, anything else is the first."""
    if all(type(v) is int for v in vals):
        return sum(vals)
    if all(type(v) in (int, float) for v in vals):
        return sum(vals) / len(vals)
    return vals[0]


def _local_phase(exp, spec, task, comps: dict, ref: tuple, ci: int, i: str, q: int) -> tuple[bytes, int, dict]:
    """A baseline's local steps: on the sub-model it was sent (the sub-model baselines: reply with the kept
    entries of its change; FIARSE's steps also get its mask) or on the full model (reply with the model)."""
    from ciders.core.wire import check

    x0, y0 = ref
    if set(comps) != {"x", "y"}:
        raise PayloadError(f"{i}: a local message holds x and y, got {sorted(comps)}")
    meta = {"round": q, "client": i, "phase": "local"}
    if spec.submodel_local:
        (x, mx), (y, my) = sm.unpack(comps["x"], x0, "x"), sm.unpack(comps["y"], y0, "y")
        kw = {"mask": mx, "threshold": True} if exp.rabo.mask_rule == "magnitude" else {}  # FIARSE: full-shape x
        xn, yn, info = spec.local_update(exp.fedmeta, task, x, y, ci, q, **kw)
        dx, dy = {k: x[k] - xn[k] for k in x}, {k: y[k] - yn[k] for k in y}
        return encode({"dx": sm.gather(dx, mx), "dy": sm.gather(dy, my)}, meta)[0], int(info.pop("calls")), info
    check(comps["x"], x0, "x")
    check(comps["y"], y0, "y")
    xn, yn, info = spec.local_update(exp.fedmeta, task, {k: comps["x"][k].to(v.device) for k, v in x0.items()},
                                     {k: comps["y"][k].to(v.device) for k, v in y0.items()}, ci, q)
    return encode({"x": xn, "y": yn}, meta)[0], int(info.pop("calls")), info


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
