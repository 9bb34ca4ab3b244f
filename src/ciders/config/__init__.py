"""Experiment configs: plain typed data at the bottom of the layers (docs/architecture.md).

One YAML file describes a whole experiment and declares its method family at the top level:
  family: ciders    `ExperimentConfig` (CIDERS and its baselines; the default when the key is absent)
  family: bilevel   `BilevelExperiment` (RABO / RAFBO / FedMBO and their baselines)
`load_experiment` / `loads_experiment` are the one entry point that reads the family and builds the right
class; `load_config(path, cls=...)` loads a known class. Every key has a default and a help text, unknown
keys and wrong types fail with the key named, `--set section.key=value` overrides follow the same rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ciders.config.base import *  # noqa: F401,F403 - the CIDERS sections and the machinery
from ciders.config.base import (AlgorithmName, ExperimentConfig, apply_overrides, check_choices, describe_keys,  # noqa: F401
                                dump_yaml, field_choices, from_dict, literal_choices, load_config, load_run_config, loads_config, opt,
                                section, to_dict, validate_sections)
from ciders.config.bilevel import (BilevelExperiment, BilevelFederationConfig, BilevelMethod,  # noqa: F401
                                   BilevelTaskConfig, FedMetaConfig, RaboConfig)
from ciders.errors import ConfigError

FAMILIES: dict[str, type] = {"ciders": ExperimentConfig, "bilevel": BilevelExperiment}


def family_of(config: dict | str | Path) -> str:
    """The declared family of a config (a mapping, YAML text, or the Path of a YAML file); "ciders" when the
    file does not say. A family that is not one of FAMILIES is an error naming the choices."""
    data: Any = config
    if isinstance(config, Path):
        if not config.is_file():
            raise ConfigError(f"config file not found: {config}")
        data = config.read_text(encoding="utf-8")
    if isinstance(data, str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise ConfigError(f"not valid YAML: {exc}") from exc
    fam = data.get("family", "ciders") if isinstance(data, dict) else "ciders"
    if fam not in FAMILIES:
        raise ConfigError(f"family: must be one of {', '.join(FAMILIES)}, got {fam!r}")
    return fam


def load_experiment(path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """The experiment a YAML file describes, as the class of its declared family (overrides applied,
    validated)."""
    fam = "ciders" if path is None else family_of(Path(path))
    for o in overrides or []:
        if o.partition("=")[0].strip() == "family":
            raise ConfigError("family: is declared by the config file and cannot be overridden with --set")
    try:
        return load_config(path, overrides, cls=FAMILIES[fam])
    except ConfigError as exc:
        # a file that does not declare its family is read as CIDERS; say so when its keys are another family's
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) if path is not None else None
        if isinstance(data, dict) and "family" not in data:
            others = [f for f, cls in FAMILIES.items() if f != fam and set(data) <= _keys(cls)]
            if others:
                raise ConfigError(f"{exc}; {path} does not declare its family, so it was read as {fam}: add "
                                  f"`family: {others[0]}` at its top level") from exc
        raise


def _keys(cls: type) -> set:
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def loads_experiment(text: str, what: str = "config") -> Any:
    """The same from YAML text (e.g. a config carried in a Flower message)."""
    return loads_config(text, what, cls=FAMILIES[family_of(text)])
