"""The ClientApp: one edge client per SuperNode, running `federation.ciders_client.client_round`.

Identity: the stable client id is `client<partition-id>` from the node config (Flower's node ids change
per run and per restart). The client reports it in every reply; the server keys all its state by it.

The client is an edge client (`workloads.edge.EdgeTask`, docs/edge.md): it never loads `model.name`. It
builds AdapEmu from the edge spec (`setup`, at first contact) and the emulator weights of its first
broadcast, which it keeps as a Hugging Face model directory, `<state-dir>/edge/`. With a `data-file` in its
node config (federation.partition=nodes) it trains on that file; otherwise on its partition of the
experiment's data.

State: durable state lives in the node's state directory (`node_config["state-dir"]`, or the directory
the simulation assigns): the edge model, the client's RoundStore record (c_i, version, pending increment,
personalized messenger) and the static components it received once (e.g. a fixed student LoRA). It survives ClientApp and
SuperNode restarts. Every server message says which round is the last committed one; the client first
drops records of later rounds (an attempt the server did not commit, e.g. before a ServerApp restart),
so client and server agree on what happened. `context.state` keeps the id and config digest the node
first ran with, so a node whose partition or experiment changed mid-run fails loudly instead of mixing
state.

Messages (message_type: fields):
  query    kind "hello"                -> {client_id, edge: digest of the spec held or ""} (no torch import)
  query    kind "setup"                the edge spec's files, checked, then stored -> {client_id, edge}
  train    family ciders, phase train  broadcast bytes -> upload bytes + metrics record  (Eq. 4-10), with the
                                       client's peak RSS and state bytes
  evaluate family ciders, phase report -> the personalized messenger x_K as wire bytes (for the evaluation)
  train    family bilevel, phase inner|outer|local -> a RABO-family phase reply (`transports.flower.bilevel`)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from ciders.transports.flower import messages as fm
from ciders.transports.flower.edge_phase import ciders_phase, setup

def client_id_of(context: Context) -> str:
    pid = context.node_config.get("partition-id")
    if pid is None:
        raise ValueError("this SuperNode has no partition-id in its node config; start it with "
                         "--node-config 'partition-id=<i> num-partitions=<N> state-dir=\"<dir>\"'")
    return f"client{int(pid)}"


def state_dir_of(context: Context, spec: dict, cid: str) -> Path:
    d = context.node_config.get("state-dir") or spec.get("clients_root")
    if not d:
        raise ValueError("no state directory: set state-dir in the SuperNode's --node-config")
    d = Path(str(d))
    return d / cid if "state-dir" not in context.node_config else d


def _check_identity(context: Context, cid: str, digest: str) -> None:
    rec = context.state.config_records.get("ciders")
    if rec is None:
        context.state["ciders"] = ConfigRecord({"client_id": cid, "config_sha": digest})
        return
    if rec["client_id"] != cid:
        raise ValueError(f"this node served {rec['client_id']} earlier in the run and now claims {cid}")
    if digest and rec["config_sha"] and rec["config_sha"] != digest:
        raise ValueError(f"{cid}: the experiment config changed within the run")
    if digest and not rec["config_sha"]:
        rec["config_sha"] = digest


def _startup_s() -> float:
    """Seconds from this process's start to now (its imports and Flower's app loading), or -1 unknown."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def run_phase(worker, f: dict, payload: bytes, cid: str, state: Path, data_file: str | None,
              phase=None) -> tuple[dict, bytes, bool]:
    """(fields, bytes, warm): the phase in the node's warm worker (`transports.flower.worker`) when the node has
    one, which holds torch, the edge model and the data; here, cold, when it has none or it is gone (nothing of
    the request ran there, so running it here is the same computation)."""
    phase = phase or ciders_phase
    if worker:
        from ciders.transports.flower.worker import WorkerGone, call

        try:
            fields, out = call(Path(str(worker)), f, payload, cid, state, data_file)
            return fields, out, True
        except WorkerGone as exc:
            print(f"warning: {exc}; running this message cold", file=sys.stderr, flush=True)
    fields, out = phase(f, payload, cid, state, data_file)
    return fields, out, False


def make_client_app(spec: dict | None = None) -> ClientApp:
    """A ClientApp. `spec` (simulation) may give `clients_root`, where each client gets a directory."""
    spec = dict(spec or {})
    app = ClientApp()

    def handle(msg: Message, context: Context, kind: str) -> Message:
        entry, started = time.perf_counter(), _startup_s()
        cid = client_id_of(context)
        f = fm.fields_of(msg.content)
        if kind == "hello":
            if f.get("kind") not in ("hello", "setup"):
                raise ValueError(f"{cid}: expected a hello or setup query, got {f.get('kind')!r}")
            _check_identity(context, cid, "")
            state = state_dir_of(context, spec, cid)
            if f["kind"] == "setup":
                return Message(fm.pack(setup(f, cid, state)), reply_to=msg)
            from ciders.models.edge_spec import held_digest  # no torch import

            return Message(fm.pack({"client_id": cid, "edge": held_digest(state / "edge")}), reply_to=msg)
        family, phase = f.get("family"), f.get("phase")
        if (kind == "report") != (phase == "report") or family not in ("ciders", "bilevel"):
            raise ValueError(f"{cid}: unexpected {kind} message (family {family!r}, phase {phase!r})")
        digest = hashlib.sha256(str(f["config"]).encode()).hexdigest()
        _check_identity(context, cid, digest)
        state = state_dir_of(context, spec, cid)
        state.mkdir(parents=True, exist_ok=True)
        if family == "bilevel":
            from ciders.transports.flower import bilevel

            return bilevel.handle(msg, cid, state)
        data_file = context.node_config.get("data-file")
        data_file = None if data_file is None else str(data_file)
        worker = context.node_config.get("worker")
        payload = fm.payload_of(msg.content) if phase != "report" else b""
        fields, out, warm = run_phase(worker, f, payload, cid, state, data_file)
        if phase == "train" and family == "ciders":  # this message's own timings, beside what the phase measured
            rec = json.loads(fields["record"])
            rec.update(handle_s=time.perf_counter() - entry, startup_s=started, warm=warm)
            fields = {**fields, "record": json.dumps(rec)}
        return Message(fm.pack(fields, out), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return handle(msg, context, "hello")

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return handle(msg, context, "train")

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return handle(msg, context, "report")

    return app


app = make_client_app()  # for `flwr run` (pyproject: ciders.transports.flower.client_app:app)
