"""RABO / RAFBO / FedMBO on Flower: the bilevel round loop (`engines.bilevel.run_bilevel`) with its messages
carried by a Flower Grid instead of direct calls, so the run equals the in-process one.

Server side (`serve`, called by the ServerApp for a bilevel experiment): `FlowerExchange` sends each
phase's per-client bytes as a `train` message {kind: "bilevel", phase, round, config} to the node hosting
client<i> (`NodeMap`: waiting `flower.node_wait_s` at the first round, `flower.rejoin_wait_s` later), and
collects the replies for up to `flower.round_timeout_s`. Error replies, replies from a node that claims
another client's id and unreadable records are rejected and logged; the loop's own checks reject bad
payloads. A client that does not answer misses that phase, as a lost reply in-process.
Client side (`handle`, from `engines.flower.client_app`): builds the task from the config it is sent and
runs `engines.bilevel_rounds.client_phase`; what it keeps between the inner and the outer phase lives in
its state directory (`DirScratch`), because Flower may start a new ClientApp process per message.
After a ServerApp restart, `resume=true` (run config) continues from the run directory's last checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from flwr.app import Message
from flwr.serverapp import Grid

from ciders.core.wire import PayloadError
from ciders.engines.flower import messages as fm
from ciders.engines.flower.nodes import NodeMap

_TASKS: dict[str, tuple] = {}  # config digest -> (experiment, task); a cache, not state


class FlowerExchange:
    def __init__(self, grid: Grid, config_text: str, exp, log: Callable[[str], None] = print):
        self.grid, self.config_text, self.fcfg, self.log = grid, config_text, exp.flower, log
        ids = [f"client{i}" for i in range(exp.federation.clients)]
        self.nodes = NodeMap(ids, set(ids), self.fcfg.round_timeout_s, log)
        self.first = True

    def __call__(self, phase: str, q: int, messages: dict[int, bytes]) -> dict:
        grace = self.fcfg.node_wait_s if self.first else self.fcfg.rejoin_wait_s
        self.nodes.discover(self.grid, grace if phase == "inner" else 0.0, quiet=phase != "inner")
        self.first = False
        sent, out = {}, []
        for i, payload in messages.items():
            node = self.nodes.node_of.get(f"client{i}")
            if node is None:
                continue
            fields = {"kind": "bilevel", "phase": phase, "round": q, "config": self.config_text}
            out.append(Message(fm.pack(fields, payload), dst_node_id=node, message_type="train"))
            sent[node] = i
        replies = {}
        for rep in self.grid.send_and_receive(out, timeout=self.fcfg.round_timeout_s) if out else []:
            i = sent.get(rep.metadata.src_node_id)
            if i is None:
                continue
            if rep.has_error():
                self.log(f"round {q} {phase}: client{i} failed ({rep.error.reason}): rejected")
                continue
            try:
                f = fm.fields_of(rep.content)
                if f.get("client_id") != f"client{i}":
                    raise PayloadError(f"reply claims to be from {f.get('client_id')!r}")
                replies[i] = (fm.payload_of(rep.content), fm.record_of(f))
            except PayloadError as exc:
                self.log(f"round {q} {phase}: rejected the reply of client{i}: {exc}")
        missing = sorted(set(messages) - set(replies))
        if missing:
            self.log(f"round {q} {phase}: no valid reply from {', '.join(f'client{i}' for i in missing)}")
        return replies


def build_task(exp):
    from ciders.engines.bilevel_tasks import build

    return build(exp)


def serve(grid: Grid, spec: dict, log=print) -> dict:
    from ciders.config import loads_config
    from ciders.config_bilevel import BilevelExperiment
    from ciders.engines.bilevel import run_bilevel

    exp = loads_config(spec["config_text"], "the bilevel experiment", cls=BilevelExperiment)
    return run_bilevel(exp, build_task(exp), spec["out"], log=log, resume=bool(spec.get("resume")),
                       exchange=FlowerExchange(grid, spec["config_text"], exp, log))


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
        from ciders.config_bilevel import BilevelExperiment

        exp = loads_config(cfg_text, "the bilevel experiment the server sent", cls=BilevelExperiment)
        _TASKS.clear()  # one experiment per process at a time
        _TASKS[key] = (exp, build_task(exp))
    return _TASKS[key]


def handle(msg: Message, cid: str, state: Path) -> Message:
    """A ClientApp `train` message of kind "bilevel"."""
    from ciders.engines.bilevel_rounds import client_phase

    f = fm.fields_of(msg.content)
    exp, task = _task(str(f["config"]))
    i = int(cid.removeprefix("client"))
    if not 0 <= i < len(task.clients()):
        raise ValueError(f"this node hosts {cid}, but the run has clients client0..client{len(task.clients()) - 1}; "
                         "check its partition-id")
    scratch = DirScratch(state / "bilevel")
    up, rec = client_phase(exp, task, str(f["phase"]), i, fm.payload_of(msg.content), scratch)
    if f["phase"] == "inner":  # the only phase that changes the scratch space
        scratch.save()
    return Message(fm.pack({"client_id": cid, "record": json.dumps(rec)}, up), reply_to=msg)
