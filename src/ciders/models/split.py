"""Layer split of Algorithm 1, from layer counts alone (no weights):
docs/method.md#algorithm-1-model-decomposition-modelprep.

Messenger P_M = top `a` layers (n-a .. n-1); full backbone B_F = layers 0 .. n-a-1;
learnable backbone B_L = n' layers of B_F at floor(j*(n-a-1)/(n'-1)), j = 0..n'-1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ciders.errors import ConfigError

_EPS = 1e-9  # guards beta*(n-a) against binary float error (0.29 * 100 = 28.999999999999996)


@dataclass(frozen=True)
class Split:
    n_layers: int
    messenger_layers: int
    student_indices: tuple[int, ...]

    @property
    def teacher_layers(self) -> int:
        """Layers of the frozen full backbone B_F (the teacher side below the messenger)."""
        return self.n_layers - self.messenger_layers

    @property
    def student_layers(self) -> int:
        return len(self.student_indices)

    @property
    def messenger_indices(self) -> tuple[int, ...]:
        return tuple(range(self.teacher_layers, self.n_layers))

    @property
    def edge_layers(self) -> int:
        """Layers of AdapEmu (B_L then P_M)."""
        return self.student_layers + self.messenger_layers


def student_count(n_teacher: int, beta: float, rounding: str = "round") -> int:
    """n' = round(beta * (n - a)) (half up; our decision, docs/method.md#algorithm-1-model-decomposition-modelprep) or
    floor(...) (Algorithm 1 literally)."""
    x = beta * n_teacher
    if rounding == "round":
        return int(math.floor(x + 0.5 + _EPS))
    if rounding == "floor":
        return int(math.floor(x + _EPS))
    raise ConfigError(f"rounding: must be 'round' or 'floor', got {rounding!r}")


def strided_indices(n_teacher: int, n_student: int) -> tuple[int, ...]:
    """floor(j * (m-1) / (n'-1)) for j = 0..n'-1, in integer arithmetic; n' = 1 keeps layer 0."""
    if not 1 <= n_student <= n_teacher:
        raise ConfigError(f"student layers must be in [1, {n_teacher}] (the B_F layer count), got {n_student}")
    if n_student == 1:
        return (0,)
    return tuple((j * (n_teacher - 1)) // (n_student - 1) for j in range(n_student))


def split_layers(
    n_layers: int,
    messenger_layers: int,
    *,
    beta: float | None = None,
    drop_ratio: float | None = None,
    student_layers: int | None = None,
    rounding: str = "round",
) -> Split:
    """The split of Algorithm 1 (docs/method.md#algorithm-1-model-decomposition-modelprep). Give at most one of beta,
    drop_ratio (= 1 - beta), student_layers; with none, drop_ratio 0.2 (the paper's setting)."""
    a = messenger_layers
    if not isinstance(a, int) or a < 1:
        raise ConfigError(f"messenger_layers: must be an integer >= 1, got {a!r}")
    if a >= n_layers:
        raise ConfigError(
            f"messenger_layers: a={a} must be < n={n_layers} (the model's layer count) so that the "
            "full backbone keeps at least one layer"
        )
    given = [k for k, v in (("beta", beta), ("drop_ratio", drop_ratio), ("student_layers", student_layers)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"set only one of beta, drop_ratio, student_layers (got {', '.join(given)})")
    m = n_layers - a
    if student_layers is not None:
        n_student = student_layers
    else:
        if drop_ratio is not None:
            if not 0 <= drop_ratio < 1:
                raise ConfigError(f"drop_ratio: must be in [0, 1), got {drop_ratio}")
            beta = 1.0 - drop_ratio
        elif beta is None:
            beta = 0.8
        if not 0 < beta <= 1:
            raise ConfigError(f"beta: must be in (0, 1], got {beta}")
        n_student = student_count(m, beta, rounding)
        if n_student < 1:
            raise ConfigError(
                f"beta={beta:g} keeps {beta * m:.2f} of the {m} backbone layers, which rounds to 0; raise beta"
            )
    return Split(n_layers, a, strided_indices(m, n_student))
