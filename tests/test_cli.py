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
