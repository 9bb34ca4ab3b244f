"""`ciders bilevel`: RABO, RAFBO and FedMBO on the real few-shot and loss-tuning data, one table."""

import json

import pytest

from ciders.cli import main
from conftest import ROOT
from helpers import shared


@pytest.mark.full_data
def test_fewshot_and_losstune_tables(tmp_path, capsys):
    shared("omniglot", "images_background_small1.zip")
    shared("cifar10", "cifar10_test.zip")
    fs = ["--set", "federation.clients=3", "--set", "federation.rounds=1", "--set", "task.eval_episodes=3",
          "--set", "task.width=8", "--set", "rabo.inner_steps=2", "--set", "rabo.solver_iters=2"]
    assert main(["bilevel", str(ROOT / "configs/cpu/rabo_fewshot.yaml"), "--out", str(tmp_path / "fs"), *fs]) == 0
    md = (tmp_path / "fs" / "bilevel.md").read_text()
    assert all(f"| {m} |" in md for m in ("rabo", "rafbo", "fedmbo"))
    assert md.splitlines()[2].startswith("| untrained (round 0) | ")  # the initial model heads the table
    res = json.loads((tmp_path / "fs" / "bilevel.json").read_text())
    assert res["rabo"]["bytes_up"] < res["fedmbo"]["bytes_up"] and res["rabo"]["calls"] > 0
    assert 0 <= res["rabo"]["final"]["official_runs_accuracy"] <= 1  # the 20 official 20-way one-shot runs
    assert "| fedmbo | " in md and "| 3 | 1.000 |" in md  # FedMBO: every client trains all of x
    lt = ["--set", "federation.clients=3", "--set", "federation.rounds=1", "--set", "task.n_max=40",
          "--set", "task.imbalance=10", "--set", "task.val_per_class=5", "--methods", "rabo,fedmbo"]
    assert main(["bilevel", str(ROOT / "configs/cpu/rabo_losstune.yaml"), "--out", str(tmp_path / "lt"), *lt]) == 0
    res = json.loads((tmp_path / "lt" / "bilevel.json").read_text())
    assert 0 <= res["rabo"]["final"]["balanced_accuracy"] <= 1 and res["rabo"]["final"]["test_examples"] == 9950


@pytest.mark.parametrize("args,err", [
    (["--set", "task.shots=2"], "unknown key 'shots' under 'task'"),
    (["--set", "rabo.mask_target=both"], "mask_target: y"),
    (["--methods", "rabo,fednest"], "unknown bilevel method 'fednest'"),
    (["--set", "task.rotations=5"], "task.rotations: must be 1, 2, 3 or 4"),
    (["--set", "federation.eval_rounds=2", "--seeds", "0", "--last-rounds", "3"],
     "set federation.eval_rounds >= 3"),
    (["--set", "rabo.segments=[0,-1]"], "rabo.segments: each must be an integer >= 0"),
    (["--set", "federation.checkpoint_keep=0"], "federation.checkpoint_keep: must be >= 1"),
])
def test_bilevel_config_errors(tmp_path, capsys, args, err):
    assert main(["bilevel", str(ROOT / "configs/cpu/rabo_losstune.yaml"), "--out", str(tmp_path), *args]) == 2
    assert err in capsys.readouterr().err


@pytest.mark.full_data
def test_bilevel_device_is_resolved_and_checked(tmp_path, capsys):
    """`device: auto` resolves here to the CPU; a CUDA device on a machine without one is a clear error."""
    import torch

    from ciders.config import load_config
    from ciders.config.bilevel import BilevelExperiment
    from ciders.workloads.bilevel import build

    shared("cifar10", "cifar10_test.zip")
    cfg = ROOT / "configs/cpu/rabo_losstune.yaml"
    small = ["federation.clients=2", "task.n_max=20", "task.imbalance=10", "task.val_per_class=5"]
    task = build(load_config(cfg, small, cls=BilevelExperiment))
    want = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert task.device.type == want and all(v.device.type == want for st in task.initial() for v in st.values())
    if not torch.cuda.is_available():
        assert main(["bilevel", str(cfg), "--out", str(tmp_path), "--set", "device=cuda:0",
                     *[x for kv in small for x in ("--set", kv)]]) == 2
        assert "device: 'cuda:0' requested but CUDA is not available" in capsys.readouterr().err


@pytest.mark.full_data
def test_paper_scale_fewshot_config_runs_a_tiny_round_on_cpu(tmp_path):
    """configs/paper/rabo_table2.yaml (ResNet12, overlapping shards) end to end at width 4, one round:
    RABO, the OAP baseline and Dist-MAML."""
    shared("omniglot", "images_background_small1.zip")
    tiny = ["federation.clients=3", "federation.rounds=1", "task.width=4", "task.eval_episodes=3", "task.eval_steps=3",
            "rabo.inner_steps=1", "rabo.solver_iters=2", "fedmeta.local_steps=1", "task.q_query=2", "device=cpu"]
    args = [x for kv in tiny for x in ("--set", kv)]
    assert main(["bilevel", str(ROOT / "configs/paper/rabo_table2.yaml"), "--out", str(tmp_path), "--methods",
                 "rabo,oap,dist-maml", *args]) == 0
    res = json.loads((tmp_path / "bilevel.json").read_text())
    assert all(0 <= r["final"]["accuracy"] <= 1 and r["calls"] > 0 for r in res.values())
    assert res["rabo"]["bytes_up"] < res["dist-maml"]["bytes_up"]


@pytest.mark.full_data
def test_compare_and_grid_tables_over_seeds(tmp_path, capsys):
    """`ciders compare` on a bilevel config is the methods x seeds table; `ciders bilevel --grid` adds one
    column per point; finished runs are reused."""
    shared("cifar10", "cifar10_test.zip")
    cfg = str(ROOT / "configs/cpu/rabo_losstune.yaml")
    small = [x for kv in ["federation.clients=2", "federation.rounds=1", "task.n_max=20", "task.imbalance=10",
                          "task.val_per_class=5"] for x in ("--set", kv)]
    assert main(["compare", cfg, "--out", str(tmp_path / "c"), "--algorithms", "rabo,fedmbo,fedavg-notune", "--seeds", "0,1",
                 *small]) == 0
    res = json.loads((tmp_path / "c" / "table.json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert res["seeds"] == [0, 1] and len(rows["rabo"]["points"]["default"]["seeds"]) == 2
    assert rows["fedmbo"]["relative_to_fedmbo"]["bytes_up"] == 1.0 and rows["rabo"]["relative_to_fedmbo"]["bytes_up"] < 1
    runs = sorted(p.parent.name for p in (tmp_path / "c").glob("default/seed*/*/summary.json"))
    assert runs == ["fedavg-notune", "fedavg-notune", "fedmbo", "fedmbo", "rabo", "rabo"]
    assert main(["bilevel", cfg, "--out", str(tmp_path / "c"), "--methods", "rabo,fedmbo,fedavg-notune", "--seeds", "0,1",
                 *small]) == 0
    assert "running nothing (reused)" in capsys.readouterr().out
    assert main(["bilevel", cfg, "--out", str(tmp_path / "g"), "--methods", "rabo,fedmbo", "--grid",
                 "task.imbalance=10,50", *small]) == 0
    md = (tmp_path / "g" / "table.md").read_text()
    assert "| task.imbalance=10 | task.imbalance=50 |" in md and "| fedmbo |" in md
