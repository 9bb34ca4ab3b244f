"""Server aggregation over named tensor dicts, once for every algorithm.

Weighted mean (FedAvg, McMahan et al. 2017; CIDERS Eq. 12) over the clients S that replied, with raw
weights w_i >= 0 (sample counts |D_i|, capacities, or 1 each):

  p_i = w_i / sum_{j in S} w_j                                   (`normalise`, `client_weights`)
  mean = sum_{i in S} p_i theta_i                                (`weighted_sum` with p, `weighted_mean` with w)

Per-coordinate masked mean (RABO / RAFBO; docs/rabo.md#per-coordinate-aggregation-and-covering-numbers): client i
holds coordinate k of the state when its mask m_i^k = 1; with the covering count C^k = sum_i m_i^k and N^k = {i : m_i^k
= 1},

  mean^k = (1 / C^k) sum_{i in N^k} v_i^k   where C^k > 0, else 0  (`masked_mean`)
  s^k   <- s^k - lr mean^k                  (C^k = 0: s^k unchanged) (`masked_step`)
  C*     = min_{k : C^k > 0} C^k                                   (`covering`: the round's covering number)

Robust aggregates (docs/method.md#robust-aggregation), unweighted and per coordinate k, as Flower's
FedMedian / FedTrimmedAvg (`aggregate_median`, `aggregate_trimmed_avg`): with v_(1)^k <= ... <= v_(n)^k the n
clients' values of coordinate k sorted,

  median^k  = v_((n+1)/2)^k                                n odd   (`coordinate_median`)
            = (v_(n/2)^k + v_(n/2+1)^k) / 2                 n even  (the mean of the two middle values)
  trimmed^k = (1 / (n - 2 b)) sum_{j=b+1}^{n-b} v_(j)^k,   b = int(beta n), beta in [0, 0.5)  (`trimmed_mean`)

b < n/2 for every beta < 0.5, so at least one value is always kept; beta = 0 is the plain unweighted mean.

Robustness (docs/security.md#aggregation): `step_check` bounds what one client may move the state by in one
round, ||step_i|| <= ratio * max(r, 1), with r the norm of a reference no client can inflate (CIDERS: ||w_0||,
the global messenger's norm at the run's start; a bound on the current ||state|| compounds, since each
accepted push raises the next round's bound), and `all_finite` is checked on an aggregate before it is
committed (finite but huge values can still sum to Inf).

With every mask full, C^k = |S| and masked_mean is the uniform weighted mean. The sums run over the
clients in the order given (float sums depend on order): `weighted_sum` in the tensors' own dtype, or in
`accumulate` (e.g. float64) and cast back.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ciders.core.tensors import State, norm


def normalise(weights: Sequence[float]) -> list[float]:
    """p_i = w_i / sum_j w_j; the w_i must be >= 0 with a positive sum (only their proportions matter)."""
    w = [float(v) for v in weights]
    if not w:
        raise ValueError("no clients to weight")
    if any(not v >= 0 for v in w) or sum(w) <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {w}")
    total = sum(w)
    return [v / total for v in w]


def client_weights(sizes: Sequence[int], uniform: bool = False) -> list[float]:
    """p_i over the clients that replied: |D_i| / sum_j |D_j|, or 1/|S| with `uniform`."""
    if not sizes:
        raise ValueError("no clients to weight")
    if uniform:
        return [1.0 / len(sizes)] * len(sizes)
    if any(n < 0 for n in sizes) or sum(sizes) <= 0:
        raise ValueError(f"client sizes must be >= 0 with a positive sum, got {list(sizes)}")
    return normalise(sizes)


def _check(states: Sequence[Mapping[str, torch.Tensor]], ref: Mapping[str, torch.Tensor], what: str) -> None:
    """Every state has `ref`'s keys and shapes (a silent mismatch would corrupt the mean)."""
    for j, s in enumerate(states):
        for k, r in ref.items():
            if k not in s:
                raise KeyError(f"{what}: client {j} has no {k!r}")
            if s[k].shape != r.shape:
                raise ValueError(f"{what}: client {j}'s {k!r} has shape {tuple(s[k].shape)}, "
                                 f"the reference {tuple(r.shape)}")
        extra = set(s) - set(ref)
        if extra:
            raise KeyError(f"{what}: client {j} has keys the reference lacks, e.g. {sorted(extra)[0]!r}")


def weighted_sum(states: Sequence[Mapping[str, torch.Tensor]], p: Sequence[float], *,
                 like: Mapping[str, torch.Tensor] | None = None, accumulate: torch.dtype | None = None,
                 what: str = "weighted_sum") -> State:
    """sum_i p_i states_i with the coefficients p as given (already normalised: see `normalise`), summed
    over the clients in order. `like` (default: the first state) fixes the keys, shapes and the result's
    dtype; `accumulate` sums in that dtype instead (e.g. torch.float64) and casts back. Detached."""
    if len(states) == 0:
        raise ValueError(f"{what}: no client states to average")
    if len(p) != len(states):
        raise ValueError(f"{what}: {len(states)} client states but {len(p)} weights")
    ref = states[0] if like is None else like
    _check(states, ref, what)
    out: State = {}
    for k, r in ref.items():
        acc = None
        for pi, s in zip(p, states):
            v = s[k].detach()
            term = (v if accumulate is None else v.to(accumulate)) * pi
            acc = term if acc is None else acc + term
        out[k] = acc if accumulate is None else acc.to(r.dtype)
    return out


def weighted_mean(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], *,
                  like: Mapping[str, torch.Tensor] | None = None, accumulate: torch.dtype | None = torch.float64,
                  what: str = "weighted_mean") -> State:
    """FedAvg: sum_i p_i states_i with p = normalise(weights) (sample counts or capacities can be passed as
    they are), accumulated in float64 by default and cast back to `like`'s (default: the first state's)
    dtypes."""
    if len(states) == 0:
        raise ValueError(f"{what}: no client states to average")
    if len(weights) != len(states):
        raise ValueError(f"{what}: {len(states)} client states but {len(weights)} weights")
    try:
        p = normalise(weights)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return weighted_sum(states, p, like=like, accumulate=accumulate, what=what)


def _sorted_clients(states: Sequence[Mapping[str, torch.Tensor]], k: str) -> torch.Tensor:
    """The clients' values of `k` stacked on a new leading axis in float64, sorted along it per coordinate."""
    return torch.stack([s[k].detach().to(torch.float64) for s in states]).sort(dim=0).values


def _robust_check(states: Sequence[Mapping[str, torch.Tensor]], what: str) -> Mapping[str, torch.Tensor]:
    if len(states) == 0:
        raise ValueError(f"{what}: no client states to aggregate")
    _check(states, states[0], what)
    return states[0]


def coordinate_median(states: Sequence[Mapping[str, torch.Tensor]], *, what: str = "coordinate_median") -> State:
    """The coordinate-wise median over the clients, unweighted: the middle value for an odd count, the mean
    of the two middle values for an even one (numpy's `np.median`, which Flower's FedMedian uses; not
    torch.median, which returns the lower of the two). Computed in float64 and cast back to the first
    state's dtype per key, in its key order. The values should be finite (the server checks every Delta_i
    first): a NaN sorts last and does not propagate as it does in numpy. Detached."""
    ref = _robust_check(states, what)
    n = len(states)
    out: State = {}
    for k, r in ref.items():
        v = _sorted_clients(states, k)
        mid = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
        out[k] = mid.to(r.dtype)
    return out


def trimmed_mean(states: Sequence[Mapping[str, torch.Tensor]], fraction: float, *,
                 what: str = "trimmed_mean") -> State:
    """The coordinate-wise trimmed mean over the n clients, unweighted: per coordinate, the b = int(fraction *
    n) smallest and the b largest values are cut and the n - 2 b left are averaged (Flower's FedTrimmedAvg
    `trim_mean`, after scipy.stats.trim_mean). fraction must be in [0, 0.5), so b < n / 2 and at least one
    value is always kept; fraction 0, or b = 0 for a small n, is the plain unweighted mean. Summed in
    float64 over the kept values in sorted order (the same on every device) and cast back to the first
    state's dtype per key, in its key order. Detached."""
    if not 0.0 <= fraction < 0.5:
        raise ValueError(f"{what}: the fraction cut from each end must be in [0, 0.5), got {fraction}")
    ref = _robust_check(states, what)
    n = len(states)
    b = int(fraction * n)
    out: State = {}
    for k, r in ref.items():
        v = _sorted_clients(states, k)
        acc = v[b].clone()
        for j in range(b + 1, n - b):
            acc += v[j]
        out[k] = (acc / (n - 2 * b)).to(r.dtype)
    return out


def masked_mean(values: Sequence[State], masks: Sequence[State]) -> tuple[State, State]:
    """(mean^k over the clients that hold coordinate k, C^k the number of them); mean^k = 0 where C^k = 0.
    values[i] need only be correct where masks[i] is 1 (0/1 masks in the values' dtype)."""
    if len(values) != len(masks) or not values:
        raise ValueError("masked_mean needs one mask per value and at least one value")
    keys = values[0].keys()
    total = {k: torch.zeros_like(values[0][k]) for k in keys}
    count = {k: torch.zeros_like(values[0][k]) for k in keys}
    for v, m in zip(values, masks):
        for k in keys:
            total[k] += v[k] * m[k]
            count[k] += m[k]
    mean = {k: torch.where(count[k] > 0, total[k] / count[k].clamp_min(1), torch.zeros_like(total[k])) for k in keys}
    return mean, count


def covering(count: Mapping[str, torch.Tensor]) -> dict:
    """Statistics of the covering counts C^k: `covering` = C* = min C^k over the coordinates someone
    trained (0 when nobody trained any), `coordinates_trained` (C^k > 0) and `coordinates`."""
    trained_counts = [c[c > 0] for c in count.values() if bool((c > 0).any())]
    cover = min(int(c.min()) for c in trained_counts) if trained_counts else 0
    trained = sum(int((c > 0).sum()) for c in count.values())
    return {"covering": cover, "coordinates_trained": trained, "coordinates": sum(c.numel() for c in count.values())}


def masked_step(state: State, values: Sequence[State], masks: Sequence[State], lr: float) -> tuple[State, dict]:
    """s^k <- s^k - lr * mean^k (masked_mean); coordinates nobody holds keep their value. Returns
    (state', covering(C))."""
    mean, count = masked_mean(values, masks)
    return {k: state[k] - lr * mean[k] for k in state}, covering(count)


def step_check(step: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor] | float, ratio: float | None,
               ref_name: str = "||state||") -> str | None:
    """Why a client's implied step is too large to accept, or None: its norm (in float64, so a float32 3e38
    does not overflow) must be finite and at most ratio * max(r, 1). r is `ref` itself when it is a number (a
    reference norm fixed before any client spoke: CIDERS passes ||w_0||, docs/security.md#aggregation), else
    the norm of the state `ref` (the state the step applies to: a bound that grows with every push it lets
    through). The floor of 1 keeps a zero-initialised state trainable. ratio None accepts any finite step."""
    n = norm(step)
    if n != n or n == float("inf"):
        return "its update is not finite (the norm overflows)"
    if ratio is None:
        return None
    bound = ratio * max(float(ref) if isinstance(ref, (int, float)) else norm(ref), 1.0)
    if n > bound:
        return f"its update norm {n:.4g} exceeds max_step_ratio {ratio:g} x max({ref_name}, 1) = {bound:.4g}"
    return None


def all_finite(*states: Mapping[str, torch.Tensor]) -> bool:
    """Every floating-point tensor of every state is finite (the check before an aggregate is committed)."""
    return all(bool(torch.isfinite(v).all()) for s in states for v in s.values() if v.is_floating_point())
