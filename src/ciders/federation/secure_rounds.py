"""The server side of a CIDERS run under secure aggregation (federation.secure_aggregation: true): the
`Coordinator` with the round's phases of `federation.secure` (docs/privacy.md#secure-aggregation).

What changes against the plain round: the train phase is wrapped by three protocol phases, the server
never decodes a client's dc_i or Delta_i (it unmasks only the sum of n_i Delta_i over the clients whose
masked upload arrived, U3), keeps no copy of any c_i (only its version: `alg.secure_server_update`), and
does not ask for personalized messengers (no "report" phase: they stay on the clients). With
`federation.secagg.cohorts: k > 1` each phase runs once per cohort (`secure.start_cohorts`: disjoint runs of
the sample, each a whole protocol run) and the unmask phase adds the sums of the cohorts that unmasked
(`secure.absorb_unmask_all`). TAKD, evaluation, logging and the checkpoint are the plain round's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.core.store import RoundStore
from ciders.federation import dp, secure
from ciders.federation.exchange import Reply
from ciders.federation.rounds import Checked, Coordinator, _count, broadcast_message
from ciders import phases as timing

_DOWN = {"secagg_keys": "secagg_setup", "secagg_shares": "secagg_keys", "secagg_unmask": "secagg_unmask"}
_UP = {"secagg_keys": "secagg_keys", "secagg_shares": "secagg_shares", "train": "masked", "secagg_unmask": "secagg_unmask"}


def load_version(store: RoundStore, cid: str) -> alg.ServerCopy:
    """The server's record of a client under secure aggregation: its version and last acknowledgement only."""
    rec = store.get(cid)
    if rec is None:
        return alg.ServerCopy({})
    return replace(codec.copy_from_record(*rec), c_i={})


class SecureCoordinator(Coordinator):
    def phases(self, t: int) -> tuple[str, ...]:
        return secure.PHASES

    def eval_clients(self, t: int) -> list[str]:
        return []  # the personalized messengers never leave the clients

    def messages(self, phase: str, t: int) -> dict[str, bytes]:
        rnd = self.round
        if phase == "secagg_keys":
            rnd = replace(rnd, secure=secure.start_cohorts(self.cfg, t, rnd.sampled, self.sizes))
        parts = rnd.secure  # one SecureRound per cohort (disjoint members)
        if phase in _DOWN:
            fn = {"secagg_keys": secure.keys_messages, "secagg_shares": secure.shares_messages,
                  "secagg_unmask": secure.unmask_messages}[phase]
            out = {c: m for sr in parts if sr.failed is None for c, m in fn(sr).items()}
            total, lens = dict(rnd.bytes_down), dict(rnd.down_len)
            for cid, m in out.items():
                _count(total, {_DOWN[phase]: len(m)})
                lens[cid] = lens.get(cid, 0) + len(m)
            self.round = replace(rnd, bytes_down=total, down_len=lens)
            return out
        if phase != "train":
            raise ValueError(f"secure CIDERS has no phase {phase!r}")
        out, total, lens = {}, dict(rnd.bytes_down), dict(rnd.down_len)
        for sr, cid in ((sr, c) for sr in parts if sr.failed is None for c in sr.u2):
            inner, _, counted = broadcast_message(self.cfg.algorithm, self.state, load_version(self.server_store, cid),
                                                  cid, rnd.down_extra, self.static, secure=True,
                                                  adapter_dtype=self.cfg.federation.adapter_dtype)
            out[cid] = secure.train_message(sr, cid, inner)
            if counted:
                _count(total, secure.train_sizes(out[cid], inner))
                lens[cid] = lens.get(cid, 0) + len(out[cid])
        self.round = replace(rnd, bytes_down=total, down_len=lens)
        return out

    def absorb(self, phase: str, t: int, replies: list[Reply], mark: Callable[[str], None] = lambda p: None) -> None:
        rnd = self.round
        up, ups = dict(rnd.bytes_up), dict(rnd.up_len)
        for r in replies:
            if r.kind == "reply" and r.error is None and r.rejected is None and r.payload:
                _count(up, {_UP[phase]: len(r.payload)})
                ups[r.client_id] = ups.get(r.client_id, 0) + len(r.payload)
        rnd = self.round = replace(rnd, bytes_up=up, up_len=ups)
        parts, acfg = rnd.secure, self.cfg.algorithm
        scaffold = acfg.consensus_update == "scaffold"
        if phase in ("secagg_keys", "secagg_shares"):
            fn = secure.absorb_keys if phase == "secagg_keys" else secure.absorb_shares
            got = [fn(sr, rs) for sr, rs in zip(parts, secure.route(parts, replies))]
            rej = {k: v for _, r in got for k, v in r.items()}
            self._note(t, phase, rej)
            self.round = replace(self.round, secure=tuple(sr for sr, _ in got),
                                 secure_rejected={**rnd.secure_rejected, **rej})
            return
        if phase == "train":
            with timing.phase("aggregation"):
                got = [secure.absorb_masked(sr, rs, self.ref, scaffold)
                       for sr, rs in zip(parts, secure.route(parts, replies))]
            rej = {k: v for g in got for k, v in g[1].items()}
            recs = {k: v for g in got for k, v in g[2].items()}
            self._note(t, phase, rej)
            missing = sorted({c for g in got for c in g[0].u2} - {r.client_id for r in replies if r.kind == "reply"})
            if missing and self.clients_store is None:
                self.log(f"round {t}: no reply from {', '.join(missing)} within the round")
            # a client that failed its train message gets its first-contact components again (as in the plain round)
            failed = {r.client_id for r in replies if r.error is not None}
            self.round = replace(self.round, secure=tuple(g[0] for g in got),
                                 secure_rejected={**rnd.secure_rejected, **rej},
                                 secure_records=recs,  # written with the unmask phase's byte counts
                                 next=replace(rnd.next, contacted=rnd.next.contacted - failed))
            return
        if phase != "secagg_unmask":
            raise ValueError(f"secure CIDERS has no phase {phase!r}")
        self._absorb_unmask(t, replies, mark)

    def _absorb_unmask(self, t: int, replies: list[Reply], mark: Callable[[str], None]) -> None:
        """The last phase: the cohorts' sums unmasked and added, the server update (Eq. 12 on the sum), the
        exclusions the round proved, the client records, then the plain round's TAKD, evaluation and commit."""
        rnd, acfg = self.round, self.cfg.algorithm
        with timing.phase("aggregation"):
            got = secure.absorb_unmask_all(rnd.secure, replies, self.ref, acfg.consensus_update == "scaffold")
        self._note(t, "secagg_unmask", got.rejected)
        included, why, rej = got.included, got.why, got.rejected
        copies = {c: load_version(self.server_store, c) for c in included}
        with timing.phase("aggregation"):
            server, new_copies, sm = alg.secure_server_update(
                acfg, rnd.next.server, got.delta, got.weight, included, copies,
                len(self.sizes), got.dc, self.cfg.federation.max_step_ratio, dp.server_privacy(self.cfg, t), why)
        for cid, cp in new_copies.items():
            if cp is not copies[cid]:
                self.server_store.put(cid, t, *codec.copy_record(cp))
        rejected = {**rnd.secure_rejected, **rej, **sm["rejected"]}
        sm["rejected"] = rejected
        self._exclude(t, got.cheats, sm, got.accused)
        if got.failed:
            sm["failed_cohorts"] = got.failed
            for f in got.failed:
                self.log(f"round {t}: the secure sum of the cohort {', '.join(f['clients'])} failed ({f['why']}); "
                         "the round goes on with the other cohorts' sums")
        if why is not None:
            self.log(f"round {t}: no secure sum ({why}); the state stays as it was")
        recs = rnd.secure_records
        client_recs = [{"event": "client", **recs[c], "client": c, "round": t, "bytes_up": rnd.up_len.get(c, 0),
                        "bytes_down": rnd.down_len.get(c, 0)} for c in included]
        for rec in client_recs:
            self._record(rec)
        failed = {r.client_id for r in replies if r.error is not None}
        contacted = (rnd.next.contacted - failed) | set(included)
        checked = Checked([], rejected, rnd.bytes_up, client_recs, [r.get("loss") for r in client_recs],
                          tuple(included))
        self._after_server(t, server, sm, checked, contacted, tuple(c for c in included if new_copies[c] is not copies[c]),
                           mark)

    def _exclude(self, t: int, cheats: dict, sm: dict, accused: list[str]) -> None:
        """Records the clients the server proved to cheat in round t in the state the round commits (they are
        never sampled again) and in the server record (`excluded`, with why), and logs them and the clients a
        peer's complaint dropped for this round only (`accused`)."""
        nxt = self.round.next
        new = {c: why for c, why in sorted(cheats.items()) if c not in nxt.excluded_ids()}
        for c, why in new.items():
            self.log(f"round {t}: excluded {c} from later rounds: {why}")
        if new:
            sm["excluded"] = new
        if accused:
            sm["dropped_on_complaint"] = accused
            self.log(f"round {t}: dropped for this round (a peer could not open its shares): {', '.join(accused)}")
        excluded = nxt.excluded + tuple((c, t, why) for c, why in new.items())
        self.round = replace(self.round, next=replace(nxt, excluded=excluded))

    def _note(self, t: int, phase: str, rejected: dict) -> None:
        for who, why in rejected.items():
            self.log(f"round {t}: {phase}: rejected {who}: {why}")
