"""The CIDERS family's durable records and wire messages (docs/architecture.md): what the stores and checkpoints
hold for a client's state, the server's copy of c_i and the server state (tensors under prefixes + JSON meta), and
the broadcast and upload as `core.wire` messages. Decoding validates shapes, dtypes and finiteness against the
messenger before anything is used, and every metadata field's type (a client trusts its server no more than the
server trusts it). The update rules these records hold are `algorithms.ciders`'; this module only encodes them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ciders.algorithms.ciders import (Broadcast, ClientState, Pending, ServerCopy, ServerState, Upload,
                                      with_ref)
from ciders.core import server_opt as so
from ciders.core.tensors import State, norm
from ciders.runtime import DTYPES


ADAPTERS = ("student",)  # the downlink extras that travel in federation.adapter_dtype, beside the messenger


def wire_dtype(st: dict, name: str) -> dict:
    """`st` with its floating-point tensors in dtype `name` (federation.adapter_dtype; "model": unchanged)."""
    if name == "model":
        return st
    dt = DTYPES[name]
    return {k: v.to(dt) if v.is_floating_point() else v for k, v in st.items()}


def _pre(st: State | None, p: str) -> dict:
    return {} if st is None else {f"{p}/{k}": v for k, v in st.items()}


def _un(t: dict, p: str) -> State | None:
    out = {k[len(p) + 1 :]: v for k, v in t.items() if k.startswith(p + "/")}
    return out or None


def client_record(s: ClientState) -> tuple[dict, dict]:
    meta = {"client_id": s.client_id, "version": s.version,
            "pending": None if s.pending is None else {"base_version": s.pending.base_version, "round": s.pending.round}}
    return {**_pre(s.c_i, "c_i"), **_pre(s.pending.dc if s.pending else None, "pending"),
            **_pre(s.personalized, "personalized")}, meta


def client_from_record(t: dict, meta: dict) -> ClientState:
    p = meta["pending"]
    pending = None if p is None else Pending(_un(t, "pending"), p["base_version"], p["round"])
    return ClientState(meta["client_id"], _un(t, "c_i"), meta["version"], pending, _un(t, "personalized"))


def copy_record(c: ServerCopy) -> tuple[dict, dict]:
    return _pre(c.c_i, "c_i"), {"version": c.version, "needs_resync": c.needs_resync,
                                "applied": None if c.applied is None else list(c.applied)}


def copy_from_record(t: dict, meta: dict) -> ServerCopy:
    applied = meta.get("applied")  # absent in run directories written before acknowledgements named uploads
    return ServerCopy(_un(t, "c_i"), meta["version"], meta["needs_resync"],
                      None if applied is None else (int(applied[0]), str(applied[1])))


def server_record(s: ServerState) -> tuple[dict, dict]:
    """Tensors messenger/<k>, c/<k> and, once a server optimizer has stepped, server_opt_m/<k> (and server_opt_v/<k>);
    meta round, total_rounds, ref_norm (||w_0||, the step bound's reference; a float, exact through JSON) and then
    server_opt ({name, step})."""
    s = with_ref(s)
    ot, om = s.opt.to_record() if s.opt is not None else ({}, {})
    return ({**_pre(s.messenger, "messenger"), **_pre(s.c, "c"), **ot},
            {"round": s.round, "total_rounds": s.total_rounds, "ref_norm": s.ref_norm, **om})


def server_from_record(t: dict, meta: dict) -> ServerState:
    """The inverse of `server_record`. Meta "server_opt" is absent in checkpoints written before server optimizers:
    no state, as with none. "ref_norm" is absent in checkpoints written before the step bound had a fixed
    reference: it becomes the norm of the messenger the checkpoint holds (the bound of the round resumed, as the
    old rule had it), fixed from then on."""
    messenger = _un(t, "messenger")
    ref = meta.get("ref_norm")
    return ServerState(meta["round"], meta["total_rounds"], messenger, _un(t, "c"),
                       so.ServerOptState.from_record(t, meta), norm(messenger) if ref is None else float(ref))


def server_to(s: ServerState, device: torch.device | str) -> ServerState:
    """The server state with every tensor (messenger, c, the server optimizer's moments) on `device`."""
    return replace(s, messenger={k: v.to(device) for k, v in s.messenger.items()},
                   c={k: v.to(device) for k, v in s.c.items()}, opt=None if s.opt is None else s.opt.to(device))


_BROADCAST = {"round": "int", "gamma": "float", "lrs": "floats", "eta_ins": "floats", "version": "int",
              "c_i_digest": "str"}
_UPLOAD = {"client_id": "str", "round": "int", "base_version": "int", "resync_request": "bool"}


def encode_broadcast(b: Broadcast, extra: dict | None = None) -> tuple[bytes, dict[str, int]]:
    """Downlink: messenger, c, (resync), plus engine extras such as the student LoRA."""
    from ciders.core.wire import encode

    meta = {"round": b.round, "gamma": b.gamma, "lrs": list(b.lrs), "eta_ins": list(b.eta_ins), "version": b.version,
            "applied": None if b.applied is None else list(b.applied), "c_i_digest": b.c_i_digest or "",
            **({"secure": True} if b.secure else {})}
    return encode({"messenger": b.messenger, "c": b.c, "resync": b.resync, **(extra or {})}, meta)


def decode_broadcast(msg: bytes, messenger_ref: State, extra_ref: dict | None = None, device=None,
                     messenger_wire: State | None = None) -> tuple[Broadcast, dict]:
    """Raises ciders.core.wire.PayloadError for anything malformed (a client trusts its server no more
    than the server trusts it). `messenger_wire`: the messenger's reference as it travels (its dtype may be
    federation.adapter_dtype's), default `messenger_ref`; c and resync always match `messenger_ref`."""
    from ciders.core.wire import PayloadError, decode, fields

    comps, meta = decode(msg, {"messenger": messenger_ref if messenger_wire is None else messenger_wire,
                               "c": messenger_ref, "resync": messenger_ref, **(extra_ref or {})}, device)
    f = fields(meta, _BROADCAST, "broadcast")
    applied = meta.get("applied")
    if applied is not None and not (isinstance(applied, list) and len(applied) == 2 and type(applied[0]) is int
                                    and isinstance(applied[1], str)):
        raise PayloadError(f"broadcast: metadata 'applied' must be null or [round, digest], got {str(applied)[:60]}")
    if "messenger" not in comps or len(f["lrs"]) != len(f["eta_ins"]) or not f["lrs"]:
        raise PayloadError("broadcast: no messenger, or the learning-rate schedules are empty or differ in length")
    secure = meta.get("secure", False)
    if not isinstance(secure, bool):
        raise PayloadError(f"broadcast: metadata 'secure' must be a bool, got {str(secure)[:40]}")
    b = Broadcast(f["round"], comps["messenger"], comps.get("c"), float(f["gamma"]), tuple(map(float, f["lrs"])),
                  tuple(map(float, f["eta_ins"])), f["version"], comps.get("resync"),
                  None if applied is None else (applied[0], applied[1]), f["c_i_digest"] or None, secure)
    return b, {k: v for k, v in comps.items() if k not in ("messenger", "c", "resync")}


def encode_upload(u: Upload) -> tuple[bytes, dict[str, int]]:
    from ciders.core.wire import encode

    meta = {"client_id": u.client_id, "round": u.round, "base_version": u.base_version,
            "resync_request": u.resync_request}
    return encode({"dc": u.dc, "personalized": u.personalized}, meta)


def decode_upload(msg: bytes, messenger_ref: State, device=None) -> Upload:
    """Raises ciders.core.wire.PayloadError for anything malformed: wrong tensors, or metadata of the
    wrong type (any other field a client adds, e.g. a claimed example count, is ignored)."""
    from ciders.core.wire import decode, fields

    comps, meta = decode(msg, {"dc": messenger_ref, "personalized": messenger_ref}, device)
    f = fields(meta, _UPLOAD, "upload")
    return Upload(f["client_id"], f["round"], f["base_version"], comps.get("dc"), f["resync_request"],
                  comps.get("personalized"))
