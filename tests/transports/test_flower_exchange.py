"""The Flower transport without processes: the run's own round loop over a FlowerExchange whose grid's nodes
answer in this process (model-free clients). Checks node discovery by stable client id and payload
hygiene: bad replies are rejected and logged with the client id, and never change global state."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import dump_yaml, load_config
from ciders.core.store import RoundStore
from ciders.core.tensors import equal
from ciders.core.wire import PayloadError, encode
from ciders.transports.flower import messages as fm
from ciders.algorithms import configure
from ciders.federation.loop import Faults, RunDir
from ciders.federation.ciders_loop import run_federation
from ciders.federation.ciders_client import client_round
from ciders.transports.flower.exchange import FlowerExchange
from synthetic import VectorTask

VEC = ["federation.clients=5", "federation.rounds=2", "algorithm.local_steps=2", "algorithm.optimizer=sgd",
       "algorithm.lr=0.05", "algorithm.gamma=0.3", "algorithm.alpha=0.2", "algorithm.metagrad=fd",
       "flower.node_wait_s=1"]


@pytest.fixture(autouse=True)
def task_identity():
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id = TaskIdentity._task_id = TaskIdentity._node_id = None


class InProcessGrid:
    """Nodes 100+i host clients c000i; `tamper[(round, cid)]` rewrites that client's train reply;
    `vanish[(round, cid)] = new_node` makes that client's node unavailable at the round's report (Flower's
    NODE_UNAVAILABLE error) and brings it back as `new_node` (None: never)."""

    def __init__(self, cfg, task, root, tamper=None, vanish=None, away=None):
        self.cfg, self.task, self.root, self.tamper = cfg, task, root, tamper or {}
        self.vanish = dict(vanish or {})
        self.away = dict(away or {})  # (round, cid) -> (new node, looks): gone once trained, back after `looks`
        self.back: list = []  # [new node, cid, looks left]
        self.nodes = {100 + i: cid for i, cid in enumerate(task.ids)}
        self.stores = {cid: RoundStore(root / cid, -1) for cid in task.ids}
        self.replies, self.ids = {}, 0

    def get_node_ids(self):
        for b in list(self.back):
            b[2] -= 1
            if b[2] < 0:
                self.nodes[b[0]] = b[1]
                self.back.remove(b)
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        return list(self.pull_messages(list(self.push_messages(messages))))

    def push_messages(self, messages):
        out = []
        for m in messages:
            self.ids += 1
            m.metadata.__dict__["_message_id"] = mid = f"m{self.ids}"
            self.replies[mid] = self.answer(m)
            out.append(mid)
        return out

    def pull_messages(self, message_ids):
        return [self.replies.pop(mid) for mid in message_ids if mid in self.replies]

    def answer(self, m):
        cid = self.nodes[m.metadata.dst_node_id]
        f = fm.fields_of(m.content)
        if f.get("kind") == "hello":
            return Message(fm.pack({"client_id": cid}), reply_to=m)
        assert f["family"] == "ciders"
        if f["phase"] == "train":
            store = self.stores[cid]
            store.recover(f["committed"])
            store.commit(f["committed"])
            up, rec = client_round(self.cfg, self.task, store, cid,
                                   fm.payload_of(m.content), {})
            rep = Message(fm.pack({"client_id": cid, "record": json.dumps(rec)}, up), reply_to=m)
            fix = self.tamper.get((f["round"], cid))
            if (f["round"], cid) in self.away:  # its node dies after training (the reply still arrives)
                node, looks = self.away.pop((f["round"], cid))
                del self.nodes[m.metadata.dst_node_id]
                self.back.append([node, cid, looks])
            return fix(m, up, rec) if fix else rep
        if (f["round"], cid) in self.vanish:  # report: the node is gone (and maybe back under a new id)
            del self.nodes[m.metadata.dst_node_id]
            if (back := self.vanish.pop((f["round"], cid))) is not None:
                self.nodes[back] = cid
            return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node unavailable"), reply_to=m)
        rec = RoundStore(self.root / cid, f["committed"]).get(cid)
        pers = codec.client_from_record(*rec).personalized
        return Message(fm.pack({"client_id": cid}, encode({"personalized": pers}, {"client_id": cid})[0]),
                       reply_to=m)


class SeenTask(VectorTask):
    """VectorTask that notes whose personalized messengers each round's evaluation got."""

    def __init__(self, n):
        super().__init__(n)
        self.seen = {}

    def evaluate(self, t, server, personalized):
        self.seen[t] = list(personalized)  # in the order the evaluation got them (sums are order-sensitive)
        return super().evaluate(t, server, personalized)


def flower_run(tmp_path, tamper=None, vanish=None, over=(), away=None):
    cfg = load_config(None, VEC + list(over))
    task = SeenTask(5)
    logs = []
    eff = configure(cfg)
    grid = InProcessGrid(eff, task, tmp_path / "nodes", tamper, vanish, away)
    ex = FlowerExchange(grid, dump_yaml(eff), sorted(task.clients()), cfg.flower, "ciders", logs.append)
    run_federation(cfg, task, tmp_path / "run", log=logs.append, progress=False, exchange=ex)
    return tmp_path / "run", logs, task.seen


def server_state(out):
    t, m = RunDir(out).load_checkpoint(RunDir(out).committed())
    return codec.server_from_record({k: v for k, v in t.items() if not k.startswith("extra/")}, m["server"])


def test_the_round_loop_over_flower_equals_the_in_process_engine(tmp_path):
    out, _, _ = flower_run(tmp_path)
    cfg = load_config(None, VEC)
    run_federation(cfg, VectorTask(5), tmp_path / "local", progress=False, log=lambda s: None)
    assert (out / "metrics.jsonl").read_text() == (tmp_path / "local" / "metrics.jsonl").read_text()


def test_a_client_whose_node_rejoins_during_the_evaluation_is_asked_again(tmp_path):
    """c0002's node is unavailable when round 0's report is asked for and comes back as node 300 (a
    SuperNode killed after training, restarted with its state directory): the evaluation waits for it
    and equals the in-process run's."""
    out, logs, seen = flower_run(tmp_path, vanish={(0, "c0002"): 300})
    run_federation(load_config(None, VEC), VectorTask(5), tmp_path / "local", progress=False, log=lambda s: None)
    assert (out / "metrics.jsonl").read_text() == (tmp_path / "local" / "metrics.jsonl").read_text()
    assert any("c0002's node is unavailable" in line for line in logs) and len(seen[0]) == 5
    assert seen[0] == sorted(seen[0])  # c0002's report came last; the evaluation still reads client order


def test_a_client_whose_node_is_gone_when_the_evaluation_starts_is_waited_for(tmp_path):
    """c0002's node dies right after it trained in round 0 (its reply arrives) and is back as node 301 only
    a few looks into the evaluation: it was trained this round, so the evaluation waits for it (within
    flower.eval_timeout_s) and equals the in-process run's."""
    out, logs, seen = flower_run(tmp_path, away={(0, "c0002"): (301, 3)})
    run_federation(load_config(None, VEC), VectorTask(5), tmp_path / "local", progress=False, log=lambda s: None)
    assert (out / "metrics.jsonl").read_text() == (tmp_path / "local" / "metrics.jsonl").read_text()
    assert len(seen[0]) == 5


def test_a_client_whose_node_never_returns_is_evaluated_without_after_the_timeout(tmp_path):
    """c0002's node is gone at round 0's report and never comes back: after flower.eval_timeout_s the
    round is evaluated over the other four personalized messengers, and round 1 goes on without it."""
    out, logs, seen = flower_run(tmp_path, vanish={(0, "c0002"): None}, over=["flower.eval_timeout_s=1.5"])
    assert seen[0] == ["c0000", "c0001", "c0003", "c0004"] == seen[1]
    assert any("without the personalized messengers of c0002" in line for line in logs)
    server = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "server"]
    assert "c0002" not in server[1]["accepted"]  # its node is gone for good


def _with_payload(payload: bytes):
    return lambda m, up, rec: Message(fm.pack({"client_id": rec["client"], "record": json.dumps(rec)}, payload),
                                      reply_to=m)


def test_bad_replies_are_rejected_logged_and_change_nothing(tmp_path):
    def wrong_dtype(m, up, rec):
        u = codec.decode_upload(up, {"x": torch.zeros(8, dtype=torch.float64)})
        bad = codec.encode_upload(alg.Upload(u.client_id, u.round, u.base_version,
                                             {"x": u.dc["x"].float()}))[0]
        return _with_payload(bad)(m, up, rec)

    def nan(m, up, rec):
        u = codec.decode_upload(up, {"x": torch.zeros(8, dtype=torch.float64)})
        bad = codec.encode_upload(alg.Upload(u.client_id, u.round, u.base_version,
                                             {"x": torch.full_like(u.dc["x"], float("nan"))}))[0]
        return _with_payload(bad)(m, up, rec)

    def impostor(m, up, rec):  # c0003's node says it is c0000
        return Message(fm.pack({"client_id": "c0000", "record": json.dumps(rec)}, up), reply_to=m)

    def crashed(m, up, rec):
        return Message(Error(code=1, reason="ClientApp raised ValueError"), reply_to=m)

    def not_bytes(m, up, rec):  # an ArrayRecord of float arrays instead of the uint8 wire payload
        rd = fm.pack({"client_id": rec["client"], "record": json.dumps(rec)})
        rd[fm.PAYLOAD] = ArrayRecord({"wire": Array(np.zeros(4, dtype=np.float32))})
        return Message(rd, reply_to=m)

    tamper = {(0, "c0001"): wrong_dtype, (0, "c0002"): nan, (0, "c0003"): impostor, (0, "c0004"): crashed,
              (1, "c0000"): not_bytes}
    out, logs, _ = flower_run(tmp_path, tamper)
    server = {r["round"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if r["event"] == "server"}
    rej0, rej1 = server[0]["rejected"], server[1]["rejected"]
    assert server[0]["accepted"] == ["c0000"]
    assert "float32" in rej0["c0001"] and "NaN" in rej0["c0002"] and "c0000" in rej0["c0003"]
    assert "ClientApp raised" in rej0["c0004"] and "uint8" in rej1["c0000"]
    for cid in ("c0001", "c0002", "c0003", "c0004"):
        assert any(cid in line and "rejected" in line for line in logs), cid
    # global state equals the in-process run in which those replies never arrived
    cfg = load_config(None, VEC)
    run_federation(cfg, VectorTask(5), tmp_path / "local", progress=False, log=lambda s: None,
                   faults=Faults(drop=set(tamper)))
    a, b = server_state(out), server_state(tmp_path / "local")
    assert equal(a.messenger, b.messenger) and equal(a.c, b.c)


def test_payload_of_rejects_anything_but_one_flat_uint8_array():
    rd = fm.pack({"kind": "train"}, b"CIDR....")
    assert fm.payload_of(rd) == b"CIDR...."
    rd["payload"] = ArrayRecord({"wire": Array(np.zeros((2, 2), dtype=np.uint8))})
    with pytest.raises(PayloadError, match="flat uint8"):
        fm.payload_of(rd)
    rd["payload"] = ArrayRecord({"wire": Array(np.zeros(2, dtype=np.uint8)), "more": Array(np.zeros(1))})
    with pytest.raises(PayloadError, match="exactly one"):
        fm.payload_of(rd)
    with pytest.raises(PayloadError, match="record must be a JSON object"):
        fm.record_of({"record": "[1]"})
