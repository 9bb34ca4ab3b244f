import json

import torch
from transformers import AutoModelForCausalLM

from ciders.cli import main
from ciders.config import load_config
from ciders.workloads.prealign import build
from ciders.fileio import read_jsonl
from conftest import ROOT

TINY = f"""
name: tiny
seed: 3
model: {{name: tiny-qwen2, device: auto, dtype: float32}}
decomposition: {{messenger_layers: 2, drop_ratio: 0.5}}
takd: {{lr: 1.0e-2, batch_size: 4, bootstrap_steps: 4, hidden_loss: teacher_rms}}
data:
  public: {ROOT}/data/gsm8k-slice/public.jsonl
  eval: {ROOT}/data/gsm8k-slice/eval.jsonl
  public_limit: 24
  eval_limit: 6
  max_length: 384
"""


def test_distill_then_export_end_to_end(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    run = tmp_path / "run"
    assert main(["distill", str(cfg), "--out", str(run), "--set", "takd.bootstrap_steps=5"]) == 0
    out = capsys.readouterr().out
    assert "student after TAKD (AdapEmu)" in out and "teacher M* (AdapFu" in out
    for f in ("config.yaml", "data.json", "metrics.jsonl", "summary.json",
              "adapters/messenger/adapter_model.safetensors", "adapters/student/adapter_config.json"):
        assert (run / f).is_file(), f
    resolved = load_config(run / "config.yaml")
    assert resolved.takd.bootstrap_steps == 5  # the override is in the resolved config
    summary = json.loads((run / "summary.json").read_text())
    assert summary["takd"]["steps"] == 5 and summary["eval_tokens"] > 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows if r["event"] == "takd"] == list(range(5))
    assert [r["path"] for r in rows if r["event"] == "eval"][-1] == "student after (AdapEmu)"
    data = json.loads((run / "data.json").read_text())
    assert data["public"]["kept"] + sum(data["public"]["skipped"].values()) == 24 and data["overlap"] == 0

    assert main(["export", str(run), "--out", str(tmp_path / "edge")]) == 0
    edge = AutoModelForCausalLM.from_pretrained(str(tmp_path / "edge")).eval()
    d, tok = build(resolved)
    d.load_student(d.read_adapter(run / "adapters" / "student", "student"))
    ids = torch.tensor([tok("Question: 2+2?\nAnswer:")["input_ids"]])
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(edge.generate(ids, **kw), d.adapemu.generate(ids, **kw))
    assert (tmp_path / "edge" / "tokenizer.json").is_file()


def test_same_seed_same_numbers(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    sums = []
    for i in range(2):
        assert main(["distill", str(cfg), "--out", str(tmp_path / f"r{i}")]) == 0
        sums.append(json.loads((tmp_path / f"r{i}" / "summary.json").read_text()))
    assert sums[0]["ppl"] == sums[1]["ppl"] and sums[0]["takd"]["last_loss"] == sums[1]["takd"]["last_loss"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.replace("public_limit: 24", "public_limt: 24"))
    assert main(["distill", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ciders: error: unknown config key 'data.public_limt'; did you mean 'data.public_limit'? "
                          "(known keys here: task,")
    assert "public_limit" in err and "\n" not in err
    cfg.write_text(TINY.replace("gsm8k-slice/eval.jsonl", "nope.jsonl"))
    assert main(["distill", str(cfg), "--out", str(tmp_path / "x")]) == 2
    assert "data file not found" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "e")]) == 2
    assert "not a run directory" in capsys.readouterr().err
