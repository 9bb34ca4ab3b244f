"""`ciders compare --tune` on the tiny model: every learning method runs the same grid on the clients' validation
parts (never trained on, disjoint from the test parts), the lowest validation NLL wins, and the final comparison
runs each method with its winner on the same training data."""

import json

from ciders.cli import main
from ciders.config import load_config
from ciders.models.load import load_tokenizer
from ciders.report import tables
from ciders.tasks.federated import tokenize_clients
from ciders.tasks.text import Example
from conftest import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")


def test_tuned_compare_picks_each_methods_best_validation_setting(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["compare", TINY, "--algorithms", "fedavg,fedprox", "--out", str(out), "--tune", "algorithm.lr=1e-3,3e-2",
                 "--tune-rounds", "1", "--set", "federation.rounds=1", "--set", "federation.validation=0.25"]) == 0
    tune = json.loads((out / "tune.json").read_text())
    assert set(tune["methods"]) == {"fedavg", "fedprox"}  # the takd-only control has no client step size
    for m, r in tune["methods"].items():
        assert [s["point"] for s in r["scores"]] == ["algorithm.lr=1e-3", "algorithm.lr=3e-2"]  # the same budget
        for s in r["scores"]:
            rd = out / "tune" / m / s["point"] / m / "seed0"
            assert s["nll"] == tables.final_metrics(rd)["nll"]
            cfg = load_config(rd / "config.yaml")
            assert cfg.eval.split == "validation" and cfg.federation.rounds == 1
            data = json.loads((rd / "data.json").read_text())
            ev = [x for x in open(rd / "metrics.jsonl") if '"event": "eval"' in x]
            tokens = json.loads(ev[-1])["global"]["tokens"]
            assert all(p["validation"] > 0 for p in data["partition"].values()) and tokens > 0
        best = min(r["scores"], key=lambda s: s["nll"])["point"]
        assert r["winner"] == [best]
        final = load_config(out / m / "seed0" / "config.yaml")
        assert final.algorithm.lr == float(best.split("=")[1]) and final.eval.split == "test"
        same_training = json.loads((out / m / "seed0" / "data.json").read_text())["partition"]
        assert same_training == json.loads((out / "tune" / m / r["scores"][0]["point"] / m / "seed0" /
                                            "data.json").read_text())["partition"]
    res = json.loads((out / "compare.json").read_text())
    assert res["tuned"] == {m: r["winner"] for m, r in tune["methods"].items()} and "takd-only" in res["methods"]
    assert (out / "compare.md").read_text().startswith("Client step sizes tuned on the validation parts")
    assert main(["compare", TINY, "--algorithms", "fedavg", "--out", str(tmp_path / "x"),
                 "--tune", "algorithm.lr=1e-3"]) == 2
    assert "set federation.validation" in capsys.readouterr().err


def test_validation_parts_are_cut_between_held_out_and_training_data():
    tok = load_tokenizer("tiny-qwen2")
    shard = [Example(f"question {i}?", f" answer {i}") for i in range(20)]
    plain = tokenize_clients([shard], [], tok, 64, 0.2)
    cut = tokenize_clients([shard], [], tok, 64, 0.2, 0.25)
    assert plain[1] == cut[1] and not plain[4]  # the same held-out head; no validation part by default
    assert [len(cut[k]["client0"]) for k in (1, 4, 0)] == [4, 5, 11]
    assert cut[0]["client0"] == plain[0]["client0"][5:]  # validation comes out of the training data only
    assert cut[2]["client0"]["validation"] == 5


def test_a_winner_at_the_edge_of_the_grid_is_flagged():
    from ciders.experiments.compare_tune import at_edge, markdown

    grid = [("algorithm.lr", ["3e-4", "1e-3", "3e-3"])]
    assert at_edge(["algorithm.lr=3e-3"], grid) == ["algorithm.lr=3e-3"]
    assert at_edge(["algorithm.lr=3e-4"], grid) == ["algorithm.lr=3e-4"]
    assert at_edge(["algorithm.lr=1e-3"], grid) == []
    assert at_edge(["algorithm.lr=1e-3"], [("algorithm.lr", ["1e-3", "3e-3"])]) == []  # 2 points bracket nothing
    two = [("algorithm.lr", ["1e-4", "1e-3", "1e-2"]), ("algorithm.gamma", ["0", "0.5", "1"])]
    assert at_edge(["algorithm.lr=1e-3", "algorithm.gamma=1"], two) == ["algorithm.gamma=1"]
    scores = [{"point": f"algorithm.lr={v}", "nll": x} for v, x in zip(grid[0][1], (4.9, 4.6, 4.3))]
    md = markdown({"fedavg": {"winner": ["algorithm.lr=3e-3"], "scores": scores, "edge": ["algorithm.lr=3e-3"]},
                   "ciders-fo": {"winner": ["algorithm.lr=1e-3"], "scores": scores, "edge": []}}, grid, 6, 0)
    assert "algorithm.lr=3e-3 (grid edge)" in md and "**Not bracketed:** fedavg chose" in md
    assert "ciders-fo chose" not in md
