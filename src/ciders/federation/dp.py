"""federation.dp as the round code uses it: each round's `Privacy` for the server and for each client, the
noise multiplier (given, or picked by the accountant for dp.target_epsilon), and the privacy spent so far
(docs/privacy.md#differential-privacy). The maths is `core.privacy`; the update rules take the `Privacy`
these functions build (`algorithms.ciders`).
"""

from __future__ import annotations

import functools
import hashlib
import math

from ciders.algorithms.ciders import Privacy
from ciders.config import ExperimentConfig
from ciders.runtime import derive_seed


def sample_rate(cfg: ExperimentConfig) -> float:
    """q = clients sampled per round / registered clients."""
    fed = cfg.federation
    return (fed.per_round or fed.clients) / fed.clients


@functools.lru_cache(maxsize=32)
def noise_multiplier(cfg: ExperimentConfig) -> float:
    """z: dp.noise_multiplier, or the smallest z whose epsilon after federation.rounds rounds is at most
    dp.target_epsilon (the same on the server and on every client: it depends on the config alone)."""
    dp = cfg.federation.dp
    if dp.target_epsilon is None:
        return dp.noise_multiplier
    from ciders.core import privacy

    return privacy.noise_for_epsilon(dp.target_epsilon, dp.delta, sample_rate(cfg), cfg.federation.rounds, dp.mode)


def private_records(cfg: ExperimentConfig) -> bool:
    """Whether clients send the cut-down record (`federation.records.CIDERS_PRIVATE`): nothing computed from
    their updates reaches the server under secure aggregation or local DP."""
    return cfg.federation.secure_aggregation or cfg.federation.dp.mode == "local"


def server_privacy(cfg: ExperimentConfig, t: int) -> Privacy:
    dp = cfg.federation.dp
    if dp.mode != "central":
        return Privacy()
    seed = derive_seed(cfg.seed, "dp-central-noise", t) if dp.noise == "seeded" else None
    return Privacy(clip=dp.clip, central_sigma=noise_multiplier(cfg) * (dp.clip or 0.0), seed=seed)


def client_privacy(cfg: ExperimentConfig, t: int, cid: str) -> Privacy:
    dp = cfg.federation.dp
    if dp.mode == "none":
        return Privacy()
    if dp.mode == "central":
        return Privacy(clip=dp.clip)
    seed = derive_seed(cfg.seed, "dp-local-noise", t, _key(cid)) if dp.noise == "seeded" else None
    return Privacy(clip=dp.clip, local_std=noise_multiplier(cfg) * (dp.clip or 0.0), seed=seed)


def _key(cid: str) -> int:
    """A client's integer key for derive_seed: a stable digest of its id (any id, not only client<i>)."""
    return int.from_bytes(hashlib.sha256(cid.encode()).digest()[:7], "big")


def spent(cfg: ExperimentConfig, t: int) -> dict:
    """The server record's DP fields after round t (rounds 0..t): z, the noise std, and epsilon at dp.delta
    (central: the whole federation's, Poisson-subsampled at rate q; local: one client's, had it taken part in
    every round)."""
    dp = cfg.federation.dp
    if dp.mode == "none":
        return {}
    from ciders.core import privacy

    z, clip = noise_multiplier(cfg), dp.clip or 0.0
    if dp.mode == "central":
        eps = privacy.central_epsilon(z, sample_rate(cfg), t + 1, dp.delta)
    else:
        eps = privacy.local_epsilon(z, t + 1, dp.delta)
    # no noise: no finite guarantee (JSON has no Infinity: null, and the docs say what it means)
    return {"dp_mode": dp.mode, "dp_noise_multiplier": z, "dp_clip": clip,
            "dp_epsilon": eps if math.isfinite(eps) else None, "dp_delta": dp.delta}
