"""Typed experiment configuration: one YAML file describes a whole experiment.

Every section is a frozen dataclass whose fields carry a default and a help text. Loading is strict:
unknown keys, wrong types and out-of-range values fail before any work, with a message that names the
key (`decomposition.beta: must be in (0, 1], got 1.5`). `--set a.b=value` overrides use the same
path syntax and the same checks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from ciders.config.federation import RunFederation
from ciders.config.fields import opt, section  # noqa: F401 - re-exported: every section module uses them
from ciders.config.privacy import DPConfig, SecAggConfig
from ciders.errors import ConfigError


# ------------------------------------------------------------------------------------------------ names
# Choices are written once, as Literal types; validation and `ciders config --keys` read them from the
# annotations. Names owned by other modules are declared here (config imports nothing above ciders.errors);
# tests check they equal the registries they mirror.

TaskName = Literal["custom", "gsm8k", "dolly", "code", "domains", "math"]  # custom + ciders.tasks.registry.TASKS
TASK_NAMES: tuple[str, ...] = typing.get_args(TaskName)
EvalTaskName = Literal["ppl", "gsm8k", "rouge_l", "humaneval:python", "humaneval:java", "humaneval:go", "nll_matrix"]
EVAL_TASK_NAMES: tuple[str, ...] = typing.get_args(EvalTaskName)  # the evaluations ciders' evaluation runs
DtypeName = Literal["auto", "float32", "bfloat16", "float16"]  # auto + ciders.runtime.DTYPES

# --------------------------------------------------------------------------------------------- sections

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("smollm2-135m", "hub id, local HF directory, or built-in name (smollm2-135m; tests: tiny-qwen2, tiny-llama, tiny-gemma, tiny-phi3)")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps")
    dtype: DtypeName = opt("auto", "auto = bfloat16 on CUDA, float32 elsewhere")
    attn_implementation: str | None = opt(None, "transformers attention backend (eager, sdpa, ...); null = model default")

    def validate(self) -> None:
        check_choices(self, "model")
        if not self.name:
            raise ConfigError("model.name: must not be empty")


@dataclass(frozen=True)
class DecompositionConfig:
    """Algorithm 1 (docs/method.md#algorithm-1-model-decomposition-modelprep). Set at most one of beta, drop_ratio,
    student_layers (default drop_ratio 0.2)."""

    messenger_layers: int = opt(2, "a: number of top layers that form the messenger P_M")
    beta: float | None = opt(None, "compression rate in (0, 1]: n' = beta * (n - a) student layers")
    drop_ratio: float | None = opt(None, "1 - beta, as the paper's experiments state it (default 0.2 when nothing is set)")
    student_layers: int | None = opt(None, "n' explicitly (overrides the beta rule)")
    rounding: Literal["round", "floor"] = opt("round", "n' = round(beta*(n-a)) (paper's reported models) or floor (Algorithm 1 literally)")

    def validate(self) -> None:
        if self.messenger_layers < 1:
            raise ConfigError(f"decomposition.messenger_layers: must be >= 1, got {self.messenger_layers}")
        given = [k for k in ("beta", "drop_ratio", "student_layers") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ConfigError(f"decomposition: set only one of beta, drop_ratio, student_layers (got {', '.join(given)})")
        if self.beta is not None and not 0 < self.beta <= 1:
            raise ConfigError(f"decomposition.beta: must be in (0, 1], got {self.beta}")
        if self.drop_ratio is not None and not 0 <= self.drop_ratio < 1:
            raise ConfigError(f"decomposition.drop_ratio: must be in [0, 1), got {self.drop_ratio}")
        if self.student_layers is not None and self.student_layers < 1:
            raise ConfigError(f"decomposition.student_layers: must be >= 1, got {self.student_layers}")
        check_choices(self, "decomposition")

    def split_kwargs(self) -> dict:
        """Keyword arguments for `ciders.models.decompose.split_layers`."""
        kw: dict = {"rounding": self.rounding}
        if self.student_layers is not None:
            kw["student_layers"] = self.student_layers
        elif self.beta is not None:
            kw["beta"] = self.beta
        else:
            kw["drop_ratio"] = 0.2 if self.drop_ratio is None else self.drop_ratio
        return kw


@dataclass(frozen=True)
class LoraConfig:
    """One PEFT LoRA adapter (docs/method.md#algorithm-1-model-decomposition-modelprep: r=4, lora_alpha=16, dropout
    0.05 on q,k,v,o,gate,up,down)."""

    r: int = opt(4, "LoRA rank")
    alpha: float = opt(16.0, "lora_alpha (scaling = alpha / r)")
    dropout: float = opt(0.05, "dropout on the LoRA input")
    targets: tuple[str, ...] = opt(DEFAULT_LORA_TARGETS, "module names (last path component) inside each decoder "
                                   "layer, or [all-linear]; the default on a layer with fused projections (e.g. Phi-3) "
                                   "becomes every linear module of the layer")

    def validate(self, where: str = "lora") -> None:
        if self.r < 1:
            raise ConfigError(f"{where}.r: must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ConfigError(f"{where}.alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{where}.dropout: must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ConfigError(f"{where}.targets: must name at least one module")


@dataclass(frozen=True)
class AdaptersConfig:
    messenger: LoraConfig = section(LoraConfig, "messenger LoRA, trained by clients")
    student: LoraConfig = section(LoraConfig, "learnable-backbone (B_L) LoRA, trained on the server by TAKD")

    def validate(self) -> None:
        self.messenger.validate("lora.messenger")
        self.student.validate("lora.student")


@dataclass(frozen=True)
class TAKDConfig:
    """Task-aware knowledge distillation, Eq. 2 (docs/method.md#eq-2-task-aware-knowledge-distillation-takd)."""

    lambda_out: float = opt(0.5, "lambda: weight of the forward KL(M*(x) || M(x)); 0 turns the KL term off")
    lambda_task: float = opt(0.3, "lambda_task: weight of the task CE on response tokens in the per-round steps "
                             "(Eq. 13); 0 turns it off. The paper gives no value: 0.3 was best of 0 / 0.1 / 0.3 / 1 "
                             "in our dose-response (docs/method.md#the-task-weight-lambda_task)")
    lambda_task_bootstrap: float | None = opt(
        0.0, "weight of the task CE during pre-alignment (takd.bootstrap_steps); null = lambda_task. 0 by "
        "measurement: the CE there helped nowhere and, with the per-round CE, hurt")
    hidden_loss: Literal["mean", "sum", "teacher_rms"] = opt(
        "mean",
        "hidden-state term: mean = MSE over tokens and hidden dims (Eq. 2 divided by hidden size); "
        "sum = Eq. 2 literally (squared L2 per token); teacher_rms = MSE / mean(B_F(x)^2) (FedBiOT)",
    )
    kd_tokens: Literal["all", "response"] = opt("all", "tokens the hidden and KL terms average over")
    lr: float = opt(5e-4, "AdamW learning rate for the student LoRA")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "global-norm gradient clipping; 0 disables")
    batch_size: int = opt(4, "public-data examples per step")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    bootstrap_steps: int = opt(60, "pre-alignment steps before round 0 (Algorithm 1 step 8)")
    round_steps: int = opt(5, "T_L: warm-started steps per round (Eq. 13)")
    plateau_examples: int = opt(
        0, "public examples held out of TAKD to stop pre-alignment once AdapEmu's NLL on them plateaus (then "
        "bootstrap_steps is the cap); 0 = exactly bootstrap_steps (docs/method.md#pre-alignment-to-a-plateau)")
    plateau_every: int = opt(10, "pre-alignment steps between two plateau checks")
    plateau_tol: float = opt(0.01, "a check that lowers the held-out NLL by less than this (nats) counts as flat")
    plateau_patience: int = opt(2, "flat checks in a row that end pre-alignment")
    teacher_cache: Literal["auto", "memory", "disk", "off"] = opt(
        "auto", "B_F(x) on public data never changes: keep it in memory, on disk, or recompute (off)"
    )
    cache_memory_mib: float = opt(2048.0, "with teacher_cache=auto, spill to disk above this size")
    activation_checkpointing: bool = opt(
        False, "recompute B_L's layer activations in the backward pass instead of keeping them: far less memory "
        "for long sequences or large batches, one more B_L forward per step (benchmarks/takd_round.py)")

    def validate(self) -> None:
        check_choices(self, "takd")
        for k in ("lambda_out", "lambda_task", "lr", "weight_decay", "max_grad_norm"):
            if getattr(self, k) < 0:
                raise ConfigError(f"takd.{k}: must be >= 0, got {getattr(self, k)}")
        if self.lambda_task_bootstrap is not None and self.lambda_task_bootstrap < 0:
            raise ConfigError(f"takd.lambda_task_bootstrap: must be >= 0 or null (null = lambda_task), "
                              f"got {self.lambda_task_bootstrap}")
        if self.lr == 0:
            raise ConfigError("takd.lr: must be > 0")
        for k in ("batch_size", "grad_accum"):
            if getattr(self, k) < 1:
                raise ConfigError(f"takd.{k}: must be >= 1, got {getattr(self, k)}")
        for k in ("bootstrap_steps", "round_steps", "plateau_examples", "plateau_tol"):
            if getattr(self, k) < 0:
                raise ConfigError(f"takd.{k}: must be >= 0, got {getattr(self, k)}")
        for k in ("plateau_every", "plateau_patience"):
            if getattr(self, k) < 1:
                raise ConfigError(f"takd.{k}: must be >= 1, got {getattr(self, k)}")

    def bootstrap(self) -> "TAKDConfig":
        """The settings of the pre-alignment steps: the same, with the bootstrap task weight as lambda_task."""
        if self.lambda_task_bootstrap is None:
            return self
        return replace(self, lambda_task=self.lambda_task_bootstrap, lambda_task_bootstrap=None)


# The values of `algorithm.name`, declared once; `ciders.algorithms.registry` holds what each method is and
# checks at import that it covers exactly these (CIDERS itself runs as ciders-fo or ciders-fd).
AlgorithmName = Literal["ciders", "fedavg", "fedprox", "scaffold", "fedot", "fedbiot", "localot", "takd-only"]


@dataclass(frozen=True)
class CidersConfig:
    """Client and server update rules of CIDERS (docs/method.md#algorithm-2-one-round); paper values in the help texts.
    `name` picks CIDERS or a baseline; a baseline fixes the knobs it needs (see `ciders.algorithms`)."""

    name: AlgorithmName = opt("ciders", "CIDERS or a baseline (baselines set their own knobs)")
    local_steps: int = opt(10, "K: optimizer updates per client per round (paper: 10 Protocol A, 20 Protocol B)")
    grad_accum: int = opt(1, "micro-batches averaged into one optimizer update")
    batch_size: int = opt(2, "examples per micro-batch")
    optimizer: Literal["sgd", "adamw"] = opt("adamw", "OPTIM of Eq. 4 (paper: AdamW)")
    lr: float = opt(1e-4, "eta: base learning rate (paper 1e-4)")
    weight_decay: float = opt(0.01, "AdamW decoupled weight decay / SGD L2 (paper 0.01)")
    max_grad_norm: float = opt(1.0, "global-norm clipping of g_traj before the optimizer (paper 1.0); 0 = off")
    schedule: Literal["constant", "warmup_cosine"] = opt(
        "warmup_cosine", "lr schedule over the run's client steps (round * K + k); eta_in follows it too")
    warmup_steps: int = opt(0, "linear warmup steps of warmup_cosine")
    min_lr_ratio: float = opt(0.0, "warmup_cosine floor as a fraction of lr")
    eta_in: float | None = opt(None, "inner look-ahead step of Eq. 6 at the base lr (null = lr); 0 turns it off")
    metagrad: Literal["fo", "fd"] = opt("fo", "first-order (default) or finite-difference HVP meta-gradient")
    eps_fd: float = opt(1e-4, "length of the central-difference probe of Eq. 7, ||x_k +- h v - x_k|| (paper 1e-4)")
    hvp: Literal["fd", "exact"] = opt(
        "exact", "Hv of the FD meta-gradient (Eq. 7): exact = double backward in the base dtype (default: on "
        "benchmarks/fd_accuracy.py as accurate as fd, 5e-7 fp32 / 2e-3 bf16 relative error, at no more cost "
        "and without an fp32 weight copy); fd = central difference along v (on a bf16/fp16 base the step's "
        "messenger evaluations then run in fp32); use fd with an attention kernel that has no second derivative")
    fd_eta: float | None = opt(None, "eta_HVP of the FD correction (paper 0.001; null = eta_in)")
    consensus_space: Literal["update", "gradient", "paper"] = opt(
        "update", "where gamma (c - c_i) enters and what Delta_i measures: update = added after the optimizer's "
        "preconditioning, Delta_i from the displacement (Adam-step units; the default, docs/method.md"
        "#the-consensus-space); gradient = added to the raw gradient, Delta_i = mean corrected gradient; "
        "paper = Eq. 4 and Eq. 8 literally (equal to both under SGD without clipping)")
    gamma: float = opt(0.01, "consensus-correction coefficient in [0, 1] (paper 0.01 Qwen2.5-3B / 0.05 Qwen2-1.5B)")
    gamma_schedule: Literal["constant", "protocol_c"] = opt(
        "constant", "protocol_c: gamma_0 = gamma_1 = 0.9, gamma_t = max(0.01, 0.9 * 0.86^(t-1))")
    alpha: float = opt(0.002, "alpha_c: consensus EMA coefficient in (0, 1] (paper 0.002)")
    tau: float = opt(0.02, "server aggregation step of Eq. 12 (paper 0.02)")
    eps_prox: float = opt(0.01, "proximal anchoring weight of Eq. 4 (paper 0.01)")
    weighting: Literal["size", "uniform"] = opt("size", "p_i = |D_i| / sum |D_j| over repliers, or uniform")
    upload_personalized_messenger: bool = opt(
        False, "also upload the client's messenger (needed for server-side cross-domain evaluation)")
    consensus_update: Literal["ema", "scaffold"] = opt(
        "ema", "server rule for c: ema = Eq. 12; scaffold = c + (1/N) sum_i dc_i (SCAFFOLD, N registered clients)")
    client_start: Literal["global", "personalized"] = opt(
        "global", "x_0 of a round: the broadcast messenger, or the client's own last x_K (LocalOT)")
    communicate: bool = opt(True, "false: clients train alone after alignment; nothing is uploaded (LocalOT)")
    client_learning: bool = opt(
        True, "false: no client is sampled or trains; the rounds run the server's TAKD schedule alone on the initial "
        "messenger (the takd-only control of `ciders compare`; docs/method.md#the-control-takd-only)")
    server_optimizer: Literal["none", "fedavgm", "fedadam", "fedyogi"] = opt(
        "none", "server optimizer on Eq. 12's messenger step d (docs/method.md#server-optimizers): none = Eq. 12 as "
        "it is; fedavgm = momentum; fedadam / fedyogi = Reddi et al. 2021, as Flower computes them; works with every "
        "method that aggregates a messenger")
    server_lr: float | None = opt(
        None, "server learning rate of server_optimizer (null = Flower's default: fedavgm 1.0, fedadam 0.1, "
        "fedyogi 0.01)")
    server_momentum: float = opt(
        0.9, "fedavgm momentum in [0, 1) (Hsu et al. 0.9; Flower's default 0.0 is plain averaging)")
    server_beta1: float = opt(0.9, "fedadam / fedyogi first-moment decay in [0, 1) (Flower 0.9)")
    server_beta2: float = opt(0.99, "fedadam / fedyogi second-moment decay in [0, 1) (Flower 0.99)")
    server_tau: float = opt(
        1e-3, "fedadam / fedyogi adaptivity eps > 0 added to sqrt(v) (Reddi et al.'s tau; Flower 1e-3)")
    aggregator: Literal["mean", "median", "trimmed_mean"] = opt(
        "mean", "how the round's reconstructed Delta_i become the Delta-bar of Eq. 12: mean = sum_i p_i Delta_i; median "
        "= coordinate-wise median; trimmed_mean = coordinate-wise mean after cutting trim_fraction of the clients "
        "from each end (both unweighted, as Flower's FedMedian / FedTrimmedAvg; docs/method.md#robust-aggregation)")
    trim_fraction: float = opt(0.2, "trimmed_mean: the fraction of clients cut from each end, in [0, 0.5) "
                                    "(Flower's beta, default 0.2)")

    def validate(self) -> None:
        w = "algorithm"
        check_choices(self, w)
        self._check_server_optimizer(w)
        if self.local_steps < 1:
            raise ConfigError(f"{w}.local_steps: K must be >= 1, got {self.local_steps}")
        for k in ("grad_accum", "batch_size"):
            if getattr(self, k) < 1:
                raise ConfigError(f"{w}.{k}: must be >= 1, got {getattr(self, k)}")
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"{w}.gamma: must be in [0, 1], got {self.gamma}")
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"{w}.alpha: must be in (0, 1], got {self.alpha}")
        if self.tau <= 0:
            raise ConfigError(f"{w}.tau: must be > 0, got {self.tau}")
        if self.lr <= 0:
            raise ConfigError(f"{w}.lr: must be > 0, got {self.lr}")
        for k in ("weight_decay", "max_grad_norm", "eps_prox", "warmup_steps"):
            if getattr(self, k) < 0:
                raise ConfigError(f"{w}.{k}: must be >= 0, got {getattr(self, k)}")
        if self.eta_in is not None and self.eta_in < 0:
            raise ConfigError(f"{w}.eta_in: must be >= 0 or null, got {self.eta_in}")
        if self.fd_eta is not None and self.fd_eta < 0:
            raise ConfigError(f"{w}.fd_eta: must be >= 0 or null, got {self.fd_eta}")
        if self.eps_fd <= 0:
            raise ConfigError(f"{w}.eps_fd: must be > 0, got {self.eps_fd}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{w}.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"{w}.trim_fraction: must be in [0, 0.5) (the fraction cut from each end), "
                              f"got {self.trim_fraction}")

    def _check_server_optimizer(self, w: str) -> None:
        if self.server_lr is not None and self.server_lr <= 0:
            raise ConfigError(f"{w}.server_lr: must be > 0 or null (null = the optimizer's default), got {self.server_lr}")
        if self.server_lr is not None and self.server_optimizer == "none":
            raise ConfigError(f"{w}.server_lr: only a server optimizer reads it; set {w}.server_optimizer to "
                              f"fedavgm, fedadam or fedyogi, or drop server_lr")
        for k, what in (("server_momentum", "fedavgm momentum"), ("server_beta1", "first-moment decay"),
                        ("server_beta2", "second-moment decay")):
            if not 0 <= getattr(self, k) < 1:
                raise ConfigError(f"{w}.{k}: must be in [0, 1) (the {what}; 1 would never forget a step), "
                                  f"got {getattr(self, k)}")
        if self.server_tau <= 0:
            raise ConfigError(f"{w}.server_tau: must be > 0 (it keeps m / (sqrt(v) + tau) finite where v is 0; "
                              f"Flower uses 1e-3), got {self.server_tau}")

    @staticmethod
    def from_raw(data: dict, prefix: str = "algorithm") -> dict:
        """`name: ciders-fo` / `ciders-fd`, as `--algorithms` spells CIDERS, is `name: ciders` with that metagrad."""
        name = data.get("name")
        if name not in ("ciders-fo", "ciders-fd"):
            return data
        mg = name.split("-")[1]
        if data.get("metagrad", mg) != mg:
            raise ConfigError(f"{prefix}.name={name} says metagrad {mg}, but {prefix}.metagrad={data['metagrad']}; "
                              "drop one of them")
        return {**data, "name": "ciders", "metagrad": mg}

    @property
    def method(self) -> str:
        """The method's registry name: ciders-fo / ciders-fd for CIDERS, else the baseline's."""
        return f"ciders-{self.metagrad}" if self.name == "ciders" else self.name

    def uses_consensus(self) -> bool:
        """Whether clients need c at all (gamma_t = 0 in every round makes c irrelevant to them)."""
        return self.gamma > 0 or self.gamma_schedule != "constant"


@dataclass(frozen=True)
class DataConfig:
    task: TaskName = opt("custom", "custom (the explicit files below) or a named task")
    source: str | None = opt(None, "named task: a local file overriding $CIDERS_DATA's, or 'hub' (internet)")
    public_size: int = opt(200, "named task: public (server distillation) examples [per label with per_label]")
    eval_size: int = opt(300, "named task without an official test split: held-out examples [per label]")
    client_size: int | None = opt(None, "named task: cap on the client pool [per label]")
    per_label: bool = opt(False, "named task: sizes apply to each label (Protocol B: 200 public / 300 eval per domain)")
    public: str = opt("data/gsm8k-slice/public.jsonl", "server public (distillation) data: a .jsonl/.json(.gz), .csv, "
                      ".tsv or .parquet file, or a hub dataset ID[:CONFIG][@SPLIT] (docs/data.md#sources)")
    eval: str = opt("data/gsm8k-slice/eval.jsonl", "global held-out evaluation data (disjoint from public); file or hub id")
    clients: str | None = opt("data/gsm8k-slice/clients.jsonl", "client training data, split by federation.partition "
                              "(iid, or natural / dirichlet over data.label_key); file or hub id")
    client_files: tuple[str, ...] = opt((), "one file (or hub id) per client for partition: files (e.g. one domain each)")
    clients_limit: int | None = opt(None, "use only the first N records of each client source")
    format: Literal["auto", "gsm8k", "instruction", "mbpp", "metamath", "prompt_completion", "chat"] = opt(
        "auto", "record format: gsm8k {question, answer}; instruction {instruction, context, response}; "
        "mbpp {text, code}; metamath {query, response}; prompt_completion {prompt, completion} (used verbatim); "
        "chat {messages: [{role, content}, ...]} ending with the assistant turn (always rendered with the "
        "tokenizer's chat template); auto = told from the first record's fields"
    )
    prompt_key: str | None = opt(None, "custom data: the field holding the prompt, in place of the format's own "
                                 "(e.g. question); with format auto and no known fields, prompt_completion")
    response_key: str | None = opt(None, "custom data: the field holding the response (e.g. answer)")
    label_key: str | None = opt(None, "custom data: the field whose value labels a record, for federation.partition "
                                "natural (one label per client) or dirichlet")
    template: Literal["plain", "chat"] = opt(
        "plain", "how non-chat records become text: plain = the format's prompt layout (e.g. 'Question: ... "
        "Answer:'); chat = the prompt as one user turn and the response as the assistant turn, through the "
        "tokenizer's chat template (instruct models)")
    max_length: int = opt(256, "tokens per example (longer examples are truncated and counted)")
    public_limit: int | None = opt(None, "use only the first N public examples")
    eval_limit: int | None = opt(None, "evaluate on only the first N examples [per label with per_label]")
    eval_batch_size: int = opt(8, "batch size for perplexity evaluation")

    def validate(self) -> None:
        check_choices(self, "data")
        if self.max_length < 8:
            raise ConfigError(f"data.max_length: must be >= 8, got {self.max_length}")
        for k in ("public_limit", "eval_limit", "clients_limit"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ConfigError(f"data.{k}: must be >= 1 or null, got {v}")
        if self.eval_batch_size < 1:
            raise ConfigError(f"data.eval_batch_size: must be >= 1, got {self.eval_batch_size}")
        for k in ("public_size", "eval_size"):
            if getattr(self, k) < 1:
                raise ConfigError(f"data.{k}: must be >= 1, got {getattr(self, k)}")
        if self.client_size is not None and self.client_size < 1:
            raise ConfigError(f"data.client_size: must be >= 1 or null, got {self.client_size}")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluations scheduled inside `ciders run` (every federation.eval_every rounds) and the defaults of
    `ciders eval`. ppl is always computed (global and per-client held-out response perplexity)."""

    tasks: tuple[EvalTaskName, ...] = opt((), "extra evaluations (ppl is always computed)")
    limit: int | None = opt(None, "evaluate only the first N examples of each task")
    max_new_tokens: int = opt(256, "generation budget for gsm8k / rouge_l / humaneval")
    batch_size: int = opt(8, "generation batch size (left padding, KV cache)")
    code_workers: int = opt(2, "concurrent sandboxed HumanEval-X programs")
    tasks_before: bool = opt(True, "also run eval.tasks before the first round (false: perplexities only)")
    split: Literal["test", "validation"] = opt(
        "test", "what the evaluations read: test = the global evaluation set and each client's held-out part; "
        "validation = each client's validation part (federation.validation), globally and per client, for tuning")
    fidelity: bool = opt(True, "edge fidelity in every evaluation: top-1 next-token agreement of AdapEmu with AdapFu "
                         "(the same messenger) on the global held-out responses; costs one full-model forward over "
                         "the global evaluation set (docs/method.md#edge-fidelity)")

    def validate(self) -> None:
        check_choices(self, "eval")
        for k in ("max_new_tokens", "batch_size", "code_workers"):
            if getattr(self, k) < 1:
                raise ConfigError(f"eval.{k}: must be >= 1, got {getattr(self, k)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"eval.limit: must be >= 1 or null, got {self.limit}")


@dataclass(frozen=True)
class FederationConfig(RunFederation):
    """The CIDERS family's federation keys (the shared ones: `config.federation.RunFederation`)."""

    partition: Literal["iid", "natural", "dirichlet", "files", "nodes"] = opt(
        "iid", "how client data is dealt: iid = a seeded even split; natural = one label (e.g. domain) per "
        "client; dirichlet = over the label column; files = custom task, data.client_files[i] is client i; "
        "nodes = each SuperNode reads its own data-file and the server holds public and eval data only "
        "(Flower deployment; docs/flower.md#each-node-brings-its-own-data)")
    dirichlet_alpha: float = opt(0.5, "Dirichlet concentration (Protocol C: 0.1 and 0.4); smaller = more skewed")
    holdout: float = opt(0.2, "fraction of each client's examples held out for its personalized evaluation")
    validation: float = opt(0.0, "fraction of each client's examples held out as its validation part (after the "
                            "held-out one; never trained on): what eval.split=validation evaluates, for tuning "
                            "(`ciders compare --tune`)")
    per_round: int | None = opt(None, "clients sampled per round (partial participation); null = all")
    rounds: int = opt(3, "T: communication rounds")
    eval_clients: Literal["all", "participants"] = opt("all", "whose personalized messengers to evaluate")
    store_cache: int = opt(16, "client records held in memory (the rest stay on disk)")
    emulator_dtype: Literal["model", "float32", "bfloat16", "float16"] = opt(
        "model", "Flower engines: dtype of the emulator's base weights in a client's first download: model = as the server holds "
        "them (lossless); bfloat16 halves an fp32 download, rounding B_L and P_M (measured in "
        "benchmarks/edge_download.py; docs/edge.md#the-first-download-in-bfloat16)")
    emulator_quantize: Literal["none", "int8"] = opt(
        "none", "Flower engines: int8 = the emulator's frozen base weights are sent, stored and held as int8 with a "
        "scale per row (torchao; about a quarter of fp32's download), the client trains LoRA on top; the server's "
        "model is unchanged (docs/edge.md#a-quantized-emulator, benchmarks/edge_quantized.py)")
    adapter_dtype: Literal["model", "bfloat16", "float16"] = opt(
        "model", "dtype of the messenger and the student LoRA in every broadcast: model = as the server holds them "
        "(lossless); bfloat16 / float16 halve an fp32 broadcast's adapters. c, a resync copy and every upload stay "
        "in the model's dtype: Eq. 11 rebuilds Delta_i exactly from dc_i and c_i (docs/method.md#adapters-on-the-wire)")
    max_step_ratio: float | None = opt(
        10.0, "reject an upload whose implied local step ||w - x_K|| (Eq. 11 x K eta_bar) exceeds this multiple "
        "of max(||w_0||, 1), ||w_0|| the messenger's norm at the run's start (docs/security.md#aggregation); "
        "null = accept any finite step")
    secure_aggregation: bool = opt(
        False, "the server learns only the sum of the round's updates, never one client's (SecAgg+ with Flower's "
        "key agreement, Shamir sharing and encryption; docs/privacy.md#secure-aggregation)")
    secagg: SecAggConfig = section(SecAggConfig, "secure aggregation's parameters (read when secure_aggregation is true)")
    dp: DPConfig = section(DPConfig, "client-level differential privacy: clipping, noise and the accountant "
                                     "(docs/privacy.md#differential-privacy)")

    def validate(self) -> None:
        check_choices(self, "federation")
        self.validate_shared()
        if self.per_round is not None and not 1 <= self.per_round <= self.clients:
            raise ConfigError(f"federation.per_round: must be in [1, clients={self.clients}] or null, got {self.per_round}")
        if not 0 <= self.holdout < 1:
            raise ConfigError(f"federation.holdout: must be in [0, 1), got {self.holdout}")
        if not 0 <= self.validation < 1 or self.holdout + self.validation >= 1:
            raise ConfigError(f"federation.validation: must be in [0, 1) with holdout + validation < 1 (something "
                              f"must be left to train on), got {self.validation} with holdout {self.holdout}")
        if self.store_cache < 1:
            raise ConfigError(f"federation.store_cache: must be >= 1, got {self.store_cache}")
        if self.dirichlet_alpha <= 0:
            raise ConfigError(f"federation.dirichlet_alpha: must be > 0, got {self.dirichlet_alpha}")
        if self.emulator_quantize != "none" and self.emulator_dtype != "model":
            raise ConfigError(f"federation.emulator_quantize={self.emulator_quantize} sends the scales and norms in the "
                              f"model's dtype: set federation.emulator_dtype: model (got {self.emulator_dtype}), or "
                              "set model.dtype to the dtype you want them in")
        self.secagg.validate()
        self.dp.validate()
        if self.secure_aggregation:
            self.secagg.check_round_size(self.per_round or self.clients)


def _finite(key: str, value: float) -> float:
    # NaN passes every range check (all comparisons are false) and inf passes the one-sided ones
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value}")
    return value


def check_finite(cfg: Any, where: str = "") -> None:
    """Every float value of `cfg` and its sections (tuples of floats too) is finite: also for a config
    built in Python, which `from_dict`'s own check does not see."""
    for f in dataclasses.fields(cfg):
        key, v = f"{where}.{f.name}" if where else f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            check_finite(v, key)
        for i, x in enumerate(v if isinstance(v, tuple) else (v,)):
            if isinstance(x, float):
                _finite(f"{key}[{i}]" if isinstance(v, tuple) else key, x)


SEED_RANGE = 2**32  # what every generator accepts (NumPy's is the smallest); seeds are ids, not magnitudes


def check_seed(seed: Any, key: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_RANGE:
        raise ConfigError(f"{key}: must be an integer in [0, 2**32), got {seed!r}")
    return seed


def validate_sections(cfg: Any) -> None:
    """Check every float is finite and every Literal-typed key against its choices (any section, from any
    module), then run every section's own validate() (the cross-field checks stay with the experiment
    class)."""
    check_finite(cfg)
    check_choices(cfg)
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v.validate()


@dataclass(frozen=True)
class FlowerConfig:
    """Only read by the Flower engines (`ciders run --engine flower-sim`, `ciders flower ...`)."""

    round_timeout_s: float = opt(600.0, "how long the ServerApp waits for a round's replies; later ones are dropped")
    eval_timeout_s: float = opt(600.0, "how long an evaluating round waits for the clients' personalized messengers")
    node_wait_s: float = opt(120.0, "at the first round, wait up to this long for all federation.clients "
                                    "SuperNodes to connect (then go on with those that did)")
    rejoin_wait_s: float = opt(0.0, "at later rounds, wait up to this long for SuperNodes that dropped out to "
                                    "come back (0 = go on with the connected ones at once)")
    client_cpus: float = opt(1.0, "simulation: CPUs Ray reserves per ClientApp (fewer = more clients at once)")
    client_gpus: float = opt(0.0, "simulation: GPUs (fractions allowed) Ray reserves per ClientApp")

    def validate(self) -> None:
        for k in ("round_timeout_s", "eval_timeout_s", "node_wait_s", "client_cpus"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"flower.{k}: must be > 0, got {getattr(self, k)}")
        for k in ("client_gpus", "rejoin_wait_s"):
            if getattr(self, k) < 0:
                raise ConfigError(f"flower.{k}: must be >= 0, got {getattr(self, k)}")


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole CIDERS-family experiment (`family: ciders`, the default)."""

    family: Literal["ciders"] = opt("ciders", "the method family this file describes (a RABO-family experiment "
                                              "has family: bilevel)")
    name: str = opt("experiment", "run name (used for the default output directory)")
    seed: int = opt(0, "seed for data order, LoRA init and dropout; runs are reproducible from it")
    model: ModelConfig = section(ModelConfig, "the pretrained LM M*")
    decomposition: DecompositionConfig = section(DecompositionConfig, "Algorithm 1: messenger / B_F / B_L split")
    lora: AdaptersConfig = section(AdaptersConfig, "PEFT LoRA for the messenger and for B_L")
    takd: TAKDConfig = section(TAKDConfig, "server-side task-aware distillation (Eq. 2)")
    data: DataConfig = section(DataConfig, "public, client and evaluation data")
    algorithm: CidersConfig = section(CidersConfig, "CIDERS client/server update rules (docs/method.md#algorithm-2-one-round)")
    federation: FederationConfig = section(FederationConfig, "clients, partition, rounds, sampling, evaluation")
    eval: EvalConfig = section(EvalConfig, "evaluation tasks (GSM8K, ROUGE-L, HumanEval-X, NLL matrix)")
    flower: FlowerConfig = section(FlowerConfig, "the Flower engines: timeouts and simulation resources")

    def validate(self) -> "ExperimentConfig":
        validate_sections(self)
        check_seed(self.seed)
        fed, data = self.federation, self.data
        if data.task == "custom" and fed.partition in ("natural", "dirichlet") and not data.label_key:
            raise ConfigError(f"federation.partition={fed.partition} over custom data needs data.label_key (the field "
                              "that labels each record of data.clients), or a labelled named task (data.task: dolly, "
                              "domains or math)")
        if data.task != "custom" and any(getattr(data, k) for k in ("prompt_key", "response_key", "label_key")):
            raise ConfigError(f"data.prompt_key / response_key / label_key are for data.task=custom; the named task "
                              f"{data.task} knows its own fields")
        if self.eval.split == "validation" and (fed.validation == 0 or fed.partition == "nodes"):
            raise ConfigError("eval.split=validation reads the clients' validation parts: set federation.validation "
                              "> 0 (e.g. 0.2), on a partition the server holds (not nodes)")
        if data.task != "custom" and fed.partition in ("files", "nodes"):
            raise ConfigError(f"federation.partition={fed.partition} is for data.task=custom")
        if fed.partition == "nodes" and self.algorithm.weighting != "uniform":
            raise ConfigError("federation.partition=nodes: the server cannot check how much data a node holds, so "
                              "p_i cannot follow |D_i|; set algorithm.weighting=uniform")
        if fed.partition == "files" and len(data.client_files) != fed.clients:
            raise ConfigError(f"federation.partition=files needs one data.client_files entry per client "
                              f"({fed.clients}), got {len(data.client_files)}")
        if data.task == "custom" and fed.partition in ("iid", "natural", "dirichlet") and not data.clients:
            raise ConfigError(f"federation.partition={fed.partition} needs data.clients (a data file to split)")
        self.check_privacy()
        return self

    def check_privacy(self) -> None:
        """The checks between secure aggregation, DP and the algorithm (docs/privacy.md): (broken?, why) rules."""
        fed, alg, rules = self.federation, self.algorithm, []
        if fed.secure_aggregation:
            sa = "federation.secure_aggregation: secure aggregation hides every single update from the server"
            rules += [(alg.upload_personalized_messenger, f"{sa}, and algorithm.upload_personalized_messenger would "
                                                          "send each client's messenger in the clear; set it to false"),
                      (alg.aggregator != "mean", f"{sa}, so a robust aggregator (algorithm.aggregator={alg.aggregator}) "
                                                 "has nothing to sort; use algorithm.aggregator=mean"),
                      (not alg.communicate, "federation.secure_aggregation: this method uploads nothing "
                                            "(algorithm.communicate is false); drop secure_aggregation")]
        if fed.dp.enabled:
            rules += [(fed.dp.mode == "central" and alg.weighting != "uniform",
                       "federation.dp.mode=central: the noise is calibrated to one client's share of a uniform mean "
                       "(p_i = 1/m); set algorithm.weighting=uniform"),
                      (alg.aggregator != "mean", f"federation.dp: the accountant assumes the mean of clipped updates; "
                                                 f"algorithm.aggregator={alg.aggregator} changes one client's influence; "
                                                 "use mean"),
                      (not alg.communicate, "federation.dp: this method uploads nothing (algorithm.communicate is "
                                            "false); drop federation.dp"),
                      (fed.dp.mode == "local" and alg.upload_personalized_messenger,
                       "federation.dp.mode=local: algorithm.upload_personalized_messenger would send each client's "
                       "messenger without noise; set it to false")]
        for broken, why in rules:
            if broken:
                raise ConfigError(why)


# --------------------------------------------------------------------------------------------- machinery


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of a config class (`from __future__ import annotations` makes them
    strings; they resolve in the class's own module)."""
    return typing.get_type_hints(cls)


def literal_choices(tp: Any) -> tuple | None:
    """The allowed values of a Literal annotation, also as one member of an Optional / Union (every
    non-None member must then be a Literal; None is the caller's business); None when `tp` is no Literal."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        out: tuple = ()
        for a in typing.get_args(tp):
            if a is type(None):
                continue
            c = literal_choices(a)
            if c is None:
                return None  # e.g. Literal[...] | str: free-form values are allowed
            out += tuple(x for x in c if x not in out)
        return out or None
    return None


def field_choices(cls: type, name: str) -> tuple | None:
    """The choices of field `name` of a config class (of each entry, for a tuple[Literal[...], ...])."""
    tp = _hints(cls)[name]
    if typing.get_origin(tp) is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return literal_choices(args[0]) if len(args) == 1 else None
    return literal_choices(tp)


def check_choices(cfg: Any, where: str = "") -> None:
    """Every Literal-typed field of `cfg` (and of its nested sections, recursively) against the choices its
    annotation lists: a Literal, an Optional / Union of Literals (None allowed when the annotation has it),
    or a tuple[Literal[...], ...] (every entry). `where` is the section's key path, e.g. "algorithm"."""
    for f in dataclasses.fields(cfg):
        key, v = f"{where}.{f.name}" if where else f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            check_choices(v, key)
            continue
        choices = field_choices(type(cfg), f.name)
        if choices is None:
            continue
        tp = _hints(type(cfg))[f.name]
        if typing.get_origin(tp) is tuple:
            for x in v if isinstance(v, (tuple, list)) else (v,):
                if x not in choices:
                    raise ConfigError(f"{key}: each entry must be one of {', '.join(map(str, choices))}, got {x!r}")
        elif not (v is None and type(None) in typing.get_args(tp)):
            _choice(key, v, choices)


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        extra = " (or ciders-fo, ciders-fd)" if "ciders" in choices and key.endswith("name") else ""
        hint = did_you_mean(str(value), [str(c) for c in choices]).replace("; ", " ")
        raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))}{extra}, got {value!r}"
                          + (f";{hint}" if hint else ""))


_YAML_TRUE = ("y", "yes", "true", "on")
_YAML_FALSE = ("n", "no", "false", "off")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check/convert one YAML value against a field type (str, int, float, bool, Optional, Literal,
    tuple[str, ...], nested dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, a, value)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and value not in typing.get_args(tp):
            # YAML 1.1 reads a bare off / on / no / yes as a bool: give back the choice that was written
            words = _YAML_TRUE if value else _YAML_FALSE
            spelled = [c for c in typing.get_args(tp) if isinstance(c, str) and c.lower() in words]
            if len(spelled) == 1:
                return spelled[0]
        return value  # checked against the annotation's choices by check_choices (validate_sections)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of settings, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (elem,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return tuple(_coerce(f"{key}[{i}]", elem, v) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return _finite(key, float(value))
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp!r}")  # a bug in a section definition


def did_you_mean(name: str, known: list[str], prefix: str = "") -> str:
    """"; did you mean 'prefix.best'?" for the closest known name, or "" when none is close."""
    import difflib

    hit = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{hit[0]}'?" if hit else ""


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build a (nested) config dataclass from a mapping; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if hasattr(cls, "from_raw"):  # a section's spelled-out aliases (algorithm.name: ciders-fo)
        data = cls.from_raw(data, prefix)
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key '{where}{unknown[0]}'{did_you_mean(unknown[0], names, where)} "
                          f"(known keys here: {', '.join(names)})")
    kw = {k: _coerce(f"{prefix}.{k}" if prefix else k, hints[k], v) for k, v in data.items()}
    return cls(**kw)


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) suitable for YAML/JSON."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v

    return conv(cfg)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set takd.lr=1e-3")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {exc}") from exc
    if isinstance(value, str) and _looks_numeric(value):
        value = float(value)  # YAML 1.1 reads 1e-3 (and nan, inf) as a string
    elif isinstance(value, list):  # the same in a list: [1e-1, 5e-1]
        value = [float(v) if isinstance(v, str) and _looks_numeric(v) else v for v in value]
    return key.split("."), value


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def apply_overrides(data: dict, overrides: list[str], cls: type = ExperimentConfig) -> dict:
    """Apply `a.b=value` overrides to a raw config mapping; unknown paths are errors."""
    data = _deepcopy_plain(data)
    for item in overrides:
        path, value = parse_override(item)
        node, tp = data, cls
        for i, part in enumerate(path):
            fields = {f.name: f for f in dataclasses.fields(tp)} if dataclasses.is_dataclass(tp) else {}
            if part not in fields:
                where = ".".join(path[:i])
                raise ConfigError(
                    f"--set {'.'.join(path)}: unknown key '{part}'"
                    + (f" under '{where}'" if where else "")
                    + did_you_mean(part, list(fields), f"{where}." if where else "")
                    + (f" (known: {', '.join(fields)})" if fields else "")
                )
            ftype = typing.get_type_hints(tp)[part]
            if i == len(path) - 1:
                if dataclasses.is_dataclass(ftype):
                    raise ConfigError(f"--set {'.'.join(path)}: is a section; set one of its keys")
                if ftype is float and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                node[part] = value
            else:
                if not dataclasses.is_dataclass(ftype):
                    raise ConfigError(f"--set {'.'.join(path)}: '{part}' is not a section")
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"--set {'.'.join(path)}: '{part}' in the file is not a mapping")
                tp = ftype
    return data


def _deepcopy_plain(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy_plain(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy_plain(v) for v in d]
    return d


# Keys holding a local path (data files, a model directory): `load_config` makes them absolute, so that a
# loaded config means the same files from any working directory (a Flower ServerApp runs in its own).
PATH_KEYS = (("data", "public"), ("data", "eval"), ("data", "clients"), ("data", "client_files"), ("data", "source"),
             ("model", "name"))
DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".parquet", ".gz")


def _anchor(value: Any, base: Path, model: bool = False) -> Any:
    """`value` made absolute against `base` when it is a relative local path. Left alone: absolute paths,
    `$CIDERS_DATA` / `~` paths (expanded when read), hub ids (no data suffix and nothing at that path), built-in
    model names; a model name only counts as a path when something exists there."""
    if isinstance(value, (list, tuple)):
        return [_anchor(v, base, model) for v in value]
    if not isinstance(value, str) or not value or value.startswith(("/", "$", "~", "hub:")) or value == "hub":
        return value
    target = base / value
    if model:
        return str(target.resolve()) if target.exists() and (value.startswith(".") or "/" in value) else value
    if target.exists() or value.lower().endswith(DATA_SUFFIXES) or value.startswith("."):
        return str(target.resolve())
    return value


def anchor_paths(data: dict, base: Path) -> dict:
    """The raw mapping with its path keys made absolute against `base` (see PATH_KEYS)."""
    data = _deepcopy_plain(data)
    for sec, key in PATH_KEYS:
        node = data.get(sec)
        if isinstance(node, dict) and key in node:
            node[key] = _anchor(node[key], base, model=sec == "model")
    return data


def _anchor_config(cfg: Any, base: Path) -> Any:
    """A loaded config whose path keys (set by --set, or left at their defaults) are absolute against `base`."""
    changes = {}
    for sec, key in PATH_KEYS:
        part = getattr(cfg, sec, None)
        if part is None or not hasattr(part, key):
            continue
        old = getattr(part, key)
        new = _anchor(old, base, model=sec == "model")
        new = tuple(new) if isinstance(old, tuple) else new
        if new != old:
            changes.setdefault(sec, {})[key] = new
    for sec, kw in changes.items():
        cfg = dataclasses.replace(cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kw)})
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None, cls: type = ExperimentConfig) -> Any:
    """Read a YAML experiment file (or the defaults when `path` is None), apply overrides, validate.
    Relative paths in the file are relative to the file; those of `overrides` and the defaults, to the current
    directory. The loaded config holds them absolute (docs/data.md#paths)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = anchor_paths(data, p.resolve().parent)
    data = apply_overrides(data, overrides or [], cls)
    return _anchor_config(from_dict(cls, data), Path.cwd()).validate()


def load_run_config(path: str | Path, cls: type = ExperimentConfig) -> Any:
    """A run directory's config.yaml. It holds absolute paths (load_config made them so); a run written before
    paths were anchored holds paths relative to the directory it was run from, which is read as the current one
    (not the run directory, which load_config would take)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    return _anchor_config(loads_config(p.read_text(encoding="utf-8"), str(p), cls), Path.cwd()).validate()


def loads_config(text: str, what: str = "config", cls: type = ExperimentConfig) -> Any:
    """A config from YAML text (e.g. one carried in a Flower message)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: the top level must be a mapping of sections")
    return from_dict(cls, data).validate()


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe_keys(cls: type = ExperimentConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every leaf key, for `ciders config --keys`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe_keys(hints[f.name], key + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            help_ = f.metadata.get("help", "")
            choices = field_choices(cls, f.name)
            if choices is not None:  # written once, in the annotation
                help_ = f"{help_} (choose from {' | '.join(map(str, choices))})"
            rows.append((key, repr(to_dict(default) if dataclasses.is_dataclass(default) else default), help_))
    return rows
