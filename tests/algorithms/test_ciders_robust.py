"""One client must never be able to move or stop the federation (docs/security.md#aggregation): weights
come from the sizes the server registered, a finite but huge update is refused, and a round whose
aggregate is not finite is rejected as a whole, the state staying at the last good one."""

from dataclasses import replace

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.core.tensors import equal
from synthetic import SIZES, cfg, quad_clients, setup


def first_round(n=4, sizes=None, dtype=torch.float64, **kw):
    c = cfg(**kw)
    fns = quad_clients(n)
    server, copies, states, ids = setup(n=n, sizes=sizes)
    if dtype != torch.float64:
        server = replace(server, messenger={"x": server.messenger["x"].to(dtype)}, c={"x": server.c["x"].to(dtype)})
        copies = {i: replace(cp, c_i={"x": cp.c_i["x"].to(dtype)}) for i, cp in copies.items()}
        states = {i: replace(s, c_i={"x": s.c_i["x"].to(dtype)}) for i, s in states.items()}
        fns = [lambda p, b, f=f: f({"x": p["x"].double()}, b) for f in fns]
    ups = []
    for i in ids:
        b = alg.make_broadcast(c, server, copies[i])
        up, states[i], _ = alg.client_update(c, b, states[i], fns[int(i[1:])], [None] * c.local_steps)
        ups.append(up)
    return c, server, copies, states, ids, ups


def test_weights_are_the_registered_sizes_whatever_the_upload():
    c, server, copies, _, ids, ups = first_round(sizes=[1, 2, 3, 4])
    _, _, m = alg.server_update(c, server, ups, copies, SIZES)
    assert m["p"] == {i: pytest.approx(n / 10) for i, n in zip(ids, [1, 2, 3, 4])}


def test_a_client_cannot_steer_the_messenger_to_a_target():
    """The attack of a client claiming p_i ~ 1: it solves for the dc that puts the messenger at a target.
    With registered weights (1/4 here) and the step bound it cannot: the global messenger stays where the
    honest clients put it, up to the bounded pull of one client."""
    c, server, copies, _, ids, ups = first_round()
    target = torch.full((6,), 1e6, dtype=torch.float64)
    k_eta = c.local_steps * c.lr
    # dc such that Delta = (w - target) / (K eta): the step that lands exactly on the target if p_i = 1
    delta = (server.messenger["x"] - target) / k_eta
    gamma = alg.round_schedule(c, 0, server.total_rounds)[2]
    dc = c.alpha * (delta + (gamma - 1) * copies[ids[0]].c_i["x"] - gamma * server.c["x"])
    evil = replace(ups[0], dc={"x": dc})
    s2, cp2, m = alg.server_update(c, server, [evil] + ups[1:], copies, SIZES, max_step_ratio=10.0)
    assert ids[0] in m["rejected"] and "exceeds max_step_ratio" in m["rejected"][ids[0]]
    assert cp2[ids[0]] is copies[ids[0]]  # its copy did not move
    assert float(s2.messenger["x"].abs().max()) < 10


@pytest.mark.parametrize("dtype,huge", [(torch.float64, 1e308), (torch.float32, 3e38)])
def test_finite_but_huge_increments_are_refused_and_the_run_goes_on(dtype, huge):
    c, server, copies, states, ids, ups = first_round(dtype=dtype)
    evil = replace(ups[0], dc={"x": torch.full((6,), huge, dtype=dtype)})
    s2, cp2, m = alg.server_update(c, server, [evil] + ups[1:], copies, SIZES, max_step_ratio=10.0)
    assert "not finite" in m["rejected"][ids[0]] or "exceeds" in m["rejected"][ids[0]]
    assert m["accepted"] == ids[1:] and torch.isfinite(s2.messenger["x"]).all() and torch.isfinite(s2.c["x"]).all()


def test_a_round_whose_aggregate_is_not_finite_is_rejected_whole():
    """Each upload's step is finite (and max_step_ratio is off), but the server step tau K eta_bar
    delta_bar overflows: the round is rejected, messenger, c and every copy stay, the clients drop their
    pending increments, and the next round trains normally with every copy still in sync."""
    c, server, copies, states, ids, ups = first_round(tau=20.0, dtype=torch.float32)
    big = {"x": torch.full((6,), c.alpha * 3e38, dtype=torch.float32)}  # Delta_i = 3e38 (c = c_i = 0)
    evil = [replace(u, dc=big) for u in ups]
    s2, cp2, m = alg.server_update(c, server, evil, copies, SIZES, max_step_ratio=None)
    assert m["accepted"] == [] and m["aggregate_rejected"] == ids
    assert all("not finite" in m["rejected"][i] for i in ids)
    assert equal(s2.messenger, server.messenger) and equal(s2.c, server.c) and s2.round == server.round + 1
    assert all(cp2[i] is copies[i] for i in ids)
    fns = quad_clients()
    ups2 = []
    for i in ids:
        b = alg.make_broadcast(c, s2, cp2[i])
        f = fns[int(i[1:])]
        up, states[i], _ = alg.client_update(c, b, states[i], lambda p, bt, f=f: f({"x": p["x"].double()}, bt),
                                             [None] * c.local_steps)
        assert not up.resync_request  # the pending increment was dropped cleanly
        ups2.append(up)
    s3, cp3, m3 = alg.server_update(c, s2, ups2, cp2, SIZES)
    assert m3["accepted"] == ids and not equal(s3.messenger, s2.messenger)


def test_an_unregistered_client_is_rejected_even_with_a_copy():
    c, server, copies, _, ids, ups = first_round()
    sizes = {i: 1 for i in ids[1:]}
    _, _, m = alg.server_update(c, server, ups, copies, sizes)
    assert m["rejected"] == {ids[0]: "not a registered client"} and m["accepted"] == ids[1:]


def test_central_dp_rejects_a_client_that_skips_clipping():
    """Central DP's noise is scaled to C, so an unclipped update would enter the mean unprotected (issue: a
    modified client at 20x C in every round). The server reconstructs Delta_i (Eq. 11) and rejects a norm above
    C; the honest, clipped updates are accepted. Under secure aggregation only the mean is seen: it is a convex
    combination of clipped updates, so a mean above C rejects the round."""
    c = cfg()
    fns = quad_clients(4)
    server, copies, states, ids = setup(n=4)
    raw = []
    for i in ids:
        b = alg.make_broadcast(c, server, copies[i])
        up, _, _ = alg.client_update(c, b, states[i], fns[int(i[1:])], [None] * c.local_steps)
        raw.append(up)
    clip = 0.05 * min(float(u.delta["x"].norm()) for u in raw)  # every raw update is 20x C or more
    priv = alg.Privacy(clip=clip)
    ups = [raw[0]]  # the cheat: its raw update, not clipped
    for i in ids[1:]:
        b = alg.make_broadcast(c, server, copies[i])
        up, _, _ = alg.client_update(c, b, states[i], fns[int(i[1:])], [None] * c.local_steps, priv)
        ups.append(up)
    s2, cp2, m = alg.server_update(c, server, ups, copies, SIZES, priv=priv)
    assert set(m["accepted"]) == set(ids[1:]) and "did not clip" in m["rejected"][ids[0]]
    assert cp2[ids[0]] is copies[ids[0]]
    # the honest clipped updates pass with the reconstruction's rounding (they sit at norm C exactly)
    assert all(abs(float(u.delta["x"].norm()) - clip) < 1e-9 * clip for u in ups[1:])
    # without DP the same uploads are all accepted (the check is DP's, not a general bound)
    assert len(alg.server_update(c, server, ups, copies, SIZES)[2]["accepted"]) == 4
    # secure aggregation: the unmasked mean
    sec = {i: alg.ServerCopy({}) for i in ids}
    big = {"x": raw[0].delta["x"] * 0.25 + sum(u.delta["x"] for u in ups[1:]) * 0.25}
    s3, _, m3 = alg.secure_server_update(c, server, big, 1.0, ids, sec, 4, priv=priv)
    assert m3["accepted"] == [] and "did not clip" in m3["rejected"]["sum"] and equal(s3.messenger, server.messenger)
    ok = {"x": sum(u.delta["x"] for u in ups[1:]) / 3}
    assert alg.secure_server_update(c, server, ok, 1.0, ids[1:], sec, 4, priv=priv)[2]["accepted"] == sorted(ids[1:])


def test_a_round_whose_new_copy_of_c_i_is_not_finite_is_rejected_whole():
    """Under the median one client's overflowing update leaves the messenger and c finite, but its copy c_i + dc_i
    of Eq. 11 is inf: that is the round's aggregate too (the next round would reconstruct from it), so the round is
    rejected as a whole and every copy stays."""
    c, server, copies, states, ids, ups = first_round(dtype=torch.float32, aggregator="median", alpha=1.0, gamma=1.0)
    # Eq. 11 with alpha = gamma = 1: Delta_i = dc_i + c = -2e38, finite; the copy c_i + dc_i = -4e38 overflows
    copies = {**copies, ids[0]: replace(copies[ids[0]], c_i={"x": torch.full((6,), -2e38)})}
    evil = replace(ups[0], dc={"x": torch.full((6,), -2e38)})
    s2, cp2, m = alg.server_update(c, server, [evil] + ups[1:], copies, SIZES, max_step_ratio=None)
    assert m["accepted"] == [] and m["aggregate_rejected"] == ids
    assert equal(s2.messenger, server.messenger) and all(cp2[i] is copies[i] for i in ids)
