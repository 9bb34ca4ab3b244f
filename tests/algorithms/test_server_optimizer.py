"""algorithm.server_optimizer inside the real server round (`ciders.server_update`; docs/method.md#server-optimizers):
none is Eq. 12 bit for bit, FedAvgM at momentum 0 and rate 1 is none, FedAdam / FedYogi / FedAvgM on top of FedAvg give
Flower's weights from the clients' own messengers, the state survives a checkpoint and a resume exactly, and every
method that aggregates a messenger takes the option."""

import importlib.util
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from ciders import algorithms
from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import load_config
from ciders.core import server_opt as so
from ciders.core.tensors import equal, max_abs_diff
from conftest import ROOT
from synthetic import SIZES, VectorTask, cfg, quad_clients, setup

BASE = dict(local_steps=3, optimizer="sgd", lr=0.05, schedule="constant")  # cfg() fills the rest (CIDERS knobs on)
FEDAVG = dict(gamma=0.0, eps_prox=0.0, eta_in=0.0, tau=1.0, alpha=1.0)  # the knobs fedavg.configure sets


def drive(c, rounds, start=None, keep=None):
    """`rounds` CIDERS rounds of 4 quadratic clients (sizes 3, 1, 2, 5) through the real functions, from `start`
    (server, copies, clients) or a fresh setup; `keep` collects (server before, the clients' x_K) per round."""
    fns = quad_clients()
    server, copies, states, ids = start or setup(sizes=[3, 1, 2, 5])
    for _ in range(rounds):
        ups = []
        for cid in ids:
            b = alg.make_broadcast(c, server, copies[cid])
            up, states[cid], _ = alg.client_update(c, b, states[cid], fns[int(cid[1:])], [None] * c.local_steps)
            ups.append(up)
        before = server
        server, copies, m = alg.server_update(c, server, ups, copies, SIZES)
        assert m["accepted"] == ids
        if keep is not None:
            keep.append((before, [states[i].personalized for i in ids]))
    return server, copies, states, ids


def test_none_is_eq12_bit_for_bit_and_writes_the_same_record():
    """With server_optimizer none the messenger is `server_messenger` of the round's sum_i p_i Delta_i, bit for
    bit, in every round; no optimizer state appears, and the checkpoint record holds what it always held."""
    c = cfg(**BASE)
    fns = quad_clients()
    server, copies, states, ids = setup(sizes=[3, 1, 2, 5])
    for _ in range(4):
        ups = []
        for cid in ids:
            b = alg.make_broadcast(c, server, copies[cid])
            up, states[cid], _ = alg.client_update(c, b, states[cid], fns[int(cid[1:])], [None] * c.local_steps)
            ups.append(up)
        lrs, _, gamma = alg.round_schedule(c, server.round, server.total_rounds)
        eta_bar = sum(lrs) / c.local_steps
        deltas = [alg.cs.reconstruct(u.dc, copies[u.client_id].c_i, server.c, c.alpha, gamma) for u in ups]
        delta_bar = alg.agg.weighted_sum(deltas, alg.agg.client_weights([SIZES[i] for i in ids]))
        w_eq12 = alg.cs.server_messenger(server.messenger, delta_bar, c.tau, c.local_steps, eta_bar)
        server, copies, _ = alg.server_update(c, server, ups, copies, SIZES)
        assert equal(server.messenger, w_eq12) and server.opt is None
    assert equal(server.messenger, drive(c, 4)[0].messenger)
    tensors, meta = codec.server_record(server)
    assert set(meta) == {"round", "total_rounds", "ref_norm"}  # ref_norm: ||w_0||, the step bound's reference
    assert all(k.startswith(("messenger/", "c/")) for k in tensors)


@pytest.mark.parametrize("knobs", [{}, FEDAVG, dict(optimizer="adamw", schedule="warmup_cosine", warmup_steps=2)])
def test_fedavgm_without_momentum_at_rate_one_equals_none_exactly(knobs):
    none = drive(cfg(**{**BASE, **knobs}), 4)[0]
    avgm = drive(cfg(**{**BASE, **knobs}, server_optimizer="fedavgm", server_momentum=0.0, server_lr=1.0), 4)[0]
    assert equal(avgm.messenger, none.messenger) and equal(avgm.c, none.c)
    assert avgm.opt.name == "fedavgm" and avgm.opt.step == 4


def flower_helpers():
    """tests/core/test_server_opt.py, whose helpers build Flower replies and strategies (it skips without flwr)."""
    spec = importlib.util.spec_from_file_location("server_opt_flower", ROOT / "tests" / "core" / "test_server_opt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FLOWER = [dict(server_optimizer="fedadam"), dict(server_optimizer="fedyogi", server_lr=0.05),
          dict(server_optimizer="fedavgm", server_lr=0.8, server_momentum=0.9)]


@pytest.mark.parametrize("opt", FLOWER, ids=lambda o: o["server_optimizer"])
def test_on_fedavg_the_weights_are_flowers_from_the_client_messengers(opt):
    """FedAvg knobs (tau = 1: Eq. 12 is the weighted mean of the clients' x_K): our server_update with a server
    optimizer, from the uploaded increments dc_i, against Flower's strategy fed the clients' x_K themselves."""
    sf = flower_helpers()
    c = cfg(**BASE, **FEDAVG, **opt)
    keep = []
    server, _, _, ids = drive(c, 3, keep=keep)
    o = so.from_config(c)
    strat = sf.flower_strategy(o.name, o)
    w = {k: v.numpy().copy() for k, v in keep[0][0].messenger.items()}
    if o.name == "fedavgm":
        strat.current_arrays = sf.arrays(w)
    diffs = []
    for r, (before, xs) in enumerate(keep):
        replies = [sf.reply({k: v.numpy() for k, v in x.items()}, SIZES[i], n + 1) for n, (i, x) in
                   enumerate(zip(ids, xs))]
        if o.name != "fedavgm":
            strat.current_arrays = {k: v.numpy().copy() for k, v in before.messenger.items()}
        new, _ = strat.aggregate_train(r + 1, replies)
        ours = keep[r + 1][0].messenger if r + 1 < len(keep) else server.messenger
        diffs.append(max(float(np.abs(new[k].numpy() - ours[k].numpy()).max()) for k in ours))
    assert max(diffs) < 1e-12, diffs
    assert max_abs_diff(server.messenger, keep[0][0].messenger) > 1e-2


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi"])
def test_a_resumed_run_continues_exactly(tmp_path, name):
    """4 rounds straight == 2 rounds, the server checkpointed (safetensors + JSON, as RunDir writes it) and
    loaded back, 2 more rounds: messenger, c and optimizer state bit for bit."""
    from safetensors.torch import load_file, save_file

    c = cfg(**BASE, server_optimizer=name)
    straight = drive(c, 4)[0]
    server, copies, states, ids = drive(c, 2)
    tensors, meta = codec.server_record(server)
    assert meta["server_opt"] == {"name": name, "step": 2}
    save_file(tensors, str(tmp_path / "state.safetensors"))
    back = codec.server_from_record(load_file(str(tmp_path / "state.safetensors")), json.loads(json.dumps(meta)))
    assert back.opt == server.opt and equal(back.messenger, server.messenger)
    resumed = drive(c, 2, start=(back, copies, states, ids))[0]
    assert equal(resumed.messenger, straight.messenger) and equal(resumed.c, straight.c)
    assert resumed.opt == straight.opt and resumed.opt.step == 4
    # losing the state (what a resume that dropped it would do) does change the run
    lost = drive(c, 2, start=(replace(back, opt=None), *drive(c, 2)[1:]))[0]
    assert not equal(lost.messenger, straight.messenger)


def test_server_to_moves_the_optimizer_state_too():
    """What a resume's device move uses (federation.rounds' _to_device), so the moments survive a resume."""
    from ciders.federation.rounds import _to_device

    server = drive(cfg(**BASE, server_optimizer="fedadam"), 1)[0]
    moved = codec.server_to(server, "cpu")
    assert moved.opt == server.opt and equal(moved.messenger, server.messenger) and equal(moved.c, server.c)
    assert codec.server_to(drive(cfg(**BASE), 1)[0], "cpu").opt is None
    resumed = _to_device(server, server.messenger)
    assert resumed.opt is not None and resumed.opt == server.opt


def test_an_old_checkpoint_without_optimizer_state_loads_and_a_server_optimizer_starts_fresh():
    c = cfg(**BASE)
    server, copies, states, ids = drive(c, 2)
    tensors, meta = codec.server_record(server)
    old = codec.server_from_record(tensors, {"round": meta["round"], "total_rounds": meta["total_rounds"]})
    assert old.opt is None and equal(old.messenger, server.messenger)
    adam = drive(cfg(**BASE, server_optimizer="fedadam"), 1, start=(old, copies, states, ids))[0]
    assert adam.opt.step == 1 and adam.opt.name == "fedadam"


def test_the_optimizer_state_moves_only_with_an_applied_aggregate():
    """A round nobody replied to, and a round whose messenger is finite but whose second moment overflows (d^2 of a
    1.8e154 step, each client's own step 1e153: the messenger's step is then m / inf = 0), leave the optimizer state
    as it was."""
    c = cfg(**BASE, server_optimizer="fedyogi", tau=20.0)
    server, copies, states, ids = drive(c, 1)
    s2, _, m = alg.server_update(c, server, [], copies, SIZES)  # nobody replied
    assert s2.opt is server.opt and m["accepted"] == []
    fns, ups = quad_clients(), []
    for cid in ids:
        b = alg.make_broadcast(c, s2, copies[cid])
        up, _, _ = alg.client_update(c, b, states[cid], fns[int(cid[1:])], [None] * c.local_steps)
        ups.append(replace(up, dc={"x": torch.full((6,), c.alpha * 6e153, dtype=torch.float64)}))
    s3, _, m = alg.server_update(c, s2, ups, copies, SIZES)  # every upload's step is finite, v is not
    assert m["aggregate_rejected"] == ids and s3.opt is server.opt and equal(s3.messenger, server.messenger)


SETS = ["algorithm.local_steps=2", "algorithm.optimizer=sgd", "algorithm.lr=0.1", "algorithm.schedule=constant",
        "algorithm.max_grad_norm=0", "federation.clients=3", "federation.rounds=2"]


@pytest.mark.parametrize("method", algorithms.METHODS)
def test_every_method_that_aggregates_a_messenger_takes_the_option(method):
    task = VectorTask(3)
    sizes = task.clients()

    def run(server_optimizer):
        a = algorithms.configure(load_config(None, SETS + [f"algorithm.server_optimizer={server_optimizer}"]),
                                 method).algorithm
        assert a.server_optimizer == server_optimizer  # no method's configure overrides it
        server = alg.init_server(task.initial_messenger(), 2)
        clients = {i: alg.init_client(i, server.messenger) for i in task.ids}
        copies = {i: alg.init_copy(server.messenger) for i in task.ids}
        for t in range(2):
            ups = []
            for i in task.ids:
                b = alg.make_broadcast(a, server, copies[i])
                up, clients[i], _ = alg.client_update(a, b, clients[i], task.loss_fn(i), task.batches(i, t, 2, 0))
                ups.append(up)
            if a.communicate:
                server, new, _ = alg.server_update(a, server, ups, copies, sizes)
                copies.update(new)
        return server

    plain, adam = run("none"), run("fedadam")
    if method == "localot":  # nothing is uploaded: there is no aggregate to optimize
        assert adam.opt is None and equal(adam.messenger, plain.messenger)
    else:
        assert adam.opt.step == 2 and max_abs_diff(adam.messenger, plain.messenger) > 1e-3
