"""Server optimizers (`ciders.core.server_opt`, docs/method.md#server-optimizers) against Flower 1.42's own strategies:
FedAvgM, FedAdam and FedYogi of `flwr.serverapp.strategy` run their real `aggregate_train` on reply Messages
(ArrayRecord + MetricRecord "num-examples"), so Flower's FedAvg averaging, pseudo-gradient, moments and step are all
theirs. Only `configure_train` is skipped (it needs a Grid of connected nodes): the tests set `current_arrays`
to what it would record, the arrays the round was broadcast with. Our update gets d = (Flower's FedAvg aggregate of
the same replies) - w, the plain step of the round."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ciders.config import CidersConfig, load_config
from ciders.config.base import field_choices
from ciders.core import server_opt as so
from ciders.errors import ConfigError

ROUNDS = 3
WEIGHTS = (3, 1, 2)  # num-examples of the three replies (p_i = 1/2, 1/6, 1/3)


def flwr() -> SimpleNamespace:
    """Flower's records, strategies and FedAvg averaging (a test that needs them skips without the flower extra)."""
    app = pytest.importorskip("flwr.app")
    strategy = pytest.importorskip("flwr.serverapp.strategy")
    from flwr.common import Metadata
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    return SimpleNamespace(app=app, strategy=strategy, Metadata=Metadata, fedavg=aggregate_arrayrecords)


def arrays(d: dict):
    app = flwr().app
    return app.ArrayRecord({k: app.Array(v) for k, v in d.items()})


def reply(arr: dict, n: int, node: int):
    """A train reply as a ServerApp receives it (explicit metadata: no SuperLink / run context needed)."""
    f = flwr()
    content = f.app.RecordDict({"arrays": arrays(arr), "metrics": f.app.MetricRecord({"num-examples": n})})
    md = f.Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="i",
                    group_id="1", created_at=0.0, ttl=3600.0, message_type="train")
    return f.app.Message(content=content, metadata=md)


def client_models(rnd: int, w: dict, dtype) -> list[dict]:
    """Three clients' models around the broadcast w: a shared drift plus client noise, different in every round."""
    g = np.random.default_rng(100 + rnd)
    drift = {k: g.normal(0.0, 0.05, v.shape) for k, v in w.items()}
    return [{k: (w[k] + drift[k] + g.normal(0.0, 0.03, w[k].shape)).astype(dtype) for k in w} for _ in WEIGHTS]


def flower_strategy(name: str, opt: so.ServerOpt):
    st = flwr().strategy
    if name == "fedavgm":
        return st.FedAvgM(server_learning_rate=opt.lr, server_momentum=opt.momentum)
    cls = {"fedadam": st.FedAdam, "fedyogi": st.FedYogi}[name]
    return cls(eta=opt.lr, beta_1=opt.beta1, beta_2=opt.beta2, tau=opt.tau)


def run_both(opt: so.ServerOpt, dtype=np.float64, rounds=ROUNDS):
    """ROUNDS rounds of Flower's strategy and of ours from the same w0 and the same replies; returns the weights of
    both after every round and the final server optimizer state."""
    g = np.random.default_rng(7)
    w0 = {"lora_A": g.normal(0, 0.5, (4, 3)).astype(dtype), "lora_B": g.normal(0, 0.5, (5,)).astype(dtype)}
    strat = flower_strategy(opt.name, opt)
    if opt.name == "fedavgm":  # FedAvgM.configure_train records the arrays once, then keeps its own
        strat.current_arrays = arrays(w0)
    fl, ours, state = dict(w0), {k: torch.from_numpy(v.copy()) for k, v in w0.items()}, None
    out = []
    for r in range(rounds):
        models = client_models(r, fl, dtype)
        replies = [reply(m, n, i + 1) for i, (m, n) in enumerate(zip(models, WEIGHTS))]
        if opt.name != "fedavgm":  # FedOpt.configure_train records the broadcast arrays every round
            strat.current_arrays = {k: v.copy() for k, v in fl.items()}
        new, _ = strat.aggregate_train(r + 1, replies)  # Flower's server_round counts from 1
        fl = {k: a.numpy().astype(dtype) for k, a in new.items()}  # the next broadcast, in the model's dtype
        plain = flwr().fedavg([m.content for m in replies], "num-examples")  # FedAvg of the same replies
        d = {k: torch.from_numpy(a.numpy()) - ours[k] for k, a in plain.items()}
        ours, state = so.update(opt, ours, d, state)
        out.append((fl, {k: v.numpy() for k, v in ours.items()}))
    return out, state


def max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)


CASES = [so.ServerOpt("fedavgm", 1.0, momentum=0.9), so.ServerOpt("fedavgm", 0.7, momentum=0.5),
         so.ServerOpt("fedadam", 0.1), so.ServerOpt("fedadam", 0.05, beta1=0.8, beta2=0.9, tau=1e-2),
         so.ServerOpt("fedyogi", 0.01), so.ServerOpt("fedyogi", 0.1, beta1=0.5, beta2=0.95, tau=1e-4)]


@pytest.mark.parametrize("opt", CASES, ids=lambda o: f"{o.name}-lr{o.lr}")
def test_same_weights_as_flower_over_three_rounds(opt):
    out, state = run_both(opt)
    assert state.step == ROUNDS
    moved = max_diff(out[-1][0], out[0][0])
    assert moved > 1e-3  # the optimizer did move the weights, round after round
    for fl, ours in out:
        assert max_diff(fl, ours) < 1e-12


@pytest.mark.parametrize("opt", CASES[::2], ids=lambda o: o.name)
def test_same_weights_as_flower_in_float32(opt):
    """A float32 messenger: our moments stay float32, Flower's FedAdam computes its step in float64 (its bias
    corrected rate is an np.float64); to ~1e-6 all the same."""
    out, state = run_both(opt, np.float32)
    assert all(t.dtype == torch.float32 for t in state.m.values())
    for fl, ours in out:
        assert ours["lora_A"].dtype == np.float32 and max_diff(fl, ours) < 1e-6


def test_fedavgm_without_momentum_at_rate_one_is_the_plain_step_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        w = {"a": torch.randn(7, 3, generator=g, dtype=dtype), "b": torch.randn(4, generator=g, dtype=dtype)}
        state = None
        for _ in range(3):
            d = {k: torch.randn(v.shape, generator=g, dtype=dtype) * 1e-3 for k, v in w.items()}
            plain = {k: w[k] * 1.0 + d[k] for k in w}  # how core.tensors.lincomb (Eq. 12) adds the step
            w, state = so.update(so.ServerOpt("fedavgm", 1.0, momentum=0.0), w, d, state)
            assert all(torch.equal(w[k], plain[k]) and w[k].dtype == dtype for k in w)


def test_first_steps_by_hand():
    """Round 1 from zero moments: FedAdam's step is lr sqrt(1 - b2^2) / (1 - b1^2) (1 - b1) d / (sqrt(1 - b2) |d| +
    eps) (Flower's exponent server_round + 1 = 2); FedYogi's v is (1 - b2) d^2 as Adam's, without the correction."""
    w, d = {"x": torch.tensor([1.0, -2.0], dtype=torch.float64)}, {"x": torch.tensor([0.5, -0.25], dtype=torch.float64)}
    b1, b2, eps = 0.9, 0.99, 1e-3
    core = (1 - b1) * d["x"] / ((1 - b2) ** 0.5 * d["x"].abs() + eps)
    adam, st = so.update(so.ServerOpt("fedadam", 0.1), w, d, None)
    assert torch.allclose(adam["x"], w["x"] + 0.1 * (1 - b2**2) ** 0.5 / (1 - b1**2) * core, rtol=1e-14)
    yogi, sy = so.update(so.ServerOpt("fedyogi", 0.01), w, d, None)
    assert torch.allclose(yogi["x"], w["x"] + 0.01 * core, rtol=1e-14)
    assert torch.allclose(sy.v["x"], (1 - b2) * d["x"] ** 2, rtol=1e-14) and st.step == sy.step == 1
    # a step opposite to the last one: yogi's v grows additively, adam's multiplicatively
    _, sy2 = so.update(so.ServerOpt("fedyogi", 0.01), yogi, {"x": -4 * d["x"]}, sy)
    v, d2 = sy.v["x"], 16 * d["x"] ** 2
    assert torch.allclose(sy2.v["x"], v - (1 - b2) * d2 * torch.sign(v - d2), rtol=1e-14)


def test_state_round_trips_through_a_checkpoint_record(tmp_path):
    from safetensors.torch import load_file, save_file

    w = {"a": torch.randn(3, 2), "b": torch.randn(5)}
    for name in ("fedavgm", "fedadam", "fedyogi"):
        _, st = so.update(so.ServerOpt(name, 0.1), w, {k: v * 0.01 for k, v in w.items()}, None)
        tensors, meta = st.to_record()
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        back = so.ServerOptState.from_record(load_file(str(tmp_path / f"{name}.safetensors")),
                                             json.loads(json.dumps(meta)))
        assert back == st and back.equal(st) and back.step == 1 and back.name == name
        assert bool(back.v) == (name != "fedavgm")
        other = so.ServerOptState(name, 2, st.m, st.v)
        assert back != other
    assert so.ServerOptState.from_record({}, {}) is None  # a record written before server optimizers


def test_a_state_of_another_optimizer_is_refused():
    w = {"x": torch.ones(2)}
    _, st = so.update(so.ServerOpt("fedadam", 0.1), w, {"x": torch.ones(2)}, None)
    with pytest.raises(ConfigError, match="algorithm.server_optimizer: the server state holds fedadam"):
        so.update(so.ServerOpt("fedyogi", 0.1), w, {"x": torch.ones(2)}, st)
    with pytest.raises(ValueError, match="second moment"):
        so.ServerOptState("fedadam", 1, st.m, {})


def test_from_config_uses_flower_default_rates():
    assert so.from_config(CidersConfig()) is None
    for name, lr in so.DEFAULT_LR.items():
        assert so.from_config(CidersConfig(server_optimizer=name)).lr == lr
    o = so.from_config(CidersConfig(server_optimizer="fedyogi", server_lr=0.3, server_beta1=0.5, server_beta2=0.9,
                                    server_tau=1e-4))
    assert (o.lr, o.beta1, o.beta2, o.tau) == (0.3, 0.5, 0.9, 1e-4)
    assert field_choices(CidersConfig, "server_optimizer") == so.NAMES


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.server_optimizer=adam"], r"algorithm.server_optimizer: must be one of none, fedavgm, fedadam, "
                                          r"fedyogi, got 'adam'"),
    (["algorithm.server_optimizer=fedadam", "algorithm.server_lr=0"], r"algorithm.server_lr: must be > 0 or null"),
    (["algorithm.server_lr=0.1"], r"algorithm.server_lr: only a server optimizer reads it; set "
                                  r"algorithm.server_optimizer"),
    (["algorithm.server_optimizer=fedavgm", "algorithm.server_momentum=1"], r"algorithm.server_momentum: must be in "
                                                                            r"\[0, 1\)"),
    (["algorithm.server_momentum=-0.1"], r"algorithm.server_momentum: must be in \[0, 1\)"),
    (["algorithm.server_beta1=1.0"], r"algorithm.server_beta1: must be in \[0, 1\)"),
    (["algorithm.server_beta2=1.5"], r"algorithm.server_beta2: must be in \[0, 1\)"),
    (["algorithm.server_tau=0"], r"algorithm.server_tau: must be > 0"),
    (["algorithm.server_tau=.nan"], r"algorithm.server_tau: must be a finite number"),
])
def test_config_validation_names_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_good_server_optimizer_configs_load():
    cfg = load_config(None, ["algorithm.server_optimizer=fedyogi", "algorithm.server_lr=0.02",
                             "algorithm.server_beta2=0", "algorithm.server_tau=1e-5"])
    a = cfg.algorithm
    assert (a.server_optimizer, a.server_lr, a.server_beta2, a.server_tau) == ("fedyogi", 0.02, 0.0, 1e-5)
    avgm = load_config(None, ["algorithm.server_optimizer=fedavgm", "algorithm.server_momentum=0"]).algorithm
    assert avgm.server_lr is None and avgm.server_momentum == 0.0
