"""The typed config of a RABO-family experiment (`family: bilevel`; docs/rabo.md): one YAML file,
`ciders bilevel CONFIG`.

Sections: task (few-shot Omniglot or loss tuning on long-tailed CIFAR-10), federation (clients, their
capacities, rounds), rabo (the algorithm: `ciders.algorithms.rabo.RaboConfig`), flower (timeouts and
resources of the Flower engine, as in the CIDERS config). Same machinery as the
CIDERS config: defaults with help, unknown keys rejected, `--set section.key=value` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Literal

from ciders.config.federation import RunFederation
from ciders.config.base import FlowerConfig, check_choices, check_seed, opt, section, validate_sections
from ciders.errors import ConfigError

# The methods a bilevel experiment can run, declared once; `ciders.algorithms.registry` holds what each one is
# and checks at import that it covers exactly these names.
BilevelMethod = Literal["rabo", "rafbo", "fedmbo", "static", "fedrolex", "fiarse", "oap", "dist-protonet",
                        "dist-maml", "fedavg-notune"]
# sub-model extraction rules (`core.masks.RULES`, checked equal by tests/core/test_masks.py)
MaskRule = Literal["importance", "static", "rolling", "magnitude", "oap", "full", "segment"]

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
    reg_way: int = opt(5, "fewshot: 0 = task.reg at every N; k > 0 = task.reg * k / n_way, so the L2 term keeps its "
                          "weight against the support cross-entropy, whose gradient on each class's row of y "
                          "shrinks as 1/N (docs/rabo.md#the-heads-l2-weight-and-n); 5, the default: the given reg "
                          "at 5-way. Chosen by measurement: +7.0 and +4.6 points for RABO at 20-way. Loss tuning "
                          "has no N and ignores it")
    shard_size: int = opt(0, "fewshot: characters per client; 0 = disjoint equal shards, k > 0 = each client draws k "
                             "(may overlap; needed when clients x n_way exceeds the character pool)")
    rotations: int = opt(1, "fewshot: each training character at this many rotations by 90 degrees, each a class "
                         "(1 = none, 4 = the standard augmentation: 136 -> 544 classes, so disjoint shards of 50 "
                         "clients still hold 5-way episodes); held-out evaluation is never rotated")
    episodes: int = opt(1, "fewshot: episodes each client draws per round (the paper's N_m tasks): the inner steps and "
                           "the baselines' local steps cycle through them, the outer loss averages over them "
                           "(rabo.head: episode: one head and hypergradient per episode, averaged)")
    eval_episodes: int = opt(100, "fewshot: held-out episodes for accuracy and its 95% CI")
    eval_steps: int = opt(20, "fewshot: head-fitting steps on each held-out episode's support")
    imbalance: float = opt(100.0, "losstune: imbalance ratio rho of the training set (n_c = n_max rho^(-c/(C-1)))")
    n_max: int = opt(300, "losstune: training images of the largest class (<= 500 in the shipped subset)")
    val_per_class: int = opt(50, "losstune: balanced validation images per class (from the test split)")
    tune_per_class: int = opt(0, "losstune: balanced images per class held out of the test split for step-size "
                                 "tuning (`ciders bilevel --tune`), disjoint from validation and test; 0 = none")
    tune_alphabets: tuple[str, ...] = opt((), "fewshot: training alphabets held out of training as the tuning split "
                                              "(`ciders bilevel --tune`): episodes of their unrotated characters, "
                                              "disjoint from the training and test characters; e.g. "
                                              "[Early_Aramaic] (22 characters); empty = none")

    def validate(self) -> None:
        if self.kind not in ("fewshot", "losstune"):
            raise ConfigError(f"task.kind: must be fewshot or losstune, got {self.kind!r}")
        if self.backbone not in BACKBONES:
            raise ConfigError(f"task.backbone: must be one of {' | '.join(BACKBONES)}, got {self.backbone!r}")
        for k in ("n_way", "k_shot", "q_query", "width", "episodes", "eval_episodes", "eval_steps", "n_max",
                  "val_per_class"):
            if getattr(self, k) < 1:
                raise ConfigError(f"task.{k}: must be >= 1, got {getattr(self, k)}")
        if self.shard_size < 0:
            raise ConfigError(f"task.shard_size: must be >= 0, got {self.shard_size}")
        if not isinstance(self.reg_way, int) or isinstance(self.reg_way, bool) or self.reg_way < 0:
            raise ConfigError(f"task.reg_way: an integer >= 0 (0 = no scaling), got {self.reg_way!r}")
        if self.rotations not in (1, 2, 3, 4):
            raise ConfigError(f"task.rotations: must be 1, 2, 3 or 4 (multiples of 90 degrees), got {self.rotations}")
        if self.k_shot + self.q_query > 20:
            raise ConfigError("task.k_shot + task.q_query: an Omniglot character has 20 drawings")
        if self.imbalance < 1:
            raise ConfigError(f"task.imbalance: must be >= 1, got {self.imbalance}")
        if self.tune_per_class < 0 or self.val_per_class + self.tune_per_class >= 1000:
            raise ConfigError("task.tune_per_class: must be >= 0, and val_per_class + tune_per_class must leave "
                              "test images of the 1000 per class")
        if any(not isinstance(a, str) or not a for a in self.tune_alphabets):
            raise ConfigError(f"task.tune_alphabets: a list of alphabet names, got {list(self.tune_alphabets)!r}")
        if self.tune_alphabets and self.kind != "fewshot":
            raise ConfigError("task.tune_alphabets: the few-shot task's tuning split; loss tuning uses "
                              "task.tune_per_class")
        if self.n_max > 500:
            raise ConfigError("task.n_max: the shipped CIFAR-10 train subset has 500 images per class")


@dataclass(frozen=True)
class BilevelFederationConfig(RunFederation):
    """The RABO family's federation keys (the shared ones: `config.federation.RunFederation`)."""

    clients: int = opt(10, "number of clients N")
    capacities: tuple[float, ...] = opt((1.0, 0.5, 0.25, 0.125, 0.0625),
                                        "capacity ratios R, assigned to clients in turn (client i gets R[i mod len])")
    rounds: int = opt(20, "Q: global iterations")
    max_step_ratio: float | None = opt(
        10.0, "reject a reply whose server step (beta G_i, alpha h_i, or the local baselines' model change) exceeds "
        "this multiple of max(r, 1), r the norm at the run's start of what it moves (||y_0||, ||x_0||, ||(x_0, y_0)||; "
        "docs/security.md#aggregation); null = accept any finite step")

    def validate(self) -> None:
        check_choices(self, "federation")
        self.validate_shared()
        if not self.capacities or any(not 0 < r <= 1 for r in self.capacities):
            raise ConfigError(f"federation.capacities: each must be in (0, 1], got {list(self.capacities)}")

    def client_capacities(self) -> list[float]:
        return [self.capacities[i % len(self.capacities)] for i in range(self.clients)]


@dataclass(frozen=True)
class RaboConfig:
    method: Literal["rabo", "rafbo", "fedmbo"] = opt("rabo", "rafbo is second-order free; fedmbo has every mask full")
    mask_rule: MaskRule = opt("importance", "sub-model extraction: importance, static (HeteroFL), rolling (FedRolex), "
                                            "magnitude (FIARSE), oap (coverage-aware, after Zhou et al.), segment "
                                            "(rabo.segments), full")
    segments: tuple[int, ...] = opt((), "mask_rule segment: client i keeps the window of k units starting at unit "
                                        "segments[i mod len] * k of every layer, for all rounds (the C_x* ablation); "
                                        "empty = segment i")
    mask_target: Literal["both", "y"] = opt("both", "y: hyperparameter tasks, where every client needs all of x")
    mask_norm: Literal["l1", "l2", "bn_scale"] = opt("l1", "importance score of a unit: the l1 or l2 norm of its "
                                                           "weights, or bn_scale: |scale| of its layer's BN "
                                                           "(ties: l1), which tracks training under BN")
    keep_full: tuple[str, ...] = opt((), "layers never pruned (e.g. head: outputs are the classes)")
    inner_steps: int = opt(5, "T: local inner steps on y per round")
    beta: float = opt(0.1, "inner learning rate")
    alpha: float = opt(0.05, "outer learning rate")
    solver: Literal["cg", "neumann"] = opt("cg", "[grad^2_yy g]^{-1} grad_y f (RAFBO: on finite-difference products)")
    solver_iters: int = opt(10, "CG iterations / Neumann terms")
    neumann_eta: float = opt(0.05, "Neumann step (< 2 / lambda_max of the inner Hessian)")
    fd_delta: float = opt(1e-3, "RAFBO finite-difference step (mu)")
    coordinates: bool = opt(False, "RAFBO: the coordinate-wise Jacobian estimator (low-dimensional x)")
    head: Literal["global", "episode"] = opt(
        "global", "few-shot: global = one head y shared by every episode (the paper's notation: inner phase on y_q, "
        "server average, hypergradient at y_{q+1}); episode = each client fits its own head from y = 0 on its "
        "episode's support (T steps of beta) and takes the hypergradient there, one phase per round, y never sent "
        "back (docs/rabo.md#one-head-per-episode)")

    def validate(self) -> "RaboConfig":
        check_choices(self, "rabo")
        for k in ("inner_steps", "solver_iters"):
            if getattr(self, k) < 1:
                raise ConfigError(f"rabo.{k}: must be >= 1, got {getattr(self, k)}")
        for k in ("beta", "alpha", "neumann_eta", "fd_delta"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"rabo.{k}: must be > 0, got {getattr(self, k)}")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.segments):
            raise ConfigError(f"rabo.segments: each must be an integer >= 0, got {list(self.segments)}")
        return self


@dataclass(frozen=True)
class FedMetaConfig:
    local_steps: int = opt(5, "local updates per round on each client (one batch / episode each)")
    lr: float = opt(0.1, "local (meta-)learning rate of the SGD step on the client")
    inner_steps: int = opt(1, "Dist-MAML: adaptation steps on the support (0: plain SGD on the query loss)")
    inner_lr: float = opt(0.5, "Dist-MAML: adaptation learning rate on the support")
    first_order: bool = opt(False, "Dist-MAML: first-order approximation (no second derivatives, FOMAML)")

    def validate(self) -> "FedMetaConfig":
        check_choices(self, "fedmeta")
        if not isinstance(self.local_steps, int) or isinstance(self.local_steps, bool) or self.local_steps < 1:
            raise ConfigError(f"fedmeta.local_steps: must be an integer >= 1, got {self.local_steps!r}")
        if not isinstance(self.inner_steps, int) or isinstance(self.inner_steps, bool) or self.inner_steps < 0:
            raise ConfigError(f"fedmeta.inner_steps: must be an integer >= 0, got {self.inner_steps!r}")
        for k in ("lr", "inner_lr"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"fedmeta.{k}: must be a number > 0, got {v!r}")
        if not isinstance(self.first_order, bool):
            raise ConfigError(f"fedmeta.first_order: must be true or false, got {self.first_order!r}")
        return self


@dataclass(frozen=True)
class BilevelExperiment:
    family: Literal["bilevel"] = opt("bilevel", "the method family this file describes (a CIDERS experiment has "
                                                "family: ciders)")
    name: str = opt("bilevel", "run name")
    seed: int = opt(0, "seed for shards, episodes and initial weights")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps: where the models and data of the task live")
    method: BilevelMethod = opt("rabo", "what runs: RABO / RAFBO / FedMBO, a single-level sub-model baseline "
                                        "(static, fedrolex, fiarse, oap: few-shot), or a full-model baseline "
                                        "(dist-protonet, dist-maml: few-shot; fedavg-notune: loss tuning); "
                                        "`ciders bilevel --methods` runs several")
    task: BilevelTaskConfig = section(BilevelTaskConfig, "the bilevel task and its data")
    federation: BilevelFederationConfig = section(BilevelFederationConfig, "clients, capacities, rounds")
    rabo: RaboConfig = section(RaboConfig, "RABO / RAFBO / FedMBO (ciders.algorithms.rabo)")
    fedmeta: FedMetaConfig = section(FedMetaConfig, "the full-model baselines' local steps (ciders.algorithms.fedmeta)")
    flower: FlowerConfig = section(FlowerConfig, "Flower engine settings (`ciders bilevel --engine flower-sim`, "
                                                 "`ciders flower ...`)")

    def validate(self) -> "BilevelExperiment":
        validate_sections(self)
        check_seed(self.seed)
        if self.task.kind == "losstune" and self.rabo.mask_target != "y":
            raise ConfigError("loss tuning needs rabo.mask_target: y (every client tunes all the loss hyperparameters)")
        if self.rabo.head == "episode" and self.task.kind != "fewshot":
            raise ConfigError("rabo.head: episode is for the few-shot task, whose labels are re-drawn each episode; "
                              f"task.kind {self.task.kind!r} has one inner problem: keep rabo.head: global")
        return self
