"""The privacy sections of a CIDERS experiment: `federation.secagg` (secure aggregation's parameters, read when
`federation.secure_aggregation` is true) and `federation.dp` (client-level differential privacy).
docs/privacy.md explains both; the cross-field checks that involve other sections are in
`ExperimentConfig.validate` (config.base).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ciders.config.fields import opt
from ciders.errors import ConfigError


@dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation (SecAgg+, Bell et al. 2020; Bonawitz et al. 2017 when every client is a neighbour):
    the server learns only the sum of the round's uploads (docs/privacy.md#secure-aggregation)."""

    neighbours: int | None = opt(
        None, "how many other sampled clients each client shares pairwise masks and key shares with (a ring over "
        "the round's sample, as in SecAgg+); null = all of them (the original SecAgg)")
    colluders: int = opt(
        1, "how many clients of a share group may collude with the server and secrecy still hold: a server that "
        "tells clients different dropout sets rebuilds both secrets of one client when 2 t <= g + colluders "
        "(g = the group's size), so the threshold must exceed (g + colluders) / 2. 0 trusts every client (then a "
        "strict majority suffices and more dropouts are tolerated); docs/security.md#secure-aggregation")
    threshold: int | None = opt(
        None, "Shamir threshold t: shares needed to rebuild a client's secret; fewer surviving clients than t "
        "abort the round's aggregate. null = the smallest t with 2 t > g + colluders (g = the share group: the "
        "client and its neighbours), which keeps a server that lies about who dropped out, helped by `colluders` "
        "clients, from learning both secrets of a client")
    frac_bits: int = opt(
        32, "fixed-point fraction bits of the masked uploads: a value v travels as round(v * 2^frac_bits) in "
        "Z_2^64, so the sum over n clients is off by at most n * 2^-(frac_bits+1) per coordinate")
    clip: float = opt(
        65536.0, "largest |v| a masked coordinate may carry (values beyond are clipped by the client); clip * "
        "2^frac_bits * (sampled clients) must stay below 2^62 so that the sum cannot wrap")
    cohorts: int = opt(
        1, "how many disjoint secure sums a round's sample is cut into (consecutive runs of the sampling order, "
        "sizes within one of each other): the server unmasks each cohort's sum apart, so a cohort whose sum fails "
        "(a client that alters its masked vector, too many dropouts) costs that cohort's updates, not the round. "
        "The price is privacy: the server learns each cohort's sum instead of the round's; "
        "docs/security.md#secure-aggregation")

    def validate(self, where: str = "federation.secagg") -> None:
        if self.neighbours is not None and self.neighbours < 1:
            raise ConfigError(f"{where}.neighbours: must be >= 1 or null (every sampled client), got {self.neighbours}")
        if isinstance(self.colluders, bool) or not isinstance(self.colluders, int) or self.colluders < 0:
            raise ConfigError(f"{where}.colluders: must be an integer >= 0, got {self.colluders!r}")
        if self.threshold is not None and self.threshold < 2:
            raise ConfigError(f"{where}.threshold: must be >= 2 (one share would be the secret itself) or null, "
                              f"got {self.threshold}")
        if not 0 <= self.frac_bits <= 48:
            raise ConfigError(f"{where}.frac_bits: must be in [0, 48], got {self.frac_bits}")
        if not self.clip > 0:
            raise ConfigError(f"{where}.clip: must be > 0, got {self.clip}")
        if isinstance(self.cohorts, bool) or not isinstance(self.cohorts, int) or self.cohorts < 1:
            raise ConfigError(f"{where}.cohorts: must be an integer >= 1, got {self.cohorts!r}")

    def group(self, sampled: int) -> int:
        """The size of a client's share group (itself + its neighbours) in a round of `sampled` clients."""
        return sampled if self.neighbours is None else min(sampled, self.neighbours + 1)

    def t(self, sampled: int) -> int:
        """The Shamir threshold for a round of `sampled` clients."""
        return self.threshold if self.threshold is not None else (self.group(sampled) + self.colluders) // 2 + 1

    def round_size_problem(self, sampled: int, where: str = "federation") -> str | None:
        """Why one secure sum over `sampled` clients cannot run with these settings (None: it can)."""
        g = self.group(sampled)
        if sampled < 3:
            return (f"{where}.secure_aggregation needs at least 3 clients per secure sum (with 2, each learns the "
                    f"other's update from the sum), got {sampled}; raise federation.per_round / clients")
        if self.neighbours is not None and self.neighbours % 2:
            return (f"{where}.secagg.neighbours: the ring gives each client the same number of neighbours on each "
                    f"side, so it must be even, got {self.neighbours}")
        t, c = self.t(sampled), self.colluders
        if c >= g:
            return (f"{where}.secagg.colluders: {c} colluders in a share group of {g} (the client and its "
                    "neighbours) leave no honest member to keep a secret; lower secagg.colluders or raise "
                    "secagg.neighbours / federation.per_round")
        if t > g:
            return (f"{where}.secagg.threshold: at most the share group's size ({g} = the client and its "
                    f"neighbours), got {t}")
        if not 2 * t > g + c:
            return (f"{where}.secagg.threshold: must be more than (g + colluders) / 2 = ({g} + {c}) / 2, got {t}; "
                    f"with a smaller threshold a server that lies about who dropped out, helped by {c} colluding "
                    "client(s), can rebuild both of a client's secrets (raise the threshold, or set "
                    "secagg.colluders lower if you trust more of the clients)")
        top = self.clip * 2.0 ** self.frac_bits * sampled
        if top >= 2.0 ** 62:
            return (f"{where}.secagg: clip * 2^frac_bits * clients per round = {top:.3g} must stay below 2^62 (the "
                    "sum would wrap around); lower secagg.clip or secagg.frac_bits")
        return None

    def check_round_size(self, sampled: int, where: str = "federation") -> None:
        """The cross-field checks that need the round's sample size (federation.per_round or clients): the
        smallest cohort (sampled // cohorts) must be a valid secure sum."""
        why = self.round_size_problem(sampled, where)
        if why is None and self.cohorts > 1:
            why = self.round_size_problem(sampled // self.cohorts, where)
            if why is not None:
                why = (f"{where}.secagg.cohorts: {self.cohorts} cohorts of a {sampled}-client round leave cohorts "
                       f"of {sampled // self.cohorts}: {why}; or lower secagg.cohorts")
        if why is not None:
            raise ConfigError(why)

    def cohort_count(self, sampled: int) -> int:
        """How many cohorts a round of `sampled` clients is cut into: `cohorts`, or fewer where the sample has
        shrunk (exclusions) so far that its smallest cohort could not run (at least 1)."""
        for k in range(min(self.cohorts, sampled), 1, -1):
            if self.round_size_problem(sampled // k) is None:
                return k
        return 1


@dataclass(frozen=True)
class DPConfig:
    """Client-level differential privacy (McMahan et al. 2018, DP-FedAvg): each client's Delta_i (Eq. 8) is
    clipped to norm `clip`, and Gaussian noise is added to the aggregate (central) or by each client to its own
    Delta_i (local); the privacy spent is tracked by Opacus's RDP accountant (docs/privacy.md#differential-privacy)."""

    mode: Literal["none", "central", "local"] = opt(
        "none", "none; central = the server adds N(0, (z C / m)^2) to the mean of m clipped updates (the server is "
        "trusted with the sum: pair it with secure_aggregation to keep single updates from it); local = each "
        "client adds N(0, (z C)^2) to its own clipped update before it leaves (no trusted server)")
    clip: float | None = opt(
        None, "C: each client's Delta_i (Eq. 8 units, the per-unit-lr displacement) is scaled to norm <= C before "
        "Eq. 9; null = no clipping (only with zero noise)")
    noise_multiplier: float = opt(0.0, "z: the noise std in units of C (0 = no noise)")
    target_epsilon: float | None = opt(
        None, "instead of noise_multiplier: the epsilon to reach after federation.rounds rounds at dp.delta; the "
        "accountant picks z")
    delta: float = opt(1e-5, "the delta of the reported (epsilon, delta) guarantee")
    noise: Literal["seeded", "secret"] = opt(
        "seeded", "seeded = noise drawn from the run seed (reproducible experiments; anyone who knows the seed can "
        "remove it); secret = from the operating system's random source (deployments; not reproducible)")

    def validate(self, where: str = "federation.dp") -> None:
        if self.clip is not None and not self.clip > 0:
            raise ConfigError(f"{where}.clip: must be > 0 or null, got {self.clip}")
        if self.noise_multiplier < 0:
            raise ConfigError(f"{where}.noise_multiplier: must be >= 0, got {self.noise_multiplier}")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ConfigError(f"{where}.target_epsilon: must be > 0 or null, got {self.target_epsilon}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"{where}.delta: must be in (0, 1), got {self.delta}")
        if self.mode == "none":
            if self.clip is not None or self.noise_multiplier or self.target_epsilon is not None:
                raise ConfigError(f"{where}: clip / noise_multiplier / target_epsilon are set but {where}.mode is none; "
                                  f"set {where}.mode to central or local")
            return
        if self.target_epsilon is not None and self.noise_multiplier:
            raise ConfigError(f"{where}: set either noise_multiplier or target_epsilon (the accountant then picks the "
                              "noise), not both")
        if (self.noise_multiplier or self.target_epsilon is not None) and self.clip is None:
            raise ConfigError(f"{where}: noise is scaled to the clipping norm, so {where}.clip must be set")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"
