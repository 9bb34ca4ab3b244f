"""Client-level differential privacy (DP-FedAvg, McMahan et al. 2018): clipping, Gaussian noise, and the
privacy accountant. Pure functions; randomness only through an explicit `torch.Generator`.

**The mechanism.** Client i's update Delta_i (Eq. 8, before Eq. 9) is clipped to L2 norm <= C:

    clip(Delta_i) = Delta_i * min(1, C / ||Delta_i||),   ||.|| the global norm over all tensors (float64)

Then, with noise multiplier z:

    central   the server adds N(0, (z C / m)^2) per coordinate to the uniform mean of the m clipped updates
              (the same as N(0, (z C)^2) on their sum: one client moves the sum by at most C, so the noise is
              z times that sensitivity)
    local     each client adds N(0, (z C)^2) per coordinate to its own clipped update before it leaves

`noise_std(mode, C, z, m)` gives these standard deviations.

**The accountant.** Opacus's RDP accountant (`opacus.accountants.RDPAccountant`) composes the rounds. For
a Gaussian mechanism of noise multiplier sigma (std / L2 sensitivity) subsampled at rate q, it computes the
Renyi DP of each round at the orders `RDPAccountant.DEFAULT_ALPHAS`, multiplies by the number of rounds,
and converts to (epsilon, delta) with Balle et al. 2020 (Thm. 21):

    epsilon = min over orders a of   RDP(a) + log((a - 1) / a) - (log delta + log a) / (a - 1)

For q = 1 the round's RDP is exactly a / (2 sigma^2).

- Central (`central_epsilon`): adjacency = adding or removing one client's data set (every update it would
  send). The noise multiplier is z; the sampling rate is q = clients per round / registered clients.
  ciders samples a fixed number of clients per round without replacement; the accountant analyses Poisson
  subsampling at rate q, the usual approximation of it (as in DP-FedAvg and DP-SGD practice), not a
  theorem about fixed-size sampling. The guarantee holds against whoever sees the released (noised) mean:
  the server is trusted with the clipped updates themselves (secure aggregation hides them from it).
- Local (`local_epsilon`): what one client's own uploads reveal to anyone who sees them, the server
  included. Adjacency = replacing the client's data by any other (bounded-range DP: an update is always
  sent, so there is nothing to remove), so one release has L2 sensitivity 2C (two updates of norm <= C
  are at most 2C apart) and noise std z C: an effective noise multiplier z / 2. There is no amplification
  by sampling (the server knows who took part), so q = 1, and `rounds` is the number of rounds the
  client took part in. Hence local_epsilon(z, T, delta) = central_epsilon(z / 2, 1, T, delta).

`noise_for_epsilon` inverts either: the smallest z (to a relative 1e-4 in epsilon) whose epsilon after the
given rounds is at most the target. The accountant's fixed orders put a floor under the epsilon it can
certify at a given delta (about 0.1 at delta = 1e-5); a target at or below that floor is refused.

**Noise draws.** `gaussian_like` draws float32 on the generator's device (the CPU by default, so a seed gives
the same noise whatever device the state lives on), key by key in sorted key order (a state's dict order
differs between one built in memory and one read back from safetensors), then casts to each tensor's
dtype and device. With `dp.noise: seeded` the seed is `runtime.derive_seed(seed, "dp-central-noise", t)`
(server) or `derive_seed(seed, "dp-local-noise", t, ci)` (client ci); with `secret`, `noise_generator(None)`
seeds from the operating system.

**No DP is bit-identical to the plain run.** `clip_to_norm(st, None)` and `add_noise(st, 0.0, gen)` return
`st` itself, and a zero std consumes no randomness.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Literal

import torch

from ciders.core.tensors import State, add, norm, scale

DPMode = Literal["none", "central", "local"]

# noise_for_epsilon: the bisection stops once epsilon at the returned z is within this fraction of the target
_EPS_RTOL = 1e-4
_MAX_Z = 1e6  # no useful noise multiplier is larger (the target is then below the accountant's floor)


# ------------------------------------------------------------------------------------------------ clipping


def clip_to_norm(st: State, max_norm: float | None) -> tuple[State, float]:
    """(st scaled by min(1, max_norm / ||st||), ||st|| before clipping): the global L2 norm over all tensors
    in float64 (sorted key order, `tensors.norm`).

    `st` itself comes back (the same dict, untouched) when max_norm is None, when ||st|| <= max_norm (a zero
    state included), and when the norm is not finite (clipping cannot repair such an update; the server's
    checks reject non-finite uploads). The clipped norm equals max_norm up to the rounding of the tensors'
    dtype."""
    n = norm(st)
    if max_norm is None:
        return st, n
    if not max_norm > 0:
        raise ValueError(f"clip_to_norm: max_norm must be > 0 or None, got {max_norm}")
    if not math.isfinite(n) or n <= max_norm:
        return st, n
    return scale(st, max_norm / n), n


# --------------------------------------------------------------------------------------------------- noise


def noise_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed`, or with 63 bits from os.urandom when seed is None
    (`dp.noise: secret`). Keep the default CPU device for noise that is reproducible across devices."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def gaussian_like(like: State, std: float, gen: torch.Generator) -> State:
    """Independent N(0, std^2) per element, shaped like `like` (keys in its order, each tensor's dtype and
    device). Drawn in float32 on gen's device, in sorted key order; std == 0 gives exact zeros and leaves
    `gen` untouched."""
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"gaussian_like: std must be finite and >= 0, got {std}")
    if std == 0:
        return {k: torch.zeros_like(v) for k, v in like.items()}
    drawn = {}
    for k in sorted(like):
        z = torch.randn(tuple(like[k].shape), generator=gen, dtype=torch.float32, device=gen.device)
        drawn[k] = (z * std).to(device=like[k].device, dtype=like[k].dtype)
    return {k: drawn[k] for k in like}


def add_noise(st: State, std: float, gen: torch.Generator) -> State:
    """st + N(0, std^2) per element (`gaussian_like`); with std == 0, `st` itself."""
    if std == 0:
        return st
    return add(st, gaussian_like(st, std, gen))


def noise_std(mode: DPMode, clip: float | None, z: float, m: int = 1) -> float:
    """The per-coordinate noise std: central z C / m (m = the number of updates in the uniform mean), local
    z C; 0.0 for mode none or z == 0 (clip may then be None)."""
    if mode not in ("none", "central", "local"):
        raise ValueError(f"noise_std: unknown mode {mode!r} (none, central, local)")
    if z < 0:
        raise ValueError(f"noise_std: the noise multiplier must be >= 0, got {z}")
    if mode == "none" or z == 0:
        return 0.0
    if clip is None or not clip > 0:
        raise ValueError(f"noise_std: noise is scaled to the clipping norm, which must be > 0 (got {clip})")
    if mode == "local":
        return z * clip
    if m < 1:
        raise ValueError(f"noise_std: the central mean needs m >= 1 updates, got {m}")
    return z * clip / m


# ---------------------------------------------------------------------------------------------- accountant


def _check_accounting(sample_rate: float, rounds: int, delta: float, where: str) -> None:
    if not 0 < sample_rate <= 1:
        raise ValueError(f"{where}: sample_rate must be in (0, 1], got {sample_rate}")
    if rounds < 0 or int(rounds) != rounds:
        raise ValueError(f"{where}: rounds must be an integer >= 0, got {rounds}")
    if not 0 < delta < 1:
        raise ValueError(f"{where}: delta must be in (0, 1), got {delta}")


def central_epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """Epsilon at `delta` after `rounds` rounds of the Poisson-subsampled Gaussian mechanism (rate
    sample_rate, noise multiplier z), composed by Opacus's RDP accountant. z == 0: inf; rounds == 0: 0."""
    _check_accounting(sample_rate, rounds, delta, "central_epsilon")
    if noise_multiplier < 0:
        raise ValueError(f"central_epsilon: noise_multiplier must be >= 0, got {noise_multiplier}")
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    from opacus.accountants import RDPAccountant  # slow to import; only the accountant needs it

    acc = RDPAccountant()
    for _ in range(int(rounds)):
        acc.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))
    return float(acc.get_epsilon(delta=delta))


def local_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """Local DP of one client after `rounds` uploads: each a Gaussian mechanism of L2 sensitivity 2C
    (replace-one adjacency) and std z C, i.e. noise multiplier z / 2, without sampling amplification."""
    return central_epsilon(noise_multiplier / 2, 1.0, rounds, delta)


def epsilon_floor(delta: float) -> float:
    """The smallest epsilon the accountant can certify at `delta` (infinite noise: zero RDP at every order)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import get_privacy_spent

    orders = RDPAccountant.DEFAULT_ALPHAS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha": expected here
        eps, _ = get_privacy_spent(orders=orders, rdp=[0.0] * len(orders), delta=delta)
    return float(eps)


def noise_for_epsilon(target_epsilon: float, delta: float, sample_rate: float, rounds: int,
                      mode: Literal["central", "local"]) -> float:
    """The smallest noise multiplier z (to a relative 1e-4 in epsilon) whose epsilon after `rounds` rounds
    is at most target_epsilon: central at `sample_rate`, local without sampling (sample_rate unused).
    Bisection over `central_epsilon` / `local_epsilon`, which decrease in z."""
    if mode not in ("central", "local"):
        raise ValueError(f"noise_for_epsilon: mode must be central or local, got {mode!r}")
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"noise_for_epsilon: target_epsilon must be finite and > 0, got {target_epsilon}")
    _check_accounting(sample_rate if mode == "central" else 1.0, rounds, delta, "noise_for_epsilon")
    if rounds < 1:
        raise ValueError("noise_for_epsilon: rounds must be >= 1 (no round releases anything)")
    floor = epsilon_floor(delta)
    if target_epsilon <= floor:
        raise ValueError(f"noise_for_epsilon: target_epsilon {target_epsilon} is at or below {floor:.4g}, the "
                         f"least the RDP accountant can certify at delta={delta} with any noise; raise it or delta")

    def eps(z: float) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # extreme optimal orders while the bisection explores
            if mode == "central":
                return central_epsilon(z, sample_rate, rounds, delta)
            return local_epsilon(z, rounds, delta)

    lo, hi = 0.0, 1.0  # invariant: eps(lo) > target >= eps(hi) (eps(0) = inf)
    eps_hi = eps(hi)
    while eps_hi > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > _MAX_Z:
            raise ValueError(f"noise_for_epsilon: no noise multiplier up to {_MAX_Z:g} reaches epsilon "
                             f"{target_epsilon} at delta={delta}")
        eps_hi = eps(hi)
    while target_epsilon - eps_hi > _EPS_RTOL * target_epsilon and hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        eps_mid = eps(mid)
        if eps_mid > target_epsilon:
            lo = mid
        else:
            hi, eps_hi = mid, eps_mid
    return hi
