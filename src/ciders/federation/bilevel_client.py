"""The client side of a RABO-family round (docs/rabo.md#one-round): `client_phase`, the only code a client runs,
in-process (`federation.bilevel_loop.in_process`) or on a Flower SuperNode (`transports.flower`).

A client decodes the server's message for its phase (`bilevel_codec.decode_message`), runs `rabo.inner_update` /
`rabo.outer_update` (or a baseline's local steps) on the sub-model it was sent, and replies with wire bytes
(`bilevel_codec.encode_message`) and a JSON-able record: loss, `calls` (loss evaluations, including those inside
second-order products) and its measured `seconds`; the server adds what it knows itself
(`bilevel_rounds.client_record`). Between the two phases of a round it keeps what it was sent (x_q and its masks) in
`scratch` (a dict in-process, a state directory on a Flower node).
"""

from __future__ import annotations

import time
import weakref
from typing import MutableMapping

import torch

from ciders.algorithms import rabo as rb
from ciders.algorithms.registry import get
from ciders.core import submodel as sm
from ciders.core.wire import PayloadError
from ciders.federation.bilevel_codec import decode_message, encode_message
from ciders.federation.exchange import client_index


class _Counter:
    """Counts loss evaluations (a second-order product by autograd costs ~2 gradients, by finite
    differences 2 gradient calls; both show up here as the calls they make)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a):
        self.calls += 1
        return self.fn(*a)


_REFS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _reference(task) -> tuple[dict, dict]:
    """task.initial(), built once per task (a paper-scale backbone's init is not free): only its shapes,
    dtypes and device are read."""
    if task not in _REFS:
        _REFS[task] = task.initial()
    return _REFS[task]


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
    comps, q = decode_message(msg, i, phase)
    t0 = time.perf_counter()
    if phase == "inner":
        x, mx = sm.unpack(comps["x"], x0, "x")
        y, my = sm.unpack(comps["y"], y0, "y")
        m = rb.ClientMasks(mx, my, task.clients()[ci])
        g = _Counter(task.g)
        G, info = rb.inner_update(cfg, rb.BilevelState(q, x, y), m, g, task.batches(ci, q, cfg.inner_steps))
        scratch.clear()
        scratch.update({"round": {"q": torch.tensor(q)}, "x": x, "mx": mx, "my": my})
        up, calls = encode_message({"G": sm.gather(G, my)}, q, i, phase), g.calls
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
        up, calls = encode_message({"h": sm.gather(h, m.x)}, q, i, phase), f.calls + g.calls
    elif phase == "outer":
        if "round" not in scratch or int(scratch["round"]["q"]) != q:
            raise PayloadError(f"{i}: outer message of round {q} without this round's inner phase")
        y, my = sm.unpack(comps["y"], y0, "y")
        if any(my[k].shape != v.shape for k, v in scratch["my"].items()):
            raise PayloadError(f"{i}: outer message's y sub-model differs from this round's inner one")
        m = rb.ClientMasks(scratch["mx"], my, task.clients()[ci])
        f, g = _Counter(task.f), _Counter(task.g)
        h, info = rb.outer_update(cfg, rb.BilevelState(q, scratch["x"], y), m, f, g, task.outer_batch(ci, q))
        up, calls = encode_message({"h": sm.gather(h, m.x)}, q, i, phase), f.calls + g.calls
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
    if spec.submodel_local:
        (x, mx), (y, my) = sm.unpack(comps["x"], x0, "x"), sm.unpack(comps["y"], y0, "y")
        kw = {"mask": mx, "threshold": True} if exp.rabo.mask_rule == "magnitude" else {}  # FIARSE: full-shape x
        xn, yn, info = spec.local_update(exp.fedmeta, task, x, y, ci, q, **kw)
        dx, dy = {k: x[k] - xn[k] for k in x}, {k: y[k] - yn[k] for k in y}
        up = encode_message({"dx": sm.gather(dx, mx), "dy": sm.gather(dy, my)}, q, i, "local")
        return up, int(info.pop("calls")), info
    check(comps["x"], x0, "x")
    check(comps["y"], y0, "y")
    xn, yn, info = spec.local_update(exp.fedmeta, task, {k: comps["x"][k].to(v.device) for k, v in x0.items()},
                                     {k: comps["y"][k].to(v.device) for k, v in y0.items()}, ci, q)
    return encode_message({"x": xn, "y": yn}, q, i, "local"), int(info.pop("calls")), info
