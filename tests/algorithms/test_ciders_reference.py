"""CIDERS rounds (client_update + server_update) against the hand-written reference in tests/reference_ciders.py:
look-ahead, non-zero c and c_i, clipping active on every step, a warmup-cosine schedule, gradient accumulation,
proximal anchoring, weight decay, torch.optim.SGD / AdamW, a non-quadratic loss on mini-batches, float64."""

import pytest
import torch

import reference_ciders as ref
from ciders.algorithms import ciders as alg
from ciders.core.tensors import digest
from synthetic import cfg

MODES = ["paper", "gradient", "update"]
SIZES = {"c0": 3, "c1": 1, "c2": 2}
ROUNDS = 3
TOL = 1e-10


def ref_cfg(mode, opt, **kw):
    base = dict(local_steps=3, grad_accum=2, optimizer=opt, lr=0.1, weight_decay=0.1 if opt == "adamw" else 0.05,
                max_grad_norm=0.05, schedule="warmup_cosine", warmup_steps=3, min_lr_ratio=0.1, eta_in=0.2,
                gamma=0.4, alpha=0.5, tau=0.7, eps_prox=0.3)
    return cfg(**{**base, **kw, "consensus_space": mode})


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def zeros(w):
    return {k: torch.zeros_like(v) for k, v in w.items()}


def lib_fd(c):
    """The library's own FD meta-gradient at the reference's iterate (the FD probe rule is tested in
    tests/core; here only its wiring inside client_update: eps_fd, fd_eta and the step's eta_in)."""
    from ciders.core.metagrad import metagrad

    names = list(ref.initial_messenger())

    def grad_fn(batch):
        def f(p):
            q = {k: v.detach().requires_grad_(True) for k, v in p.items()}
            loss = ref.loss_fn(q, batch)
            return loss.detach(), dict(zip(q, torch.autograd.grad(loss, list(q.values()))))
        return f

    def g(params, eta_in, batch):
        x = {n: p.detach().clone() for n, p in zip(names, params)}
        gm, _ = metagrad(grad_fn(batch), x, eta_in, kind="fd", eps_fd=c.eps_fd, eta_hvp=c.fd_eta)
        return [gm[n] for n in names]
    return g


def check_client(c, cid, up, st, m, r, lib_delta, c_i_before):
    """The library's client outputs against the reference's (Eqs. 8-10, x_K, E-RAE, clipping)."""
    assert diff(st.c_i, c_i_before) < TOL  # the committed c_i the round started from
    assert diff(st.personalized, r.x) < TOL, f"{cid}: x_K"
    assert diff(up.dc, r.dc) < TOL, f"{cid}: dc_i (Eq. 10)"
    assert diff({k: st.c_i[k] + st.pending.dc[k] for k in st.c_i}, r.c_i_new) < TOL, f"{cid}: c_i' (Eq. 9)"
    assert diff(lib_delta, r.delta) < TOL, f"{cid}: Delta_i (Eq. 8, as the server recovers it by Eq. 11)"
    assert m["delta_norm"] == pytest.approx(float(sum((v * v).sum() for v in r.delta.values())) ** 0.5, rel=TOL)
    assert m["e_rae"] == pytest.approx(r.e_rae, rel=TOL)
    assert len(r.clip_norms) == c.local_steps and min(r.clip_norms) > 2 * c.max_grad_norm  # every step clips
    assert all(s["g_traj_norm"] > 2 * c.max_grad_norm for s in m["steps"])


def run_against_reference(c, mode, metagrad=ref.fo_metagrad):
    w0 = ref.initial_messenger()
    ids = list(SIZES)
    server, copies = alg.init_server(w0, ROUNDS), {i: alg.init_copy(w0) for i in ids}
    states = {i: alg.init_client(i, w0) for i in ids}
    rw, rc = {k: v.clone() for k, v in w0.items()}, zeros(w0)
    r_ci = {i: zeros(w0) for i in ids}
    checked_nonzero = 0
    for t in range(ROUNDS):
        lrs, eta_ins = ref.round_lrs(c, t, ROUNDS)
        assert len(set(lrs)) == len(lrs)  # the schedule moves within the round: eta_bar is not any one eta_k
        ups, results = [], {}
        for j, cid in enumerate(ids):
            batches = ref.client_batches(j, t, c.local_steps * c.grad_accum)
            b = alg.make_broadcast(c, server, copies[cid])
            up, states[cid], m = alg.client_update(c, b, states[cid], ref.loss_fn, batches)
            r = ref.client_round(c, mode, rw, rc, r_ci[cid], c.gamma, lrs, eta_ins, batches, metagrad)
            lib_delta = alg.cs.reconstruct(up.dc, copies[cid].c_i, server.c, c.alpha, b.gamma)
            check_client(c, cid, up, states[cid], m, r, lib_delta, r_ci[cid])
            checked_nonzero += min(diff(rc, zeros(w0)), diff(r_ci[cid], zeros(w0))) > 1e-3
            ups.append(up)
            results[cid] = r
        server, copies, sm = alg.server_update(c, server, ups, copies, SIZES)
        assert sm["accepted"] == ids
        rw, rc, r_copies, deltas = ref.server_round(c, rw, rc, r_ci, {i: results[i].dc for i in ids}, SIZES,
                                                    c.gamma, lrs)
        assert all(diff(deltas[i], results[i].delta) < TOL for i in ids)  # the reference's own Eq. 11 is exact
        assert diff(server.messenger, rw) < TOL and diff(server.c, rc) < TOL, f"round {t}: Eq. 12"
        assert all(diff(copies[i].c_i, r_copies[i]) < TOL for i in ids)
        r_ci = {i: results[i].c_i_new for i in ids}
    assert checked_nonzero == len(ids) * (ROUNDS - 1)  # c and c_i were non-zero after round 0


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", MODES)
def test_rounds_match_the_hand_written_reference(mode, opt):
    run_against_reference(ref_cfg(mode, opt), mode)


def test_fd_rounds_match_the_reference_with_the_library_probe():
    c = ref_cfg("paper", "adamw", metagrad="fd", hvp="fd", fd_eta=0.05, eps_fd=1e-3)
    run_against_reference(c, "paper", lib_fd(c))


@pytest.mark.parametrize("mode", MODES)
def test_fd_rounds_with_the_exact_hvp_match_the_reference(mode):
    c = ref_cfg(mode, "adamw", metagrad="fd", hvp="exact", fd_eta=0.05)
    run_against_reference(c, mode, ref.fd_metagrad_exact(0.05))


def test_modes_agree_for_plain_sgd():
    """With SGD, no weight decay and no clipping the three consensus spaces are the same algorithm (the
    theory check holds for each): x_K, Delta_i and dc_i agree to rounding."""
    outs = {}
    for mode in MODES:
        c = ref_cfg(mode, "sgd", weight_decay=0.0, max_grad_norm=0.0)
        w0 = ref.initial_messenger()
        server, copies = alg.init_server(w0, ROUNDS), {i: alg.init_copy(w0) for i in SIZES}
        states = {i: alg.init_client(i, w0) for i in SIZES}
        rec = []
        for t in range(ROUNDS):
            ups = []
            for j, cid in enumerate(SIZES):
                b = alg.make_broadcast(c, server, copies[cid])
                batches = ref.client_batches(j, t, c.local_steps * c.grad_accum)
                up, states[cid], _ = alg.client_update(c, b, states[cid], ref.loss_fn, batches)
                ups.append(up)
                rec += [states[cid].personalized, up.dc,
                        alg.cs.reconstruct(up.dc, copies[cid].c_i, server.c, c.alpha, b.gamma)]
            server, copies, _ = alg.server_update(c, server, ups, copies, SIZES)
            rec += [server.messenger, server.c]
        outs[mode] = rec
    for mode in MODES[1:]:
        assert max(diff(a, b) for a, b in zip(outs["paper"], outs[mode])) < 1e-12, mode
    assert diff(outs["paper"][-1], zeros(outs["paper"][-1])) > 1e-3  # c is not trivially zero


def test_the_reference_spaces_agree_only_where_they_should():
    """The reference itself, before the library has the modes: its three spaces agree for plain SGD (and with the
    library's paper rule there), and differ once clipping and AdamW are on, so the mode tests compare something."""
    c_plain = ref_cfg("paper", "sgd", weight_decay=0.0, max_grad_norm=0.0)
    c_full = ref_cfg("paper", "adamw")
    w = ref.initial_messenger()
    g = torch.Generator().manual_seed(3)
    cc, c_i = ({k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in w.items()} for _ in range(2))
    lrs, eta_ins = ref.round_lrs(c_plain, 1, ROUNDS)
    batches = ref.client_batches(0, 1, c_plain.local_steps * c_plain.grad_accum)
    b = alg.Broadcast(1, w, cc, c_plain.gamma, tuple(lrs), tuple(eta_ins), c_i_digest=digest(c_i))
    up, st, _ = alg.client_update(c_plain, b, alg.ClientState("c0", c_i), ref.loss_fn, batches)
    for c, same in ((c_plain, True), (c_full, False)):
        r = {m: ref.client_round(c, m, w, cc, c_i, c.gamma, lrs, eta_ins, batches) for m in MODES}
        if same:
            assert diff(r["paper"].x, st.personalized) < 1e-12 and diff(r["paper"].dc, up.dc) < 1e-12
        for m in MODES[1:]:
            gap = max(diff(r["paper"].delta, r[m].delta), diff(r["paper"].x, r[m].x), diff(r["paper"].dc, r[m].dc))
            assert (gap < 1e-12) if same else (gap > 1e-4), (m, gap)
