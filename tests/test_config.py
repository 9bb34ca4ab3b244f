import pytest

from ciders.config import (
    DEFAULT_LORA_TARGETS,
    ExperimentConfig,
    describe_keys,
    dump_yaml,
    from_dict,
    load_config,
    to_dict,
)
from ciders.errors import ConfigError
from conftest import ROOT


def write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_defaults_and_shipped_configs_validate():
    cfg = load_config(None)
    assert cfg.lora.messenger.targets == DEFAULT_LORA_TARGETS and cfg.lora.messenger.r == 4
    assert cfg.lora.messenger.alpha == 16 and cfg.lora.messenger.dropout == 0.05
    assert cfg.takd.lambda_out == 0.5 and cfg.takd.round_steps == 5
    assert cfg.decomposition.split_kwargs() == {"rounding": "round", "drop_ratio": 0.2}
    for p in (ROOT / "configs").glob("*.yaml"):
        load_config(p)


def test_roundtrip_through_yaml(tmp_path):
    cfg = load_config(None, ["takd.lr=1e-3", "lora.student.targets=q_proj,v_proj", "decomposition.beta=0.5"])
    assert cfg.takd.lr == 1e-3 and cfg.lora.student.targets == ("q_proj", "v_proj")
    again = load_config(write(tmp_path, dump_yaml(cfg)))
    assert again == cfg and to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize(
    "text, match",
    [
        ("takd:\n  lrr: 1\n", "unknown config key 'takd.lrr'"),
        ("modle:\n  name: x\n", "unknown config key 'modle'"),
        ("takd:\n  lr: fast\n", "takd.lr: expected a number"),
        ("seed: 1.5\n", "seed: expected an integer"),
        ("decomposition:\n  beta: 1.5\n", r"decomposition.beta: must be in \(0, 1\]"),
        ("decomposition:\n  beta: 0.5\n  drop_ratio: 0.5\n", "set only one of beta, drop_ratio"),
        ("decomposition:\n  messenger_layers: 0\n", "decomposition.messenger_layers: must be >= 1"),
        ("takd:\n  hidden_loss: l1\n", "takd.hidden_loss: must be one of mean, sum, teacher_rms"),
        ("lora:\n  messenger:\n    r: 0\n", "lora.messenger.r: must be >= 1"),
        ("lora:\n  student:\n    alpha: -1\n", "lora.student.alpha: must be > 0"),
        ("takd:\n  batch_size: 0\n", "takd.batch_size: must be >= 1"),
        ("takd: 3\n", "takd: expected a mapping"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("a: [1\n", "not valid YAML"),
    ],
)
def test_bad_files_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "override, match",
    [
        ("takd.nope=1", "unknown key 'nope' under 'takd'"),
        ("nope.lr=1", "unknown key 'nope'"),
        ("takd=1", "is a section"),
        ("seed.x=1", "'seed' is not a section"),
        ("takdlr", "expected key=value"),
        ("takd.lr=-1", "takd.lr: must be >= 0"),
    ],
)
def test_bad_overrides(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_override_types():
    cfg = load_config(None, ["decomposition.beta=1", "seed=7", "data.public_limit=null", "model.attn_implementation=eager"])
    assert cfg.decomposition.beta == 1.0 and isinstance(cfg.decomposition.beta, float)
    assert cfg.seed == 7 and cfg.data.public_limit is None and cfg.model.attn_implementation == "eager"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/no/such.yaml")


def test_every_key_has_help():
    rows = describe_keys()
    assert {r[0] for r in rows} >= {"seed", "takd.lambda_out", "lora.messenger.r", "decomposition.rounding"}
    assert all(help_ for _, _, help_ in rows)
    assert from_dict(ExperimentConfig, {}) == ExperimentConfig()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["federation.partition=files"], "needs one data.client_files entry per client"),
        (["data.clients=null"], "partition=iid needs data.clients"),
        (["federation.per_round=5"], r"federation.per_round: must be in \[1, clients=3\]"),
        (["federation.rounds=0"], "federation.rounds: must be >= 1"),
        (["algorithm.gamma=-0.1"], r"algorithm.gamma: must be in \[0, 1\]"),
        (["algorithm.alpha=0"], r"algorithm.alpha: must be in \(0, 1\]"),
        (["algorithm.tau=0"], "algorithm.tau: must be > 0"),
        (["algorithm.local_steps=0"], "algorithm.local_steps: K must be >= 1"),
    ],
)
def test_federation_checks(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
    ok = load_config(None, ["federation.partition=files", "data.client_files=[a.jsonl, b.jsonl, c.jsonl]"])
    assert ok.data.client_files == ("a.jsonl", "b.jsonl", "c.jsonl")
