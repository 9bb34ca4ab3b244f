"""The RABO family's client side on a Flower node: `federation.bilevel_client.client_phase` for a message of
family "bilevel", with what the client keeps between the inner and the outer phase in its state directory
(`DirScratch`), because Flower may start a new ClientApp process per message. The server side is the
run's own loop over `transports.flower.exchange.FlowerExchange`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from flwr.app import Message

from ciders.transports.flower import messages as fm

_TASKS: dict[str, tuple] = {}  # config digest -> (experiment, task); a cache, not state


def build_task(exp):
    from ciders.workloads.bilevel import build

    return build(exp)


class DirScratch(dict):
    """The client's between-phase scratch space, mirrored to `root` (safetensors, atomic writes)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root
        if (root / "scratch.json").is_file():
            from safetensors.torch import load_file

            for name in json.loads((root / "scratch.json").read_text()):
                self[name] = load_file(str(root / f"{name}.safetensors"))

    def save(self) -> None:
        from safetensors.torch import save_file

        from ciders.fileio import atomic_path, write_json

        self.root.mkdir(parents=True, exist_ok=True)
        for name, st in self.items():
            with atomic_path(self.root / f"{name}.safetensors") as tmp:
                save_file({k: v.contiguous() for k, v in st.items()}, str(tmp))
        write_json(self.root / "scratch.json", sorted(self))  # the commit point: names written last


def _task(cfg_text: str):
    key = hashlib.sha256(cfg_text.encode()).hexdigest()
    if key not in _TASKS:
        from ciders.config import loads_config
        from ciders.config.bilevel import BilevelExperiment

        exp = loads_config(cfg_text, "the bilevel experiment the server sent", cls=BilevelExperiment)
        _TASKS.clear()  # one experiment per process at a time
        _TASKS[key] = (exp, build_task(exp))
    return _TASKS[key]


def handle(msg: Message, cid: str, state: Path) -> Message:
    """A ClientApp `train` message of family "bilevel"."""
    from ciders.federation.bilevel_client import client_phase

    f = fm.fields_of(msg.content)
    exp, task = _task(str(f["config"]))
    scratch = DirScratch(state / "bilevel")
    up, rec = client_phase(exp, task, str(f["phase"]), cid, fm.payload_of(msg.content), scratch)
    if f["phase"] == "inner":  # the only phase that changes the scratch space
        scratch.save()
    return Message(fm.pack({"client_id": cid, "record": json.dumps(rec)}, up), reply_to=msg)
