"""The bilevel family on Flower without processes: the round loop with `FlowerExchange` over a grid whose
nodes run the real ClientApp handler (`transports.flower.bilevel.handle`, scratch space on disk) in this
process. It must equal the in-process run; bad replies are rejected, logged, and never applied."""

import json
from dataclasses import replace

import pytest
from flwr.app import Error, Message
from flwr.supercore.task_identity import TaskIdentity

from ciders.config import dump_yaml
from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig
from ciders.federation.bilevel_loop import in_process, run_bilevel
from ciders.federation.inprocess import Faults
from ciders.transports.flower.exchange import FlowerExchange
from ciders.algorithms.registry import bilevel_config as method_config
from ciders.transports.flower import bilevel as fb
from ciders.transports.flower import messages as fm
from helpers import QuadTask


@pytest.fixture(autouse=True)
def task_identity():
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id = TaskIdentity._task_id = TaskIdentity._node_id = None


IDS = ["client0", "client1", "client2"]


def exp_for(method, rule="importance"):
    base = BilevelExperiment(federation=BilevelFederationConfig(clients=3, rounds=2))
    base = replace(base, rabo=replace(base.rabo, inner_steps=2, beta=0.1, alpha=0.1, solver_iters=6, mask_rule=rule),
                   fedmeta=replace(base.fedmeta, local_steps=2, lr=0.05), flower=replace(base.flower, node_wait_s=1))
    return method_config(base, method)


class NodeGrid:
    """Nodes 100+i host client<i> and answer with the ClientApp's bilevel handler; `tamper[(round, phase,
    i)](msg, reply)` rewrites a reply."""

    def __init__(self, root, tamper=None):
        self.root, self.tamper = root, tamper or {}
        self.nodes = {100 + i: f"client{i}" for i in range(3)}

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            cid = self.nodes[m.metadata.dst_node_id]
            f = fm.fields_of(m.content)
            if f.get("kind") == "hello":
                out.append(Message(fm.pack({"client_id": cid}), reply_to=m))
                continue
            fb._TASKS.clear()  # every message in a fresh "process": the scratch space comes from disk
            rep = fb.handle(m, cid, self.root / cid)
            fix = self.tamper.get((f["round"], f["phase"], cid))
            out.append(fix(m, rep) if fix else rep)
        return out


@pytest.fixture()
def quad(monkeypatch):
    task = QuadTask()
    monkeypatch.setattr(fb, "build_task", lambda exp: task)
    return task


@pytest.mark.parametrize("method,rule", [("rabo", "importance"), ("rabo", "magnitude"), ("dist-maml", "importance")])
def test_flower_exchange_equals_in_process(tmp_path, quad, method, rule):
    """RABO on structured sub-models and on unstructured (magnitude) masks, and a full-model baseline; the
    single-level sub-model baselines need the few-shot task (tests/transports/test_flower.py runs OAP)."""
    exp = exp_for(method, rule)
    run_bilevel(exp, quad, tmp_path / "local", log=lambda s: None)
    ex = FlowerExchange(NodeGrid(tmp_path / "nodes"), dump_yaml(exp), IDS, exp.flower, "bilevel", lambda s: None)
    run_bilevel(exp, quad, tmp_path / "flower", log=lambda s: None, exchange=ex)
    for f in ("metrics.jsonl", "final.safetensors"):
        assert (tmp_path / "local" / f).read_bytes() == (tmp_path / "flower" / f).read_bytes(), f
    assert (tmp_path / "nodes" / "client0" / "bilevel" / "scratch.json").is_file() == (method != "dist-maml")


def test_bad_flower_replies_are_rejected_and_logged(tmp_path, quad):
    exp = exp_for("rabo")

    def impostor(m, rep):  # client1's node says it is client0
        f = fm.fields_of(rep.content)
        return Message(fm.pack({**f, "client_id": "client0"}, fm.payload_of(rep.content)), reply_to=m)

    def crashed(m, rep):
        return Message(Error(code=1, reason="ClientApp raised ValueError"), reply_to=m)

    def unreadable(m, rep):
        return Message(fm.pack({"client_id": "client2", "record": "[1]"}, fm.payload_of(rep.content)), reply_to=m)

    tamper = {(0, "inner", "client1"): impostor, (0, "outer", "client0"): crashed, (1, "inner", "client2"): unreadable}
    logs = []
    ex = FlowerExchange(NodeGrid(tmp_path / "nodes", tamper), dump_yaml(exp), IDS, exp.flower, "bilevel", logs.append)
    run_bilevel(exp, quad, tmp_path / "flower", log=logs.append, exchange=ex)
    drop = set(tamper)
    run_bilevel(exp, quad, tmp_path / "lost", log=lambda s: None, exchange=in_process(exp, quad, Faults(drop=drop)))
    assert (tmp_path / "flower" / "final.safetensors").read_bytes() == (tmp_path / "lost" / "final.safetensors").read_bytes()
    assert any("client1" in line and "claims to be from 'client0'" in line for line in logs)
    assert any("client0: client error: ClientApp raised ValueError" in line for line in logs)
    assert any("client2" in line and "JSON object" in line for line in logs)
    rounds = [json.loads(line) for line in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    assert [r["inner_clients"] for r in rounds if r["event"] == "round"] == [["client0", "client2"], ["client0", "client1"]]


def test_the_outer_phase_without_this_rounds_inner_phase_is_refused(tmp_path, quad):
    from ciders.core.wire import PayloadError
    from ciders.federation.bilevel_client import client_phase
    from ciders.federation.bilevel_rounds import BilevelServer

    exp = exp_for("rabo")
    server = BilevelServer(exp, quad, log=lambda s: None)
    server.begin(0)
    server.absorb("inner", {})
    with pytest.raises(PayloadError, match="without this round's inner phase"):
        client_phase(exp, quad, "outer", "client0", server.down("outer", "client0"), fb.DirScratch(tmp_path / "s"))
