import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ciders.models.decompose import decompose
from ciders.models.export import export_edge_model
from ciders.models.load import load_model
from helpers import ARCHS, randomize_lora, run_dir_without_run as _run_dir


@pytest.mark.parametrize("name", ARCHS)
def test_export_roundtrip(name, tmp_path):
    d = decompose(load_model(name), 2, drop_ratio=0.5)
    randomize_lora(d)
    teacher_w = d.backbone_full[0].self_attn.q_proj.weight.clone()
    export_edge_model(d, tmp_path / "edge")
    info = json.loads((tmp_path / "edge" / "ciders_export.json").read_text())
    assert info["student_indices"] == list(d.split.student_indices)
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "edge")).eval()
    assert type(m) is type(d.base) and m.config.num_hidden_layers == d.split.edge_layers
    assert not any("lora" in n for n, _ in m.named_parameters())
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, d.adapemu(ids).logits, atol=1e-4, rtol=1e-4)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(ids, **kw), d.adapemu.generate(ids, **kw))
    # merging happened on a copy: the shared teacher weights are untouched
    assert torch.equal(d.backbone_full[0].self_attn.q_proj.weight, teacher_w)


def test_export_never_deletes_files_it_did_not_write(tmp_path, capsys):
    from ciders.cli import main
    from ciders.fileio import MARKER

    run = _run_dir(tmp_path)
    out = tmp_path / "models"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} holds files ciders did not write" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["export", str(run), "--out", str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()
    AutoModelForCausalLM.from_pretrained(str(out))
    # an earlier export: replaced without --force; its own files that the new one does not write go
    edge = tmp_path / "edge"
    assert main(["export", str(run), "--out", str(edge)]) == 0
    marker = json.loads((edge / MARKER).read_text())
    assert marker["command"] == "export" and "model.safetensors" in marker["files"]
    (edge / "stale.bin").write_bytes(b"x")  # as if an earlier version wrote it
    (edge / MARKER).write_text(json.dumps({**marker, "files": marker["files"] + ["stale.bin", "../outside"]}))
    (tmp_path / "outside").write_text("not the export's to delete")
    (edge / "NOTES.md").write_text("my notes on this model")
    assert main(["export", str(run), "--out", str(edge)]) == 0
    assert not (edge / "stale.bin").exists() and (edge / "NOTES.md").read_text() == "my notes on this model"
    assert (tmp_path / "outside").is_file() and "# Edge model" in (edge / "README.md").read_text()  # the model card
    AutoModelForCausalLM.from_pretrained(str(edge))


def test_export_output_has_the_umask_permissions(tmp_path):
    import os
    import stat

    d = decompose(load_model("tiny-qwen2"), 2, drop_ratio=0.5)
    old = os.umask(0o022)
    try:
        export_edge_model(d, tmp_path / "edge")
    finally:
        os.umask(old)
    paths = [tmp_path / "edge", *(tmp_path / "edge").rglob("*")]
    assert len(paths) > 3
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths} == {
        p.name: 0o755 if p.is_dir() else 0o644 for p in paths}
