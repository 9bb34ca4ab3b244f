"""Secure aggregation in a run (federation.secure, federation.secure_rounds): the same numbers as the plain run
to the quantization tolerance, dropouts, crash and resume, and what the server receives, stores and logs."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import load_config
from ciders.core import secagg as sa
from ciders.core import wire
from ciders.core.store import RoundStore
from ciders.errors import ConfigError
from ciders.federation import secure
from ciders.federation.exchange import Reply
from ciders.federation.loop import Faults, RunDir, SimulatedCrash
from ciders.federation.ciders_loop import run_federation
from ciders.fileio import read_jsonl
from synthetic import VectorTask

BASE = ["federation.clients=6", "federation.rounds=4", "federation.per_round=5", "algorithm.local_steps=3",
        "algorithm.lr=0.05", "algorithm.gamma=0.3", "algorithm.alpha=0.2", "algorithm.tau=0.5",
        "algorithm.metagrad=fd", "algorithm.schedule=warmup_cosine", "algorithm.warmup_steps=2"]
SECURE = ["federation.secure_aggregation=true"]
# Delta-bar differs from the plain run's by at most n 2^-33 / sum_U w_i per coordinate from the fixed point
# (f = 32), plus float64 rounding; through tau K eta_bar and alpha that is far below 1e-9 on the messenger and c
TOL = 1e-9


def run(out, *extra, faults=None, resume=False, n=6, task=None):
    cfg = load_config(None, BASE + list(extra))
    return run_federation(cfg, task or VectorTask(n), out, resume=resume, faults=faults, progress=False,
                          log=lambda s: None)


def final(out):
    t, meta = RunDir(out).load_checkpoint(RunDir(out).committed())
    return t


def close(a, b, tol=TOL):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("extra", [["algorithm.optimizer=sgd"], ["algorithm.optimizer=adamw"],
                                   ["algorithm.name=scaffold", "algorithm.optimizer=sgd"],
                                   ["algorithm.weighting=uniform"]])
def test_a_secure_run_equals_the_plain_run(tmp_path, extra):
    run(tmp_path / "plain", *extra)
    run(tmp_path / "secure", *extra, *SECURE)
    close(final(tmp_path / "plain"), final(tmp_path / "secure"))
    plain = [r for r in read_jsonl(tmp_path / "plain" / "metrics.jsonl") if r["event"] == "server"]
    sec = [r for r in read_jsonl(tmp_path / "secure" / "metrics.jsonl") if r["event"] == "server"]
    assert [sorted(r["accepted"]) for r in plain] == [r["accepted"] for r in sec]
    assert all(r["secure"] for r in sec)
    for a, b in zip(plain, sec):
        assert abs(a["delta_bar_norm"] - b["delta_bar_norm"]) <= 1e-8 * max(1.0, a["delta_bar_norm"])


def test_a_secure_run_is_reproducible_although_every_key_and_mask_is_fresh(tmp_path):
    run(tmp_path / "a", *SECURE)
    run(tmp_path / "b", *SECURE)
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    a, b = final(tmp_path / "a"), final(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("phase", ["train", "secagg_unmask"])
def test_a_client_dropping_after_its_shares_does_not_stop_the_round(tmp_path, phase):
    """Round 0 samples 5 of 6 clients; one of them is lost after it sent its shares: at the masked upload (it is
    left out of the sum, its pair masks removed with its rebuilt key) or at the unmask (it is in the sum, its
    self-mask rebuilt from the others' shares). The plain run with the same upload lost (train) or kept gives the
    same numbers."""
    task = VectorTask(6)
    sampled = [r for r in _sample(tmp_path, task)]
    gone = sampled[1]
    run(tmp_path / "secure", *SECURE, faults=Faults(drop={(0, phase, gone)}))
    run(tmp_path / "plain", faults=Faults(drop={(0, "train", gone)}) if phase == "train" else None)
    close(final(tmp_path / "plain"), final(tmp_path / "secure"))
    server0 = next(r for r in read_jsonl(tmp_path / "secure" / "metrics.jsonl") if r["event"] == "server")
    assert (gone in server0["accepted"]) == (phase == "secagg_unmask")
    assert len(server0["accepted"]) >= 4


def _sample(tmp_path, task):
    from ciders.federation.rundir import sample_clients

    return sample_clients(sorted(task.clients()), 5, 0, 0)


def test_too_few_survivors_skip_the_round_not_the_run(tmp_path):
    task = VectorTask(6)
    s = _sample(tmp_path, task)
    # threshold = a strict majority of 5 = 3: with 3 of 5 masked uploads lost, the round cannot be unmasked
    run(tmp_path / "r", *SECURE, faults=Faults(drop={(1, "train", c) for c in s[:3]}))
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    server = [r for r in rows if r["event"] == "server"]
    assert server[1]["accepted"] == [] and "fewer than the threshold" in server[1]["rejected"]["sum"]
    assert len(server) == 4 and server[2]["accepted"]  # the run goes on
    # the skipped round moved nothing: round 1's checkpoint holds round 0's messenger and c
    ev = [r for r in rows if r["event"] == "round"]
    assert len(ev) == 4


def test_resume_after_a_crash_before_any_client_masked_gives_the_same_run(tmp_path):
    """A crash inside round 2's first phase (client 1 of the key exchange): no client has masked round 2 yet, so
    the resumed run reruns it and equals the uninterrupted run bit for bit."""
    run(tmp_path / "ref", *SECURE)
    with pytest.raises(SimulatedCrash):
        run(tmp_path / "x", *SECURE, faults=Faults(crash=(2, "client:1")))
    run(tmp_path / "x", *SECURE, resume=True)
    assert (tmp_path / "x" / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    a, b = final(tmp_path / "ref"), final(tmp_path / "x")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("point", ["server", "takd", "checkpoint"])
def test_a_crash_after_the_clients_masked_costs_that_round_not_the_run(tmp_path, point):
    """A crash after round 2's masked uploads: no client masks round 2 again (a rerun would let the server read
    an update off the difference of two sums), so the resumed round ends without an update, saying why, and
    the run goes on. Rounds before it are the uninterrupted run's."""
    run(tmp_path / "ref", *SECURE)
    with pytest.raises(SimulatedCrash):
        run(tmp_path / "x", *SECURE, faults=Faults(crash=(2, point)))
    run(tmp_path / "x", *SECURE, resume=True)
    ref, got = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("ref", "x"))
    server = {r["round"]: r for r in got if r["event"] == "server"}
    assert sorted(server) == [0, 1, 2, 3] and server[2]["accepted"] == [] and server[3]["accepted"]
    assert "threshold" in server[2]["rejected"]["sum"]
    assert any("already masked" in why for why in server[2]["rejected"].values())
    assert [r for r in got if r.get("round", 99) < 2] == [r for r in ref if r.get("round", 99) < 2]


def test_a_client_never_masks_a_round_twice(tmp_path):
    """The rerun attack, client side: after masking round t, a client refuses the keys and train phases of
    round t (a fresh session would be made otherwise) and of earlier rounds, and takes round t + 1."""
    cfg = load_config(None, BASE + SECURE)
    ids = [f"c{i:04d}" for i in range(5)]
    sessions = secure.Sessions(tmp_path / "s")

    def through_train(t):
        sr = secure.start(cfg, t, tuple(ids), {c: 10 for c in ids})
        for name, make, absorb in (("secagg_keys", secure.keys_messages, secure.absorb_keys),
                                   ("secagg_shares", secure.shares_messages, secure.absorb_shares)):
            replies = [Reply(c, secure.client_phase(name, cfg, sessions, c, m)[0]) for c, m in make(sr).items()]
            sr, _ = absorb(sr, replies)
        msg = secure.train_message(sr, ids[0], wire.encode({}, {"round": t})[0])
        up = alg.Upload(ids[0], t, 0, delta={"x": torch.ones(4)})
        return secure.client_phase("train", cfg, sessions, ids[0], msg, train=lambda inner: (up, {"loss": 1.0}),
                                   weight=10)

    through_train(3)
    assert sessions.masked_through(ids[0]) == 3
    for t in (3, 2):
        with pytest.raises(wire.PayloadError, match="already masked"):
            through_train(t)
    with pytest.raises(wire.PayloadError, match="already masked"):  # the keys phase alone is refused too
        secure.client_phase("secagg_keys", cfg, sessions, ids[0], secure.keys_messages(
            secure.start(cfg, 3, tuple(ids), {c: 10 for c in ids}))[ids[0]])
    assert "masked" in wire.decode(through_train(4)[0])[0]
    (tmp_path / "s" / f"{ids[0]}.masked").write_text("garbage")
    with pytest.raises(wire.PayloadError, match="unreadable"):
        through_train(5)


def test_a_client_masks_only_with_the_weight_its_own_rule_gives(tmp_path):
    """The weight attack: a server that sends the target weight 1 and everyone else 2^-60 reads the target's
    update off the sum. Weights are integers the client checks (its own data size, or 1 under uniform
    weighting); any other value is refused before the client trains."""
    cfg = load_config(None, BASE + SECURE)
    ids = [f"c{i:04d}" for i in range(5)]
    sessions = secure.Sessions(tmp_path / "s")
    sr = secure.start(cfg, 0, tuple(ids), {c: 10 for c in ids})
    assert sr.weights == {c: 10 for c in ids}
    for name, make, absorb in (("secagg_keys", secure.keys_messages, secure.absorb_keys),
                               ("secagg_shares", secure.shares_messages, secure.absorb_shares)):
        replies = [Reply(c, secure.client_phase(name, cfg, sessions, c, m)[0]) for c, m in make(sr).items()]
        sr, _ = absorb(sr, replies)
    trained = []
    up = alg.Upload(ids[0], 0, 0, delta={"x": torch.ones(4)})

    def train(inner):
        trained.append(1)
        return up, {"loss": 1.0}

    inner = wire.encode({}, {"round": 0})[0]
    import shutil

    for k, w in enumerate([1, 2**-60, 1.0, 11, 0, -10]):
        evil = replace(sr, weights={**sr.weights, ids[0]: w})
        d = tmp_path / f"try{k}"
        shutil.copytree(tmp_path / "s", d)
        with pytest.raises(wire.PayloadError):
            secure.client_phase("train", cfg, secure.Sessions(d), ids[0], secure.train_message(evil, ids[0], inner),
                                train=train, weight=secure.own_weight(cfg, 10))
    assert not trained
    reply, _ = secure.client_phase("train", cfg, sessions, ids[0], secure.train_message(sr, ids[0], inner),
                                   train=train, weight=secure.own_weight(cfg, 10))
    assert trained and "masked" in wire.decode(reply)[0]
    uniform = load_config(None, BASE + SECURE + ["algorithm.weighting=uniform"])
    assert secure.start(uniform, 0, tuple(ids), {c: 10 for c in ids}).weights == {c: 1 for c in ids}
    assert secure.own_weight(uniform, 10) == 1 and secure.own_weight(cfg, 10) == 10


class Tap:
    """The in-process exchange, with every reply the server receives kept (phase, client, bytes, record)."""

    def __init__(self):
        self.got = []

    def wrap(self, exchange):
        def tapped(phase, t, msgs):
            replies = exchange(phase, t, msgs)
            self.got += [(phase, r.client_id, r.payload, r.record) for r in replies]
            return replies

        return tapped


def test_the_server_receives_stores_and_logs_no_single_update(tmp_path, monkeypatch):
    """Every reply the server process receives is parsed: the only tensors are uint8 byte strings (keys,
    encrypted shares) and the int64 masked vectors, none of which is near any client's w_i Delta_i or dc_i;
    the records carry no norm; the server's store holds versions, no tensor; metrics.jsonl and run.log carry no
    per-client update statistic."""
    from ciders.federation import ciders_loop as loop

    truths: list[dict] = []
    real = alg.client_update

    def spy(*a, **kw):
        up, st, rec = real(*a, **kw)
        truths.append({"delta": up.delta, "dc": up.dc})
        return up, st, rec

    monkeypatch.setattr(alg, "client_update", spy)
    tap = Tap()
    real_inproc = loop.InProcess
    monkeypatch.setattr(loop, "InProcess", lambda *a, **kw: tap.wrap(real_inproc(*a, **kw)))
    out = tmp_path / "r"
    run(out, *SECURE, "algorithm.name=scaffold", "algorithm.optimizer=sgd", n=6, task=VectorTask(6, dim=256))
    assert truths and tap.got
    plain = [v for tr in truths for st in tr.values() for v in st.values()]
    kinds = set()
    for phase, cid, payload, record in tap.got:
        comps, meta = wire.decode(payload)
        assert set(record) <= {"client", "round", "gamma", "eta_bar", "loss", "steps", "compute_s"}
        for name, st in comps.items():
            for k, v in st.items():
                kinds.add((phase, name, str(v.dtype)))
                assert v.dtype in (torch.uint8, torch.int64), (phase, name, k, v.dtype)
                if v.dtype == torch.int64:  # a masked vector: spread over the ring, nothing like a real update
                    y = v.numpy().astype(np.float64) / 2.0**32
                    assert np.abs(y).mean() > 2.0**26
                    for p in plain:
                        if p.shape == v.shape:
                            assert np.corrcoef(y.ravel(), p.numpy().ravel())[0, 1] ** 2 < 0.1
        with pytest.raises(wire.PayloadError):  # no reply is an upload the server could decode
            codec.decode_upload(payload, {"x": torch.zeros(256, dtype=torch.float64)})
    assert ("train", "masked", "torch.int64") in kinds and ("secagg_shares", "shares", "torch.uint8") in kinds
    # what the server keeps: versions only
    store = RoundStore(out / "server", RunDir(out).committed())
    for cid in VectorTask(6).ids:
        rec = store.get(cid)
        assert rec is None or rec[0] == {}
    for f in (out / "server").rglob("*"):
        if f.is_file() and f.suffix == ".safetensors":
            from safetensors.torch import load_file

            assert load_file(str(f)) == {}
    for r in read_jsonl(out / "metrics.jsonl"):
        if r["event"] == "client":
            assert not {"dc_norm", "delta_norm", "c_i_norm", "e_rae", "s_dr", "s_ppr", "g_mean_norm"} & set(r)
            assert all(set(s) <= {"step", "loss", "lr"} for s in r["steps"])
    assert not (out / "clients").exists() or all(f.parent.parent.name == "clients" for f in (out / "clients").rglob("*.safetensors"))
    # the clients' protocol secrets are theirs, readable by their user only
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in (out / "clients-secagg").iterdir())


def test_the_secure_phases_are_counted_on_the_wire(tmp_path):
    run(tmp_path / "s", *SECURE)
    run(tmp_path / "p")
    s = json.loads((tmp_path / "s" / "summary.json").read_text())["mib"]
    p = json.loads((tmp_path / "p" / "summary.json").read_text())["mib"]
    down, up = s["by_component"]["down"], s["by_component"]["up"]
    assert {"secagg_setup", "secagg_keys", "secagg_shares", "secagg_unmask", "messenger"} <= set(down)
    assert {"secagg_keys", "secagg_shares", "masked", "secagg_unmask"} <= set(up) and "dc" not in up
    # the masked vector is the update in 64-bit fixed point: twice the float32 ... here float64: the same size
    assert s["up_per_client_round"] > p["up_per_client_round"]
    recs = read_jsonl(tmp_path / "s" / "metrics.jsonl")
    rounds = [r for r in recs if r["event"] == "round"]
    assert all(r["bytes_up"]["masked"] > 0 for r in rounds)
    # the components add up to the bytes each client's messages really had, every phase included
    for r in rounds:
        mine = [c for c in recs if c["event"] == "client" and c["round"] == r["round"]]
        assert len(mine) == len(r["clients"])
        for way in ("bytes_down", "bytes_up"):
            assert sum(r[way].values()) == sum(c[way] for c in mine), (r["round"], way)


# ------------------------------------------------------------------------------ hostile replies


def _sr(n=5):
    cfg = load_config(None, BASE + SECURE)
    ids = [f"c{i:04d}" for i in range(n)]
    return secure.start(cfg, 0, tuple(ids), {c: 10 for c in ids}), ids


def _keys_reply(cid, pub, t=0, **over):
    comps = {"keys": {"c": secure._u8(pub["pk_c"]), "s": secure._u8(pub["pk_s"])}}
    meta = {"client_id": cid, "round": t, "commit": pub["commit"], **over}
    return Reply(cid, wire.encode(comps, meta)[0])


def test_the_server_refuses_malformed_or_reused_keys():
    sr, ids = _sr()
    pubs = {c: sa.client_keys(sr.params, c)[1] for c in ids}
    replies = [_keys_reply(c, pubs[c]) for c in ids[:2]]
    replies.append(_keys_reply(ids[2], {**pubs[ids[2]], "pk_s": pubs[ids[0]]["pk_s"]}))  # someone else's key
    replies.append(_keys_reply(ids[3], {**pubs[ids[3]], "pk_c": b"not a key"}))
    replies.append(_keys_reply(ids[4], pubs[ids[4]], t=3))  # a replayed reply of another round
    replies.append(_keys_reply("c9999", pubs[ids[1]]))  # not a member
    sr2, rejected = secure.absorb_keys(sr, replies)
    assert set(sr2.keys) == set(ids[:2])
    assert set(rejected) == {ids[2], ids[3], ids[4], "c9999"}
    assert sr2.failed is not None and "threshold" in sr2.failed


def test_the_server_refuses_shares_for_clients_outside_the_group():
    sr, ids = _sr()
    secrets, pubs = {}, {}
    for c in ids:
        secrets[c], pubs[c] = sa.client_keys(sr.params, c)
    sr, _ = secure.absorb_keys(sr, [_keys_reply(c, pubs[c]) for c in ids])
    replies = []
    for c in ids:
        _, cts = sa.client_shares(sr.params, secrets[c], {j: sr.keys[j] for j in sr.params.group(c)})
        if c == ids[0]:
            cts = {**cts, "c7777": b"x"}
        if c == ids[1]:
            cts.pop(ids[2])
        replies.append(Reply(c, wire.encode({"shares": {d: secure._u8(ct) for d, ct in cts.items()}},
                                            {"client_id": c, "round": 0})[0]))
    sr, rejected = secure.absorb_shares(sr, replies)
    assert set(rejected) == {ids[0], ids[1]} and sr.u2 == tuple(ids[2:])
    assert all(set(v) <= set(ids[2:]) for v in sr.routed.values())


def test_a_masked_upload_of_the_wrong_type_is_rejected():
    sr, ids = _sr()
    sr = secure.SecureRound(sr.params, sr.weights, u2=tuple(ids))
    ref = {"x": torch.zeros(8, dtype=torch.float64)}
    good = wire.encode({"masked": {"delta/x": torch.zeros(8, dtype=torch.int64)}}, {"client_id": ids[0], "round": 0})[0]
    floaty = wire.encode({"masked": {"delta/x": torch.zeros(8)}}, {"client_id": ids[1], "round": 0})[0]
    normy = wire.encode({"masked": {"delta/x": torch.zeros(8, dtype=torch.int64)}}, {"client_id": ids[2], "round": 0})[0]
    replies = [Reply(ids[0], good, {"loss": 1.0}), Reply(ids[1], floaty, {"loss": 1.0}),
               Reply(ids[2], normy, {"loss": 1.0, "dc_norm": 0.3})]  # a record field the private schema lacks
    sr2, rejected, recs, _ = secure.absorb_masked(sr, replies, ref, scaffold=False)
    assert list(sr2.masked) == [ids[0]] and set(rejected) == {ids[1], ids[2]}


def test_a_client_refuses_a_train_message_whose_broadcast_is_not_what_it_announces(tmp_path):
    """The broadcast travels unencoded behind the train message's envelope (one copy of a first-contact
    emulator, not a re-encoded one); the envelope announces its length. A client takes the broadcast only
    when the bytes behind the envelope are exactly that many, and nothing else rides in the envelope."""
    cfg = load_config(None, BASE + SECURE)
    ids = [f"c{i:04d}" for i in range(5)]
    sr = secure.start(cfg, 0, tuple(ids), {c: 10 for c in ids})
    sessions = secure.Sessions(tmp_path / "s")
    for name, make, absorb in (("secagg_keys", secure.keys_messages, secure.absorb_keys),
                               ("secagg_shares", secure.shares_messages, secure.absorb_shares)):
        replies = [Reply(c, secure.client_phase(name, cfg, sessions, c, m)[0]) for c, m in make(sr).items()]
        sr, rejected = absorb(sr, replies)
        assert not rejected
    broadcast = wire.encode({"messenger": {"x": torch.arange(4.0)}}, {"round": 0})[0]
    got = []

    def train(inner):
        got.append(inner)
        return alg.Upload(ids[0], 0, 0, delta={"x": torch.ones(4)}), {"loss": 1.0}

    def attempt(msg, sess):
        return secure.client_phase("train", cfg, secure.Sessions(sess), ids[0], msg, train=train,
                                   weight=secure.own_weight(cfg, 10))

    import shutil

    good = secure.train_message(sr, ids[0], broadcast)
    assert good.endswith(broadcast) and secure.train_sizes(good, broadcast)["messenger"] > 0
    head = good[: len(good) - len(broadcast)]
    comps, meta = wire.decode(head)
    bad = {
        "one byte short": good[:-1],
        "one byte more": good + b"\0",
        "no broadcast": head,
        "announces more": wire.encode(comps, {**meta, "broadcast_bytes": len(broadcast) + 1})[0] + broadcast,
        "no length": wire.encode(comps, {k: v for k, v in meta.items() if k != "broadcast_bytes"})[0] + broadcast,
        "a smuggled component": wire.encode({**comps, "extra": {"x": torch.zeros(1)}}, meta)[0] + broadcast,
        "components past the end": head[: len(head) - 1],
    }
    for why, msg in bad.items():
        sess = tmp_path / why.replace(" ", "-")
        shutil.copytree(tmp_path / "s", sess)
        with pytest.raises(wire.PayloadError):
            attempt(msg, sess)
        assert not got, why  # refused before the client trained on anything
    reply, _ = attempt(good, tmp_path / "s")
    assert got == [broadcast] and "masked" in wire.decode(reply)[0]


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("extra, match", [
    (["algorithm.upload_personalized_messenger=true"], "upload_personalized_messenger"),
    (["algorithm.aggregator=median"], "robust aggregator"),
    (["federation.per_round=2"], "at least 3 clients"),
    (["federation.secagg.neighbours=3"], "even"),
    (["federation.secagg.threshold=2"], "at least|more than \\(g \\+ colluders\\)"),
    (["federation.secagg.threshold=3"], "more than \\(g \\+ colluders\\) / 2 = \\(5 \\+ 1\\) / 2"),
    (["federation.secagg.threshold=6"], "at most the share group's size"),
    (["federation.secagg.colluders=5"], "no honest member"),
    (["federation.secagg.colluders=-1"], "integer >= 0"),
    (["federation.secagg.frac_bits=48", "federation.secagg.clip=1e6"], "2\\^62"),
])
def test_settings_that_would_defeat_secure_aggregation_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, BASE + SECURE + extra)


def test_the_default_threshold_keeps_one_colluder_and_a_lying_server_from_a_client_secret():
    """t > (g + colluders) / 2: 4 of a group of 5 by default (one colluder), a strict majority (3) only when the
    config trusts every client (colluders 0); with neighbours the group, not the round, sets it."""
    sc = load_config(None, BASE + SECURE).federation.secagg
    assert sc.colluders == 1 and sc.t(5) == 4 and sc.t(3) == 3 and sc.t(10) == 6
    assert load_config(None, BASE + SECURE + ["federation.secagg.colluders=0"]).federation.secagg.t(5) == 3
    ring = load_config(None, BASE + SECURE + ["federation.secagg.neighbours=2", "federation.secagg.colluders=2"])
    assert ring.federation.secagg.t(5) == 3  # group of 3: (3 + 2) // 2 + 1


def test_a_method_that_uploads_nothing_cannot_run_securely():
    from ciders.algorithms import configure

    with pytest.raises(ConfigError, match="uploads nothing"):
        configure(load_config(None, BASE + SECURE + ["algorithm.name=localot"]))
