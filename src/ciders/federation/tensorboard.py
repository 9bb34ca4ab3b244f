"""Optional TensorBoard mirror of metrics.jsonl (federation.tensorboard: true). metrics.jsonl stays the
source of truth; every numeric leaf of a record becomes a scalar `<event>/<path>` at step = round
(client records: `client/<id>/<key>`; per-step lists are left out)."""

from __future__ import annotations

from pathlib import Path

from ciders.errors import CidersError


def flatten(rec: dict) -> dict[str, float]:
    ev = rec.get("event", "record")
    base = f"client/{rec['client']}" if ev == "client" and "client" in rec else ev
    out: dict[str, float] = {}

    def walk(x, path):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            out[path] = float(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")

    for k, v in rec.items():
        if k not in ("event", "round", "client", "steps"):
            walk(v, f"{base}/{k}")
    return out


class Mirror:
    def __init__(self, directory: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise CidersError("federation.tensorboard needs the tensorboard package: pip install tensorboard") from exc
        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, rec: dict) -> None:
        step = int(rec.get("round", -1))
        for tag, v in flatten(rec).items():
            self.writer.add_scalar(tag, v, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
