"""The consensus copies c_i (client) and the server's copy stay bit-identical under every fault at once:
lost, duplicated and late uploads, clients restored from arbitrary earlier snapshots (pending increment
and all), and server restarts that drop an uncommitted round. 30 seeds of random faults, then a few clean
rounds; every client must end with exactly the server's copy."""

import functools
import random
from dataclasses import replace

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.core.tensors import equal

from synthetic import SIZES, cfg, quad_clients, setup


@functools.lru_cache(maxsize=None)  # the states are frozen dataclasses; the tests only read them
def faulty_rounds(seed: int, rounds: int = 24, clean: int = 3):
    rng = random.Random(seed)
    c = cfg(gamma=0.5, alpha=0.3)
    fns = quad_clients(seed=seed % 7)
    server, copies, states, ids = setup(rounds=rounds + clean)
    snaps = {i: [states[i]] for i in ids}
    late: list[alg.Upload] = []
    stats = {"restores": 0, "restarts": 0, "resyncs": 0}
    for t in range(rounds + clean):
        faulty = t < rounds
        arrive = [rng.random() < 0.5 for _ in late] if faulty else [False] * len(late)
        delivered = [u for u, go in zip(late, arrive) if go]
        late = [u for u, go in zip(late, arrive) if not go]
        for i in ids:
            if faulty and rng.random() < 0.2:
                continue  # not sampled, or offline this round
            if faulty and rng.random() < 0.2:
                states[i] = rng.choice(snaps[i])  # restored from any earlier snapshot
                stats["restores"] += 1
            b = alg.make_broadcast(c, server, copies[i])
            up, states[i], m = alg.client_update(c, b, states[i], fns[int(i[1:])], [None] * c.local_steps)
            stats["resyncs"] += bool(m.get("resync_request"))
            snaps[i].append(states[i])
            fate = rng.random() if faulty else 1.0
            if fate < 0.15:
                continue  # lost
            if fate < 0.3:
                late.append(up)  # arrives in a later round (the server refuses it as late)
                continue
            delivered.append(up)
            if fate > 0.85:
                delivered.insert(rng.randrange(len(delivered) + 1), up)  # duplicated
        if faulty:
            rng.shuffle(delivered)
        new_server, new_copies, _ = alg.server_update(c, server, delivered, {u.client_id: copies[u.client_id]
                                                                              for u in delivered}, SIZES)
        if faulty and rng.random() < 0.1:
            stats["restarts"] += 1  # the server crashed before committing: the round is run again
            continue
        server, copies = new_server, {**copies, **new_copies}
    return c, server, copies, states, ids, stats


@pytest.mark.parametrize("seed", range(30))
def test_copies_end_bit_identical_under_random_faults(seed):
    c, server, copies, states, ids, stats = faulty_rounds(seed)
    for i in ids:
        st = alg.reconcile(states[i], alg.make_broadcast(c, server, copies[i]))
        assert st is not None, f"{i} still needs a resync after the clean rounds ({stats})"
        assert st.version == copies[i].version and equal(st.c_i, copies[i].c_i), (i, stats)


def test_the_fault_mix_exercises_restores_restarts_and_resyncs():
    """The random schedule above really does what it claims (summed over the 30 seeds)."""
    total = {"restores": 0, "restarts": 0, "resyncs": 0}
    for seed in range(30):
        for k, v in faulty_rounds(seed)[-1].items():
            total[k] += v
    assert total["restores"] > 100 and total["restarts"] > 30 and total["resyncs"] > 10, total


def test_a_restored_pending_increment_is_not_committed_for_another_upload():
    """The attack the acknowledgement stops: the client's upload A (round 0) is lost; in round 1 it uploads
    B from the same version, which the server applies (version 0 -> 1); then the client is restored to its
    snapshot after round 0, still holding A as pending. Versions say "commit" (0 + 1 = 1), but the server
    applied B: the client must not commit A, and asks for a resync instead."""
    c = cfg()
    fns = quad_clients()
    server, copies, states, ids = setup()
    i = ids[0]
    b0 = alg.make_broadcast(c, server, copies[i])
    _, after_a, _ = alg.client_update(c, b0, states[i], fns[0], [None] * c.local_steps)  # A: lost
    server, _, _ = alg.server_update(c, server, [], {}, SIZES)
    b1 = alg.make_broadcast(c, server, copies[i])
    up_b, _, _ = alg.client_update(c, b1, after_a, fns[0], [None] * c.local_steps)
    server, new, m = alg.server_update(c, server, [up_b], {i: copies[i]}, SIZES)
    copies.update(new)
    assert m["accepted"] == [i] and copies[i].version == 1
    b2 = alg.make_broadcast(c, server, copies[i])
    assert after_a.pending is not None and after_a.version == 0 and b2.version == 1
    assert alg.reconcile(after_a, b2) is None  # not a commit of A
    up, _, m = alg.client_update(c, b2, after_a, fns[0], [None] * c.local_steps)
    assert up.resync_request


def test_a_copy_that_differs_at_equal_versions_forces_a_resync():
    """Whatever made them differ, a client whose c_i does not hash to the server's digest resyncs."""
    c = cfg()
    server, copies, states, ids = setup()
    i = ids[0]
    drifted = replace(states[i], c_i={"x": states[i].c_i["x"] + torch.finfo(torch.float64).eps})
    assert alg.reconcile(drifted, alg.make_broadcast(c, server, copies[i])) is None
    assert alg.reconcile(states[i], alg.make_broadcast(c, server, copies[i])) is not None
