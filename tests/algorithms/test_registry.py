"""The method registry: one typed table for both families, matching the names the config layer declares."""

import typing
from dataclasses import replace

import pytest

from ciders import algorithms
from ciders.algorithms import dist_maml, fedot, registry
from ciders.config import AlgorithmName, BilevelExperiment, BilevelMethod, load_config
from ciders.core import masks as mk
from ciders.config.bilevel import MaskRule
from ciders.errors import ConfigError


def test_the_registry_covers_exactly_the_declared_names():
    assert set(registry.names("bilevel")) == set(typing.get_args(BilevelMethod))
    ciders = {"ciders" if n.startswith("ciders-") else n for n in registry.names("ciders")}
    assert ciders == set(typing.get_args(AlgorithmName))
    assert set(typing.get_args(MaskRule)) == set(mk.RULES)
    # one name, one method: no name is used by both families
    assert len(registry.REGISTRY) == len(registry.names("ciders")) + len(registry.names("bilevel"))


def test_a_registry_that_misses_a_declared_name_fails_at_import(monkeypatch):
    monkeypatch.setattr(registry, "_ALL", [m for m in registry._ALL if m.name != "oap"])
    with pytest.raises(RuntimeError, match="bilevel registry"):
        registry._check_against_config()


def test_methods_are_typed_rows_not_module_paths():
    m = registry.get("dist-maml", "bilevel")
    assert m.local_update is dist_maml.local_update and m.task_kind == "fewshot" and m.phases == ("local",)
    rolex = registry.get("fedrolex")  # a single-level sub-model baseline: the ProtoNet step on its sub-model
    assert rolex.mask_rule == "rolling" and rolex.phases == ("local",) and rolex.submodel_local
    assert rolex.local_update is registry.dist_protonet.local_update and rolex.task_kind == "fewshot"
    assert registry.get("rabo").phases == ("inner", "outer") and not registry.get("dist-maml").submodel_local
    assert registry.get("fedot", "ciders").configure is fedot.configure
    assert registry.get("ciders-fd").phases == ("train",)


def test_unknown_or_wrong_family_names_are_errors_naming_the_choices():
    with pytest.raises(ConfigError, match="unknown algorithm 'rabo'; choose from ciders-fo"):
        registry.get("rabo", "ciders")
    with pytest.raises(ConfigError, match="unknown bilevel method 'fedavg'; choose from rabo"):
        registry.get("fedavg", "bilevel")


def test_configure_reads_the_config_s_own_method():
    cfg = load_config(None, ["algorithm.metagrad=fd"])
    assert cfg.algorithm.method == "ciders-fd" and algorithms.configure(cfg).algorithm.metagrad == "fd"
    assert algorithms.configure(cfg, "fedavg").algorithm.method == "fedavg"


def test_bilevel_config_sets_what_the_method_runs():
    exp = BilevelExperiment()
    fedmbo = registry.bilevel_config(exp, "fedmbo")
    assert fedmbo.rabo.mask_rule == "full" and fedmbo.rabo.method == "fedmbo" and fedmbo.method == "fedmbo"
    assert registry.bilevel_config(exp, "rafbo").rabo.method == "rafbo"
    with pytest.raises(ConfigError, match="dist-maml is a baseline of the fewshot task"):
        registry.bilevel_config(replace(exp, task=replace(exp.task, kind="losstune"),
                                        rabo=replace(exp.rabo, mask_target="y")), "dist-maml")


def test_rafbos_coordinate_estimator_is_checked_where_the_method_is_fixed():
    """A config loaded for `ciders bilevel --methods rafbo --set rabo.coordinates=true` names the default method;
    RAFBO gets the estimator, RABO and FedMBO refuse it (they would ignore it)."""
    from ciders.algorithms.registry import bilevel_config
    from ciders.config.base import load_config
    from ciders.config.bilevel import BilevelExperiment
    from ciders.errors import ConfigError

    exp = load_config(None, ["rabo.coordinates=true"], cls=BilevelExperiment)
    assert bilevel_config(exp, "rafbo").rabo.coordinates
    for name in ("rabo", "fedmbo"):
        with pytest.raises(ConfigError, match="coordinate-wise estimator is RAFBO's, and"):
            bilevel_config(exp, name)
