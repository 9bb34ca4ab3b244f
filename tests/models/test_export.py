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


# ------------------------------------------------------------------ --out and the marker under attack (issue 34.8)


def test_export_never_deletes_or_writes_through_a_symlink(tmp_path):
    """An earlier export's marker lists names under a directory that is now a symlink: one leading outside
    (its victim must survive) and one back into the export (deleting through it would delete the new
    config.json). A file the export writes that is a symlink is replaced, not written through."""
    from ciders.fileio import MARKER

    d = decompose(load_model("tiny-qwen2"), 2, drop_ratio=0.5)
    edge, outside = tmp_path / "edge", tmp_path / "outside"
    export_edge_model(d, edge)
    outside.mkdir()
    (outside / "victim.txt").write_text("not the export's to delete")
    (outside / "card.md").write_text("my own card")
    (edge / "sub").symlink_to(outside, target_is_directory=True)
    (edge / "loop").symlink_to(edge, target_is_directory=True)
    (edge / "README.md").symlink_to(outside / "card.md")
    marker = json.loads((edge / MARKER).read_text())
    (edge / MARKER).write_text(json.dumps({**marker, "files": marker["files"] + ["sub/victim.txt",
                                                                                "loop/config.json"]}))
    export_edge_model(d, edge, card=lambda info: "# Edge model\n")
    assert (outside / "victim.txt").read_text() == "not the export's to delete"
    assert (outside / "card.md").read_text() == "my own card"
    assert (edge / "config.json").is_file() and (edge / "sub").is_symlink() and (edge / "loop").is_symlink()
    assert not (edge / "README.md").is_symlink() and (edge / "README.md").read_text() == "# Edge model\n"
    assert "sub/victim.txt" not in json.loads((edge / MARKER).read_text())["files"]


def test_output_dir_refuses_to_write_through_a_symlinked_directory(tmp_path):
    """A file the new output writes under a directory that is a symlink out of it: a one-line error before
    the first file moves, nothing written outside, the earlier output intact."""
    from ciders.errors import CidersError
    from ciders.fileio import output_dir

    out, outside = tmp_path / "edge", tmp_path / "outside"
    with output_dir(out, "export") as tmp:
        (tmp / "a.txt").write_text("1")
    outside.mkdir()
    (out / "onnx").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CidersError, match=r"edge/onnx is reached through a symlinked directory \(it leads to .*outside\)"):
        with output_dir(out, "export") as tmp:
            (tmp / "a.txt").write_text("2")
            (tmp / "onnx").mkdir()
            (tmp / "onnx" / "model.onnx").write_text("graph")
    assert list(outside.iterdir()) == [] and (out / "a.txt").read_text() == "1"


def _bad_outs(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    return {"under a file": (tmp_path / "file" / "edge", "which is a file, not a directory"),
            "deeper under a file": (tmp_path / "file" / "a" / "edge", "which is a file, not a directory"),
            "a dangling symlink": (tmp_path / "dangling", "which does not exist (a dangling link)"),
            "under a dangling symlink": (tmp_path / "dangling" / "edge", "which does not exist (a dangling link)"),
            "/proc": ("/proc/ciders-edge", "is on /proc, a kernel pseudo-filesystem"),
            "/sys": ("/sys/ciders-edge", "is on /sys, a kernel pseudo-filesystem")}


BAD_OUTS = ("under a file", "deeper under a file", "a dangling symlink", "under a dangling symlink", "/proc", "/sys")


def _fake_export_source(tmp_path, monkeypatch, node: bool):
    """A run directory (or a node's state directory) whose model must never be built: building it fails."""
    import shutil

    import ciders.workloads.edge
    import ciders.workloads.prealign
    from conftest import ROOT

    def never(*a, **k):
        raise AssertionError("built the model before checking --out")

    monkeypatch.setattr(ciders.workloads.prealign, "build", never)
    monkeypatch.setattr(ciders.workloads.edge, "node_model", never)
    src = tmp_path / "src"
    if node:
        (src / "edge").mkdir(parents=True)
        (src / "edge" / "ciders_edge.json").write_text("{}")
    else:
        src.mkdir()
        shutil.copy(ROOT / "configs" / "tiny.yaml", src / "config.yaml")
    return src


@pytest.mark.parametrize("node", [False, True], ids=["run", "node"])
@pytest.mark.parametrize("case", BAD_OUTS)
def test_export_checks_out_before_building_the_model(tmp_path, monkeypatch, capsys, case, node):
    from ciders.cli import main

    src = _fake_export_source(tmp_path, monkeypatch, node)
    out, says = _bad_outs(tmp_path)[case]
    assert main(["export", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ciders: error: ") and says in err and "--out" in err
    assert not (tmp_path / "gone").exists() and (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("node", [False, True], ids=["run", "node"])
def test_export_builds_the_model_when_out_is_fine(tmp_path, monkeypatch, node):
    """The control of the test above: its fake model build is reached with a good --out."""
    from ciders.cli import main

    src = _fake_export_source(tmp_path, monkeypatch, node)
    with pytest.raises(AssertionError, match="built the model before"):
        main(["export", str(src), "--out", str(tmp_path / "new" / "edge")])


@pytest.mark.parametrize("case", BAD_OUTS)
def test_export_edge_model_checks_out_dir_before_merging(tmp_path, monkeypatch, case):
    import re

    import ciders.models.export
    from ciders.errors import CidersError

    monkeypatch.setattr(ciders.models.export, "merged_copy", lambda m: pytest.fail("merged before checking"))
    out, says = _bad_outs(tmp_path)[case]
    with pytest.raises(CidersError, match=re.escape(says)):
        export_edge_model(None, out)


def test_export_refuses_an_out_it_cannot_write(tmp_path, monkeypatch, capsys):
    """os.access stands in for a read-only directory: as root (CI containers) chmod would not stop a write."""
    import os

    from ciders.cli import main

    src = _fake_export_source(tmp_path, monkeypatch, node=False)
    (tmp_path / "ro" / "old").mkdir(parents=True)
    monkeypatch.setattr(os, "access", lambda p, mode: os.path.realpath(p) != str((tmp_path / "ro").resolve()))
    # created in it; it exists and gets files; it gets the scratch directory that an export builds beside
    for out in (tmp_path / "ro" / "edge", tmp_path / "ro", tmp_path / "ro" / "old"):
        assert main(["export", str(src), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"cannot write {tmp_path / 'ro'}: permission denied" in err
