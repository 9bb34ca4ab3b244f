"""The Flower engine gives the in-process engine's numbers: under Flower's simulation (Ray) and in a real
loopback deployment (SuperLink + SuperNodes over TLS with SuperNode authentication), including a
SuperNode killed mid-round, a reply that comes after its round closed, and a SuperLink + ServerApp
restart that resumes from the run checkpoint.

Tolerance: none. Both engines run the same functions on the same bytes with the same seeds, and every
tensor is decoded into its own aligned storage, so metrics.jsonl and the final adapters are compared
bit for bit (client processes run with OMP_NUM_THREADS=1, like the reference run)."""

import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.core.store import RoundStore
from ciders.federation.loop import Faults, RunDir
from ciders.fileio import read_jsonl
from conftest import ROOT
from flower_helpers import TINY, assert_same_run, deployment, free_port, local_run

pytestmark = pytest.mark.flower


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return p


# ------------------------------------------------------------------------------------------ simulation


@pytest.mark.parametrize("method", ["ciders", "fedot"])
def test_simulation_equals_in_process(tiny, tmp_path, method):
    """`ciders run --engine flower-sim`: partial participation (2 of 3), per-client consensus state, and
    (FedOT) a static B_L sent once and kept by each client across its Ray worker processes."""
    from ciders.cli import main

    extra = [f"algorithm.name={method}", "algorithm.metagrad=fd", "federation.per_round=2", "federation.rounds=3"]
    local_run(tiny, tmp_path / "local", extra)
    args = [x for kv in extra for x in ("--set", kv)]
    assert main(["run", str(tiny), "--out", str(tmp_path / "sim"), "--engine", "flower-sim", *args]) == 0
    assert_same_run(tmp_path / "local", tmp_path / "sim")
    assert not (tmp_path / "sim" / "clients").exists()  # client state lives with the clients
    log = (tmp_path / "sim" / "server.log").read_text()  # the ServerApp's log, kept in the run directory
    assert "evaluating before the first round" in log and log.splitlines()[0][2] == ":", log[:300]
    if method == "fedot":
        rows = [r for r in read_jsonl(tmp_path / "sim" / "metrics.jsonl") if r["event"] == "round"]
        seen, first = set(), []  # a round sends the static B_L iff one of its clients is contacted first
        for r in rows:
            first.append(bool(set(r["clients"]) - seen))
            seen |= set(r["clients"])
        assert [("student" in r["bytes_down"]) for r in rows] == first and first[0] and not all(first)
        held = list((tmp_path / "sim" / "flower-clients").glob("client*/static/student.safetensors"))
        assert len(held) == 3


def test_secure_aggregation_with_central_dp_on_the_simulation_equals_in_process(tiny, tmp_path):
    """federation.secure_aggregation over Flower: the four protocol phases as Flower messages, each client's
    secrets in its own state directory, central DP noise on the unmasked sum; bit for bit the in-process run
    (the keys and masks differ, the sum they leave does not)."""
    from ciders.cli import main

    extra = ["federation.secure_aggregation=true", "algorithm.weighting=uniform", "federation.dp.mode=central",
             "federation.dp.clip=1.0", "federation.dp.noise_multiplier=0.5"]
    local_run(tiny, tmp_path / "local", extra)
    args = [x for kv in extra for x in ("--set", kv)]
    assert main(["run", str(tiny), "--out", str(tmp_path / "sim"), "--engine", "flower-sim", *args]) == 0
    assert_same_run(tmp_path / "local", tmp_path / "sim")
    rows = read_jsonl(tmp_path / "sim" / "metrics.jsonl")
    assert all(r["secure"] and r["dp_epsilon"] > 0 for r in rows if r["event"] == "server")
    secrets = sorted((tmp_path / "sim" / "flower-clients").glob("client*/secagg/client*.json"))
    assert len(secrets) == 3 and all((f.stat().st_mode & 0o777) == 0o600 for f in secrets)
    assert not list((tmp_path / "sim" / "server").rglob("*.safetensors")) or all(
        not load_file(str(f)) for f in (tmp_path / "sim" / "server").rglob("*.safetensors"))


# ------------------------------------------------------------------------------------------ deployment


def start_nodes(dep, n, env=None):
    for i in range(n):
        dep.register(i)
    for i in range(n):
        dep.start_supernode(i, n, dep.work / "nodes" / f"client{i}", env=(env or {}).get(i))
    dep.wait_online(n)


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


def test_loopback_deployment_with_tls_and_node_auth_equals_in_process(tiny, tmp_path, capsys):
    """`ciders flower loopback`: credentials, SuperLink, 3 SuperNodes, one run, everything stopped."""
    from ciders.cli import main

    local_run(tiny, tmp_path / "local")
    port = free_port()
    assert main(["flower", "loopback", str(tiny), "--out", str(tmp_path / "dep-run"), "--clients", "3",
                 "--work", str(tmp_path / "dep"), "--port", str(port), "--control-port", str(free_port())]) == 0
    logs = capsys.readouterr().out
    assert "TLS + SuperNode auth" in logs and "Control on 127.0.0.1:" in logs and "finished:completed" in logs and "still running" not in logs, logs
    assert_same_run(tmp_path / "local", tmp_path / "dep-run", tmp_path / "dep")


def in_sync(cs: alg.ClientState, cp: alg.ServerCopy) -> bool:
    from ciders.core.tensors import equal

    if cs.version == cp.version:
        return equal(cs.c_i, cp.c_i)
    p = cs.pending
    return p is not None and cp.version == cs.version + 1 and equal({k: cs.c_i[k] + p.dc[k] for k in cs.c_i}, cp.c_i)


def test_supernode_killed_mid_round_rejoins_in_sync(tiny, tmp_path):
    """Round 0: client2's SuperNode is SIGKILLed after training, before replying, and restarted with
    the same key and state directory (it rejoins once the SuperLink has marked it offline). The round
    completes with the others (p renormalised over them) and the run equals the in-process run in which
    client2's reply was lost; client2's consensus copy is in sync with the server's."""
    over = ["flower.round_timeout_s=100", "flower.rejoin_wait_s=90", "flower.eval_timeout_s=240"]  # round 1 waits
    local_run(tiny, tmp_path / "local", over, Faults(drop={(0, "client2")}))
    dep = deployment(tmp_path)
    out = tmp_path / "run"
    try:
        dep.start_superlink()
        start_nodes(dep, 3, env={2: {"CIDERS_FLOWER_FAULT": "client2:0:sleep:600"}})
        run_id = dep.launch(tiny, out, over)
        wait_for(lambda: (dep.work / "nodes" / "client2" / "FAULT_SLEEPING_r0").exists(), 300, "client2 to train")
        dep.kill("supernode2")
        dep.rejoin(2, 3, dep.work / "nodes" / "client2")  # back, without the fault
        assert dep.wait_run(run_id, timeout=600) == "finished:completed", dep.run_log(run_id)[-3000:]
    finally:
        dep.stop()
    assert_same_run(tmp_path / "local", out, dep.work)
    rows = read_jsonl(out / "metrics.jsonl")
    server = {r["round"]: r for r in rows if r["event"] == "server"}
    assert server[0]["accepted"] == ["client0", "client1"] and abs(sum(server[0]["p"].values()) - 1) < 1e-12
    assert server[1]["accepted"] == ["client0", "client1", "client2"]
    assert_in_sync(out, dep.work, ["client2"])
    assert dep.leftovers() == []


def test_reply_after_the_round_closed_is_not_applied(tiny, tmp_path):
    """client1 replies about 20 s after round 0 closed: the round completes without it, the late upload is
    never applied, and the run equals the in-process run in which that reply was lost."""
    timeout = 60  # each ClientApp message starts a process that builds the model: ~10-25 s on 2 cores
    over = [f"flower.round_timeout_s={timeout}", "flower.eval_timeout_s=240"]
    local_run(tiny, tmp_path / "local", over, Faults(drop={(0, "client1")}))
    dep = deployment(tmp_path)
    out = tmp_path / "run"
    try:
        dep.start_superlink()
        start_nodes(dep, 3, env={1: {"CIDERS_FLOWER_FAULT": f"client1:0:sleep:{timeout + 20}"}})
        run_id = dep.launch(tiny, out, over)
        assert dep.wait_run(run_id, timeout=600) == "finished:completed", dep.run_log(run_id)[-3000:]
    finally:
        dep.stop()
    assert_same_run(tmp_path / "local", out)
    server = {r["round"]: r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "server"}
    assert "client1" not in server[0]["accepted"] and "client1" in server[1]["accepted"]
    assert_in_sync(out, dep.work, ["client1"])
    assert dep.leftovers() == []


def assert_in_sync(out, work, cids):
    server = RoundStore(out / "server", RunDir(out).committed())
    for cid in cids:
        store = RoundStore(work / "nodes" / cid / "store", RunDir(out).committed())
        assert in_sync(codec.client_from_record(*store.get(cid)), codec.copy_from_record(*server.get(cid))), cid


def test_restarted_superlink_and_serverapp_resume_from_the_checkpoint(tiny, tmp_path):
    """The SuperLink (with its ServerApp) is killed once round 0 is committed; a new SuperLink and
    `flwr run ... resume=true` finish the run, which equals an uninterrupted in-process run."""
    over = ["federation.rounds=3"]
    local_run(tiny, tmp_path / "local", over)
    dep = deployment(tmp_path)
    out = tmp_path / "run"
    try:
        dep.start_superlink()
        start_nodes(dep, 3)
        dep.launch(tiny, out, over)
        wait_for(lambda: RunDir(out).committed() == 0, 300, "round 0 to commit")
        dep.kill("superlink")
        for i in range(3):  # the nodes outlive their SuperLink or not; start them afresh either way
            dep.kill(f"supernode{i}")
        dep.start_superlink()
        start_nodes(dep, 3)
        run_id = dep.launch(tiny, out, over, resume=True)
        assert dep.wait_run(run_id, timeout=600) == "finished:completed", dep.run_log(run_id)[-3000:]
    finally:
        dep.stop()
    assert_same_run(tmp_path / "local", out)
    assert dep.leftovers() == []


# ------------------------------------------------------------------------------------- bilevel family

BILEVEL = ["federation.clients=3", "federation.rounds=2", "task.eval_episodes=3", "task.width=8",
           "rabo.inner_steps=2", "rabo.solver_iters=2", "fedmeta.local_steps=2", "flower.node_wait_s=90",
           "flower.round_timeout_s=120"]


def assert_same_bilevel_run(a: Path, b: Path):
    for f in ("metrics.jsonl", "final.safetensors"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), (a, f)


def test_bilevel_family_on_flower_equals_in_process(tmp_path, capsys):
    """`ciders bilevel --engine flower-sim` (RABO, the OAP sub-model baseline, Dist-ProtoNet) and a loopback
    deployment of RABO (TLS + SuperNode auth, a new ClientApp process per message, the between-phase
    scratch space in each node's state directory) give the in-process numbers, bit for bit, on the vendored
    Omniglot slice (data/omniglot-slice: runs on a fresh clone, without CIDERS_DATA)."""
    from ciders.cli import main

    # deployed processes run in their own directories: the data path must be absolute (docs/flower.md)
    data = f"task.data={ROOT / 'data' / 'omniglot-slice'}"
    cfg = str(ROOT / "configs/cpu/rabo_fewshot.yaml")
    sets = [x for kv in [*BILEVEL, data] for x in ("--set", kv)]
    methods = ["--methods", "rabo,oap,dist-protonet"]
    assert main(["bilevel", cfg, "--out", str(tmp_path / "local"), *methods, *sets]) == 0
    assert main(["bilevel", cfg, "--out", str(tmp_path / "sim"), "--engine", "flower-sim", *methods, *sets]) == 0
    for m in ("rabo", "oap", "dist-protonet"):
        assert_same_bilevel_run(tmp_path / "local" / m, tmp_path / "sim" / m)
    capsys.readouterr()
    assert main(["flower", "loopback", cfg, "--out", str(tmp_path / "dep-run"), "--clients", "3",
                 "--work", str(tmp_path / "dep"), "--port", str(free_port()), "--control-port", str(free_port()),
                 *sets]) == 0
    logs = capsys.readouterr().out
    assert "finished:completed" in logs and "still running" not in logs, logs
    assert_same_bilevel_run(tmp_path / "local" / "rabo", tmp_path / "dep-run")
    assert (tmp_path / "dep" / "nodes" / "client0" / "bilevel" / "scratch.json").is_file()


def test_one_head_per_episode_on_flower_equals_in_process(tmp_path):
    """rabo.head: episode (one phase per round, no scratch between phases) with two episodes per client and round,
    on Flower's simulation: the in-process numbers, bit for bit."""
    from ciders.cli import main

    data = f"task.data={ROOT / 'data' / 'omniglot-slice'}"
    cfg = str(ROOT / "configs/cpu/rabo_fewshot.yaml")
    extra = ["rabo.head=episode", "task.episodes=2", "rabo.beta=0.5"]
    sets = [x for kv in [*BILEVEL, data, *extra] for x in ("--set", kv)]
    assert main(["bilevel", cfg, "--out", str(tmp_path / "local"), "--methods", "rabo", *sets]) == 0
    assert main(["bilevel", cfg, "--out", str(tmp_path / "sim"), "--engine", "flower-sim", "--methods", "rabo",
                 *sets]) == 0
    assert_same_bilevel_run(tmp_path / "local" / "rabo", tmp_path / "sim" / "rabo")
    rounds = [r for r in read_jsonl(tmp_path / "sim" / "rabo" / "metrics.jsonl") if r["event"] == "round"]
    assert rounds and all("inner_clients" not in r for r in rounds)  # the one-phase round ran
