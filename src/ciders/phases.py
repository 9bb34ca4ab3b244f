"""Where a run's time goes: `with phase("evaluation"): ...` marks a piece of work, and inside `profiling()` each
phase's seconds are summed. Time is exclusive: a phase inside another (a checkpoint write inside TAKD, say)
counts for the inner one only, so the phases add up to at most the wall time, and the rest is "other".
Outside `profiling()` a phase costs one context-variable read. Used by `benchmarks/round_profile.py`.
"""

from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

# The phases the federation marks, in the order a round meets them (`benchmarks/round_profile.py` prints them so).
PHASES = ("model and data", "teacher cache", "pre-alignment", "client steps", "aggregation", "TAKD", "evaluation", "serialization",
          "I/O")


@dataclass
class Profile:
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0
    _stack: list = field(default_factory=list)  # [name, start, seconds spent in nested phases]

    def shares(self) -> dict[str, float]:
        """Each phase's seconds over the wall time, plus "other" (what no phase covered)."""
        out = {k: v / self.wall for k, v in self.seconds.items()} if self.wall > 0 else {}
        out["other"] = max(0.0, 1.0 - sum(out.values())) if self.wall > 0 else 0.0
        return out


_ACTIVE: contextvars.ContextVar[Profile | None] = contextvars.ContextVar("ciders_profile", default=None)


@contextmanager
def phase(name: str) -> Iterator[None]:
    prof = _ACTIVE.get()
    if prof is None:
        yield
        return
    frame = [name, time.perf_counter(), 0.0]
    prof._stack.append(frame)
    try:
        yield
    finally:
        prof._stack.pop()
        spent = time.perf_counter() - frame[1]
        prof.seconds[name] = prof.seconds.get(name, 0.0) + spent - frame[2]
        prof.calls[name] = prof.calls.get(name, 0) + 1
        if prof._stack:
            prof._stack[-1][2] += spent


@contextmanager
def profiling() -> Iterator[Profile]:
    """Collect the phases of the work done inside; the Profile's wall time is this block's."""
    prof = Profile()
    token = _ACTIVE.set(prof)
    t0 = time.perf_counter()
    try:
        yield prof
    finally:
        prof.wall = time.perf_counter() - t0
        _ACTIVE.reset(token)
