"""Server optimizers on the aggregated messenger update: FedAvgM, FedAdam and FedYogi (Reddi et al., "Adaptive
Federated Optimization", ICLR 2021; Hsu et al. 2019 for FedAvgM; docs/method.md#server-optimizers).

Optax style: hyperparameters (`ServerOpt`) and explicit state (`ServerOptState`) in, new messenger and new state
out; nothing is written in place. The input is the step the server's plain rule would take this round,

  d = w_plain - w          (Eq. 12: d = -tau K eta_bar sum_i p_i Delta_i; an *update*, not a gradient)

and the optimizers, with t the number of updates applied so far, this one included, are

  fedavgm   m' = mu m + d                                            w' = w + lr m'
  fedadam   m' = b1 m + (1 - b1) d,  v' = b2 v + (1 - b2) d^2        w' = w + lr_t m' / (sqrt(v') + eps)
            lr_t = lr sqrt(1 - b2^(t+1)) / (1 - b1^(t+1))
  fedyogi   m' as fedadam,  v' = v - (1 - b2) d^2 sign(v - d^2)      w' = w + lr m' / (sqrt(v') + eps)

with m = v = 0 before the first update. These are the formulas of Flower 1.42's `flwr.serverapp.strategy`
FedAvgM / FedAdam / FedYogi (tests/core/test_server_opt.py runs both on the same inputs): Flower's FedAvgM keeps
the momentum of the pseudo-gradient w - w_plain = -d and subtracts it, which is the same weights (our m is minus
theirs); its FedAdam bias-corrects with exponent server_round + 1, server_round counting from 1 (so t + 1 here,
where Adam itself would use t); FedYogi has no bias correction; both start v at 0, not at Reddi et al.'s
v_{-1} >= eps^2. Moments are kept in float32 at least (float64 for a float64 messenger); w' is cast back to the
messenger's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ciders.core.optim import moments_equal
from ciders.core.tensors import State
from ciders.errors import ConfigError

NAMES = ("none", "fedavgm", "fedadam", "fedyogi")  # = the choices of algorithm.server_optimizer (a test checks)
ADAPTIVE = ("fedadam", "fedyogi")  # the ones with a second moment v
DEFAULT_LR = {"fedavgm": 1.0, "fedadam": 0.1, "fedyogi": 0.01}  # Flower 1.42's defaults, for server_lr: null


@dataclass(frozen=True)
class ServerOpt:
    """Hyperparameters of one server optimizer (`algorithm.server_*`)."""

    name: str
    lr: float
    momentum: float = 0.9  # fedavgm
    beta1: float = 0.9  # fedadam / fedyogi
    beta2: float = 0.99
    tau: float = 1e-3  # eps of the denominator, Reddi et al.'s tau (the degree of adaptivity)


def from_config(cfg: Any) -> ServerOpt | None:
    """The server optimizer of an `algorithm` section (CidersConfig), or None for server_optimizer: none."""
    name = cfg.server_optimizer
    if name == "none":
        return None
    lr = DEFAULT_LR[name] if cfg.server_lr is None else cfg.server_lr
    return ServerOpt(name, lr, cfg.server_momentum, cfg.server_beta1, cfg.server_beta2, cfg.server_tau)


@dataclass(frozen=True, eq=False)
class ServerOptState:
    """The server optimizer's explicit state: which optimizer, the updates applied so far, the first moment m and
    (fedadam / fedyogi) the second moment v of every messenger tensor; v is empty for fedavgm."""

    name: str
    step: int
    m: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        if self.name not in DEFAULT_LR:
            raise ValueError(f"ServerOptState: unknown server optimizer {self.name!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"ServerOptState: step must be an integer >= 0, got {self.step!r}")
        if self.v and self.m.keys() != self.v.keys():
            diff = sorted(set(self.m) ^ set(self.v))[:3]
            raise ValueError(f"ServerOptState: m and v name different tensors ({diff})")
        if (self.name in ADAPTIVE) != bool(self.v):
            need = "needs" if self.name in ADAPTIVE else "has no"
            raise ValueError(f"ServerOptState: {self.name} {need} second moment v")

    def to_record(self, prefix: str = "server_opt") -> tuple[dict[str, torch.Tensor], dict]:
        """Flat tensors `{prefix}_m/<name>`, `{prefix}_v/<name>` and JSON meta `{prefix}: {name, step}`."""
        tensors = {f"{prefix}_m/{k}": t for k, t in self.m.items()}
        tensors.update({f"{prefix}_v/{k}": t for k, t in self.v.items()})
        return tensors, {prefix: {"name": self.name, "step": self.step}}

    @classmethod
    def from_record(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping, prefix: str = "server_opt"
                    ) -> "ServerOptState | None":
        """The inverse of to_record (other keys are ignored); None when the record holds no server optimizer state
        (meta `{prefix}` absent or null: a checkpoint written before server optimizers, or server_optimizer none)."""
        info = meta.get(prefix)
        if info is None:
            return None

        def part(p: str) -> dict[str, torch.Tensor]:
            return {k[len(p) + 1 :]: t for k, t in tensors.items() if k.startswith(p + "/")}

        return cls(str(info["name"]), int(info["step"]), part(f"{prefix}_m"), part(f"{prefix}_v"))

    def to(self, device: torch.device | str) -> "ServerOptState":
        return ServerOptState(self.name, self.step, {k: t.to(device) for k, t in self.m.items()},
                              {k: t.to(device) for k, t in self.v.items()})

    def tensors(self) -> list[State]:
        return [self.m, self.v] if self.v else [self.m]

    def equal(self, other: object) -> bool:
        """Same optimizer and step, and bitwise the same moments (shapes, dtypes, values) under the same names."""
        return (isinstance(other, ServerOptState) and (self.name, self.step) == (other.name, other.step)
                and moments_equal((self.m, other.m), (self.v, other.v)))

    __eq__ = equal  # a bool, not an elementwise tensor comparison
    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside


def state_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 at least: moments of a bfloat16 / float16 messenger would lose the small d^2."""
    return torch.promote_types(t.dtype, torch.float32)


def init(name: str, params: Mapping[str, torch.Tensor]) -> ServerOptState:
    def zeros() -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(p, dtype=state_dtype(p)) for k, p in params.items()}

    return ServerOptState(name, 0, zeros(), zeros() if name in ADAPTIVE else {})


def update(opt: ServerOpt, w: State, d: State, state: ServerOptState | None) -> tuple[State, ServerOptState]:
    """One server-optimizer step from the messenger w and the plain step d (module docstring); state None starts
    from zero moments. Returns (w', state')."""
    if state is None:
        state = init(opt.name, w)
    if state.name != opt.name:
        raise ConfigError(f"algorithm.server_optimizer: the server state holds {state.name} moments but the config "
                          f"says {opt.name}; resume with server_optimizer: {state.name}, or start a new run")
    if state.m.keys() != w.keys():
        raise ValueError("server optimizer state and messenger name different tensors")
    t = state.step + 1
    new_w, m, v = {}, {}, {}
    for k, wk in w.items():
        dk = d[k].to(state.m[k].dtype)
        if opt.name == "fedavgm":
            m[k] = state.m[k] * opt.momentum + dk
            step = m[k] * opt.lr
        else:
            m[k] = state.m[k] * opt.beta1 + dk * (1 - opt.beta1)
            d2 = dk * dk
            if opt.name == "fedadam":
                v[k] = state.v[k] * opt.beta2 + d2 * (1 - opt.beta2)
            else:  # fedyogi
                v[k] = state.v[k] - d2 * (1 - opt.beta2) * torch.sign(state.v[k] - d2)
            step = (_lr_t(opt, t) * m[k]) / (v[k].sqrt() + opt.tau)
        new_w[k] = (wk.to(step.dtype) + step).to(wk.dtype)
    return new_w, ServerOptState(opt.name, t, m, v)


def _lr_t(opt: ServerOpt, t: int) -> float:
    """fedadam: Flower's bias-corrected rate, exponent t + 1 (its server_round + 1); fedyogi: lr."""
    if opt.name != "fedadam":
        return opt.lr
    return opt.lr * math.sqrt(1 - opt.beta2 ** (t + 1.0)) / (1 - opt.beta1 ** (t + 1.0))
