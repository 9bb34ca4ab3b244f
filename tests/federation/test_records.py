"""Client metrics records are claims: checked against a schema, never able to set the server's fields,
and never able to break what reads metrics.jsonl later (docs/security.md#client-records)."""

import json
from dataclasses import replace

import pytest

from ciders.core.wire import PayloadError
from ciders.federation import records
from ciders.federation.bilevel_loop import run_bilevel
from ciders.federation.exchange import Reply
from ciders.federation.inprocess import InProcess
from ciders.fileio import read_jsonl

from synthetic import checked_uploads, one_round


@pytest.mark.parametrize("bad", [
    {"event": "eval"},  # a server field
    {"bytes_up": 1},  # the server counts bytes itself
    {"loss": "low"}, {"loss": [1.0]}, {"loss": True}, {"round": -1}, {"r_fd_small": 1.5},
    {"steps": [{"step": 0, "loss": 1.0}] * (records.MAX_STEPS + 1)},
    {"steps": [{"step": 0, "event": "eval"}]}, {"steps": "many"}, {"client": ["x"]},
    {"loss": 10**400},
])
def test_a_record_that_does_not_fit_rejects_the_reply(tmp_path, bad):
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    a, b, _ = rnd.sampled
    checked = checked_uploads(cfg, ref, task.clients(), rnd,
                            [Reply(a, ups[a][0], {**ups[a][1], **bad}), Reply(b, *ups[b])])
    assert [u.client_id for u in checked.uploads] == [b] and "client record" in checked.rejected[a]
    assert [r["client"] for r in checked.client_records] == [b]


def test_the_server_writes_its_own_fields_after_the_clients(tmp_path):
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    a = rnd.sampled[0]
    rec = {**ups[a][1], "client": "someone-else", "round": 99}
    checked = checked_uploads(cfg, ref, task.clients(), rnd, [Reply(a, ups[a][0], rec)])
    r = checked.client_records[0]
    assert (r["event"], r["client"], r["round"], r["bytes_up"]) == ("client", a, 0, len(ups[a][0]))


def test_our_own_clients_records_fit_the_schema(tmp_path):
    """The schema and the client code cannot drift apart: FO, FD and resync records all pass."""
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    for cid in rnd.sampled:
        assert records.check(ups[cid][1], records.CIDERS) == ups[cid][1]
    records.check({"client": "c0", "round": 3, "resync_request": True}, records.CIDERS)


@pytest.mark.parametrize("text", ["[" * 3000 + "]" * 3000, '{"a": ' * 50 + "1" + "}" * 50, "[1, 2]", "x" * 10])
def test_record_text_from_the_wire_is_bounded(text):
    with pytest.raises(PayloadError):
        records.parse(text)
    with pytest.raises(PayloadError):
        records.parse("{" + '"k": 1, ' * (records.MAX_RECORD // 8) + '"z": 0}')


def test_bilevel_records_from_clients_cannot_inflate_totals_or_spoof_fields(tmp_path):
    """RABO: a client claiming bytes_up, a phase or an event of its own is rejected; the honest clients'
    records are composed by the server (bytes counted on the wire, masks' kept fraction)."""
    from helpers import QuadTask

    from ciders.algorithms.registry import bilevel_config
    from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig
    from ciders.federation.bilevel_client import client_phase

    base = BilevelExperiment(federation=BilevelFederationConfig(clients=3, rounds=1))
    exp = bilevel_config(replace(base, rabo=replace(base.rabo, inner_steps=2, solver_iters=4)), "rabo")
    task = QuadTask()
    scratch: dict = {}

    def client(phase, cid, msg):
        up, rec = client_phase(exp, task, phase, cid, msg, scratch.setdefault(cid, {}))
        if cid == "client1":
            rec = {**rec, "bytes_up": 10**12, "event": "eval"}
        return up, rec

    logs: list[str] = []
    summary = run_bilevel(exp, task, tmp_path, log=logs.append, exchange=InProcess(client))
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("event") == "client"]
    assert rows and all(r["client"] != "client1" for r in rows)
    assert any("client1" in line and "unknown key" in line for line in logs)
    assert summary["bytes_up"] < 10**9
    assert all(set(r) >= {"bytes_up", "bytes_down", "kept_fraction", "capacity"} for r in rows)
    json.dumps(summary)
