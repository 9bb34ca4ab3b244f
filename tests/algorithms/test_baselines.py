"""Each baseline's round against a hand computation (docs/method.md#baselines-as-knob-settings; `ciders.algorithms`).

Vector level: quadratic client losses 0.5 (x-b)^T H (x-b) + n_k^T x (VectorTask), plain SGD at a
constant learning rate, the real make_broadcast / client_update / server_update of the configured
method, against the textbook update written out by hand below."""

import pytest
import torch

from ciders import algorithms
from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import load_config
from ciders.core.tensors import max_abs_diff
from ciders.federation.loop import RunDir
from ciders.federation.ciders_loop import run_federation
from synthetic import VectorTask
from ciders.errors import ConfigError
from ciders.fileio import read_jsonl

K, LR, MU = 3, 0.1, 0.3
SETS = [f"algorithm.local_steps={K}", "algorithm.optimizer=sgd", f"algorithm.lr={LR}", "algorithm.weight_decay=0",
        "algorithm.max_grad_norm=0", "algorithm.schedule=constant", f"algorithm.eps_prox={MU}", "algorithm.gamma=0.05",
        "algorithm.alpha=0.01", "algorithm.tau=0.02", "federation.clients=3", "federation.rounds=2"]


def cfg_for(method, *extra):
    return algorithms.configure(load_config(None, SETS + list(extra)), method)


def grad(task, cid, x, noise):
    h, b = task._client(cid)
    return h @ (x - b) + noise  # the gradient of VectorTask's loss, by hand


def rounds(cfg, task, ids, n_rounds, sampled=None):
    """Drive the real update functions for n_rounds; returns the server state and client states."""
    acfg = cfg.algorithm
    server = alg.init_server(task.initial_messenger(), n_rounds)
    sizes = task.clients()
    clients = {c: alg.init_client(c, server.messenger) for c in ids}
    copies = {c: alg.init_copy(server.messenger) for c in ids}
    for t in range(n_rounds):
        who = sampled[t] if sampled else ids
        ups = []
        for c in who:
            b = alg.make_broadcast(acfg, server, copies[c])
            up, clients[c], _ = alg.client_update(acfg, b, clients[c], task.loss_fn(c), task.batches(c, t, K, 0))
            ups.append(up)
        if acfg.communicate:
            server, new, _ = alg.server_update(acfg, server, ups, {c: copies[c] for c in who}, {c: sizes[c] for c in ids})
            copies.update(new)
    return server, clients


def local_sgd(task, cid, x, t, prox_anchor=None, corr=None):
    for k, n in enumerate(task.batches(cid, t, K, 0)):
        g = grad(task, cid, x, n)
        if corr is not None:
            g = g + corr
        if prox_anchor is not None:
            g = g + MU * (x - prox_anchor)
        x = x - LR * g
    return x


@pytest.mark.parametrize("method,prox", [("fedavg", False), ("fedprox", True), ("fedot", False), ("fedbiot", True)])
def test_fedavg_family_one_round_by_hand(method, prox):
    task, ids = VectorTask(3), ["c0000", "c0001", "c0002"]
    cfg = cfg_for(method)
    server, clients = rounds(cfg, task, ids, 1)
    w = torch.zeros(8, dtype=torch.float64)
    sizes = task.clients()
    xs = {c: local_sgd(task, c, w, 0, prox_anchor=w if prox else None) for c in ids}
    hand = sum(sizes[c] * xs[c] for c in ids) / sum(sizes[c] for c in ids)  # FedAvg, weights |D_i|
    assert torch.allclose(server.messenger["x"], hand, atol=1e-12, rtol=0)
    for c in ids:  # the client keeps its own x_K
        assert torch.allclose(clients[c].personalized["x"], xs[c], atol=1e-12, rtol=0)
    b = alg.make_broadcast(cfg.algorithm, server, alg.init_copy(server.messenger))
    assert b.c is None  # gamma = 0: the consensus is not broadcast


def test_fedavg_is_ciders_with_its_knobs_off():
    a = cfg_for("fedavg").algorithm
    assert (a.gamma, a.eps_prox, a.eta_in, a.tau, a.metagrad) == (0.0, 0.0, 0.0, 1.0, "fo")
    assert cfg_for("fedprox").algorithm.eps_prox == MU
    t = cfg_for("fedbiot").takd
    assert (t.hidden_loss, t.lambda_task, t.lambda_out) == ("teacher_rms", 0.0, 0.5)
    assert cfg_for("fedot").takd.round_steps == 0 and cfg_for("localot").takd.round_steps == 0
    assert cfg_for("fedbiot").takd.round_steps == load_config(None, SETS).takd.round_steps
    c = cfg_for("ciders-fd")
    assert c.algorithm.name == "ciders" and c.algorithm.metagrad == "fd"
    assert algorithms.configure(cfg_for("scaffold")) == cfg_for("scaffold")  # idempotent
    with pytest.raises(ConfigError, match="unknown algorithm 'fedsgd'"):
        algorithms.configure(load_config(None, SETS), "fedsgd")


def hand_scaffold(task, ids, sampled, n_rounds):
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II, lr_g = 1), written out."""
    n = len(ids)
    x = torch.zeros(8, dtype=torch.float64)
    c = torch.zeros_like(x)
    ci = {i: torch.zeros_like(x) for i in ids}
    for t in range(n_rounds):
        dys, dcs = [], []
        for i in sampled[t]:
            y = local_sgd(task, i, x, t, corr=c - ci[i])
            ci_new = ci[i] - c + (x - y) / (K * LR)
            dys.append(y - x)
            dcs.append(ci_new - ci[i])
            ci[i] = ci_new
        x = x + sum(dys) / len(dys)
        c = c + (len(dys) / n) * (sum(dcs) / len(dcs))
    return x, c, ci


@pytest.mark.parametrize("sampled", [None, [["c0000", "c0002"], ["c0001", "c0002"], ["c0000", "c0001"]]])
def test_scaffold_three_rounds_by_hand(sampled):
    task, ids = VectorTask(3), ["c0000", "c0001", "c0002"]
    plan = sampled or [ids] * 3
    server, clients = rounds(cfg_for("scaffold"), task, ids, 3, sampled=plan)
    x, c, ci = hand_scaffold(task, ids, plan, 3)
    assert torch.allclose(server.messenger["x"], x, atol=1e-10, rtol=0)
    assert torch.allclose(server.c["x"], c, atol=1e-10, rtol=0)
    for i in ids:  # committed c_i plus the pending (acknowledged next contact) increment
        st = clients[i]
        mine = st.c_i["x"] + (st.pending.dc["x"] if st.pending else 0)
        assert torch.allclose(mine, ci[i], atol=1e-10, rtol=0)


def test_scaffold_full_participation_equals_eq12_with_alpha_one():
    task, ids = VectorTask(3), ["c0000", "c0001", "c0002"]
    cfg = cfg_for("scaffold")
    from dataclasses import replace

    ema = replace(cfg, algorithm=replace(cfg.algorithm, consensus_update="ema"))
    s1, _ = rounds(cfg, task, ids, 3)
    s2, _ = rounds(ema, task, ids, 3)
    assert max_abs_diff(s1.c, s2.c) < 1e-12 and max_abs_diff(s1.messenger, s2.messenger) < 1e-12


def test_localot_trains_alone_from_its_own_messenger(tmp_path):
    task = VectorTask(3)
    cfg = cfg_for("localot")
    run_federation(cfg, task, tmp_path, progress=False, log=lambda s: None)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    rounds_ = [r for r in rows if r["event"] == "round"]
    assert all(r["bytes_up"] == {} for r in rounds_)  # nothing is uploaded, ever
    assert sum(rounds_[0]["bytes_down"].values()) > 0 and rounds_[1]["bytes_down"] == {}  # one download
    from ciders.core.store import RoundStore

    store = RoundStore(tmp_path / "clients", RunDir(tmp_path).committed())
    w = torch.zeros(8, dtype=torch.float64)
    for c in task.ids:
        x = local_sgd(task, c, local_sgd(task, c, w, 0), 1)  # round 1 continues from round 0's x_K
        st = codec.client_from_record(*store.get(c))
        assert torch.allclose(st.personalized["x"], x, atol=1e-12, rtol=0)
    tensors, meta = RunDir(tmp_path).load_checkpoint(1)
    assert torch.equal(tensors["messenger/x"], w)  # the server never aggregates
