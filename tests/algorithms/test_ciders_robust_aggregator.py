"""algorithm.aggregator in `server_update` (docs/method.md#robust-aggregation): median and trimmed_mean replace
sum_i p_i Delta_i by an unweighted robust centre of the reconstructed Delta_i, for the messenger step and for c;
Eq. 11, the copies of c_i, the step bound and the finite check are untouched, and mean is today's code bit for bit."""

from dataclasses import replace

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.core import aggregate as agg
from ciders.core import consensus as cs
from ciders.core.tensors import equal
from synthetic import SIZES, cfg, client_uploads, quad_clients, setup

N = 5
REGISTERED = [1, 2, 3, 4, 5]  # unequal |D_i|: the mean is weighted, the robust aggregates are not
HUGE = 1e6


uploads = client_uploads


def second_round(**kw):
    """The uploads of round 1 (the clients commit round 0's increments on the broadcast), after a plain round 0 with
    the mean: c and every c_i are non-zero, so Eq. 11 has work to do."""
    c = cfg(**kw)
    fns = quad_clients(N)
    server, copies, states, ids = setup(n=N, sizes=REGISTERED)
    ups = uploads(c, server, copies, states, ids, fns)
    server, copies, _ = alg.server_update(cfg(**{k: v for k, v in kw.items() if k == "consensus_update"}), server,
                                          ups, copies, SIZES)
    return c, server, copies, states, ids, uploads(c, server, copies, states, ids, fns)


def deltas(c, server, copies, ups):
    """Eq. 11 for each upload, as the server computes it."""
    gamma = alg.round_schedule(c, server.round, server.total_rounds)[2]
    return [cs.reconstruct(u.dc, copies[u.client_id].c_i, server.c, c.alpha, gamma) for u in ups]


def eta_bar(c, server):
    return sum(alg.round_schedule(c, server.round, server.total_rounds)[0]) / c.local_steps


def attacked(c, server, copies, ups, n_evil=2):
    """The first n_evil clients upload the dc whose Delta_i is +HUGE in every coordinate (accepted: no step bound)."""
    gamma = alg.round_schedule(c, server.round, server.total_rounds)[2]
    out = list(ups)
    for j in range(n_evil):
        cid = ups[j].client_id
        target = torch.full_like(server.c["x"], HUGE)
        dc = c.alpha * (target + (gamma - 1) * copies[cid].c_i["x"] - gamma * server.c["x"])
        out[j] = replace(ups[j], dc={"x": dc})
    return out


def test_mean_is_todays_server_update_bit_for_bit():
    """The default (aggregator mean): sum_i p_i Delta_i through agg.weighted_sum, Eq. 12 for w and c, as before;
    no `aggregator` field in the metrics, so a mean run's metrics.jsonl is unchanged."""
    c, server, copies, _, ids, ups = second_round()
    assert c.aggregator == "mean"
    s2, cp2, m = alg.server_update(c, server, ups, copies, SIZES)
    p = agg.client_weights([SIZES[i] for i in ids])
    d_bar = agg.weighted_sum(deltas(c, server, copies, ups), p)
    w = cs.server_messenger(server.messenger, d_bar, c.tau, c.local_steps, eta_bar(c, server))
    assert torch.equal(s2.messenger["x"], w["x"])
    assert torch.equal(s2.c["x"], cs.server_consensus(server.c, d_bar, c.alpha)["x"])
    assert "aggregator" not in m and m["accepted"] == ids
    assert set(m) == {"round", "gamma", "accepted", "rejected", "p", "delta_bar_norm", "c_norm"}


def to32(server, copies, ups):
    f = lambda d: {k: v.float() for k, v in d.items()}  # noqa: E731
    return (replace(server, messenger=f(server.messenger), c=f(server.c)),
            {i: replace(cp, c_i=f(cp.c_i)) for i, cp in copies.items()}, [replace(u, dc=f(u.dc)) for u in ups])


def test_mean_is_todays_server_update_bit_for_bit_in_float32():
    """A float32 messenger: Delta-bar is still summed in float32 by agg.weighted_sum, in client order (summing in
    float64 instead would change the last bits, and with them every mean run's numbers)."""
    c, server, copies, _, ids, ups = second_round()
    server, copies, ups = to32(server, copies, ups)
    s2, _, m = alg.server_update(c, server, ups, copies, SIZES)
    d_bar = agg.weighted_sum(deltas(c, server, copies, ups), agg.client_weights([SIZES[i] for i in ids]))
    w = cs.server_messenger(server.messenger, d_bar, c.tau, c.local_steps, eta_bar(c, server))
    assert m["accepted"] == ids and s2.messenger["x"].dtype == torch.float32
    assert torch.equal(s2.messenger["x"], w["x"]) and torch.equal(s2.c["x"], cs.server_consensus(server.c, d_bar,
                                                                                                  c.alpha)["x"])


@pytest.mark.parametrize("how", [dict(aggregator="median"), dict(aggregator="trimmed_mean", trim_fraction=0.2),
                                 dict(aggregator="trimmed_mean", trim_fraction=0.4)], ids=lambda d: str(d))
def test_robust_aggregate_drives_messenger_and_c_copies_unchanged(how):
    """Eq. 12 with Delta-bar = the robust centre (unweighted) for both w and c; each client's copy of c_i moves by
    its own dc_i exactly as under mean; the aggregator is recorded."""
    c, server, copies, _, ids, ups = second_round(**how)
    s2, cp2, m = alg.server_update(c, server, ups, copies, SIZES)
    ds = deltas(c, server, copies, ups)
    d_bar = agg.coordinate_median(ds) if c.aggregator == "median" else agg.trimmed_mean(ds, c.trim_fraction)
    w = cs.server_messenger(server.messenger, d_bar, c.tau, c.local_steps, eta_bar(c, server))
    assert torch.equal(s2.messenger["x"], w["x"])
    assert torch.equal(s2.c["x"], cs.server_consensus(server.c, d_bar, c.alpha)["x"])
    mean_bar = agg.weighted_sum(ds, agg.client_weights([SIZES[i] for i in ids]))
    assert float((d_bar["x"] - mean_bar["x"]).abs().max()) > 1e-6  # it is not the weighted mean
    assert m["aggregator"] == c.aggregator and m["accepted"] == ids
    _, cp_mean, _ = alg.server_update(replace(c, aggregator="mean"), server, ups, copies, SIZES)
    assert all(equal(cp2[i].c_i, cp_mean[i].c_i) and cp2[i].version == cp_mean[i].version for i in ids)


def test_scaffold_c_keeps_its_own_rule_under_a_robust_aggregator():
    c, server, copies, _, ids, ups = second_round(aggregator="median", consensus_update="scaffold")
    s2, _, _ = alg.server_update(c, server, ups, copies, SIZES)
    assert torch.equal(s2.c["x"], cs.scaffold_consensus(server.c, [u.dc for u in ups], len(SIZES))["x"])
    d_bar = agg.coordinate_median(deltas(c, server, copies, ups))
    w = cs.server_messenger(server.messenger, d_bar, c.tau, c.local_steps, eta_bar(c, server))
    assert torch.equal(s2.messenger["x"], w["x"])


@pytest.mark.parametrize("how", [dict(aggregator="median"), dict(aggregator="trimmed_mean", trim_fraction=0.4)],
                         ids=["median", "trimmed_mean-0.4"])
def test_two_of_five_huge_updates_drag_the_mean_not_the_robust_centre(how):
    """Two of five clients send Delta_i = 1e6 (accepted: max_step_ratio None). The mean's Delta-bar is dragged to
    ~1e5 and beyond; the median (and the mean after cutting 2 from each end) stays within the honest clients' range
    in every coordinate, for the messenger and for c."""
    c, server, copies, _, ids, ups = second_round(**how)
    evil = attacked(c, server, copies, ups)
    honest = torch.stack([d["x"] for d in deltas(c, server, copies, ups[2:])])
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    step = c.tau * c.local_steps * eta_bar(c, server)
    s_mean, _, m_mean = alg.server_update(replace(c, aggregator="mean"), server, evil, copies, SIZES,
                                          max_step_ratio=None)
    s_rob, _, m_rob = alg.server_update(c, server, evil, copies, SIZES, max_step_ratio=None)
    assert m_mean["accepted"] == ids and m_rob["accepted"] == ids  # the attack is not refused, only out-voted
    assert m_mean["delta_bar_norm"] > 1e5
    mean_bar = (server.messenger["x"] - s_mean.messenger["x"]) / step
    assert float(mean_bar.min()) > 1e5
    rob_bar = (server.messenger["x"] - s_rob.messenger["x"]) / step
    tol = 1e-9 * (1 + float(honest.abs().max()))
    assert bool(((rob_bar >= lo - tol) & (rob_bar <= hi + tol)).all())
    assert m_rob["delta_bar_norm"] <= float(honest.abs().max(dim=0).values.norm()) * (1 + 1e-9)
    c_bar = (s_rob.c["x"] - (1 - c.alpha) * server.c["x"]) / c.alpha
    assert bool(((c_bar >= lo - 1e-6) & (c_bar <= hi + 1e-6)).all())


def test_trimming_too_little_does_not_protect():
    """trim_fraction 0.2 cuts int(0.2 * 5) = 1 client from each end: one of the two attackers stays in."""
    c, server, copies, _, ids, ups = second_round(aggregator="trimmed_mean", trim_fraction=0.2)
    _, _, m = alg.server_update(c, server, attacked(c, server, copies, ups), copies, SIZES, max_step_ratio=None)
    assert m["delta_bar_norm"] > 1e5


def test_the_step_bound_and_finite_check_still_apply_under_median():
    c, server, copies, _, ids, ups = second_round(aggregator="median")
    s2, cp2, m = alg.server_update(c, server, attacked(c, server, copies, ups), copies, SIZES, max_step_ratio=10.0)
    assert all("exceeds max_step_ratio" in m["rejected"][i] for i in ids[:2]) and m["accepted"] == ids[2:]
    assert all(cp2[i] is copies[i] for i in ids[:2])
    d_bar = agg.coordinate_median(deltas(c, server, copies, ups[2:]))  # the median of the three accepted
    w = cs.server_messenger(server.messenger, d_bar, c.tau, c.local_steps, eta_bar(c, server))
    assert torch.equal(s2.messenger["x"], w["x"])


def test_median_composes_with_a_server_optimizer():
    c, server, copies, _, ids, ups = second_round(aggregator="median", server_optimizer="fedadam")
    s2, _, m = alg.server_update(c, server, ups, copies, SIZES)
    assert s2.opt is not None and s2.opt.step == 1 and m["aggregator"] == "median"
    assert torch.isfinite(s2.messenger["x"]).all()


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.aggregator=median", "federation.secure_aggregation=true"], "secure_aggregation.*aggregator=median"),
    (["algorithm.aggregator=trimmed_mean", "federation.dp.mode=local", "federation.dp.clip=1.0"],
     "federation.dp.*aggregator=trimmed_mean"),
    (["algorithm.aggregator=trimmed_mean", "algorithm.trim_fraction=0.5"], "trim_fraction"),
    (["algorithm.aggregator=krum"], "aggregator"),
])
def test_config_refuses_what_a_robust_aggregator_cannot_do(overrides, match):
    from ciders.config import load_config
    from ciders.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_robust_configs_load():
    from ciders.config import load_config

    a = load_config(None, ["algorithm.aggregator=trimmed_mean", "algorithm.trim_fraction=0.34"]).algorithm
    assert (a.aggregator, a.trim_fraction) == ("trimmed_mean", 0.34)
    assert load_config(None, []).algorithm.aggregator == "mean"
