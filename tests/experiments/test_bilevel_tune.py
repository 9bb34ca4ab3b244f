"""experiments.bilevel_tune: each method tuned on the tuning split with its own keys, the winner run over the seeds,
the test metric averaged over the last rounds; real long-tailed CIFAR-10, 2 clients, 2 rounds."""

from dataclasses import replace

import pytest

from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig, BilevelTaskConfig
from ciders.errors import ConfigError
from ciders.experiments.bilevel_tune import method_grid, render, run_tuned
from ciders.fileio import read_jsonl


def tiny(data):
    exp = BilevelExperiment(task=BilevelTaskConfig(kind="losstune", data=str(data), width=8, n_max=20, imbalance=10,
                                                   val_per_class=5, tune_per_class=5),
                            federation=BilevelFederationConfig(clients=2, capacities=(1.0, 0.5), rounds=2))
    return replace(exp, rabo=replace(exp.rabo, mask_target="y", inner_steps=2, solver="neumann", solver_iters=2,
                                     neumann_eta=0.1)).validate()


def test_each_method_reads_only_its_own_step_sizes():
    tune = [("rabo.alpha", ["0.05", "0.2"]), ("rabo.beta", ["0.5"]), ("fedmeta.lr", ["0.1", "0.5", "1.0"])]
    assert method_grid("rabo", tune) == tune[:2] and method_grid("fedavg-notune", tune) == tune[2:]


@pytest.mark.full_data
def test_tuning_picks_the_best_tuning_split_score_then_runs_the_seeds(tmp_path):
    from helpers import shared

    exp = tiny(shared("cifar10"))
    tune = [("rabo.alpha", ["0.05", "0.5"]), ("fedmeta.lr", ["0.1", "0.5"])]
    res = run_tuned(exp, ["rabo", "fedavg-notune"], [0, 1], tune, tmp_path, last=2, log=lambda s: None)
    for row in res["rows"]:
        assert row["budget"] == 2 and row["chosen"] == max(row["tune_scores"], key=row["tune_scores"].get)
        m, chosen = row["method"], row["chosen"]
        for point, score in row["tune_scores"].items():  # the score is the tuning split's, over the last 2 rounds
            ev = [r for r in read_jsonl(tmp_path / "tune" / m / point / m / "metrics.jsonl") if r["event"] == "eval"]
            assert score == pytest.approx(100 * sum(e["tune_balanced_accuracy"] for e in ev[-2:]) / 2)
        # seed 0 is the tuning seed: its final run is the tuning run; seed 1 ran at the chosen setting
        assert not (tmp_path / "final" / "seed0" / m).exists()
        finals = []
        for d in (tmp_path / "tune" / m / chosen / m, tmp_path / "final" / "seed1" / m):
            evals = [r for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "eval" and r["round"] >= 0]
            assert "tune_balanced_accuracy" in evals[-1]
            finals.append(100 * sum(e["balanced_accuracy"] for e in evals[-2:]) / 2)
        assert row["test"]["seeds"] == pytest.approx(finals)
    assert "fedmeta.lr=" in (tmp_path / "tune.md").read_text()


@pytest.mark.full_data
def test_the_tuning_split_is_disjoint_and_required(tmp_path):
    from helpers import shared

    from ciders.workloads.bilevel import build

    exp = tiny(shared("cifar10"))
    task = build(exp)
    assert len(task.tune[1]) == 50 and len(task.test[1]) == 10 * (1000 - 5 - 5)
    import torch

    # disjoint: no tuning image is a test or validation image (pooled features, CIFAR has no exact duplicates here)
    for other in (task.test[0], torch.cat([v[0] for v in task.val])):
        assert float(torch.cdist(task.tune[0], other).min()) > 0
    with pytest.raises(ConfigError, match="tuning split"):
        run_tuned(replace(exp, task=replace(exp.task, tune_per_class=0)), ["rabo"], [0], [("rabo.alpha", ["0.1"])],
                  tmp_path)
    with pytest.raises(ConfigError, match="fedmeta"):
        run_tuned(exp, ["fedavg-notune"], [0], [("rabo.alpha", ["0.1"])], tmp_path)
    with pytest.raises(ConfigError, match="tune_per_class"):
        replace(exp.task, tune_per_class=996).validate()


def test_unequal_budgets_are_flagged():
    rows = [{"method": "rabo", "budget": 4, "chosen": "rabo.alpha=0.1", "tune_best": 20.0, "test": {"mean": 19.0, "std": 1.0}},
            {"method": "fedavg-notune", "budget": 2, "chosen": "fedmeta.lr=0.5", "tune_best": 18.0,
             "test": {"mean": 17.0, "std": 0.5}}]
    md = render({"seeds": [0, 1], "tuning_seed": 0, "last_rounds": 3, "rows": rows})
    assert "Unequal budgets** (rabo 4, fedavg-notune 2)" in md and "| rabo | 4 | rabo.alpha=0.1 | 20.00 | 19.00 ± 0.00 [sd 1.00] | - | - | - | - |" in md


def test_contrasts_are_paired_by_seed_and_costs_relative_to_fedmbo():
    from ciders.experiments.bilevel_tune import contrasts, relative_costs

    cost = lambda k: {"op_estimate": k, "seconds": 1.0, "bytes_up": 2 * k, "bytes_down": k}  # noqa: E731
    rows = [{"method": "rabo", "test": {"seeds": [18.0, 20.0, 22.0]}, "costs": [cost(1.0), cost(2.0), cost(1.0)]},
            {"method": "fedmbo", "test": {"seeds": [20.0, 19.0, 24.0]}, "costs": [cost(4.0), cost(4.0), cost(2.0)]},
            {"method": "fedavg-notune", "test": {"seeds": [16.0, 18.0, 20.0]}, "costs": [cost(1.0)] * 3}]
    got = {(c["method"], c["against"]): c for c in contrasts(rows)}
    assert set(got) == {("rabo", "fedavg-notune"), ("fedmbo", "fedavg-notune"), ("rabo", "fedmbo"),
                        ("fedavg-notune", "fedmbo")}
    assert got[("rabo", "fedavg-notune")]["mean"] == 2.0 and got[("rabo", "fedavg-notune")]["ci95"] == 0.0  # paired
    assert got[("rabo", "fedmbo")]["mean"] == pytest.approx(-1.0)
    assert got[("rabo", "fedmbo")]["ci95"] == pytest.approx(4.303)  # diffs -2, 1, -2: sd sqrt(3)
    rel = relative_costs(rows)
    assert rel["rabo"]["op_estimate"] == pytest.approx((0.25 + 0.5 + 0.5) / 3) and rel["fedmbo"]["seconds"] == 1.0
    assert relative_costs(rows[:1]) == {}
