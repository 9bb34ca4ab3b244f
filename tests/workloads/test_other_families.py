"""Any HF decoder model works: a whole `ciders run` (decomposition, TAKD pre-alignment, two rounds of clients,
aggregation, evaluation, export) on two architecture families besides Llama / Qwen2: Gemma and Phi-3 (fused
projections), tiny and random, with the exported edge model loading in plain transformers."""

import json
import math

import pytest
import torch

from ciders.cli import main
from ciders.fileio import read_jsonl
from conftest import ROOT


@pytest.mark.parametrize("family", ["tiny-gemma", "tiny-phi3"])
def test_a_run_on_another_architecture_family(tmp_path, family):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "r"
    assert main(["run", str(ROOT / "configs" / "tiny.yaml"), "--out", str(out), "--set", f"model.name={family}",
                 "--set", "data.clients_limit=12", "--set", "data.max_length=256"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = read_jsonl(out / "metrics.jsonl")
    ev = [r for r in rows if r["event"] == "eval"]
    assert len(ev) >= 2 and all(math.isfinite(r["global"]["ppl"]) for r in ev)
    clients = [r for r in rows if r["event"] == "client"]
    assert len(clients) == 3 * 2 and all(math.isfinite(r["loss"]) for r in clients)
    assert summary["rounds"] == 2
    # the exported edge model (AdapEmu, LoRA merged) loads in plain transformers and gives finite logits
    assert main(["export", str(out), "--out", str(tmp_path / "e")]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "e"))
    assert type(model).__name__.lower().startswith(family.split("-")[1])
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    # the run's messenger adapter is a standard PEFT directory; on Phi-3 the fused projections carry the LoRA
    target = json.loads((out / "adapters" / "messenger" / "adapter_config.json").read_text())["target_modules"]
    if family == "tiny-phi3":
        assert "qkv_proj" in target and "gate_up_proj" in target
