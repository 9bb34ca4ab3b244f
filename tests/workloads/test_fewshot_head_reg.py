"""task.reg_way: the few-shot head's L2 weight scaled by reg_way / n_way, so the (reg/2)|y|^2 term keeps its weight
against the support cross-entropy at every N (docs/rabo.md#the-heads-l2-weight-and-n). On the vendored Omniglot slice."""

import math

import pytest
import torch

from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig, BilevelTaskConfig
from ciders.errors import ConfigError
from ciders.workloads.bilevel import build, head_reg
from helpers import vendored


def task_for(n_way, reg_way):
    t = BilevelTaskConfig(data=str(vendored("omniglot-slice")), n_way=n_way, k_shot=1, q_query=2, width=4,
                          eval_episodes=2, eval_steps=2, reg=0.05, reg_way=reg_way)
    exp = BilevelExperiment(task=t, federation=BilevelFederationConfig(clients=1, capacities=(1.0,), rounds=1))
    return build(exp.validate())


@pytest.mark.parametrize("n_way, reg_way, want", [(5, 0, 0.05), (20, 0, 0.05), (5, 5, 0.05), (20, 5, 0.0125),
                                                  (10, 5, 0.025)])
def test_the_weight_scales_as_reg_way_over_n(n_way, reg_way, want):
    assert math.isclose(head_reg(BilevelTaskConfig(n_way=n_way, reg=0.05, reg_way=reg_way)), want)


def test_the_inner_loss_carries_the_scaled_weight():
    """The L2 part of g is (head_reg / 2)|y|^2: adding a constant to every logit (the bias) leaves the support CE
    unchanged, so g's change is the L2 term's change alone."""
    for reg_way, want in ((0, 0.05), (5, 0.05 * 5 / 10)):
        task = task_for(10, reg_way)
        x, y = task.initial()
        ep = task.batches(0, 0, 1)[0]
        y = {k: torch.randn_like(v) for k, v in y.items()}
        shifted = {k: (v + 1.0 if k.endswith("bias") else v) for k, v in y.items()}  # same softmax, larger norm
        l2 = lambda h: 0.5 * sum((v ** 2).sum() for v in h.values())
        dg = task.g(x, shifted, ep) - task.g(x, y, ep)
        assert math.isclose(float(dg), want * float(l2(shifted) - l2(y)), rel_tol=1e-4), (reg_way, float(dg))


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match="task.reg_way: an integer >= 0"):
        BilevelTaskConfig(reg_way=-1).validate()
    with pytest.raises(ConfigError, match="task.reg_way: an integer >= 0"):
        BilevelTaskConfig(reg_way=2.5).validate()


def test_five_way_is_unchanged_by_the_default():
    """The default (5) leaves every 5-way run exactly as it was before the key existed."""
    assert BilevelTaskConfig().reg_way == 5
    assert head_reg(BilevelTaskConfig(n_way=5, reg=0.05)) == 0.05


def test_the_table_config_pins_the_weight_its_tables_were_measured_with(monkeypatch):
    """configs/cpu/rabo_table2.yaml's Table II, 30-round and matched-steps tables were measured with reg_way 0; without
    the pin its commands would run at the new default and no longer reproduce them."""
    from conftest import ROOT

    from ciders.config import load_experiment

    monkeypatch.setenv("CIDERS_DATA", str(ROOT / "data"))
    cfg = load_experiment(ROOT / "configs/cpu/rabo_table2.yaml", ["task.n_way=20"])
    assert cfg.task.reg_way == 0 and head_reg(cfg.task) == cfg.task.reg
