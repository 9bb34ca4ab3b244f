import re
from pathlib import Path
from dataclasses import dataclass as dataclasses_dataclass
from typing import Literal, Optional  # noqa: F401 - resolved in _Toy's string annotations
from typing import get_args as typing_get_args

import functools

import pytest

from ciders.config import (
    DEFAULT_LORA_TARGETS,
    ExperimentConfig,
    describe_keys,
    dump_yaml,
    from_dict,
    load_config,
    loads_config,
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
    assert ok.data.client_files == tuple(str(Path.cwd() / f) for f in ("a.jsonl", "b.jsonl", "c.jsonl"))


# ------------------------------------------------------------------------- choices written once (Literal)


def _literal_keys(cls=ExperimentConfig, prefix=""):
    """(key, choices, is_tuple) of every Literal-typed leaf key, read from the annotations."""
    import dataclasses
    import typing

    from ciders.config import field_choices

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _literal_keys(hints[f.name], f"{prefix}{f.name}.")
        elif (choices := field_choices(cls, f.name)) is not None:
            yield f"{prefix}{f.name}", choices, typing.get_origin(hints[f.name]) is tuple


def test_every_literal_key_rejects_a_bad_value_naming_key_value_and_choices():
    import re

    from ciders.config import apply_overrides, check_choices

    keys = {k: (c, t) for k, c, t in _literal_keys() if "." in k}  # the top-level `family` has one choice
    assert set(keys) >= {"model.dtype", "decomposition.rounding", "takd.hidden_loss", "takd.kd_tokens",
                         "takd.teacher_cache", "algorithm.name", "algorithm.optimizer", "data.task", "data.format",
                         "federation.partition", "federation.eval_clients", "eval.tasks"}
    assert keys["takd.hidden_loss"] == (("mean", "sum", "teacher_rms"), False)
    for key, (choices, is_tuple) in keys.items():
        for c in choices:  # every declared choice passes (the cross-field rules aside)
            cfg = from_dict(ExperimentConfig, apply_overrides({}, [f"{key}=[{c}]" if is_tuple else f"{key}={c}"]))
            check_choices(cfg)
            got = functools.reduce(getattr, key.split("."), cfg)  # nested sections too (federation.dp.mode)
            assert got == ((c,) if is_tuple else c)
        listed = re.escape(", ".join(choices))
        if is_tuple:
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: each entry must be one of {listed}, "
                                                  r"got 'bogus'$"):
                load_config(None, [f"{key}=[{choices[0]}, bogus]"])
        else:
            alias = re.escape(" (or ciders-fo, ciders-fd)") if key == "algorithm.name" else ""
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: must be one of {listed}{alias}, got 'bogus'$"):
                load_config(None, [f"{key}=bogus"])


def test_yaml_bools_read_back_as_the_choice_written(tmp_path):
    # YAML 1.1 reads a bare `off` as false: the Literal field takes the choice back
    assert load_config(write(tmp_path, "takd:\n  teacher_cache: off\n")).takd.teacher_cache == "off"
    assert load_config(None, ["takd.teacher_cache=off"]).takd.teacher_cache == "off"
    with pytest.raises(ConfigError, match="^takd.kd_tokens: must be one of all, response, got True$"):
        load_config(write(tmp_path, "takd:\n  kd_tokens: yes\n"))


def test_help_lists_the_choices_from_the_annotation():
    rows = {k: h for k, _, h in describe_keys()}
    assert rows["algorithm.optimizer"] == "OPTIM of Eq. 4 (paper: AdamW) (choose from sgd | adamw)"
    assert rows["eval.tasks"].endswith("(choose from ppl | gsm8k | rouge_l | humaneval:python | humaneval:java | "
                                       "humaneval:go | nll_matrix)")
    assert "choose from" not in rows["takd.lr"]


def test_a_section_validated_alone_checks_its_choices():
    from ciders.config import CidersConfig, EvalConfig, TAKDConfig

    with pytest.raises(ConfigError, match="^takd.kd_tokens: must be one of all, response, got 'some'$"):
        TAKDConfig(kd_tokens="some").validate()
    with pytest.raises(ConfigError, match="^eval.tasks: each entry must be one of .*, got 'bleu'$"):
        EvalConfig(tasks=("gsm8k", "bleu")).validate()
    EvalConfig(tasks=("gsm8k", "humaneval:go")).validate()
    CidersConfig(name="fedprox").validate()


# string annotations, as `from __future__ import annotations` leaves them
@dataclasses_dataclass(frozen=True)
class _Toy:
    a: "Literal['x', 'y']" = "x"
    b: "Optional[Literal['p', 'q']]" = None
    c: "tuple[Literal['u', 'v'], ...]" = ()
    d: "Literal['x'] | Literal['z'] | None" = None
    e: "Literal['x'] | str" = "free"
    f: str = "free"


def test_choices_are_read_through_string_annotations_optional_union_and_tuples():
    from ciders.config import check_choices, field_choices, literal_choices

    assert [field_choices(_Toy, k) for k in "abcdef"] == [("x", "y"), ("p", "q"), ("u", "v"), ("x", "z"), None, None]
    assert literal_choices(Optional[Literal["a", "b"]]) == ("a", "b") and literal_choices(int) is None
    check_choices(_Toy(a="y", b=None, c=("v", "u"), d="z", e="anything", f="anything"), "toy")
    for kw, msg in [({"a": "z"}, "toy.a: must be one of x, y, got 'z'"),
                    ({"b": "r"}, "toy.b: must be one of p, q, got 'r'"),
                    ({"c": ("u", "w")}, "toy.c: each entry must be one of u, v, got 'w'"),
                    ({"d": "y"}, "toy.d: must be one of x, z, got 'y'"),
                    ({"a": None}, "toy.a: must be one of x, y, got None")]:
        with pytest.raises(ConfigError) as exc:
            check_choices(_Toy(**kw), "toy")
        assert str(exc.value) == msg


def test_names_declared_in_config_match_the_registries():
    """config imports nothing above ciders.errors, so it declares task / evaluation / dtype names itself."""
    import ast

    import ciders.config as config
    from ciders.runtime import DTYPES
    from ciders.tasks.registry import TASKS

    try:
        from ciders.workloads.evaluation import EVAL_TASKS
    except ImportError:  # before the engines/ move
        from ciders.engines.evaluation import EVAL_TASKS

    assert config.TASK_NAMES == ("custom", *TASKS)
    assert config.EVAL_TASK_NAMES == tuple(EVAL_TASKS)
    assert typing_get_args(config.DtypeName) == ("auto", *DTYPES)
    from pathlib import Path

    for path in Path(config.__file__).parent.glob("*.py"):  # the config package: base, bilevel, __init__
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert {m for m in imported if m.split(".")[0] == "ciders" and not m.startswith("ciders.config")} <= \
            {"ciders.errors"}, path


def test_the_family_is_declared_not_guessed(tmp_path):
    from ciders.config import BilevelExperiment, family_of, load_experiment

    p = tmp_path / "b.yaml"
    p.write_text("family: bilevel\nrabo: {beta: 0.2}\n")
    exp = load_experiment(p)
    assert isinstance(exp, BilevelExperiment) and exp.rabo.beta == 0.2 and family_of(p) == "bilevel"
    assert load_experiment(None).family == "ciders"
    p.write_text("rabo: {beta: 0.2}\n")  # no family: read as CIDERS, and the error says what to add
    with pytest.raises(ConfigError, match="unknown config key 'rabo'.*add `family: bilevel`"):
        load_experiment(p)
    p.write_text("family: fedx\n")
    with pytest.raises(ConfigError, match="family: must be one of ciders, bilevel, got 'fedx'"):
        load_experiment(p)
    with pytest.raises(ConfigError, match="cannot be overridden"):
        load_experiment(None, ["family=bilevel"])


# ------------------------------------------------------------------------- non-finite numbers and seeds


def _float_keys(cls, prefix=""):
    """(key, is_tuple) of every float-typed leaf key (float, float | None, tuple[float, ...])."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _float_keys(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is tuple and float in typing.get_args(tp):
            yield f"{prefix}{f.name}", True
        elif tp is float or float in typing.get_args(tp):
            yield f"{prefix}{f.name}", False


def _families():
    from ciders.config import FAMILIES

    return list(FAMILIES.items())


def test_every_float_key_of_every_family_rejects_nan_and_inf(tmp_path):
    import dataclasses

    from ciders.config import load_experiment

    n = 0
    for fam, cls in _families():
        keys = list(_float_keys(cls))
        assert len(keys) > 10, fam
        for key, is_tuple in keys:
            where = f"{key}[1]" if is_tuple else key
            for raw, shown, yaml_too in (("nan", "nan", False), ("-inf", "-inf", False), (".nan", "nan", True),
                                         (".inf", "inf", True), ("-.Inf", "-inf", True)):
                value = f"[1.0, {raw}]" if is_tuple else raw
                msg = f"^{re.escape(where)}: must be a finite number, got {shown}$"
                with pytest.raises(ConfigError, match=msg):  # --set
                    load_config(None, [f"{key}={value}"], cls=cls)
                if yaml_too:  # in a file, YAML spells them .nan / .inf (a bare nan is a string: not a number)
                    parts = key.split(".")
                    text = f"family: {fam}\n" + "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parts[:-1]))
                    text += f"{'  ' * (len(parts) - 1)}{parts[-1]}: {value}\n"
                    with pytest.raises(ConfigError, match=msg):
                        load_experiment(write(tmp_path, text))
                n += 1
        # a config built in Python is checked by validate()
        cfg = load_config(None, cls=cls)
        key, is_tuple = keys[0]
        head, _, leaf = key.rpartition(".")
        section = getattr(cfg, head) if head else cfg
        bad = dataclasses.replace(section, **{leaf: (float("nan"),) if is_tuple else float("nan")})
        with pytest.raises(ConfigError, match=f"^{key}.*: must be a finite number, got nan$"):
            (dataclasses.replace(cfg, **{head: bad}) if head else bad).validate()
    assert n > 100


@pytest.mark.parametrize("seed", [-1, 2**32, 2**64, "1.5"])
def test_seeds_outside_what_every_generator_takes_are_rejected(seed):
    for _, cls in _families():
        with pytest.raises(ConfigError, match="^seed: "):
            load_config(None, [f"seed={seed}"], cls=cls)
        assert load_config(None, [f"seed={2**32 - 1}"], cls=cls).seed == 2**32 - 1


def test_compare_seeds_are_checked_like_the_config_seed():
    from ciders.errors import CidersError
    from ciders.experiments.compare import parse_seeds

    assert parse_seeds("0,4294967295") == [0, 2**32 - 1]
    with pytest.raises(CidersError, match=r"--seeds: must be an integer in \[0, 2\*\*32\), got -1"):
        parse_seeds("0,-1")


def test_numbers_in_an_overridden_list_are_numbers():
    from ciders.config.bilevel import BilevelExperiment

    cfg = load_config(None, ["federation.capacities=[1e-1, 5e-1, 1]"], cls=BilevelExperiment)
    assert cfg.federation.capacities == (0.1, 0.5, 1.0)
    assert load_config(None, ["lora.student.targets=[q_proj, v_proj]"]).lora.student.targets == ("q_proj", "v_proj")


def test_algorithm_name_takes_the_method_names_of_algorithms():
    for name, mg in (("ciders-fo", "fo"), ("ciders-fd", "fd")):
        cfg = load_config(None, [f"algorithm.name={name}"])
        assert (cfg.algorithm.name, cfg.algorithm.metagrad, cfg.algorithm.method) == ("ciders", mg, name)
        assert loads_config(f"algorithm: {{name: {name}}}\n").algorithm.method == name
    with pytest.raises(ConfigError, match="algorithm.name=ciders-fd says metagrad fd, but algorithm.metagrad=fo"):
        load_config(None, ["algorithm.name=ciders-fd", "algorithm.metagrad=fo"])


def test_unknown_keys_and_choices_say_did_you_mean():
    with pytest.raises(ConfigError, match=r"--set algorithm.lrr: unknown key 'lrr' under 'algorithm'; "
                                          r"did you mean 'algorithm.lr'\?"):
        load_config(None, ["algorithm.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'federation.round'; did you mean 'federation.rounds'\?"):
        loads_config("federation: {round: 3}\n")
    with pytest.raises(ConfigError, match=r"got 'fedbiott'; did you mean 'fedbiot'\?"):
        load_config(None, ["algorithm.name=fedbiott"])
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'") as e:
        load_config(None, ["zzz=1"])
    assert "did you mean" not in str(e.value)  # nothing close: no guess


def test_a_run_directory_config_reads_relative_paths_as_the_old_runs_meant_them(tmp_path, monkeypatch):
    from ciders.config import load_run_config

    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    rel, absolute = str(Path("data", "p.jsonl")), str(tmp_path / "e.jsonl")  # not literal paths: test_docs checks those
    (run / "config.yaml").write_text(f"data: {{public: {rel}, eval: {absolute}}}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(run / "config.yaml")
    assert cfg.data.public == str(tmp_path / rel)  # where the run was started, not the run dir
    assert cfg.data.eval == absolute
    fresh = load_config(None, [f"data.public={rel}"])
    (run / "config.yaml").write_text(dump_yaml(fresh))
    monkeypatch.chdir(run)  # a new run's config.yaml is absolute: the same from anywhere
    assert load_run_config(run / "config.yaml") == fresh


def test_the_takd_task_weight_defaults_are_the_measured_ones_the_docs_state():
    """The task-CE weights decide comparisons (docs/results-cpu.md#the-takd-task-weight-a-dose-response), so the
    defaults must be the ones the dose-response chose and docs/method.md states, and the configs of documented
    results must pin the weights they were measured with."""
    from ciders.config import load_config
    from ciders.config.base import TAKDConfig
    from conftest import ROOT

    t = TAKDConfig()
    assert (t.lambda_task, t.lambda_task_bootstrap) == (0.3, 0.0)
    doc = (ROOT / "docs" / "method.md").read_text()
    assert "`lambda_task: 0.3` in the per-round steps and\n`lambda_task_bootstrap: 0`" in doc
    for name in ("protocol_a", "protocol_b", "protocol_h"):
        c = load_config(ROOT / "configs" / "cpu" / f"{name}.yaml", []).takd
        assert (c.lambda_task, c.lambda_task_bootstrap) == (1.0, 1.0), name
