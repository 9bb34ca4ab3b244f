"""Client-level DP in runs (federation.dp): no noise and no clipping is the plain run bit for bit, clipping bounds
every client's Delta_i, the noise added has the standard deviation the accountant's noise multiplier implies,
and epsilon(delta) is recorded per round."""

import math

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.config import load_config
from ciders.core import privacy
from ciders.errors import ConfigError
from ciders.federation import dp
from ciders.federation.loop import RunDir
from ciders.federation.ciders_loop import run_federation
from ciders.fileio import read_jsonl
from synthetic import VectorTask

BASE = ["federation.clients=6", "federation.rounds=3", "federation.per_round=4", "algorithm.local_steps=3",
        "algorithm.optimizer=sgd", "algorithm.lr=0.05", "algorithm.gamma=0.3", "algorithm.alpha=0.2",
        "algorithm.tau=0.5", "algorithm.weighting=uniform"]


class WideTask(VectorTask):
    """VectorTask with a diagonal Hessian, so a messenger of tens of thousands of coordinates stays cheap (the
    noise tests estimate a standard deviation from it)."""

    def _client(self, cid):
        if cid not in self._params:
            from ciders.runtime import derive_seed

            g = torch.Generator().manual_seed(derive_seed(self.seed, "synthetic-client", self.ids.index(cid)))
            h = 0.5 + torch.rand(self.dim, generator=g, dtype=torch.float64)
            self._params[cid] = (h, torch.randn(self.dim, generator=g, dtype=torch.float64))
        return self._params[cid]

    def loss(self, cid, x):
        h, b = self._client(cid)
        return 0.5 * ((x - b) ** 2 * h).sum()


def run(out, *extra, task=None):
    cfg = load_config(None, BASE + list(extra))
    return run_federation(cfg, task or VectorTask(6), out, progress=False, log=lambda s: None)


def state(out, t=None):
    rd = RunDir(out)
    return rd.load_checkpoint(rd.committed() if t is None else t)[0]


def rows(out, event):
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == event]


@pytest.mark.parametrize("mode", ["central", "local"])
def test_no_noise_and_no_clipping_is_the_plain_run_bit_for_bit(tmp_path, mode):
    run(tmp_path / "plain")
    run(tmp_path / "dp", f"federation.dp.mode={mode}")
    a, b = state(tmp_path / "plain"), state(tmp_path / "dp")
    assert all(torch.equal(a[k], b[k]) for k in a)
    s = rows(tmp_path / "dp", "server")
    assert all(r["dp_epsilon"] is None and r["dp_noise_multiplier"] == 0 for r in s)  # no noise: no guarantee


def test_clipping_bounds_every_update_and_the_mean(tmp_path):
    clip = 0.05
    run(tmp_path / "c", "federation.dp.mode=central", f"federation.dp.clip={clip}", "federation.max_step_ratio=null")
    clients = rows(tmp_path / "c", "client")
    assert clients and all(r["clipped"] for r in clients) and all(r["delta_norm"] <= clip * (1 + 1e-9) for r in clients)
    assert all(r["delta_bar_norm"] <= clip * (1 + 1e-9) for r in rows(tmp_path / "c", "server"))
    run(tmp_path / "p")
    assert max(r["delta_norm"] for r in rows(tmp_path / "p", "client")) > 5 * clip  # the bound was binding


def test_the_central_noise_has_the_std_the_accountant_asks_for(tmp_path):
    """target_epsilon -> the accountant's z; round 0 of the noised run minus the noiseless one, on a 40,000-
    dimensional messenger, is tau K eta_bar N(0, (z C / m)^2): its std matches to 2%."""
    task = lambda: WideTask(6, dim=20000)  # noqa: E731
    clip, eps = 0.5, 4.0
    common = ["federation.dp.mode=central", f"federation.dp.clip={clip}", "federation.dp.delta=1e-5",
              "algorithm.gamma=0.0", "federation.max_step_ratio=null", "federation.checkpoint_keep=9"]
    run(tmp_path / "quiet", *common, task=task())
    run(tmp_path / "noisy", *common, f"federation.dp.target_epsilon={eps}", task=task())
    cfg = load_config(None, BASE + common + [f"federation.dp.target_epsilon={eps}"])
    z = privacy.noise_for_epsilon(eps, 1e-5, 4 / 6, 3, "central")
    assert dp.noise_multiplier(cfg) == z
    s = rows(tmp_path / "noisy", "server")
    assert [r["dp_noise_multiplier"] for r in s] == [z] * 3
    eps_path = [r["dp_epsilon"] for r in s]
    assert eps_path == sorted(eps_path) and 0.99 * eps <= eps_path[-1] <= eps  # spent after the last round
    assert eps_path[0] == pytest.approx(privacy.central_epsilon(z, 4 / 6, 1, 1e-5))
    a, b = state(tmp_path / "quiet", 0)["messenger/x"], state(tmp_path / "noisy", 0)["messenger/x"]
    lrs, _, _ = alg.round_schedule(cfg.algorithm, 0, 3)
    step = cfg.algorithm.tau * sum(lrs)  # tau K eta_bar
    noise = (b - a) / step
    assert noise.mean().abs().item() < 4 * z * clip / 4 / math.sqrt(noise.numel())
    assert noise.std().item() == pytest.approx(z * clip / 4, rel=0.02)  # m = 4 clients per round


def test_the_local_noise_has_std_z_times_clip_and_its_records_are_private(tmp_path):
    cfg = load_config(None, BASE + ["federation.dp.mode=local", "federation.dp.clip=0.2",
                                    "federation.dp.noise_multiplier=1.5"])
    task = WideTask(6, dim=20000)
    cid = task.ids[0]
    w = task.initial_messenger()
    b = alg.make_broadcast(cfg.algorithm, alg.init_server(w, 3), alg.init_copy(w))
    batches = task.batches(cid, 0, 3, 0)
    quiet, _, _ = alg.client_update(cfg.algorithm, b, alg.init_client(cid, w), task.loss_fn(cid), batches,
                                    alg.Privacy(clip=0.2))
    loud, _, rec = alg.client_update(cfg.algorithm, b, alg.init_client(cid, w), task.loss_fn(cid), batches,
                                     dp.client_privacy(cfg, 0, cid))
    noise = loud.delta["x"] - quiet.delta["x"]
    assert noise.std().item() == pytest.approx(1.5 * 0.2, rel=0.02)
    assert torch.allclose(loud.dc["x"] - quiet.dc["x"], cfg.algorithm.alpha * noise)  # dc follows the noisy Delta
    # in a run: no norm leaves the client, no personalized messenger is asked for, epsilon is one client's
    run(tmp_path / "l", "federation.dp.mode=local", "federation.dp.clip=0.2", "federation.dp.noise_multiplier=1.5")
    for r in rows(tmp_path / "l", "client"):
        assert not {"dc_norm", "delta_norm", "c_i_norm", "clipped", "e_rae"} & set(r)
    s = rows(tmp_path / "l", "server")
    assert s[-1]["dp_epsilon"] == pytest.approx(privacy.local_epsilon(1.5, 3, 1e-5))
    assert all("personalized" not in json_keys for json_keys in (r.keys() for r in rows(tmp_path / "l", "eval")))


def test_seeded_noise_reproduces_and_secret_noise_does_not(tmp_path):
    common = ["federation.dp.mode=central", "federation.dp.clip=0.5", "federation.dp.noise_multiplier=1.0"]
    run(tmp_path / "a", *common)
    run(tmp_path / "b", *common)
    run(tmp_path / "c", *common, "federation.dp.noise=secret")
    a, b, c = (state(tmp_path / x)["messenger/x"] for x in "abc")
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_central_dp_with_secure_aggregation(tmp_path):
    common = ["federation.dp.mode=central", "federation.dp.clip=0.5", "federation.dp.noise_multiplier=1.0"]
    run(tmp_path / "plain", *common)
    run(tmp_path / "sec", *common, "federation.secure_aggregation=true")
    a, b = state(tmp_path / "plain"), state(tmp_path / "sec")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-9  # the same noise on the same (secure) sum
    assert [r["dp_epsilon"] for r in rows(tmp_path / "sec", "server")] == \
        [r["dp_epsilon"] for r in rows(tmp_path / "plain", "server")]


@pytest.mark.parametrize("extra, match", [
    (["federation.dp.mode=central", "algorithm.weighting=size"], "weighting=uniform"),
    (["federation.dp.clip=1.0"], "mode is none"),
    (["federation.dp.mode=central", "federation.dp.noise_multiplier=1.0"], "clip must be set"),
    (["federation.dp.mode=local", "federation.dp.clip=1", "federation.dp.noise_multiplier=1",
      "federation.dp.target_epsilon=3"], "not both"),
    (["federation.dp.mode=central", "algorithm.aggregator=median"], "mean of clipped"),
    (["federation.dp.mode=local", "algorithm.upload_personalized_messenger=true"], "without noise"),
])
def test_dp_settings_that_break_the_guarantee_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, BASE + extra)
