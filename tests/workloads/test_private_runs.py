"""Secure aggregation and DP on a real (tiny, random) decoder LLM through `ciders run`: the messenger LoRA of the
secure run equals the plain run's to the quantization tolerance, and a DP run records the epsilon it spent."""

import json

import pytest
import torch

from ciders.cli import main
from ciders.core import privacy
from ciders.federation.loop import RunDir
from ciders.fileio import read_jsonl
from conftest import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")
SGD = ["algorithm.optimizer=sgd", "federation.rounds=2", "federation.checkpoint_keep=4"]


def sets(*kv):
    return [x for item in kv for x in ("--set", item)]


def checkpoint(out, t):
    return RunDir(out).load_checkpoint(t)[0]


def test_a_secure_llm_run_equals_the_plain_one(tmp_path):
    """Float32 LoRA on tiny-qwen2, SGD: after each round the messenger, c and the student LoRA of the secure
    run are within float32 rounding of the plain run's (the fixed point adds at most 3 * 2^-33 to Delta-bar)."""
    assert main(["run", TINY, "--out", str(tmp_path / "plain"), "--quiet", *sets(*SGD)]) == 0
    assert main(["run", TINY, "--out", str(tmp_path / "sec"), "--quiet",
                 *sets(*SGD, "federation.secure_aggregation=true")]) == 0
    for t in (0, 1):
        a, b = checkpoint(tmp_path / "plain", t), checkpoint(tmp_path / "sec", t)
        assert a.keys() == b.keys()
        worst = max((a[k] - b[k]).abs().max().item() / max(a[k].abs().max().item(), 1e-3) for k in a)
        assert worst < 1e-5, (t, worst)
    s = json.loads((tmp_path / "sec" / "summary.json").read_text())
    assert "masked" in s["mib"]["by_component"]["up"] and "dc" not in s["mib"]["by_component"]["up"]
    before, after = s["eval_before"]["global"]["ppl"], s["eval_after"]["global"]["ppl"]
    p = json.loads((tmp_path / "plain" / "summary.json").read_text())["eval_after"]["global"]["ppl"]
    assert after == pytest.approx(p, rel=1e-5) and after < before


def test_a_dp_run_on_the_llm_records_epsilon_and_reports_it(tmp_path):
    out = tmp_path / "dp"
    assert main(["run", TINY, "--out", str(out), "--quiet",
                 *sets("federation.secure_aggregation=true", "algorithm.weighting=uniform",
                       "federation.dp.mode=central", "federation.dp.clip=1.0", "federation.dp.target_epsilon=8")]) == 0
    server = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "server"]
    z = privacy.noise_for_epsilon(8.0, 1e-5, 1.0, 2, "central")
    assert [r["dp_noise_multiplier"] for r in server] == [z, z]
    assert server[-1]["dp_epsilon"] == pytest.approx(privacy.central_epsilon(z, 1.0, 2, 1e-5))
    assert all(torch.isfinite(v).all() for v in checkpoint(out, 1).values())
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    html = next((tmp_path / "rep").rglob("index.html")).read_text()
    assert "Privacy" in html and "noise multiplier z" in html and "DP epsilon spent" in html
