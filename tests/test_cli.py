import json

import pytest
import yaml

from ciders.cli import main
from ciders.config import load_config
from conftest import ROOT


def test_config_command(capsys, tmp_path):
    assert main(["config", str(ROOT / "configs" / "demo.yaml"), "--set", "takd.lr=0.1"]) == 0
    p = tmp_path / "resolved.yaml"
    p.write_text(capsys.readouterr().out)
    assert load_config(p).takd.lr == 0.1 and yaml.safe_load(p.read_text())["model"]["name"] == "smollm2-135m"
    assert main(["config", "--keys"]) == 0
    assert "takd.lambda_out" in capsys.readouterr().out
    assert main(["config", "--set", "takd.lr=-1"]) == 2
    assert capsys.readouterr().err.strip() == "ciders: error: takd.lr: must be >= 0, got -1.0"


def test_cache_command(cache_tmp, capsys):
    from ciders.models.load import cached_conversion

    cached_conversion("m", lambda tmp: (tmp / "w.bin").write_bytes(b"x" * 2048), "test")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(cache_tmp) in out and "m " in out
    assert main(["cache", "--clear", "m"]) == 0 and "removed m" in capsys.readouterr().out
    assert main(["cache", "--convert", "llama-7b"]) == 2
    assert "only smollm2-135m" in capsys.readouterr().err


def test_theory_command_prints_one_json_object_per_round(capsys):
    import json

    assert main(["theory", "--clients", "4", "--dim", "6", "--K", "3", "--eta", "0.1", "--gamma", "0.5",
                 "--alpha", "0.2", "--eps-prox", "0.1", "--rounds", "6", "--loss", "linear", "--seed", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["round"] for r in rows] == list(range(7))
    assert rows[0]["dr"] == 0.0 and rows[0]["psi"] == 1.0
    assert all(abs(r["ppr"] - r["psi"]) < 1e-10 and abs(r["dr"] - (1 - r["psi"])) < 1e-10 for r in rows)
    assert main(["theory", "--rounds", "2"]) == 0
    assert "PPR" in capsys.readouterr().out


def test_run_refuses_to_overwrite(tmp_path, capsys):
    from ciders.federation.loop import RunDir

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text('{"round": 1}')
    assert RunDir(tmp_path).committed() == 1
    assert main(["run", str(ROOT / "configs" / "tiny.yaml"), "--out", str(tmp_path)]) == 2
    assert "already holds a run (round 1 committed); pass --resume" in capsys.readouterr().err


# ----------------------------------------------------------------- output directories: never someone else's files


def _mine(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "notes.txt").write_text("mine")
    return d


def _one_line_error(capsys, *parts):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ciders: error: ") and all(p in err for p in parts), err


@pytest.mark.parametrize("argv", [
    ["run", "configs/tiny.yaml"], ["distill", "configs/tiny.yaml"], ["compare", "configs/tiny.yaml"],
    ["sweep", "configs/tiny.yaml", "--grid", "seed=0,1"], ["bilevel", "configs/cpu/rabo_fewshot.yaml"],
    ["compare", "configs/cpu/rabo_losstune.yaml"],
])
def test_experiment_commands_refuse_an_out_holding_files_ciders_did_not_write(tmp_path, capsys, argv):
    out = _mine(tmp_path / "out")
    assert main([argv[0], str(ROOT / argv[1]), *argv[2:], "--out", str(out)]) == 2
    _one_line_error(capsys, f"{out} holds files ciders did not write", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_another_commands_output_is_refused_too(tmp_path, capsys):
    from ciders.fileio import claim_output

    out = claim_output(tmp_path / "c", "compare")
    (out / "compare.json").write_text("{}")
    assert main(["run", str(ROOT / "configs" / "tiny.yaml"), "--out", str(out)]) == 2
    _one_line_error(capsys, "is the output of `ciders compare`")


def test_check_output_accepts_new_empty_own_and_legacy_directories(tmp_path):
    from ciders.errors import CidersError
    from ciders.fileio import MARKER, check_output, claim_output

    assert check_output(tmp_path / "new", "run") is False
    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty", "run") is False
    own = claim_output(tmp_path / "own", "run")
    (own / "notes.txt").write_text("mine")
    assert check_output(own, "run") is True and (own / MARKER).is_file()
    legacy = _mine(tmp_path / "legacy")
    (legacy / "checkpoints").mkdir()
    (legacy / "checkpoints" / "LATEST").write_text('{"round": 0}')  # a run written before markers
    assert check_output(legacy, "run", legacy=("checkpoints/LATEST",)) is True
    with pytest.raises(CidersError, match="holds files ciders did not write"):
        check_output(legacy, "run")
    assert check_output(legacy, "run", force=True) is False
    (tmp_path / "f").write_text("x")
    with pytest.raises(CidersError, match="is a file"):
        check_output(tmp_path / "f", "run", force=True)


@pytest.fixture
def vec_run(tmp_path):
    from ciders.federation.ciders_loop import run_federation
    from synthetic import VectorTask

    cfg = load_config(None, ["federation.clients=3", "federation.rounds=2", "algorithm.local_steps=2"])
    run_federation(cfg, VectorTask(3), tmp_path / "run", progress=False, log=lambda s: None)
    return tmp_path / "run"


def test_report_keeps_files_it_did_not_write(tmp_path, capsys, vec_run):
    target = _mine(tmp_path / "site" / "report")
    (target / "fig_loss.png").write_bytes(b"my figure")  # a name the report also writes
    (target / "fig_mine.png").write_bytes(b"my other figure")
    assert main(["report", str(vec_run), "--out", str(tmp_path / "site")]) == 2
    _one_line_error(capsys, f"{target} holds files ciders did not write")
    assert (target / "fig_loss.png").read_bytes() == b"my figure"
    assert main(["report", str(vec_run), "--out", str(tmp_path / "site"), "--force"]) == 0
    assert (target / "index.html").is_file() and (target / "fig_loss.png").read_bytes() != b"my figure"
    assert (target / "fig_mine.png").read_bytes() == b"my other figure" and (target / "notes.txt").is_file()
    assert main(["report", str(vec_run), "--out", str(tmp_path / "site")]) == 0  # its own output: no --force
    assert (target / "fig_mine.png").is_file() and (target / "notes.txt").is_file()


# ----------------------------------------------------------------- the machine's limits: one line, not a traceback


def test_a_full_disk_is_one_line(tmp_path, capsys, vec_run, monkeypatch):
    import errno
    import os

    def full(src, dst, *a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    with monkeypatch.context() as m:
        m.setattr(os, "replace", full)
        assert main(["report", str(vec_run), "--out", str(tmp_path / "site")]) == 2
    _one_line_error(capsys, "cannot write ", "index.html: disk full (ENOSPC)")
    assert not list((tmp_path / "site").rglob("*.tmp")) and not list((tmp_path / "site").glob(".*partial"))


def test_a_read_only_disk_below_any_guard_is_one_line_too(capsys, monkeypatch):
    import errno
    import os

    import ciders.report.html

    def read_only(path, out=None, force=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/mnt/ro/report/fig_loss.png")

    monkeypatch.setattr(ciders.report.html, "write_report", read_only)
    assert main(["report", "/some/run"]) == 2
    _one_line_error(capsys, "cannot write /mnt/ro/report/fig_loss.png: read-only file system (EROFS)")


def test_out_of_memory_is_one_line(capsys, monkeypatch, tmp_path):
    import ciders.experiments.theory

    def huge(*a, **kw):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 360000000000000000 bytes. Error code 12")

    with monkeypatch.context() as m:
        m.setattr(ciders.experiments.theory, "run_theory", huge)
        assert main(["theory"]) == 2
    _one_line_error(capsys, "out of memory (tried to allocate 360000000000000000 bytes)")

    def cuda(*a, **kw):
        import torch

        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                          "capacity of 139.80 GiB of which 1.2 GiB is free.")

    with monkeypatch.context() as m:
        m.setattr(ciders.experiments.theory, "run_theory", cuda)
        assert main(["theory"]) == 2
    _one_line_error(capsys, "out of memory (tried to allocate 20.00 GiB)")
    from helpers import vendored

    small = ["federation.clients=2", "federation.rounds=1", "task.eval_episodes=2", "task.width=100000000",
             f"task.data={vendored('omniglot-slice')}"]
    assert main(["bilevel", str(ROOT / "configs/cpu/rabo_fewshot.yaml"), "--methods", "rabo", "--out",
                 str(tmp_path / "b"), *[x for kv in small for x in ("--set", kv)]]) == 2
    _one_line_error(capsys, "out of memory")


@pytest.mark.parametrize("argv, err", [
    (["theory", "--eta", "nan"], "argument --eta: must be a finite number, got 'nan'"),
    (["theory", "--tau", "inf"], "argument --tau: must be a finite number, got 'inf'"),
    (["theory", "--clients", "0"], "argument --clients: must be an integer >= 1, got '0'"),
    (["theory", "--seed", str(2**64)], "argument --seed: must be an integer in [0, 2**32)"),
    (["plan", "tiny-qwen2", "-a", "2", "--lora-alpha", "inf"], "argument --lora-alpha: must be a finite number"),
    (["eval", "run", "--limit", "0"], "argument --limit: must be an integer >= 1"),
])
def test_bad_command_line_numbers_are_argparse_errors(capsys, argv, err):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and err in capsys.readouterr().err


# ----------------------------------------------------------------- watching a run; continuing it for more rounds


def _tiny(tmp_path):
    p = tmp_path / "tiny.yaml"
    import re

    # the tiny config with absolute data paths (its own are relative: to the config file, or to the checkout)
    p.write_text(re.sub(r"(\.\./)?data/", f"{ROOT}/data/", (ROOT / "configs" / "tiny.yaml").read_text()))
    return p


def test_run_lines_run_log_and_resume_for_more_rounds(tmp_path, capsys):
    from ciders.fileio import read_jsonl

    cfg, out = str(_tiny(tmp_path)), tmp_path / "run"
    assert main(["run", cfg, "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "client0 personalized messenger" in cap.out  # the result table stays on stdout
    lines = [x for x in cap.err.splitlines() if x.startswith("round ") and "|" in x]
    assert [x.split()[1] for x in lines] == ["-1/1", "0/1", "1/1"]  # as metrics.jsonl numbers them
    assert all("global ppl" in x for x in lines) and "MiB so far" in lines[-1] and "client loss" in lines[-1]
    log = (out / "run.log").read_text()
    assert all(x in log for x in lines) and "model tiny-qwen2" in log and "\r" not in log

    assert main(["run", cfg, "--out", str(out), "--resume", "--set", "federation.rounds=1"]) == 2
    assert "federation.rounds can only grow" in capsys.readouterr().err
    assert main(["run", cfg, "--out", str(out), "--resume", "--set", "federation.rounds=3",
                 "--set", "algorithm.lr=0.01"]) == 2
    assert "differs from the run's config.yaml at 'algorithm.lr'" in capsys.readouterr().err

    assert main(["run", cfg, "--out", str(out), "--resume", "--set", "federation.rounds=3", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "round " not in cap.err  # --quiet: no lines (and no bars) on the console
    rows = read_jsonl(out / "metrics.jsonl")
    assert sorted({r["round"] for r in rows if r["event"] == "round"}) == [0, 1, 2]
    assert {r["round"] for r in rows if r["event"] == "eval"} == {-1, 0, 1, 2}
    assert [r["rounds"] for r in rows if r["event"] == "extend"] == [3]
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3
    log = (out / "run.log").read_text()
    assert "federation.rounds 2 -> 3" in log and "round 2/2 | global ppl" in log  # the log still gets every line
