"""The per-update step bound against a reference no client can inflate (issue 34; docs/security.md#aggregation).

`federation.max_step_ratio` bounds each client's implied step K eta_bar Delta_i by ratio x max(||w_0||, 1), with
||w_0|| the global messenger's norm at the run's start, carried in the server state (`ServerState.ref_norm`) and
its checkpoints. It used to be ratio x max(||w||, 1) with w the current messenger: under `aggregator: mean` one
client of five pushing the largest accepted step in one direction every round grew the model geometrically (each
push raised the next round's bound), to ~385x the honest run's norm away from it after 6 rounds (tau = 1)."""

import json
from dataclasses import replace

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.core import consensus as cs
from ciders.core.tensors import equal, norm
from synthetic import SIZES, cfg, client_uploads, largest_accepted, quad_clients, setup

RATIO = 10.0  # federation.max_step_ratio's default
N = 5  # clients, equal sizes: the attacker's weight p is 1/5
ROUNDS = 8


def _evil(c, server, copy, cid, step):
    """The upload whose reconstructed Delta_i (Eq. 11) has the implied step K eta_bar Delta_i = step."""
    lrs, _, gamma = alg.round_schedule(c, server.round, server.total_rounds)
    delta = step / sum(lrs)
    dc = c.alpha * (delta + (gamma - 1) * copy.c_i["x"] - gamma * server.c["x"])
    return alg.Upload(cid, server.round, copy.version, dc={"x": dc})


def _largest_accepted(c, server, copies, cid, honest, u):
    """The largest b for which the server accepts the step -b u, found by asking the server itself (doubling, then
    bisection): the attacker needs no knowledge of the rule."""
    def ok(b):
        up = _evil(c, server, copies[cid], cid, -b * u)
        m = alg.server_update(c, server, [up] + honest, copies, SIZES, max_step_ratio=RATIO)[2]
        return cid not in m["rejected"]

    return largest_accepted(ok, 60)


def _honest_uploads(c, server, copies, states, fns, ids):
    return client_uploads(c, server, copies, states, ids, fns)


def _run(c, attack, rounds=ROUNDS, ratio=RATIO):
    """rounds of 5 clients; with `attack`, c0 sends the largest step the server accepts along the fixed direction
    -u every round. Returns [(server state, copies, metrics)] after each round."""
    fns = quad_clients(N)
    server, copies, states, ids = setup(n=N, rounds=rounds)
    u = torch.ones(6, dtype=torch.float64) / 6 ** 0.5
    out = []
    for _ in range(rounds):
        ups = _honest_uploads(c, server, copies, states, fns, ids[1:] if attack else ids)
        if attack:
            b = _largest_accepted(c, server, copies, ids[0], ups, u)
            ups = [_evil(c, server, copies[ids[0]], ids[0], -b * u)] + ups
        server, copies, m = alg.server_update(c, server, ups, copies, SIZES, max_step_ratio=ratio)
        out.append((server, copies, m))
    return out


def _drifts(c):
    """||w_attacked - w_honest|| and that over ||w_honest|| after each round."""
    honest, attacked = _run(c, False), _run(c, True)
    assert all("c0" in m["accepted"] for _, _, m in attacked)  # the attacker's every push went in
    d = [float((a.messenger["x"] - h.messenger["x"]).norm()) for (h, _, _), (a, _, _) in zip(honest, attacked)]
    return d, [x / float(h.messenger["x"].norm()) for x, (h, _, _) in zip(d, honest)]


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_one_client_of_five_moves_the_model_at_most_linearly_in_rounds(tau):
    """Each round the attacker's accepted step is at most RATIO x max(||w_0||, 1), so it moves w by at most
    tau p RATIO max(||w_0||, 1): after t rounds, at most t times that (the honest clients only pull back)."""
    c = cfg(tau=tau)
    drift, rel = _drifts(c)
    per_round = tau * (1 / N) * RATIO * max(norm(setup(n=N)[0].messenger), 1.0)
    print(f"tau={tau} drift/||w_honest|| after each round: {[round(r, 3) for r in rel]}")
    assert drift[0] > 0.9 * per_round  # the attack is at full strength
    assert all(d <= (t + 1) * per_round * (1 + 1e-9) for t, d in enumerate(drift))
    assert rel[5] < 10  # after 6 rounds (the old bound let it reach 385x at tau = 1, 45x at tau = 0.5)


def test_the_old_bound_on_the_current_norm_compounds(monkeypatch):
    """What the reference fixes: the same attack against the old rule (the reference re-taken from the current
    messenger every round) grows the drift geometrically, ~2.9x a round at tau = 1."""
    monkeypatch.setattr(alg, "with_ref", lambda s: replace(s, ref_norm=norm(s.messenger)))
    drift, rel = _drifts(cfg(tau=1.0))
    print(f"old rule, tau=1 drift/||w_honest|| after each round: {[round(r, 3) for r in rel]}")
    assert rel[5] > 100 and drift[7] > 2.5 ** 7 * drift[0]


@pytest.mark.parametrize("knobs", [dict(tau=1.0), dict(tau=0.5), dict(optimizer="adamw"),
                                   dict(server_optimizer="fedadam"), dict(aggregator="median")],
                         ids=["fedavg-tau", "tau-0.5", "adamw", "fedadam", "median"])
def test_an_honest_run_is_unchanged(knobs):
    """Bit for bit the run without any bound (so the fix changes no honest run): every honest step is far inside
    both the new bound RATIO x max(||w_0||, 1) and the old one RATIO x max(||w||, 1), which therefore accepted
    everything too."""
    c = cfg(**knobs)
    bounded, free = _run(c, False), _run(c, False, ratio=None)
    for (s1, cp1, m1), (s2, cp2, m2) in zip(bounded, free):
        assert equal(s1.messenger, s2.messenger) and equal(s1.c, s2.c) and m1 == m2 and len(m1["accepted"]) == N
        assert all(equal(cp1[i].c_i, cp2[i].c_i) for i in cp1)
    worst = max(_honest_steps(c) or [0.0])
    assert worst < 0.1 * RATIO  # ||w_0|| = 0 here: the new bound is RATIO, the old one RATIO x max(||w||, 1) >= it


def _honest_steps(c):
    """Every honest upload's implied step norm ||K eta_bar Delta_i|| over an honest run."""
    fns = quad_clients(N)
    server, copies, states, ids = setup(n=N, rounds=ROUNDS)
    out = []
    for _ in range(ROUNDS):
        ups = _honest_uploads(c, server, copies, states, fns, ids)
        lrs, _, gamma = alg.round_schedule(c, server.round, server.total_rounds)
        for up in ups:
            delta = cs.reconstruct(up.dc, copies[up.client_id].c_i, server.c, c.alpha, gamma)
            out.append(norm(delta) * sum(lrs))
        server, copies, _ = alg.server_update(c, server, ups, copies, SIZES, max_step_ratio=RATIO)
    return out


def test_the_reference_is_fixed_saved_and_loaded():
    """init_server fixes ||w_0||; rounds carry it however the messenger moves; the checkpoint record keeps it
    exactly through JSON; a checkpoint written before it existed loads with its own messenger's norm."""
    w0 = {"x": torch.tensor([3.0, 4.0, 0, 0, 0, 0], dtype=torch.float64)}
    server = alg.init_server(w0, 4)
    assert server.ref_norm == 5.0
    last = _run(cfg(tau=1.0), True, rounds=3)[-1][0]
    assert last.ref_norm == 0.0 and norm(last.messenger) > 1  # the zero start of `setup`, kept
    tensors, meta = codec.server_record(last)
    back = codec.server_from_record(tensors, json.loads(json.dumps(meta)))
    assert back.ref_norm == 0.0 and equal(back.messenger, last.messenger)
    old = codec.server_from_record(tensors, {k: v for k, v in meta.items() if k != "ref_norm"})
    assert old.ref_norm == norm(last.messenger)
    bare = alg.ServerState(0, 4, w0, {"x": torch.zeros(6, dtype=torch.float64)})  # built without one
    assert alg.with_ref(bare).ref_norm == 5.0 and codec.server_record(bare)[1]["ref_norm"] == 5.0


def test_a_step_inside_the_old_bound_but_outside_the_new_one_is_refused_plain_and_secure():
    """A messenger pushed to norm 100 (ref_norm still 1): a step of norm 50 passed the old bound (10 x 100) and
    is now refused, per upload and, under secure aggregation, as the round's sum; with the reference at 100 it
    passes."""
    c = cfg()
    server, copies, states, ids = setup(n=N)
    server = replace(server, messenger={"x": torch.full((6,), 100 / 6 ** 0.5, dtype=torch.float64)}, ref_norm=1.0)
    step = -torch.full((6,), 50 / 6 ** 0.5, dtype=torch.float64)
    lrs = alg.round_schedule(c, server.round, server.total_rounds)[0]
    up = _evil(c, server, copies[ids[0]], ids[0], step)
    m = alg.server_update(c, server, [up], copies, SIZES, max_step_ratio=RATIO)[2]
    assert "exceeds max_step_ratio 10 x max(||w_0||, 1) = 10" in m["rejected"][ids[0]]
    sec = {i: alg.ServerCopy({}) for i in ids}
    s2, _, m2 = alg.secure_server_update(c, server, {"x": step / sum(lrs)}, 1.0, ids[:1], sec, N, max_step_ratio=RATIO)
    assert m2["accepted"] == [] and "exceeds max_step_ratio" in m2["rejected"]["sum"]
    assert equal(s2.messenger, server.messenger) and s2.ref_norm == 1.0
    wide = replace(server, ref_norm=100.0)
    assert alg.server_update(c, wide, [up], copies, SIZES, max_step_ratio=RATIO)[2]["accepted"] == [ids[0]]
    assert alg.secure_server_update(c, wide, {"x": step / sum(lrs)}, 1.0, ids[:1], sec, N,
                                    max_step_ratio=RATIO)[2]["accepted"] == [ids[0]]
