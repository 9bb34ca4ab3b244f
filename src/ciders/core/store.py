"""Durable per-key records (a tensor dict + JSON meta) with round-atomic commits and bounded memory.

Each write goes to `root/<key>/r<round>.safetensors` (atomic rename). A record counts once its round
is committed: the engine commits a round by atomically writing its checkpoint pointer, and on resume
`recover(committed)` deletes records of the crashed round, so a kill at any point leaves exactly the
state of the last committed round. Reads return the newest record with round <= the horizon (the
round being built). An LRU cache keeps at most `cache_size` records in memory: 1,000s of registered
clients cost disk, not RAM, and never-seen keys cost nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch

from ciders.fileio import atomic_path, makedirs, remove_leftovers
from ciders.phases import phase

_REC = re.compile(r"^r(\d{8})\.safetensors$")


class RoundStore:
    def __init__(self, root: str | Path, committed: int = -1, cache_size: int = 16):
        self.root = makedirs(root)
        self.committed = committed
        self.horizon = committed + 1
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[int, dict, dict]] = OrderedDict()

    def _dir(self, key: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", key):
            raise ValueError(f"store key {key!r} must be [A-Za-z0-9_.-]+")
        return self.root / key

    def rounds(self, key: str) -> list[int]:
        """The rounds of `key`'s records on disk, ascending (committed or not)."""
        d = self._dir(key)
        if not d.is_dir():
            return []
        return sorted(int(m.group(1)) for f in os.listdir(d) if (m := _REC.match(f)))

    def get(self, key: str) -> tuple[dict[str, torch.Tensor], dict] | None:
        hit = self._cache.get(key)
        if hit is not None and hit[0] <= self.horizon:
            self._cache.move_to_end(key)
            return hit[1], hit[2]
        rounds = [r for r in self.rounds(key) if r <= self.horizon]
        if not rounds:
            return None
        from safetensors import safe_open

        path = self._dir(key) / f"r{rounds[-1]:08d}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # own, aligned storage (see core.wire)
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        self._remember(key, rounds[-1], tensors, meta)
        return tensors, meta

    @phase("I/O")
    def put(self, key: str, round_: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        from safetensors.torch import save_file

        if round_ <= self.committed:
            raise ValueError(f"round {round_} is already committed")
        d = makedirs(self._dir(key))
        with atomic_path(d / f"r{round_:08d}.safetensors") as tmp:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
                      metadata={"meta": json.dumps(meta)})
        self._remember(key, round_, tensors, meta)

    def _remember(self, key: str, round_: int, tensors: dict, meta: dict) -> None:
        self._cache[key] = (round_, tensors, meta)
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def commit(self, round_: int, keys: list[str] | None = None) -> None:
        """Mark `round_` committed (the caller has durably recorded it) and drop superseded records."""
        self.committed = round_
        self.horizon = round_ + 1
        for key in keys if keys is not None else self.keys():
            for r in self.rounds(key)[:-1]:
                (self._dir(key) / f"r{r:08d}.safetensors").unlink(missing_ok=True)

    def recover(self, committed: int) -> int:
        """Delete records newer than `committed` (a crashed round); returns how many. Also drops what a
        killed process can leave besides: records superseded by a newer committed one (a kill between the
        round's commit and `commit` here; never read again, as reads take the newest) and the scratch files
        of interrupted writes."""
        n = 0
        remove_leftovers(self.root)
        for key in self.keys():
            rounds = self.rounds(key)
            for r in rounds:
                if r > committed:
                    (self._dir(key) / f"r{r:08d}.safetensors").unlink()
                    n += 1
            for r in [r for r in rounds if r <= committed][:-1]:
                (self._dir(key) / f"r{r:08d}.safetensors").unlink()
        self.committed, self.horizon = committed, committed + 1
        self._cache.clear()
        return n

    def keys(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    @property
    def cached(self) -> int:
        return len(self._cache)
