"""The RABO family's records and wire: a `BilevelState` as checkpoint tensors and back (`flat`, `from_record`), and
the round's messages and replies as `core.wire` bytes (`encode_message`, `decode_reply`, `decode_message`). The
update rules are `algorithms.rabo`'s."""

from __future__ import annotations

from ciders.errors import CidersError


def flat(s) -> dict:
    """x and y of a BilevelState as one flat dict of CPU tensors (`x/<name>`, `y/<name>`)."""
    return {**{f"x/{k}": v.detach().cpu().contiguous() for k, v in s.x.items()},
            **{f"y/{k}": v.detach().cpu().contiguous() for k, v in s.y.items()}}


def from_record(tensors: dict, meta: dict, s0, what: str = "the checkpoint"):
    """(state, totals, last eval) of a checkpoint (`RunDir.load_checkpoint`), on the devices of `s0` (the initial
    state). Meta "ref_norm" ({"x": ||x_0||, "y": ||y_0||, "xy": ||(x_0, y_0)||}, the step bound's references;
    floats, exact through JSON) is absent in checkpoints written before the bound had fixed references: they
    become the norms of the x and y the checkpoint holds (the bound of the round resumed, as the old rule had it),
    fixed from then on."""
    from ciders.algorithms.rabo import BilevelState, ref_norms

    try:
        x = {k: tensors[f"x/{k}"].to(v.device) for k, v in s0.x.items()}
        y = {k: tensors[f"y/{k}"].to(v.device) for k, v in s0.y.items()}
    except KeyError as exc:
        raise CidersError(f"{what} lacks {exc}; the run directory is damaged") from exc
    ref = meta.get("ref_norm")
    ref = ref_norms(x, y) if ref is None else {k: float(ref[k]) for k in ("x", "y", "xy")}
    return BilevelState(int(meta["round"]), x, y, ref), meta["totals"], meta["eval"]


# ---------------------------------------------------------------------------------------------- the wire

def encode_message(comps: dict, q: int, cid: str, phase: str) -> bytes:
    """A message or a reply of the RABO family's round: its components and the round, client and phase it
    belongs to (every component a state dict; a sub-model's as `core.submodel.pack` / `gather` leave it)."""
    from ciders.core.wire import encode

    return encode(comps, {"round": q, "client": cid, "phase": phase})[0]


def decode_reply(msg: bytes, q: int, cid: str, phase: str, names: tuple[str, ...], expect: dict | None = None,
                 device=None) -> dict:
    """The server's reading of client cid's reply: for round q and `phase`, with exactly the components `names`
    (checked against `expect` where given); PayloadError otherwise."""
    from ciders.core.wire import PayloadError, decode

    comps, meta = decode(msg, expect, device=device)
    if meta.get("round") != q or meta.get("client") != cid or meta.get("phase") != phase:
        raise PayloadError(f"reply is for round {meta.get('round')} client {meta.get('client')} phase "
                           f"{meta.get('phase')!r}, expected round {q} {cid} phase {phase!r}")
    if set(comps) != set(names):
        raise PayloadError(f"reply must hold {' and '.join(names)}, got {sorted(comps)}")
    return comps


def decode_message(msg: bytes, cid: str, phase: str) -> tuple[dict, int]:
    """The client's reading of the server's message: (its components, the round), checked to be for this client
    and phase; PayloadError otherwise."""
    from ciders.core.wire import PayloadError, decode

    comps, meta = decode(msg)
    q = meta.get("round")
    if meta.get("client") != cid or meta.get("phase") != phase or type(q) is not int:
        raise PayloadError(f"{cid}: message is for client {meta.get('client')} phase {meta.get('phase')!r}")
    return comps, q
