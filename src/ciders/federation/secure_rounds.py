"""Secure aggregation's phases around a CIDERS round's train phase (federation.secure_aggregation: true;
docs/privacy.md#secure-aggregation): `SecurePhases`, which the `Coordinator` composes in place of its plain train
and report phases.

What changes against the plain round: the train phase is wrapped by three protocol phases (`secure.PHASES`), the
server never decodes a client's dc_i or Delta_i (it unmasks only the sum of n_i Delta_i over the clients whose
masked upload arrived, U3), keeps no copy of any c_i (only its version: `alg.secure_server_update`), and does not
ask for personalized messengers (no "report" phase: they stay on the clients). With `federation.secagg.cohorts:
k > 1` each phase runs once per cohort (`secure.start_cohorts`: disjoint runs of the sample, each a whole protocol
run) and the unmask phase adds the sums of the cohorts that unmasked (`secure.absorb_unmask_all`). TAKD, evaluation,
the records and the checkpoint are the plain round's.

The phases are functions over explicit state: the round's protocol state travels in the round
(`rounds.InFlight.secure`, a `Protocol`); `SecurePhases` holds only what is fixed for the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ciders.algorithms import ciders as alg
from ciders.core.store import RoundStore
from ciders.federation import codec, console, dp, secure
from ciders.federation.exchange import Admitted
from ciders import phases as timing

_DOWN = {"secagg_keys": "secagg_setup", "secagg_shares": "secagg_keys", "secagg_unmask": "secagg_unmask"}
_UP = {"secagg_keys": "secagg_keys", "secagg_shares": "secagg_shares", "train": "masked",
       "secagg_unmask": "secagg_unmask"}


def load_version(store: RoundStore, cid: str) -> alg.ServerCopy:
    """The server's record of a client under secure aggregation: its version and last acknowledgement only."""
    rec = store.get(cid)
    if rec is None:
        return alg.ServerCopy({})
    return replace(codec.copy_from_record(*rec), c_i={})


@dataclass(frozen=True)
class Protocol:
    """A secure round's protocol state between its phases: one `secure.SecureRound` per cohort, what the earlier
    phases rejected (with why) and the masked uploads' client records, written once the round unmasks."""

    cohorts: tuple
    rejected: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Unmasked:
    """The secure round's server step: Eq. 12 on the unmasked sum (`alg.secure_server_update`), the clients it
    holds, the new versions and the round's exclusions (`excluded`, appended to the state's)."""

    server: alg.ServerState
    copies: dict  # client -> its ServerCopy before the step
    new_copies: dict  # client -> after
    metrics: dict  # the server record
    included: list
    excluded: tuple


class SecurePhases:
    """Secure aggregation's phases of a CIDERS round (see the module docstring)."""

    phases = secure.PHASES

    def __init__(self, cfg, sizes: dict, ref: dict, log: Callable[[str], None]):
        self.cfg, self.sizes, self.ref, self.log = cfg, sizes, ref, log

    def configure(self, phase: str, t: int, rnd, broadcast: Callable[[str], tuple[bytes, bool]]):
        """-> (the round, {client: message}, {client: its bytes per component, None if not counted}). `broadcast(cid)`:
        the plain round's broadcast to client cid and whether it is counted (`rounds.broadcast_message`)."""
        if phase == "secagg_keys":
            rnd = replace(rnd, secure=Protocol(secure.start_cohorts(self.cfg, t, rnd.sampled, self.sizes)))
        parts = rnd.secure.cohorts  # one SecureRound per cohort (disjoint members)
        if phase in _DOWN:
            fn = {"secagg_keys": secure.keys_messages, "secagg_shares": secure.shares_messages,
                  "secagg_unmask": secure.unmask_messages}[phase]
            out = {c: m for sr in parts if sr.failed is None for c, m in fn(sr).items()}
            return rnd, out, {c: {_DOWN[phase]: len(m)} for c, m in out.items()}
        if phase != "train":
            raise ValueError(f"secure CIDERS has no phase {phase!r}")
        out, sizes = {}, {}
        for sr, cid in ((sr, c) for sr in parts if sr.failed is None for c in sr.u2):
            inner, counted = broadcast(cid)
            out[cid] = secure.train_message(sr, cid, inner)
            sizes[cid] = secure.train_sizes(out[cid], inner) if counted else None
        return rnd, out, sizes

    @staticmethod
    def up_sizes(phase: str, msg: bytes) -> dict | None:
        """Each protocol reply under its phase's name."""
        return {_UP[phase]: len(msg)} if msg else None

    def aggregate(self, phase: str, t: int, rnd, got: Admitted, quiet: bool):
        """-> (the round, the unmask phase's `secure.Sum` or None before it). The refused deliveries are rejected
        under the phase's name; `quiet`: do not log clients that did not answer (in-process, none is lost)."""
        replies, pr = list(got.replies), rnd.secure
        parts = pr.cohorts
        scaffold = self.cfg.algorithm.consensus_update == "scaffold"
        refused = {k: f"{phase}: {why}" for k, why in got.refused.items()}
        routed = list(zip(parts, secure.route(parts, replies)))
        if phase in ("secagg_keys", "secagg_shares"):
            fn = secure.absorb_keys if phase == "secagg_keys" else secure.absorb_shares
            res = [fn(sr, rs) for sr, rs in routed]
            rej = {**refused, **{k: v for _, r in res for k, v in r.items()}}
            self._note(t, phase, rej)
            return replace(rnd, secure=replace(pr, cohorts=tuple(sr for sr, _ in res),
                                               rejected={**pr.rejected, **rej})), None
        if phase == "train":
            with timing.phase("aggregation"):
                res = [secure.absorb_masked(sr, rs, self.ref, scaffold) for sr, rs in routed]
            rej = {**refused, **{k: v for g in res for k, v in g[1].items()}}
            self._note(t, phase, rej)
            missing = sorted({c for g in res for c in g[0].u2} - {r.client_id for r in replies} - set(got.refused))
            if missing and not quiet:
                self.log(f"round {t}: no reply from {', '.join(missing)} within the round")
            # a client that failed its train message gets its first-contact components again (as in the plain round)
            recs = {k: v for g in res for k, v in g[2].items()}
            pr = Protocol(tuple(g[0] for g in res), {**pr.rejected, **rej}, recs)
            return replace(rnd, secure=pr, next=replace(rnd.next, contacted=rnd.next.contacted - got.failed)), None
        if phase != "secagg_unmask":
            raise ValueError(f"secure CIDERS has no phase {phase!r}")
        with timing.phase("aggregation"):
            summed = secure.absorb_unmask_all(parts, replies, self.ref, scaffold)
        summed = replace(summed, rejected={**refused, **summed.rejected})
        self._note(t, phase, summed.rejected)
        return rnd, summed

    def server_step(self, t: int, rnd, summed: secure.Sum, copies: dict) -> Unmasked:
        """Eq. 12 on the unmasked sum, the exclusions the round proved and the server record (with every phase's
        rejections); `copies`: the included clients' versions (`load_version`)."""
        acfg = self.cfg.algorithm
        with timing.phase("aggregation"):
            server, new_copies, sm = alg.secure_server_update(
                acfg, rnd.next.server, summed.delta, summed.weight, summed.included, copies, len(self.sizes),
                summed.dc, self.cfg.federation.max_step_ratio, dp.server_privacy(self.cfg, t), summed.why)
        sm["rejected"] = {**rnd.secure.rejected, **summed.rejected, **sm["rejected"]}
        excluded = self._exclude(t, rnd.next, summed.cheats, sm, summed.accused)
        if summed.failed:
            sm["failed_cohorts"] = summed.failed
            for f in summed.failed:
                self.log(f"round {t}: the secure sum of the cohort {', '.join(f['clients'])} failed ({f['why']}); "
                         "the round goes on with the other cohorts' sums")
        if summed.why is not None:
            self.log(f"round {t}: no secure sum ({summed.why}); the state stays as it was")
        return Unmasked(server, copies, new_copies, sm, list(summed.included), excluded)

    def _exclude(self, t: int, nxt, cheats: dict, sm: dict, accused: list[str]) -> tuple:
        """The state's exclusions with the clients the server proved to cheat in round t (never sampled again),
        also in the server record (`excluded`, with why); logs them and the clients a peer's complaint dropped for
        this round only (`accused`)."""
        new = {c: why for c, why in sorted(cheats.items()) if c not in nxt.excluded_ids()}
        for c, why in new.items():
            self.log(f"round {t}: excluded {c} from later rounds: {why}")
        if new:
            sm["excluded"] = new
        if accused:
            sm["dropped_on_complaint"] = accused
            self.log(f"round {t}: dropped for this round (a peer could not open its shares): {', '.join(accused)}")
        return nxt.excluded + tuple((c, t, why) for c, why in new.items())

    def _note(self, t: int, phase: str, rejected: dict) -> None:
        for who, why in rejected.items():
            self.log(console.rejected(t, phase, who, why))
