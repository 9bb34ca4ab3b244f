"""Named tasks inside `ciders run` (tiny model): Protocol B's shape (one domain per client, per-domain
public / evaluation sizes, the NLL matrix scheduled in the run) and Protocol C's (Dirichlet over a
category column), plus `ciders eval` and `ciders score-code` on the outputs."""

import json

import pytest

from ciders.cli import main
from ciders.fileio import read_jsonl
from helpers import shared, toolchain

BASE = ["model.name=tiny-qwen2", "model.dtype=float32", "decomposition.messenger_layers=2", "decomposition.drop_ratio=0.5",
        "takd.bootstrap_steps=1", "takd.round_steps=1", "takd.hidden_loss=teacher_rms", "algorithm.local_steps=1",
        "algorithm.batch_size=2", "algorithm.lr=1e-3", "federation.rounds=1", "federation.holdout=0.25"]


def sets(*kv):
    return [x for pair in (("--set", v) for v in BASE + list(kv)) for x in pair]


@pytest.mark.full_data
def test_protocol_b_shape_domains_natural_partition_and_nll_matrix(tmp_path, capsys):
    shared("personalization")
    out = tmp_path / "b"
    args = sets("data.task=domains", "data.per_label=true", "data.public_size=2", "data.eval_size=2",
                "data.client_size=6", "data.max_length=2048", "federation.clients=5", "federation.partition=natural",
                "eval.tasks=[nll_matrix]")
    assert main(["run", "--out", str(out), *args, str(tmp_path / "none.yaml")]) == 2  # config must exist
    (tmp_path / "e.yaml").write_text("name: b\n")
    assert main(["run", str(tmp_path / "e.yaml"), "--out", str(out), *args]) == 0
    info = json.loads((out / "data.json").read_text())
    sp = info["split"]
    assert sp["public"] == 10 and sp["eval"] == 10 and sp["partition"] == "natural"
    assert [list(h["labels"]) for h in sp["histograms"]] == [[d] for d in sorted(["medical", "finance",
                                                                                     "customer_support", "code", "general"])]
    assert set(info["client_label"].values()) == {"medical", "finance", "customer_support", "code", "general"}
    ev = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "eval"][-1]
    assert json.loads((out / "eval" / "round_0000.json").read_text()) == ev
    m = ev["nll_matrix"]
    assert len(m["cells"]) == 5 and all(len(row) == 5 for row in m["cells"].values())
    assert all(c["examples"] == 2 and c["tokens"] > 0 for row in m["cells"].values() for c in row.values())
    assert m["delta_cross"] == pytest.approx(m["off_mean"] - m["diag_mean"])
    capsys.readouterr()
    assert main(["eval", str(out), "--tasks", "nll_matrix,ppl", "--messenger", "client:client0"]) == 0
    saved = json.loads((out / "eval" / "adapemu-client_client0.json").read_text())
    assert saved["tasks"]["nll_matrix"]["cells"] == m["cells"]  # same messengers, same numbers


@pytest.mark.full_data
def test_protocol_c_shape_dirichlet_over_categories(tmp_path):
    shared("gsm8k")
    (tmp_path / "c.yaml").write_text("name: c\n")
    out = tmp_path / "c"
    args = sets("data.task=math", "data.public_size=8", "data.client_size=120", "data.eval_limit=6",
                "data.max_length=512", "federation.clients=4", "federation.partition=dirichlet",
                "federation.dirichlet_alpha=0.1")
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(out), *args]) == 0
    sp = json.loads((out / "data.json").read_text())["split"]
    assert not sp["official_eval_split"] and sp["eval"] == 6 and sp["client_pool"] == 120  # held out of the pool
    assert sum(h["size"] for h in sp["histograms"]) == 120 and sp["label_skew"] > 0.2
    assert all(set(h["labels"]) <= {"steps_1-2", "steps_3", "steps_4", "steps_5", "steps_6+"} for h in sp["histograms"])


@pytest.mark.full_data
def test_eval_command_on_every_path(tmp_path, capsys):
    shared("humaneval-x")
    toolchain("python")
    from conftest import ROOT

    cfg = (ROOT / "configs" / "tiny.yaml").read_text().replace("../data/", f"{ROOT}/data/")
    (tmp_path / "t.yaml").write_text(cfg)
    out = tmp_path / "r"
    assert main(["run", str(tmp_path / "t.yaml"), "--out", str(out)]) == 0
    for path in ("adapemu", "adapfu", "teacher"):
        assert main(["eval", str(out), "--tasks", "ppl,gsm8k,rouge_l,humaneval:python", "--limit", "2",
                     "--path", path]) == 0
        r = json.loads((out / "eval" / f"{path}-global.json").read_text())["tasks"]
        assert r["gsm8k"]["questions"] == 2 and r["humaneval:python"]["tasks"] == 2 and r["rouge_l"]["pairs"] == 2
        assert r["ppl"]["tokens"] > 0
    assert main(["eval", str(out), "--tasks", "bogus"]) == 2
    assert "unknown evaluation 'bogus'" in capsys.readouterr().err


@pytest.mark.full_data
def test_score_code_command(tmp_path, capsys):
    shared("humaneval-x")
    toolchain("python")
    from ciders.eval.humaneval import load_problems

    probs = load_problems("python")[:4]
    lines = []
    for p in probs:
        lines.append(json.dumps({"task_id": p["task_id"], "completion": p["canonical_solution"]}))
        lines.append(json.dumps({"task_id": p["task_id"], "completion": "    return None\n"}))
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(lines) + "\n")
    assert main(["score-code", "--language", "python", "--completions", str(f), "--samples-per-task", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["pass@1"] == 0.5 and r["pass@2"] == 1.0 and r["statuses"] == {"passed": 4, "failed": 4}
    assert main(["score-code", "--language", "python", "--completions", str(f), "--samples-per-task", "3"]) == 2
    assert "task Python/0 has 2 samples" in capsys.readouterr().err
