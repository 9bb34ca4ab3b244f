from dataclasses import replace

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.config import CidersConfig
from ciders.core.tensors import digest, equal, lincomb, max_abs_diff
from ciders.experiments.theory import run_theory
from synthetic import SIZES, cfg, quad_clients, setup


def run_round(c, server, copies, states, fns, ids, batches=None):
    ups, metrics = [], []
    for cid in ids:
        b = alg.make_broadcast(c, server, copies[cid])
        up, states[cid], m = alg.client_update(c, b, states[cid], fns[int(cid[1:])], batches or [None] * c.local_steps)
        ups.append(up)
        metrics.append(m)
    return ups, metrics




def test_clipping_bounds_the_whole_corrected_step():
    """Eq. 4 clips g_traj = g + gamma (c - c_i) + eps_prox (x - w) as one vector (paper consensus space); here the
    correction alone is about 20 times max_grad_norm, so clipping g alone would let the step grow with it."""
    c = cfg(local_steps=2, eta_in=0.0, max_grad_norm=0.1, consensus_space="paper")
    fn = quad_clients()[0]
    w = {"x": torch.linspace(-1.0, 1.0, 6, dtype=torch.float64)}
    cc, c_i = {"x": torch.full((6,), 2.0, dtype=torch.float64)}, {"x": -torch.ones(6, dtype=torch.float64)}
    b = alg.Broadcast(0, w, cc, c.gamma, (c.lr,) * 2, (0.0,) * 2, c_i_digest=digest(c_i))
    _, st, m = alg.client_update(c, b, alg.ClientState("c0", c_i), fn, [None, None])
    x, norms = w["x"], []
    for _ in range(2):  # the same two SGD steps by hand
        p = x.clone().requires_grad_(True)
        traj = torch.autograd.grad(fn({"x": p}, None), p)[0] + c.gamma * (cc["x"] - c_i["x"]) + c.eps_prox * (x - w["x"])
        norms.append(float(traj.norm()))
        x = x - c.lr * c.max_grad_norm / (traj.norm() + 1e-6) * traj
    assert min(norms) > 10 * c.max_grad_norm
    assert [s["g_traj_norm"] for s in m["steps"]] == pytest.approx(norms, rel=1e-12)
    assert float((st.personalized["x"] - x).abs().max()) < 1e-12


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_eq11_reconstruction_equals_the_true_displacement(opt):
    c = cfg(optimizer=opt, schedule="warmup_cosine", warmup_steps=2, metagrad="fd")
    fns = quad_clients()
    server, copies, states, ids = setup(sizes=[3, 1, 2, 5])
    for t in range(10):
        w = server.messenger
        ups, _ = run_round(c, server, copies, states, fns, ids)
        lrs, _, gamma = alg.round_schedule(c, t, server.total_rounds)
        eta_bar = sum(lrs) / c.local_steps
        for cid, up in zip(ids, ups):
            true = lincomb([(1 / (c.local_steps * eta_bar), w), (-1 / (c.local_steps * eta_bar), states[cid].personalized)])
            rec = alg.cs.reconstruct(up.dc, copies[cid].c_i, server.c, c.alpha, gamma)
            assert max_abs_diff(rec, true) < 1e-9
        server, copies, m = alg.server_update(c, server, ups, copies, SIZES)
        assert m["accepted"] == ids
    # after the next contact the client's committed copy equals the server's, bit for bit
    run_round(c, server, copies, states, fns, ids)
    for cid in ids:
        assert equal(states[cid].c_i, copies[cid].c_i) and states[cid].version == copies[cid].version == 10


def test_reduces_to_fedavg():
    c = cfg(gamma=0.0, eps_prox=0.0, eta_in=0.0, tau=1.0)
    fns = quad_clients()
    server, copies, states, ids = setup(sizes=[1, 2, 3, 4])
    for _ in range(3):
        ups, _ = run_round(c, server, copies, states, fns, ids)
        xs = [states[i].personalized for i in ids]
        fedavg = lincomb([(n / 10, x) for n, x in zip([1, 2, 3, 4], xs)])
        server, copies, _ = alg.server_update(c, server, ups, copies, SIZES)
        assert max_abs_diff(server.messenger, fedavg) < 1e-12


def test_fd_with_zero_hvp_weight_is_fo():
    fns = quad_clients()
    outs = []
    for kind in ("fo", "fd"):
        c = cfg(metagrad=kind, fd_eta=0.0)
        server, copies, states, ids = setup()
        for _ in range(3):
            ups, ms = run_round(c, server, copies, states, fns, ids)
            server, copies, _ = alg.server_update(c, server, ups, copies, SIZES)
        outs.append(server)
        if kind == "fd":
            assert all(s["r_fd"] == 0 for m in ms for s in m["steps"]) and ms[0]["r_fd_small"] == c.local_steps
    assert equal(outs[0].messenger, outs[1].messenger) and equal(outs[0].c, outs[1].c)


@pytest.mark.parametrize("space", ["update", "gradient", "paper"])
@pytest.mark.parametrize("loss, k, eps", [("linear", 1, 0.0), ("linear", 5, 0.0), ("linear", 5, 0.2),
                                          ("linear", 3, 1.0), ("quadratic", 1, 0.0)])
def test_theory_psi_t(loss, k, eps, space):
    rows = list(run_theory(5, 7, k, 0.1, 0.4, 0.15, eps, 40, loss, seed=2, consensus_space=space))
    assert rows[0]["dr"] == 0 and rows[0]["psi"] == 1
    for r in rows:
        assert abs(r["dr"] - r["dr_pred"]) < 1e-10 and abs(r["ppr"] - r["psi"]) < 1e-10
    assert rows[-1]["psi"] == pytest.approx(rows[-1]["psi_inf"], abs=2e-3)
    if eps > 0:
        assert rows[-1]["psi_inf"] > 1 - 0.4  # proximal damping keeps a more personalized field


def test_theory_does_not_hold_where_spec_says_it_need_not():
    # quadratic losses with K > 1: the gradient moves along the path, so psi_t is only approximate
    rows = list(run_theory(5, 7, 5, 0.1, 0.4, 0.15, 0.0, 20, "quadratic", seed=2))
    assert max(abs(r["ppr"] - r["psi"]) for r in rows) > 1e-6


def test_lost_duplicated_and_late_uploads_keep_copies_in_sync():
    c = cfg()
    fns = quad_clients()
    server, copies, states, ids = setup()
    held = None
    for t in range(8):
        ups, _ = run_round(c, server, copies, states, fns, ids)
        delivered = list(ups)
        if t == 1:
            delivered.remove(ups[0])  # lost
        if t == 2:
            delivered.append(ups[1])  # duplicated
        if t == 3:
            held = ups[2]  # arrives late
            delivered.remove(ups[2])
        if t == 4:
            delivered.append(held)  # ... in the next round (its id is also in this round's uploads)
        server, copies, m = alg.server_update(c, server, delivered, copies, SIZES)
        if t == 2:
            assert "duplicate" in m["rejected"]["c1"]
        if t == 4:
            assert set(m["accepted"]) == set(ids)
            assert "late" in m["rejected"]["c2"] or "duplicate" in m["rejected"]["c2"]
    run_round(c, server, copies, states, fns, ids)  # next contact commits or drops pending increments
    for cid in ids:
        assert equal(states[cid].c_i, copies[cid].c_i) and states[cid].version == copies[cid].version
    assert copies["c0"].version == 7 and copies["c1"].version == 8 and copies["c2"].version == 7


def test_late_upload_alone_is_rejected_without_side_effects():
    c = cfg()
    fns = quad_clients()
    server, copies, states, ids = setup()
    ups, _ = run_round(c, server, copies, states, fns, ids)
    server, copies, _ = alg.server_update(c, server, ups[1:], copies, SIZES)  # c0's upload missed round 0
    before = (server.messenger, server.c, copies["c0"])
    server2, copies2, m = alg.server_update(c, server, [ups[0]], copies, SIZES)
    assert m["accepted"] == [] and "late" in m["rejected"]["c0"]
    assert equal(server2.messenger, before[0]) and equal(server2.c, before[1]) and copies2["c0"] is before[2]


def test_client_restored_from_an_old_snapshot_resyncs():
    c = cfg()
    fns = quad_clients()
    server, copies, states, ids = setup()
    snapshot = states["c0"]
    for _ in range(3):
        ups, _ = run_round(c, server, copies, states, fns, ids)
        server, copies, _ = alg.server_update(c, server, ups, copies, SIZES)
    states["c0"] = snapshot  # the device lost its disk state and restored a 3-round-old copy
    ups, ms = run_round(c, server, copies, states, fns, ids)
    assert ups[0].resync_request and ms[0]["resync_request"]
    server, copies, m = alg.server_update(c, server, ups, copies, SIZES)
    assert "resync requested" in m["rejected"]["c0"] and copies["c0"].needs_resync
    ups, _ = run_round(c, server, copies, states, fns, ids)  # this broadcast carries the server's copy
    assert not ups[0].resync_request
    server, copies, m = alg.server_update(c, server, ups, copies, SIZES)
    assert "c0" in m["accepted"] and not copies["c0"].needs_resync
    run_round(c, server, copies, states, fns, ids)
    assert equal(states["c0"].c_i, copies["c0"].c_i)


def test_malformed_uploads_never_touch_global_state():
    c = cfg()
    fns = quad_clients()
    server, copies, states, ids = setup()
    ups, _ = run_round(c, server, copies, states, fns, ids)
    bad = [replace(ups[0], dc={"x": torch.full((6,), float("nan"), dtype=torch.float64)}),
           replace(ups[1], dc={"y": torch.zeros(6, dtype=torch.float64)}),
           replace(ups[2], dc={"x": torch.zeros(5, dtype=torch.float64)}),
           replace(ups[3], client_id="c9")]  # not a registered client
    s2, cp2, m = alg.server_update(c, server, bad, copies, SIZES)
    assert m["accepted"] == [] and len(m["rejected"]) == 4
    assert equal(s2.messenger, server.messenger) and all(cp2[i] is copies[i] for i in ids)


def test_partial_participation_renormalises_p():
    c = cfg()
    fns = quad_clients()
    server, copies, states, ids = setup(sizes=[1, 1, 2, 4])
    ups, _ = run_round(c, server, copies, states, fns, ids[2:])
    s2, _, m = alg.server_update(c, server, ups, copies, SIZES)
    assert m["p"] == {"c2": pytest.approx(1 / 3), "c3": pytest.approx(2 / 3)}


def test_client_round_metrics_and_determinism():
    c = cfg(metagrad="fd")
    fns = quad_clients()
    runs = []
    for _ in range(2):
        server, copies, states, ids = setup()
        all_m = []
        for _ in range(3):
            ups, ms = run_round(c, server, copies, states, fns, ids)
            server, copies, sm = alg.server_update(c, server, ups, copies, SIZES)
            all_m.append((ms, sm))
        runs.append(all_m)
    assert runs[0] == runs[1]
    m = runs[0][0][0][0]
    for k in ("loss", "e_rae", "s_dr", "s_ppr", "c_norm", "c_i_norm", "dc_norm", "r_fd_small", "steps"):
        assert k in m
    assert m["s_dr"] == 0 and m["s_ppr"] == pytest.approx(1.0)  # round 0: c = c_i = 0
    assert set(m["steps"][0]) >= {"loss", "g_norm", "g_traj_norm", "lr", "r_fd"}


def test_config_validation_names_the_key():
    from ciders.errors import ConfigError

    for kw, match in [({"gamma": 1.5}, "algorithm.gamma"), ({"alpha": 0.0}, "algorithm.alpha"),
                      ({"tau": 0.0}, "algorithm.tau"), ({"local_steps": 0}, "algorithm.local_steps"),
                      ({"optimizer": "lion"}, "algorithm.optimizer")]:
        with pytest.raises(ConfigError, match=match):
            CidersConfig(**kw).validate()


@pytest.mark.parametrize("hvp", ["fd", "exact"])
def test_r_fd_under_accumulation_is_the_ratio_of_the_step_not_the_largest_micro_batch(hvp):
    from ciders.core.metagrad import exact_hvp, metagrad
    from ciders.core.tensors import norm

    c = cfg(local_steps=1, grad_accum=2, metagrad="fd", hvp=hvp, fd_eta=0.3)
    fn = quad_clients()[0]
    server, copies, states, ids = setup()
    batches = [3.0, -2.5]  # the micro-batches shift the gradient in opposite directions
    b = alg.make_broadcast(c, server, copies[ids[0]])
    _, _, m = alg.client_update(c, b, states[ids[0]], fn, batches)
    vs, corrs, ratios = [], [], []
    for batch in batches:
        kw = {"hvp_fn": lambda x, v, batch=batch: exact_hvp(fn, x, v, batch)} if hvp == "exact" else {}
        _, info = metagrad(lambda p, batch=batch: alg.grad_of(fn, p, batch), server.messenger, b.eta_ins[0], "fd",
                           c.eps_fd, c.fd_eta, **kw)
        vs.append(info["v"])
        corrs.append(info["corr"])
        ratios.append(info["r_fd"])
    step = norm(lincomb([(0.5, corrs[0]), (0.5, corrs[1])])) / norm(lincomb([(0.5, vs[0]), (0.5, vs[1])]))
    assert m["steps"][0]["r_fd"] == pytest.approx(step, rel=1e-9)
    assert abs(step - max(ratios)) > 1e-3 * step  # the test can tell the two rules apart


@pytest.mark.parametrize("hvp,calls", [("exact", 2), ("fd", 4)])
def test_an_fd_step_evaluates_the_loss_once_per_point(hvp, calls):
    """Exact HVP: the forward at x_k serves the first gradient and the double backward (x_k and the look-ahead:
    2 loss calls per micro-batch); FD probes: x_k, the look-ahead and the two probes (4)."""
    c = cfg(local_steps=2, metagrad="fd", hvp=hvp, fd_eta=0.3)
    fn = quad_clients()[0]
    n = []

    def counting(p, batch):
        n.append(1)
        return fn(p, batch)

    server, copies, states, ids = setup()
    b = alg.make_broadcast(c, server, copies[ids[0]])
    _, _, m = alg.client_update(c, b, states[ids[0]], counting, [None, None])
    assert len(n) == calls * 2 and len(m["steps"]) == 2
