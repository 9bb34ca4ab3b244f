"""task.episodes (the paper's N_m): each client draws that many episodes per round; one episode is exactly the
episode drawn before the option existed; the inner / local steps cycle through them, the outer loss averages over
them, and with rabo.head: episode each episode gets its own head and hypergradient, averaged."""

from dataclasses import replace

import torch

from ciders.algorithms import rabo as rb
from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig
from ciders.core import submodel as sm
from ciders.core.wire import decode
from ciders.federation.bilevel_client import client_phase
from ciders.federation.bilevel_rounds import BilevelServer
from ciders.runtime import derive_seed
from ciders.tasks import omniglot as om
from ciders.workloads.bilevel import FewShotTask
from helpers import vendored


def task_with(episodes, seed=0):
    pool = om.load_characters(vendored("omniglot-slice", "images_background_small1.zip"))  # 24 characters
    return FewShotTask(pool, [1.0, 0.5], n_way=3, k_shot=1, q_query=2, width=4, seed=seed, eval_episodes=2,
                       episodes=episodes)


def test_one_episode_is_the_episode_drawn_before_the_option():
    t = task_with(1)
    gen = torch.Generator().manual_seed(derive_seed(0, "bilevel-episodes", 3, 1))
    want = om.episode(t.pool, t.shards[1], 3, 1, 2, gen)
    b = t.batches(1, 3, 4)
    assert all(e is b[0] for e in b) and t.outer_batch(1, 3) is b[0]
    assert torch.equal(b[0].support, want.support) and torch.equal(b[0].query_labels, want.query_labels)


def test_several_episodes_cycle_in_the_steps_and_average_in_the_outer_loss():
    t = task_with(3)
    eps = t.round_episodes(0, 2)
    assert len(eps) == 3 and not torch.equal(eps[0].support, eps[1].support)
    assert [id(e) for e in t.batches(0, 2, 5)] == [id(eps[j]) for j in (0, 1, 2, 0, 1)]
    x, y = t.initial()
    y = {k: torch.randn_like(v) for k, v in y.items()}
    assert t.outer_batch(0, 2) == eps
    assert torch.allclose(t.f(x, y, eps), sum(t.f(x, y, e) for e in eps) / 3)
    assert torch.allclose(t.g(x, y, eps), sum(t.g(x, y, e) for e in eps) / 3)


def test_one_head_per_episode_averages_the_hypergradients_of_the_rounds_episodes():
    t = task_with(2)
    exp = BilevelExperiment(federation=BilevelFederationConfig(clients=2, capacities=(1.0, 0.5), rounds=1))
    exp = replace(exp, rabo=replace(exp.rabo, head="episode", inner_steps=3, beta=0.5, solver_iters=3))
    server = BilevelServer(exp, t, log=lambda s: None)
    server.begin(0)
    up, rec = client_phase(exp, t, "outer", "client1", server.down("outer", "client1"), {})
    got = sm.scatter(decode(up)[0]["h"], server.masks["client1"].x, server.state.x)
    m = server.masks["client1"]
    (x, mx), (y0, my) = sm.client_view(server.state.x, m.x), sm.client_view(server.state.y, m.y)
    mi = rb.ClientMasks(mx, my, m.capacity)
    hs = []
    for ep in t.round_episodes(1, 0):
        y, _ = rb.episode_head(exp.rabo, x, y0, mi, t.g, [ep] * 3)
        hs.append(rb.outer_update(exp.rabo, rb.BilevelState(0, x, y), mi, t.f, t.g, ep)[0])
    assert not all(torch.allclose(hs[0][k], hs[1][k]) for k in hs[0])  # two episodes, two directions
    want = sm.scatter(sm.gather({k: (hs[0][k] + hs[1][k]) / 2 for k in hs[0]}, mi.x), m.x, server.state.x)
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert type(rec["solver_iters"]) is int  # counts add up over the episodes, so the record stays a count
