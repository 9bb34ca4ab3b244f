"""The in-process transport: every client is a function call in this process (the embedded default), with
channel faults injectable for tests. It moves the same bytes as the Flower transport
(`transports.flower.exchange`), so a run gives the same numbers on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ciders.federation.exchange import Reply
from ciders.errors import PayloadError

ClientFn = Callable[[str, str, bytes], tuple[bytes, dict]]  # (phase, client id, message) -> (reply, record)


class SimulatedCrash(RuntimeError):
    """Raised by a Faults plan to emulate a kill at a given point (tests)."""


@dataclass
class Faults:
    """Channel faults and crash points for tests. The sets hold (round, phase, client_id), or
    (round, client_id), which matches every phase of that round but the evaluation's "report"."""

    drop: set = field(default_factory=set)  # the reply is lost
    duplicate: set = field(default_factory=set)  # the reply arrives twice
    delay: set = field(default_factory=set)  # the reply arrives in the same phase of the next round
    corrupt: set = field(default_factory=set)  # the reply is replaced by `corrupt(reply)` (the exchange's)
    error: set = field(default_factory=set)  # the client reports a failure instead of its reply
    crash: tuple[int, str] | None = None  # (round, point): client:<k>, then the server's named points

    def maybe_crash(self, t: int, point: str) -> None:
        if self.crash == (t, point):
            raise SimulatedCrash(f"simulated crash at round {t}, {point}")

    @staticmethod
    def hit(keys: set, t: int, phase: str, cid: str) -> bool:
        return ((t, cid) in keys and phase != "report") or (t, phase, cid) in keys


class InProcess:
    """`client(phase, cid, message) -> (reply bytes, record)` for every addressed client, in order.
    `corrupt(reply bytes) -> bytes` implements Faults.corrupt; `on_reply(cid, record)` reports progress."""

    def __init__(self, client: ClientFn, faults: Faults | None = None,
                 corrupt: Callable[[bytes], bytes] | None = None,
                 on_reply: Callable[[str, dict], None] | None = None):
        self.client, self.faults, self.corrupt, self.on_reply = client, faults or Faults(), corrupt, on_reply
        self.late: dict[str, list[Reply]] = {}  # phase -> replies delayed into its next call

    def __call__(self, phase: str, t: int, messages: dict[str, bytes]) -> list[Reply]:
        f = self.faults
        late, replies, copies = self.late.pop(phase, []), [], []
        for j, (cid, msg) in enumerate(messages.items()):
            try:
                up, rec = self.client(phase, cid, msg)
            except PayloadError as exc:  # the client refuses the message: an error reply, as over Flower
                replies.append(Reply(cid, error=str(exc)))
                f.maybe_crash(t, f"client:{j}" if phase != "report" else f"report:{j}")
                continue
            if f.hit(f.corrupt, t, phase, cid) and up and self.corrupt is not None:
                up = self.corrupt(up)
            if f.hit(f.delay, t, phase, cid):
                if up:
                    self.late.setdefault(phase, []).append(Reply(cid, up, {}, kind="late"))
            elif f.hit(f.error, t, phase, cid):
                replies.append(Reply(cid, error="simulated client failure"))
            elif not f.hit(f.drop, t, phase, cid):
                replies.append(Reply(cid, up, rec))
                if f.hit(f.duplicate, t, phase, cid) and up:
                    copies.append(Reply(cid, up, {}, kind="copy"))
            if self.on_reply is not None:
                self.on_reply(cid, rec)
            f.maybe_crash(t, f"client:{j}" if phase != "report" else f"report:{j}")
        return late + replies + copies
