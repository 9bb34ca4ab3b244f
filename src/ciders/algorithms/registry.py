"""Every method, by name, for both families: the one table configs, the CLI, `compare`, `bilevel` and the
round functions read (docs/architecture.md, "Adding a method").

A `Method` says which family it belongs to and how it is built from an experiment config:
  ciders family   `configure(cfg) -> cfg`: CIDERS itself, or a baseline that fixes some of its knobs
                  (docs/method.md, "Baselines as knob settings"); every one runs the same client and
                  server functions (`algorithms.ciders`).
  bilevel family  RABO / RAFBO / FedMBO run `algorithms.rabo`, their `configure(rabo_cfg) -> rabo_cfg` (in
                  `algorithms.rabo`, `.rafbo`, `.fedmbo`) fixing the variant `rabo_method` and, for FedMBO, the
                  full masks; the baselines run their own `local_update` (`algorithms.fedmeta`) on
                  the task kind they belong to, the full model, or, with a `mask_rule`, the sub-model
                  that rule extracts (the paper's single-level sub-model baselines; docs/rabo.md).

The names a config may hold are declared once, as `Literal` types in the config layer
(`config.AlgorithmName`, `config.BilevelMethod`); this table must cover exactly them (checked at
import, and by tests/algorithms/test_registry.py).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

from ciders.algorithms import (dist_maml, dist_protonet, fedavg, fedavg_notune, fedbiot, fedmbo, fedot, fedprox,
                               localot, rabo, rafbo, scaffold, takd_only)
from ciders.config import AlgorithmName
from ciders.config.bilevel import BilevelMethod
from ciders.errors import ConfigError

Family = Literal["ciders", "bilevel"]


@dataclass(frozen=True)
class Method:
    name: str
    family: Family
    summary: str
    configure: Callable[[Any], Any] | None = None  # ciders: cfg -> its effective cfg; RABO variants: cfg.rabo -> its
    rabo_method: str | None = None  # bilevel: the algorithms.rabo variant it runs ...
    mask_rule: str | None = None  # a sub-model baseline's extraction rule
    local_update: Callable | None = None  # bilevel full-model baselines: their client step
    task_kind: str | None = None  # bilevel full-model baselines: the task they belong to

    @property
    def submodel_local(self) -> bool:
        """A single-level sub-model baseline: its local step runs on an extracted sub-model (`mask_rule`)."""
        return self.local_update is not None and self.mask_rule is not None

    @property
    def phases(self) -> tuple[str, ...]:
        """The message phases of one round (`federation.exchange`)."""
        if self.family == "ciders":
            return ("train",)
        return ("local",) if self.local_update is not None else ("inner", "outer")


def _ciders(metagrad: str) -> Callable:
    def configure(cfg):
        return replace(cfg, algorithm=replace(cfg.algorithm, name="ciders", metagrad=metagrad))

    return configure


_ALL = [
    Method("ciders-fo", "ciders", "CIDERS, first-order meta-gradient", _ciders("fo")),
    Method("ciders-fd", "ciders", "CIDERS, finite-difference meta-gradient", _ciders("fd")),
    Method("fedavg", "ciders", "FedAvg on the messenger", fedavg.configure),
    Method("fedprox", "ciders", "FedProx on the messenger", fedprox.configure),
    Method("scaffold", "ciders", "SCAFFOLD on the messenger", scaffold.configure),
    Method("fedot", "ciders", "offsite-tuning with FedAvg, B_L aligned once", fedot.configure),
    Method("fedbiot", "ciders", "FedBiOT: B_L re-aligned every round", fedbiot.configure),
    Method("localot", "ciders", "each client alone, nothing uploaded", localot.configure),
    Method("takd-only", "ciders", "control: the TAKD schedule alone, no client learning", takd_only.configure),
    Method("rabo", "bilevel", "RABO: implicit hypergradients on importance sub-models", rabo.configure, "rabo"),
    Method("rafbo", "bilevel", "RAFBO: second-order free (finite differences)", rafbo.configure, "rafbo"),
    Method("fedmbo", "bilevel", "FedMBO: every mask full", fedmbo.configure, "fedmbo"),
    # the paper's single-level sub-model baselines: the ProtoNet client step on each one's extracted sub-model
    Method("static", "bilevel", "single-level sub-model training, fixed leading sub-model (HeteroFL)",
           mask_rule="static", local_update=dist_protonet.local_update, task_kind="fewshot"),
    Method("fedrolex", "bilevel", "single-level sub-model training, rolling window (FedRolex)", mask_rule="rolling",
           local_update=dist_protonet.local_update, task_kind="fewshot"),
    Method("fiarse", "bilevel", "single-level sub-model training, magnitude extraction with threshold-controlled "
           "updates (FIARSE)", mask_rule="magnitude", local_update=dist_protonet.local_update, task_kind="fewshot"),
    Method("oap", "bilevel", "single-level sub-model training, coverage-aware extraction (after OAP)",
           mask_rule="oap", local_update=dist_protonet.local_update, task_kind="fewshot"),
    Method("dist-protonet", "bilevel", "FedAvg of a prototypical network", local_update=dist_protonet.local_update,
           task_kind="fewshot"),
    Method("dist-maml", "bilevel", "FedAvg of MAML", local_update=dist_maml.local_update, task_kind="fewshot"),
    Method("fedavg-notune", "bilevel", "FedAvg of the classifier on the untuned loss",
           local_update=fedavg_notune.local_update, task_kind="losstune"),
]
REGISTRY: dict[str, Method] = {m.name: m for m in _ALL}


def names(family: Family) -> tuple[str, ...]:
    return tuple(m.name for m in _ALL if m.family == family)


def get(name: str, family: Family | None = None) -> Method:
    m = REGISTRY.get(name)
    if m is None or (family is not None and m.family != family):
        choices = names(family) if family else tuple(REGISTRY)
        what = {"ciders": "algorithm", "bilevel": "bilevel method"}.get(family or "", "method")
        raise ConfigError(f"unknown {what} {name!r}; choose from {', '.join(choices)}")
    return m


def bilevel_config(exp, name: str):
    """The bilevel experiment `exp` with `name` as what it runs: FedMBO with every mask full, the baselines
    with their own client step (and only on their task kind), Static / FedRolex / FIARSE / OAP on the
    sub-model their extraction rule gives. A config that names this method but sets a contradicting
    rabo.method is an error."""
    m = get(name, "bilevel")
    if m.local_update is not None:
        if m.task_kind != exp.task.kind:
            raise ConfigError(f"{name} is a baseline of the {m.task_kind} task, not of {exp.task.kind}")
        if m.mask_rule is not None:  # a sub-model baseline: its extraction rule decides the masks
            return replace(exp, method=name, rabo=replace(exp.rabo, method="rabo", mask_rule=m.mask_rule)).validate()
        return replace(exp, method=name).validate()
    if exp.method == name and exp.rabo.method not in (m.rabo_method, "rabo"):
        raise ConfigError(f"method {name} runs rabo.method {m.rabo_method}, but the config has rabo.method "
                          f"{exp.rabo.method}; set method: {exp.rabo.method} or drop rabo.method")
    rabo = m.configure(exp.rabo)
    # checked here, where each run's method is fixed: a config loaded for `--methods rafbo` may name another
    if rabo.coordinates and rabo.method != "rafbo":
        raise ConfigError(f"rabo.coordinates: the coordinate-wise estimator is RAFBO's, and {name} runs "
                          f"{rabo.method}; run it with --methods rafbo")
    return replace(exp, method=name, rabo=rabo).validate()


def _check_against_config() -> None:
    """The table covers exactly the names the config layer declares."""
    ciders_names = {"ciders" if n.startswith("ciders-") else n for n in names("ciders")}
    declared = set(typing.get_args(AlgorithmName))
    if ciders_names != declared:
        raise RuntimeError(f"algorithm registry {sorted(ciders_names)} != config.AlgorithmName {sorted(declared)}")
    if set(names("bilevel")) != set(typing.get_args(BilevelMethod)):
        raise RuntimeError(f"bilevel registry {names('bilevel')} != config.BilevelMethod "
                           f"{typing.get_args(BilevelMethod)}")


_check_against_config()
