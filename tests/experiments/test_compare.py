"""`ciders compare` and `ciders sweep` on the tiny model: same data for every method, per-seed values
aggregated as mean +- sample std, finished runs reused, and payload sizes measured from the bytes that
crossed the wire / were saved, checked against `ciders plan`."""

import json
import statistics

import pytest

from ciders.cli import main
from ciders.models.plan import make_plan
from ciders.config import load_config
from ciders.report import tables
from conftest import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def cmp_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp") / "c"
    assert main(["compare", TINY, "--algorithms", "ciders-fo,fedavg,localot", "--seeds", "0,1", "--out", str(out),
                 "--set", "federation.rounds=2"]) == 0
    return out


def test_compare_table_is_the_mean_and_std_of_the_seeds(cmp_dir):
    res = json.loads((cmp_dir / "compare.json").read_text())
    assert res["methods"] == ["ciders-fo", "fedavg", "localot", "takd-only"] and res["seeds"] == [0, 1]  # + control
    for m in res["methods"]:
        vals = [res["per_seed"][m][s]["ppl"] for s in ("0", "1")]
        fresh = tables.final_metrics(cmp_dir / m / "seed0")
        assert fresh["ppl"] == res["per_seed"][m]["0"]["ppl"]
        agg = res["aggregate"][m]["ppl"]
        assert agg["mean"] == pytest.approx(statistics.fmean(vals)) and agg["std"] == pytest.approx(statistics.stdev(vals))
    assert vals[0] != vals[1]  # seeds really differ
    md = (cmp_dir / "compare.md").read_text()
    best = min(res["methods"], key=lambda m: round(res["aggregate"][m]["ppl"]["mean"], 3))
    assert f"| {best} | **" in md
    # the same split and partition for every method of one seed
    for s in ("seed0", "seed1"):
        infos = {m: json.loads((cmp_dir / m / s / "data.json").read_text())["split"] for m in res["methods"]}
        assert len({json.dumps(v, sort_keys=True) for v in infos.values()}) == 1
    cfgs = {m: load_config(cmp_dir / m / "seed0" / "config.yaml").algorithm for m in res["methods"]}
    assert cfgs["fedavg"].gamma == 0 and cfgs["localot"].communicate is False and cfgs["ciders-fo"].gamma == 0.05
    assert cfgs["takd-only"].client_learning is False and cfgs["ciders-fo"].client_learning is True


def test_compare_holds_every_method_against_the_control(cmp_dir):
    res = json.loads((cmp_dir / "compare.json").read_text())
    assert res["control"] == "takd-only"
    vs = res["against_control"]
    assert set(vs) == set(tables.CONTROL_METRICS)  # nll, personalized PPL and edge fidelity, all recorded
    for k, rows in vs.items():
        assert {r["a"] for r in rows} == {"ciders-fo", "fedavg", "localot"} and {r["b"] for r in rows} == {"takd-only"}
        for r in rows:
            d = [res["per_seed"][r["a"]][s][k] - res["per_seed"]["takd-only"][s][k] for s in ("0", "1")]
            assert r["diff_mean"] == pytest.approx(statistics.fmean(d))
    md = (cmp_dir / "compare.md").read_text()
    assert "| takd-only (control) |" in md
    marks = tables.control_marks(vs)
    for m in ("ciders-fo", "fedavg", "localot"):  # a dagger exactly where the method does not beat the control
        row = next(line for line in md.splitlines() if line.startswith(f"| {m} |"))
        assert row.count("†") == sum((m, k) in marks for k in tables.CONTROL_METRICS)
    assert main(["report", str(cmp_dir)]) == 0
    assert "takd-only (control)" in (cmp_dir / "report" / "index.html").read_text()


def test_compare_reuses_finished_runs(cmp_dir, capsys):
    before = (cmp_dir / "fedavg" / "seed1" / "metrics.jsonl").read_bytes()
    assert main(["compare", TINY, "--algorithms", "fedavg", "--seeds", "1", "--out", str(cmp_dir),
                 "--set", "federation.rounds=2"]) == 0
    assert "finished earlier, reusing" in capsys.readouterr().out
    assert (cmp_dir / "fedavg" / "seed1" / "metrics.jsonl").read_bytes() == before
    assert main(["compare", TINY, "--algorithms", "fedavg", "--seeds", "1", "--out", str(cmp_dir),
                 "--set", "federation.rounds=2", "--set", "algorithm.lr=0.5"]) == 2  # not silently reused
    assert "config differs" in capsys.readouterr().err


def test_payloads_measured_match_the_plan(cmp_dir):
    cfg = load_config(cmp_dir / "ciders-fo" / "seed0" / "config.yaml")
    d = cfg.decomposition
    p = make_plan(cfg.model.name, d.messenger_layers, drop_ratio=d.drop_ratio, messenger_lora=cfg.lora.messenger,
                  student_lora=cfg.lora.student).to_dict()
    stored = tables.stored_lora_mib(cmp_dir / "ciders-fo" / "seed0")
    assert stored == {"messenger": p["messenger_lora_mib"], "student": p["student_lora_mib"]}
    c = tables.communication(cmp_dir / "ciders-fo" / "seed0")["per_client_round"]

    def framed(measured, plan_mib, n_tensors):
        # a component on the wire = its tensor bytes (the plan's figure) + its safetensors header
        extra = measured * 2**20 - plan_mib * 2**20
        return 8 < extra < 8 + 160 * n_tensors

    nm, ns = p["messenger_lora_tensors"], p["student_lora_tensors"]
    assert framed(c["down"]["messenger"], p["downlink_mib"]["messenger"], nm)
    assert framed(c["down"]["c"], p["downlink_mib"]["consensus"], nm)
    assert framed(c["down"]["student"], p["downlink_mib"]["student_lora"], ns)
    assert framed(c["up"]["dc"], p["uplink_mib"]["consensus_increment"], nm)
    f = tables.communication(cmp_dir / "fedavg" / "seed0")["per_client_round"]
    assert "c" not in f["down"] and f["up"]["dc"] == c["up"]["dc"]  # FedAvg: no consensus downlink
    lo = tables.communication(cmp_dir / "localot" / "seed0")
    assert lo["up"] == 0 and lo["per_client_round"]["down"]["messenger"] == pytest.approx(
        c["down"]["messenger"] / 2)  # one download over two rounds
    # the emulator's frozen base weights go to each client once (first contact), as `ciders plan` counts
    # them (edge base weights); this run is FP32
    summary = json.loads((cmp_dir / "ciders-fo" / "seed0" / "summary.json").read_text())
    emu = summary["mib"]["first_contact"]["emulator"]
    assert "emulator" not in c["down"]  # not averaged into the per-round traffic
    assert 0 < emu * 2**20 - p["edge_base_params"] * 4 < 200 * 64
    md = tables.communication_markdown({"ciders-fo": cmp_dir / "ciders-fo" / "seed0"})
    assert "| ciders-fo |" in md


def test_compare_errors(tmp_path, capsys):
    assert main(["compare", TINY, "--algorithms", "ciders-fo,fedsgd", "--out", str(tmp_path)]) == 2
    assert "unknown fedsgd" in capsys.readouterr().err
    assert main(["compare", TINY, "--seeds", "0,x", "--out", str(tmp_path)]) == 2
    assert main(["compare", TINY, "--control", "ciders-fo,fedavg", "--out", str(tmp_path)]) == 2
    assert "--control: one method or none" in capsys.readouterr().err
    assert main(["compare", TINY, "--control", "takd", "--out", str(tmp_path)]) == 2
    assert "unknown takd" in capsys.readouterr().err
    assert main(["sweep", TINY, "--grid", "decomposition.drop_ratio", "--out", str(tmp_path)]) == 2
    assert main(["sweep", TINY, "--grid", "decomposition.drop_ratio=2", "--out", str(tmp_path)]) == 2
    assert "drop_ratio" in capsys.readouterr().err


def test_sweep_grid(tmp_path):
    out = tmp_path / "s"
    assert main(["sweep", TINY, "--grid", "decomposition.drop_ratio=0.2,0.5", "--algorithms", "ciders-fo,fedot",
                 "--out", str(out), "--set", "federation.rounds=1", "--control", "none"]) == 0
    res = json.loads((out / "sweep.json").read_text())
    assert [r["values"] for r in res["rows"]] == [{"decomposition.drop_ratio": "0.2"}, {"decomposition.drop_ratio": "0.5"}]
    mib = [r["aggregate"]["ciders-fo"]["stored_mib"]["mean"] for r in res["rows"]]
    assert mib[0] > mib[1]  # a higher drop ratio stores fewer student LoRA layers
    assert (out / "decomposition.drop_ratio=0.5" / "fedot" / "seed0" / "summary.json").is_file()
    assert "| 0.5 |" in (out / "sweep.md").read_text()


def test_methods_of_a_seed_share_one_pre_alignment_equal_to_a_fresh_one(cmp_dir, tmp_path, capsys):
    from ciders import algorithms
    from ciders.core.tensors import equal
    from ciders.workloads import prealign as pa
    from ciders.workloads.llm import LLMTask

    files = sorted((cmp_dir / "prealign").glob("*.safetensors"))
    assert len(files) == 2  # one per seed: ciders-fo, fedavg and localot agree on every pre-alignment input
    cfg = algorithms.configure(load_config(cmp_dir / "fedavg" / "seed1" / "config.yaml"))
    task = LLMTask(cfg, tmp_path / "fresh", log=lambda *_: None)
    t, m, pre = task._prealign()  # computed again, without the cache
    hit = pa.load_cached(cmp_dir / "prealign", pa.key(cfg, task.public))
    assert hit is not None and equal(hit[0], t) and hit[1] == m and hit[2] == pre
    # FedBiOT's pre-alignment (no task CE, teacher-RMS hidden term) is the default one here, so it is shared;
    # a task CE in pre-alignment makes a different one
    from dataclasses import replace

    fedbiot = algorithms.configure(cfg, "fedbiot")
    assert pa.key(fedbiot, task.public) == pa.key(cfg, task.public)
    ce = replace(cfg, takd=replace(cfg.takd, lambda_task_bootstrap=1.0))
    assert pa.key(fedbiot, task.public) != pa.key(ce, task.public)
    files[0].write_bytes(b"not a safetensors file")  # a damaged cache entry is recomputed, not trusted
    assert pa.load_cached(cmp_dir / "prealign", files[0].stem) is None


def test_an_interrupted_comparison_keeps_its_table_so_far_and_reports(tmp_path):
    """compare.json / compare.md are rewritten after every finished run: a comparison stopped as its second run
    starts holds the first run's table, lists the other runs as pending, and `ciders report` draws it (README's
    compare and report lines rely on it: tests/test_doc_commands_long.py)."""
    import math

    from ciders.experiments.compare import run_compare
    from synthetic import VectorTask

    class Task(VectorTask):
        def evaluate(self, t, server, personalized):
            nll = super().evaluate(t, server, personalized)["global_loss"]
            return {"global": {"nll": nll, "ppl": math.exp(nll), "tokens": 100}}

    made = []

    def make_task(c, o):
        if made:
            raise KeyboardInterrupt  # Ctrl-C as the second run starts
        made.append(o)
        return Task(c.federation.clients, seed=c.seed)

    cfg = load_config(None, ["federation.clients=3", "federation.rounds=2", "algorithm.local_steps=2",
                             "algorithm.optimizer=sgd", "algorithm.lr=0.05"])
    out = tmp_path / "cmp"
    with pytest.raises(KeyboardInterrupt):
        run_compare(cfg, ["ciders-fo", "fedavg"], [0, 1], out, make_task=make_task, log=lambda s: None, progress=False,
                    control=None)
    info = json.loads((out / "compare.json").read_text())
    assert list(info["per_seed"]["ciders-fo"]) == ["0"] and info["per_seed"]["fedavg"] == {}
    assert info["pending"] == ["fedavg/seed0", "ciders-fo/seed1", "fedavg/seed1"]
    assert info["aggregate"]["ciders-fo"]["nll"]["n"] == 1 and "fedavg" not in info["aggregate"]
    assert (out / "compare.md").read_text().startswith("In progress: 3 of 4 runs still to do")
    assert main(["report", str(out)]) == 0
    page = (out / "report" / "index.html").read_text()
    assert "in progress: 3 runs to go" in page and "fedavg/seed0" in page and "runs not found" not in page
