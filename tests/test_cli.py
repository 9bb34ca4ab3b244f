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
