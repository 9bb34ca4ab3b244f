"""What a transport moves: one round's messages out, the replies back. Both method families and every
engine speak this interface, so a transport knows nothing about the algorithm and the round loop
(`federation.loop`) knows nothing about the transport.

A phase of a round is one message per addressed client and at most one reply each:
  CIDERS     train  (broadcast -> upload, Eq. 4-12)    report (the personalized messenger, for evaluation)
  RABO       inner  (x_q, y_q -> G^i)                  outer  (y_{q+1} -> masked hypergradient)
  baselines  local  (the full model -> the client's model)

    exchange(phase, t, {client_id: message bytes}) -> [Reply, ...]

Client ids are strings (`client<i>`) everywhere: configs, wire metadata, records, stores, Flower nodes.
A transport reports what arrived, nothing more: a lost reply is simply absent; a client-side failure
is a Reply with `error`; a reply the transport could not read, or one that claims another client's id,
is a Reply with `rejected` (the reason); copies that arrive outside the request/reply pairing (a reply delayed into a
later round, a duplicated delivery) are Replies of kind "late" / "copy" that the server validates by
their content like any other upload. Every check lives in the server functions, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol


@dataclass(frozen=True)
class Reply:
    """One delivery to the server. `record` is the client's metrics record (JSON-able; it is checked by
    the server before it is written)."""

    client_id: str
    payload: bytes = b""
    record: dict = field(default_factory=dict)
    kind: Literal["reply", "late", "copy"] = "reply"
    error: str | None = None  # the client reported a failure
    rejected: str | None = None  # the transport could not accept the reply (why)


@dataclass(frozen=True)
class Admitted:
    """A phase's deliveries after the round loop's admission (`admit`): `replies`, at most one per client that
    was sent this phase's message, in arrival order; `others`, the late and duplicated deliveries (a family that
    takes them checks them by their content); `refused`, who was turned away and why; `failed`, the clients that
    reported an error."""

    replies: tuple[Reply, ...]
    others: tuple[Reply, ...]
    refused: dict
    failed: frozenset


def admit(replies: list[Reply], sent: Iterable[str], phase: str, t: int) -> Admitted:
    """The one admission rule of every phase of every family: a client's error, a reply the transport could not
    accept, a reply from a client that was sent no message this phase and a second reply from the same client are
    refused (with why); nothing refused reaches a server step."""
    sent = set(sent)
    ok, others, refused, failed, seen = [], [], {}, set(), set()
    for r in replies:
        if r.error is not None:
            refused[r.client_id] = f"client error: {str(r.error)[:200]}"
            failed.add(r.client_id)
        elif r.rejected is not None:
            refused[r.client_id] = r.rejected
        elif r.kind != "reply":
            others.append(r)
        elif r.client_id not in sent:
            refused[str(r.client_id)[:64]] = f"a reply from a client sent no {phase} message in round {t}"
        elif r.client_id in seen:
            refused[r.client_id] = f"a second {phase} reply in round {t}"
        else:
            ok.append(r)
            seen.add(r.client_id)
    return Admitted(tuple(ok), tuple(others), refused, frozenset(failed))


class Exchange(Protocol):
    def __call__(self, phase: str, t: int, messages: dict[str, bytes]) -> list[Reply]: ...


def client_id(i: int) -> str:
    """The stable id of client i (0-based): the same string on every engine and in every file."""
    return f"client{int(i)}"


def client_index(cid: str, n: int) -> int:
    """The index of a `client<i>` id among n clients; ValueError on anything else."""
    if not isinstance(cid, str) or not cid.startswith("client") or not cid[6:].isdigit():
        raise ValueError(f"{cid!r} is not a client id (client<i>)")
    i = int(cid[6:])
    if not 0 <= i < n or cid != client_id(i):
        raise ValueError(f"{cid!r} is not one of client0..client{n - 1}")
    return i
