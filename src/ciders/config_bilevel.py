"""The typed config of a RABO-family experiment (SPEC 2): one YAML file, `ciders bilevel CONFIG`.

Sections: task (few-shot Omniglot or loss tuning on long-tailed CIFAR-10), federation (clients, their
capacities, rounds), rabo (the algorithm: `ciders.algorithms.rabo.RaboConfig`), flower (timeouts and
resources of the Flower engine, as in the CIDERS config). Same machinery as the
CIDERS config: defaults with help, unknown keys rejected, `--set section.key=value` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ciders.algorithms.bilevel import BILEVEL, METHODS
from ciders.algorithms.fedmeta import FedMetaConfig
from ciders.algorithms.rabo import RaboConfig
from ciders.config import FlowerConfig, opt, section, validate_sections
from ciders.errors import ConfigError

BACKBONES = ("conv4", "resnet12")


@dataclass(frozen=True)
class BilevelTaskConfig:
    kind: str = opt("fewshot", "fewshot (Omniglot hyper-representation) | losstune (VS-loss on long-tailed CIFAR-10)")
    data: str = opt("${CIDERS_DATA}/omniglot", "dataset directory (omniglot/ or cifar10/)")
    n_way: int = opt(5, "fewshot: N classes per episode")
    k_shot: int = opt(1, "fewshot: K support drawings per class (the inner data)")
    q_query: int = opt(5, "fewshot: query drawings per class (the outer data)")
    backbone: str = opt("conv4", "fewshot: conv4 | resnet12 (the paper's; widths from task.width: w, 2.5w, 5w, 10w)")
    width: int = opt(32, "fewshot: Conv4 channels (ResNet12: the first block's); losstune: hidden units of the "
                         "classifier")
    reg: float = opt(0.05, "L2 weight on y in the inner loss (strong convexity)")
    shard_size: int = opt(0, "fewshot: characters per client; 0 = disjoint equal shards, k > 0 = each client draws k "
                             "(may overlap; needed when clients x n_way exceeds the character pool)")
    eval_episodes: int = opt(100, "fewshot: held-out episodes for accuracy and its 95% CI")
    eval_steps: int = opt(20, "fewshot: head-fitting steps on each held-out episode's support")
    imbalance: float = opt(100.0, "losstune: imbalance ratio rho of the training set (n_c = n_max rho^(-c/(C-1)))")
    n_max: int = opt(300, "losstune: training images of the largest class (<= 500 in the shipped subset)")
    val_per_class: int = opt(50, "losstune: balanced validation images per class (from the test split)")

    def validate(self) -> None:
        if self.kind not in ("fewshot", "losstune"):
            raise ConfigError(f"task.kind: must be fewshot or losstune, got {self.kind!r}")
        if self.backbone not in BACKBONES:
            raise ConfigError(f"task.backbone: must be one of {' | '.join(BACKBONES)}, got {self.backbone!r}")
        for k in ("n_way", "k_shot", "q_query", "width", "eval_episodes", "eval_steps", "n_max", "val_per_class"):
            if getattr(self, k) < 1:
                raise ConfigError(f"task.{k}: must be >= 1, got {getattr(self, k)}")
        if self.shard_size < 0:
            raise ConfigError(f"task.shard_size: must be >= 0, got {self.shard_size}")
        if self.k_shot + self.q_query > 20:
            raise ConfigError("task.k_shot + task.q_query: an Omniglot character has 20 drawings")
        if self.imbalance < 1:
            raise ConfigError(f"task.imbalance: must be >= 1, got {self.imbalance}")
        if self.n_max > 500:
            raise ConfigError("task.n_max: the shipped CIFAR-10 train subset has 500 images per class")


@dataclass(frozen=True)
class BilevelFederationConfig:
    clients: int = opt(10, "number of clients N")
    capacities: tuple[float, ...] = opt((1.0, 0.5, 0.25, 0.125, 0.0625),
                                        "capacity ratios R, assigned to clients in turn (client i gets R[i mod len])")
    rounds: int = opt(20, "Q: global iterations")

    def validate(self) -> None:
        if self.clients < 1 or self.rounds < 1:
            raise ConfigError("federation.clients and federation.rounds must be >= 1")
        if not self.capacities or any(not 0 < r <= 1 for r in self.capacities):
            raise ConfigError(f"federation.capacities: each must be in (0, 1], got {list(self.capacities)}")

    def client_capacities(self) -> list[float]:
        return [self.capacities[i % len(self.capacities)] for i in range(self.clients)]


@dataclass(frozen=True)
class BilevelExperiment:
    name: str = opt("bilevel", "run name")
    seed: int = opt(0, "seed for shards, episodes and initial weights")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps: where the models and data of the task live")
    method: str = opt("rabo", "what runs: rabo | rafbo | fedmbo | static | fedrolex | fiarse | oap (RABO with that "
                              "extraction rule) | dist-protonet | dist-maml (few-shot) | fedavg (loss tuning, untuned); "
                              "`ciders bilevel --methods` runs several")
    task: BilevelTaskConfig = section(BilevelTaskConfig, "the bilevel task and its data")
    federation: BilevelFederationConfig = section(BilevelFederationConfig, "clients, capacities, rounds")
    rabo: RaboConfig = section(RaboConfig, "RABO / RAFBO / FedMBO (ciders.algorithms.rabo)")
    fedmeta: FedMetaConfig = section(FedMetaConfig, "the full-model baselines' local steps (ciders.algorithms.fedmeta)")
    flower: FlowerConfig = section(FlowerConfig, "Flower engine settings (`ciders bilevel --engine flower-sim`, "
                                                 "`ciders flower ...`)")

    def validate(self) -> "BilevelExperiment":
        validate_sections(self)
        if self.method not in METHODS:
            raise ConfigError(f"method: must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method in BILEVEL and BILEVEL[self.method][0] != self.rabo.method:
            raise ConfigError(f"method {self.method} runs rabo.method {BILEVEL[self.method][0]}, but the config has "
                              f"rabo.method {self.rabo.method}; set method: {self.rabo.method} or drop rabo.method")
        if self.task.kind == "losstune" and self.rabo.mask_target != "y":
            raise ConfigError("loss tuning needs rabo.mask_target: y (every client tunes all the loss hyperparameters)")
        return self


def is_bilevel(config: dict | str | Path) -> bool:
    """Whether a config (a mapping, YAML text, or the Path of a YAML file) is a bilevel experiment: it has a
    `rabo` section, which a CIDERS experiment never has. Unreadable input is not (load_config reports it)."""
    import yaml

    if isinstance(config, Path):
        if not config.is_file():
            return False
        config = config.read_text()
    if isinstance(config, str):
        try:
            config = yaml.safe_load(config)
        except yaml.YAMLError:
            return False
    return isinstance(config, dict) and "rabo" in config
