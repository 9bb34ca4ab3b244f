"""The few-shot task's tuning split (task.tune_alphabets): whole training alphabets leave training, `evaluate`
scores episodes of their characters as `tune_accuracy`, and `ciders bilevel --tune` selects on it, never on the
test characters. The vendored Omniglot slice, its one training alphabet split in two by renaming."""

import zipfile
from dataclasses import replace

import pytest

from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig, BilevelTaskConfig
from ciders.errors import ConfigError
from ciders.experiments.bilevel_tune import run_tuned
from ciders.fileio import read_jsonl
from ciders.tasks import omniglot as om
from ciders.workloads.bilevel import build, tuning_split
from helpers import vendored


@pytest.fixture(scope="module")
def two_alphabets(tmp_path_factory):
    """The slice with its 24 Balinese characters dealt into two alphabets: Balinese (1-12) and Held (13-24)."""
    root = tmp_path_factory.mktemp("omniglot")
    src = vendored("omniglot-slice", "images_background_small1.zip")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(root / "images_background_small1.zip", "w") as zout:
        for name in zin.namelist():
            parts = name.split("/")
            if len(parts) >= 3 and parts[2].startswith("character") and int(parts[2][9:]) > 12:
                parts[1] = "Held"
            zout.writestr("/".join(parts), zin.read(name))
    (root / "images_background_small2.zip").write_bytes(
        vendored("omniglot-slice", "images_background_small2.zip").read_bytes())
    return root


def exp_for(root, **task):
    t = BilevelTaskConfig(data=str(root), n_way=3, k_shot=1, q_query=2, width=4, eval_episodes=3, eval_steps=2, **task)
    exp = BilevelExperiment(task=t, federation=BilevelFederationConfig(clients=2, capacities=(1.0, 0.5), rounds=2))
    return replace(exp, rabo=replace(exp.rabo, inner_steps=1, solver_iters=2)).validate()


def test_tuning_alphabets_leave_training_whole_and_are_checked(two_alphabets):
    pool = om.load_characters(two_alphabets / "images_background_small1.zip")
    train, tune = tuning_split(pool, ("Held",), 5)
    assert len(train) == len(tune) == 12 and not set(train) & set(tune) and {**train, **tune}.keys() == pool.keys()
    assert all(c.startswith("Held/") for c in tune)
    with pytest.raises(ConfigError, match="Nope is not a training alphabet; choose from Balinese, Held"):
        tuning_split(pool, ("Nope",), 5)
    with pytest.raises(ConfigError, match="12 characters, fewer than task.n_way = 20"):
        tuning_split(pool, ("Held",), 20)
    with pytest.raises(ConfigError, match="loss tuning uses task.tune_per_class"):
        BilevelTaskConfig(kind="losstune", tune_alphabets=("Held",)).validate()


def test_the_task_trains_without_them_and_scores_them_apart(two_alphabets, monkeypatch):
    task = build(exp_for(two_alphabets, tune_alphabets=("Held",)))
    assert sorted(task.tune_pool) and all(c.startswith("Held/") for c in task.tune_pool)
    assert not any(c.startswith("Held/") for shard in task.shards for c in shard)  # no client trains on them
    assert not set(task.eval_pool) & set(task.tune_pool)
    seen = []
    real = om.episode
    monkeypatch.setattr(om, "episode", lambda pool, chars, *a: seen.append(set(chars)) or real(pool, chars, *a))
    x, y = task.initial()
    out = task.evaluate(x, y)
    assert 0 <= out["tune_accuracy"] <= 1 and 0 <= out["accuracy"] <= 1
    assert set(task.eval_pool) in seen and set(task.tune_pool) in seen  # test and tuning episodes, each its own
    assert "tune_accuracy" not in build(exp_for(two_alphabets)).evaluate(x, y)


def test_bilevel_tune_selects_few_shot_step_sizes_on_the_tuning_split(two_alphabets, tmp_path):
    exp = exp_for(two_alphabets, tune_alphabets=("Held",))
    tune = [("rabo.alpha", ["0.01", "0.5"]), ("fedmeta.lr", ["0.05"])]
    res = run_tuned(exp, ["rabo", "static"], [0], tune, tmp_path, last=1, log=lambda s: None)
    rabo = next(r for r in res["rows"] if r["method"] == "rabo")
    for point, score in rabo["tune_scores"].items():
        ev = [r for r in read_jsonl(tmp_path / "tune" / "rabo" / point / "rabo" / "metrics.jsonl") if r["event"] == "eval"]
        assert score == pytest.approx(100 * ev[-1]["tune_accuracy"]) and rabo["test"]["seeds"] != [] 
    assert rabo["chosen"] == max(rabo["tune_scores"], key=rabo["tune_scores"].get)
    assert "held-out alphabets" in (tmp_path / "tune.md").read_text()
    with pytest.raises(ConfigError, match="tune_alphabets"):
        run_tuned(exp_for(two_alphabets), ["rabo"], [0], tune, tmp_path / "no")
