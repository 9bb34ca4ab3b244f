"""A CIDERS round under secure aggregation, as messages (docs/privacy.md#secure-aggregation).

The round's phases (`Coordinator.phases` when federation.secure_aggregation is true):
  secagg_keys    server -> sampled S: the round and its members; client -> pk_c, pk_s, H(b_i)     (U1 replied)
  secagg_shares  server -> U1: the public keys of each one's live group; client -> encrypted shares (U2)
  train          server -> U2: the broadcast, its weight n_i and the shares addressed to it; the client checks
                 n_i against its own rule (1, or its own |D_i|) and refuses a round it has masked before;
                 client -> y_i = masked fixed-point [n_i Delta_i (, dc_i for SCAFFOLD)] + its record (U3)
  secagg_unmask  server -> U3: who is active (U3) and who dropped (U2 \\ U3); client -> its shares (U4)
The server then forms sum_{U3} n_i Delta_i (`core.secagg.unmask`), divides by sum_{U3} n_i and runs
`secure_server_update`. The weights are integers a client can check (not normalised shares it could not): a
server that sent one client 1 and the others 2^-60 would read that client's Delta_i off the sum.

Server side: pure functions over `SecureRound` (what the round has learnt so far; replaced, never mutated).
Client side: `client_phase`, whose protocol secrets live in the client's own session directory (one JSON
file, mode 0600, per client, rewritten each phase), never in the server's files.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ciders.algorithms import ciders as alg
from ciders.config import ExperimentConfig
from ciders.core import secagg as sa
from ciders.core import wire
from ciders.core.wire import PayloadError
from ciders.federation import records
from ciders.federation.exchange import Reply

PHASES = ("secagg_keys", "secagg_shares", "train", "secagg_unmask")
MAX_MEMBERS = 2000  # clients per secure round (the member list travels in a message header of at most 64 KiB)
KEY_KINDS = ("c", "s")


# ---------------------------------------------------------------------------------------------- encoding


def _u8(b: bytes) -> torch.Tensor:
    # one copy: the tensor owns the bytearray (frombuffer on immutable bytes would warn)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)


def blobs(comp: dict | None, allowed: Callable[[str], bool], max_bytes: int, what: str) -> dict[str, bytes]:
    """A component of byte strings (1-D uint8 tensors), each name allowed and at most max_bytes long."""
    out = {}
    for k, v in (comp or {}).items():
        if not allowed(k):
            raise PayloadError(f"{what}: unexpected entry {k[:40]!r}")
        if v.dtype != torch.uint8 or v.dim() != 1 or v.numel() > max_bytes:
            raise PayloadError(f"{what}: {k[:40]!r} must be at most {max_bytes} bytes")
        out[k] = bytes(v.numpy().tobytes())
    return out


def _ids(v, what: str, known: set[str] | None = None) -> list[str]:
    """A list of distinct client ids, each at most MAX_NAME characters (and one of `known`, when given)."""
    if not isinstance(v, list) or not all(isinstance(c, str) and 0 < len(c) <= wire.MAX_NAME for c in v) \
            or len(set(v)) != len(v) or len(v) > MAX_MEMBERS:
        raise PayloadError(f"{what}: must be a list of at most {MAX_MEMBERS} distinct client ids")
    for c in v:
        if known is not None and c not in known:
            raise PayloadError(f"{what}: {c[:40]!r} is not a client of this round")
    return v


def masked_ref(ref: dict, scaffold: bool) -> dict:
    """The reference of a masked upload: int64 tensors of the messenger's shapes (delta/ and dc/ keys)."""
    one = {k: torch.empty(v.shape, dtype=torch.int64) for k, v in ref.items()}
    return {"masked": {**{f"delta/{k}": v for k, v in one.items()},
                       **({f"dc/{k}": v for k, v in one.items()} if scaffold else {})}}


# ---------------------------------------------------------------------------------------------- server side


@dataclass(frozen=True)
class SecureRound:
    """What the server has learnt in a secure round, phase by phase."""

    params: sa.Params
    weights: dict  # client -> n_i, the integer it multiplies Delta_i by: 1, or its registered size |D_i|
    keys: dict = field(default_factory=dict)  # U1: client -> (pk_c, pk_s)
    commits: dict = field(default_factory=dict)  # U1: client -> H(b_i)
    routed: dict = field(default_factory=dict)  # U2: recipient -> {sender: ciphertext}
    u2: tuple = ()
    masked: dict = field(default_factory=dict)  # U3: client -> y_i (int64 tensors)
    failed: str | None = None  # why the sum cannot be formed (the round goes on without an update)
    complaints: dict = field(default_factory=dict)  # U3: client -> the peers whose shares it could not open
    cheats: dict = field(default_factory=dict)  # client -> what the server itself saw it do wrong (proof)


def live_sets(sr: SecureRound) -> tuple[list[str], list[str], dict[str, set]]:
    """(active, dropped, omitted): a client named in a complaint is dropped for this round like a dropout (its
    masked vector left out, its pair masks removed with its rebuilt key), never excluded for it (the server
    cannot check a complaint); omitted = who each active client did not mask with."""
    accused = {c for who, cs in sr.complaints.items() if who in sr.masked for c in cs}
    active = [c for c in sr.params.members if c in sr.masked and c not in accused]
    dropped = [c for c in sr.u2 if c not in active]
    return active, dropped, {c: set(sr.complaints.get(c, ())) for c in active}


def start(cfg: ExperimentConfig, t: int, sampled: tuple[str, ...], sizes: dict[str, int]) -> SecureRound:
    """The round's parameters (from the config, which every client holds too) and each client's weight
    n_i = |D_i| (or 1 under uniform weighting): the server divides the sum by sum_{U3} n_i, so
    p_i = n_i / sum_{U3} n_j is Eq. 12's. Each client checks its n_i (`own_weight`)."""
    sc = cfg.federation.secagg
    p = sa.Params(t, tuple(sampled), sc.t(len(sampled)), sc.neighbours, sc.frac_bits, sc.clip)
    uniform = cfg.algorithm.weighting == "uniform"
    return SecureRound(p, {c: (1 if uniform else int(sizes[c])) for c in sampled})


def start_cohorts(cfg: ExperimentConfig, t: int, sampled: tuple[str, ...], sizes: dict[str, int]
                  ) -> tuple[SecureRound, ...]:
    """The round's sample cut into `federation.secagg.cohorts` disjoint secure sums: consecutive runs of the
    sampling order, sizes within one of each other (fewer cohorts if the sample has shrunk below what they
    need). Each cohort is a whole protocol run of its own (`start`); its members see only one another."""
    k, n = cfg.federation.secagg.cohort_count(len(sampled)), len(sampled)
    cuts = [n * j // k for j in range(k + 1)]
    return tuple(start(cfg, t, tuple(sampled[a:b]), sizes) for a, b in zip(cuts, cuts[1:]))


def route(parts: tuple[SecureRound, ...], replies: list[Reply]) -> list[list[Reply]]:
    """The replies of each cohort's members; a reply from no member goes to the first cohort, which rejects it."""
    where = {c: i for i, sr in enumerate(parts) for c in sr.params.members}
    out: list[list[Reply]] = [[] for _ in parts]
    for r in replies:
        out[where.get(r.client_id, 0)].append(r)
    return out


@dataclass(frozen=True)
class Sum:
    """A round's secure sums put together: the unmasked cohorts' sums added (None: no cohort unmasked), the
    clients they hold, why the round has no sum (every cohort failed) and the cohorts that failed."""

    delta: dict | None
    dc: dict | None
    why: str | None
    included: list[str]
    weight: int
    accused: list[str]  # masked, but left out of its cohort's sum on a peer's complaint
    failed: list[dict]  # {"clients": members, "why": ...} of each cohort whose sum failed while others did not
    rejected: dict
    cheats: dict


def absorb_unmask_all(parts: tuple[SecureRound, ...], replies: list[Reply], ref: dict, scaffold: bool) -> Sum:
    """`absorb_unmask` per cohort, and the sum over the cohorts whose sums unmasked (n_i Delta_i and the
    weights n_i add across cohorts as within one, so Eq. 12's mean is unchanged). A cohort whose sum fails
    costs its own clients' updates; the round has no sum only when every cohort failed."""
    got = [absorb_unmask(sr, rs, ref, scaffold) for sr, rs in zip(parts, route(parts, replies))]
    rejected = {k: v for g in got for k, v in g[3].items()}
    cheats = {k: v for g in got for k, v in g[4].items()}
    ok = [i for i, g in enumerate(got) if g[2] is None]
    live = [live_sets(sr)[0] for sr in parts]
    accused = sorted(c for sr, a in zip(parts, live) for c in sr.masked if c not in a)
    if not ok:
        why = got[0][2] if len(got) == 1 else "; ".join(f"cohort {i}: {g[2]}" for i, g in enumerate(got))
        return Sum(None, None, why, [c for a in live for c in a], 0, accused, [], rejected, cheats)
    delta = {k: sum(got[i][0][k] for i in ok) for k in got[ok[0]][0]}
    dc = {k: sum(got[i][1][k] for i in ok) for k in got[ok[0]][1]} if scaffold else None
    included = [c for i in ok for c in live[i]]
    failed = [{"clients": list(parts[i].params.members), "why": g[2]} for i, g in enumerate(got) if i not in ok]
    weight = sum(parts[i].weights[c] for i in ok for c in live[i])
    return Sum(delta, dc, None, included, weight, accused, failed, rejected, cheats)


def own_weight(cfg: ExperimentConfig, size: int) -> int:
    """The weight n_i a client accepts: 1 under uniform weighting, else its own training-set size."""
    return 1 if cfg.algorithm.weighting == "uniform" else int(size)


def params_for(cfg: ExperimentConfig, t: int, members: list[str]) -> sa.Params:
    """The parameters a client derives from its own config and the member list (it never takes a threshold
    or a fixed-point format from the server)."""
    sc = cfg.federation.secagg
    if len(members) < 3:
        raise PayloadError(f"secure aggregation over {len(members)} clients would reveal their updates")
    return sa.Params(t, tuple(members), sc.t(len(members)), sc.neighbours, sc.frac_bits, sc.clip)


def keys_messages(sr: SecureRound) -> dict[str, bytes]:
    meta = {"round": sr.params.round, "members": list(sr.params.members)}
    msg = wire.encode({}, meta)[0]
    return {c: msg for c in sr.params.members}


def _reply_meta(r: Reply, t: int, what: str, expect: dict | None = None) -> tuple[dict, dict]:
    comps, meta = wire.decode(r.payload, expect)
    f = wire.fields(meta, {"client_id": "str", "round": "int"}, what)
    if f["client_id"] != r.client_id or f["round"] != t:
        raise PayloadError(f"{what}: claims to be from {f['client_id']!r} in round {f['round']}")
    return comps, meta


def _usable(r: Reply, members, rejected: dict, what: str) -> bool:
    if r.error is not None:
        rejected[r.client_id] = f"{what}: client error: {str(r.error)[:200]}"
    elif r.rejected is not None:
        rejected[r.client_id] = f"{what}: {r.rejected}"
    elif r.kind != "reply" or r.client_id not in members:
        rejected[str(r.client_id)[:64]] = f"{what}: not a reply of this round's members"
    else:
        return True
    return False


def absorb_keys(sr: SecureRound, replies: list[Reply]) -> tuple[SecureRound, dict]:
    """U1: the members whose public keys parse (and are not another member's) and whose commitment is a digest."""
    _, _, _, asym = sa._crypto()
    t, keys, commits, rejected, seen = sr.params.round, {}, {}, {}, set()
    for r in replies:
        if not _usable(r, sr.params.members, rejected, "keys") or r.client_id in keys:
            continue
        try:
            comps, meta = _reply_meta(r, t, "keys")
            got = blobs(comps.get("keys"), lambda k: k in KEY_KINDS, sa.MAX_KEY_BYTES, "keys")
            commit = wire.fields(meta, {"commit": "str"}, "keys")["commit"]
            if set(got) != set(KEY_KINDS) or len(commit) != 64 or any(ch not in "0123456789abcdef" for ch in commit):
                raise PayloadError("keys: needs pk_c, pk_s and a SHA-256 commitment")
            for b in got.values():
                asym.bytes_to_public_key(b)
            if got["c"] in seen or got["s"] in seen or got["c"] == got["s"]:
                raise PayloadError("keys: a public key already used in this round")
        except PayloadError as exc:
            rejected[r.client_id] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - whatever the key parser makes of hostile bytes
            rejected[r.client_id] = f"keys: unreadable public key ({str(exc)[:80]})"
            continue
        seen |= {got["c"], got["s"]}
        keys[r.client_id], commits[r.client_id] = (got["c"], got["s"]), commit
    sr = replace(sr, keys=keys, commits=commits)
    if len(keys) < sr.params.threshold:
        sr = replace(sr, failed=f"{len(keys)} clients sent keys, fewer than the threshold {sr.params.threshold}")
    return sr, rejected


def shares_messages(sr: SecureRound) -> dict[str, bytes]:
    out = {}
    for c in sr.keys:
        group = {j: sr.keys[j] for j in sr.params.group(c) if j in sr.keys}
        comp = {f"{j}/{kind}": _u8(pk) for j, pair in group.items() for kind, pk in zip(KEY_KINDS, pair)}
        out[c] = wire.encode({"keys": comp}, {"round": sr.params.round})[0]
    return out


def absorb_shares(sr: SecureRound, replies: list[Reply]) -> tuple[SecureRound, dict]:
    """U2: the members of U1 that sent a ciphertext for exactly the other live members of their group."""
    t, routed, u2, rejected, cheats = sr.params.round, {}, [], {}, dict(sr.cheats)
    for r in replies:
        if not _usable(r, tuple(sr.keys), rejected, "shares") or r.client_id in u2:
            continue
        want = {j for j in sr.params.group(r.client_id) if j in sr.keys and j != r.client_id}
        try:
            comps, _ = _reply_meta(r, t, "shares")
            got = blobs(comps.get("shares"), lambda k: k in want, sa.MAX_CIPHERTEXT, "shares")
            if set(got) != want:
                raise PayloadError(f"shares: for {sorted(got)[:3]}, expected its group's live members")
        except PayloadError as exc:
            rejected[r.client_id] = str(exc)
            continue
        if not all(sa.fernet_shaped(ct) for ct in got.values()):  # the server's own proof: no one can forge it
            cheats[r.client_id] = rejected[r.client_id] = "shares: a ciphertext that is no Fernet token"
            continue
        u2.append(r.client_id)
        for dst, ct in got.items():
            routed.setdefault(dst, {})[r.client_id] = ct
    u2 = tuple(c for c in sr.params.members if c in u2)
    routed = {d: {s: ct for s, ct in m.items() if s in u2} for d, m in routed.items() if d in u2}
    sr = replace(sr, routed=routed, u2=u2, cheats=cheats)
    if sr.failed is None and len(u2) < sr.params.threshold:
        sr = replace(sr, failed=f"{len(u2)} clients sent their shares, fewer than the threshold {sr.params.threshold}")
    return sr, rejected


def train_message(sr: SecureRound, cid: str, broadcast: bytes) -> bytes:
    """The client's weight n_i and the shares addressed to it, with the broadcast behind them as it is (its
    length in the metadata): at first contact the broadcast holds the emulator, which is copied once here
    and once by the client (`wire.split_tail`), not re-encoded."""
    comps = {"shares": {s: _u8(ct) for s, ct in sr.routed.get(cid, {}).items()}}
    meta = {"round": sr.params.round, "weight": sr.weights[cid], "broadcast_bytes": len(broadcast)}
    return wire.encode(comps, meta)[0] + broadcast


def train_sizes(msg: bytes, broadcast: bytes) -> dict[str, int]:
    """Bytes per component of the secure train message `msg` that carries `broadcast`: the broadcast's own
    components (read from its header, not decoded: it can hold the emulator), and the routed shares and
    envelope as secagg_shares."""
    inner = wire.sizes(broadcast)
    inner["secagg_shares"] = len(msg) - len(broadcast)
    return inner


def absorb_masked(sr: SecureRound, replies: list[Reply], ref: dict, scaffold: bool
                  ) -> tuple[SecureRound, dict, dict[str, dict], dict[str, int]]:
    """U3: the members of U2 whose masked upload decodes against the int64 reference; their records (checked
    against the private schema) and bytes."""
    t, masked, recs, rejected, nbytes, complaints = sr.params.round, {}, {}, {}, {}, {}
    expect = masked_ref(ref, scaffold)
    for r in replies:
        if not _usable(r, sr.u2, rejected, "masked upload") or r.client_id in masked:
            continue
        try:
            comps, meta = _reply_meta(r, t, "masked upload", expect)
            if "masked" not in comps:
                raise PayloadError("masked upload: no masked vector")
            rec = records.check(r.record, records.CIDERS_PRIVATE)
            bad = _ids(meta.get("failed", []), "masked upload: failed", set(sr.routed.get(r.client_id, {})))
        except PayloadError as exc:
            rejected[r.client_id] = str(exc)
            continue
        masked[r.client_id], recs[r.client_id], complaints[r.client_id] = comps["masked"], rec, tuple(bad)
        nbytes[r.client_id] = len(r.payload)
    sr = replace(sr, masked=masked, complaints=complaints)
    live = len(live_sets(sr)[0])
    if sr.failed is None and live < sr.params.threshold:
        sr = replace(sr, failed=f"{live} masked uploads of clients no peer reported, fewer than the threshold "
                                f"{sr.params.threshold}")
    return sr, rejected, recs, nbytes


def unmask_messages(sr: SecureRound) -> dict[str, bytes]:
    active, dropped, _ = live_sets(sr)
    msg = wire.encode({}, {"round": sr.params.round, "active": active, "dropped": dropped})[0]
    return {c: msg for c in active}


def absorb_unmask(sr: SecureRound, replies: list[Reply], ref: dict, scaffold: bool
                  ) -> tuple[dict | None, dict | None, str | None, dict, dict]:
    """(sum_{active} n_i Delta_i, sum_{active} dc_i or None, why the sum failed or None, rejected, cheats: the
    clients the server has proven to cheat this round, with why)."""
    t, answers, rejected = sr.params.round, {}, {}
    active, dropped, omitted = live_sets(sr)
    for r in replies:
        if not _usable(r, tuple(active), rejected, "unmask") or r.client_id in answers:
            continue
        group = set(sr.params.group(r.client_id))
        try:
            comps, _ = _reply_meta(r, t, "unmask")
            b = blobs(comps.get("b"), lambda k: k in group and k in active, sa.MAX_CIPHERTEXT, "unmask b")
            sk = blobs(comps.get("sk"), lambda k: k in group and k in dropped, sa.MAX_CIPHERTEXT, "unmask sk")
        except PayloadError as exc:
            rejected[r.client_id] = str(exc)
            continue
        answers[r.client_id] = {**{c: ("b", v) for c, v in b.items()}, **{c: ("sk", v) for c, v in sk.items()}}
    if sr.failed is not None:
        return None, None, sr.failed, rejected, dict(sr.cheats)
    got = sa.unmask_checked(sr.params, {c: sr.masked[c] for c in active}, dropped, sr.keys, sr.commits, answers,
                            omitted)
    cheats = {**sr.cheats, **got.cheats}
    if got.total is None:
        return None, None, got.why, rejected, cheats
    total = got.total
    like = {k: torch.empty(v.shape, dtype=torch.float64) for k, v in ref.items()}
    got = sa.dequantize(total, sr.params.frac_bits, {f"{p}/{k}": v for p in ("delta", "dc") for k, v in like.items()
                                                     if p == "delta" or scaffold})
    dev, dts = next(iter(ref.values())).device, {k: v.dtype for k, v in ref.items()}
    delta = {k: got[f"delta/{k}"].to(dts[k]).to(dev) for k in ref}
    dc = {k: got[f"dc/{k}"].to(dts[k]).to(dev) for k in ref} if scaffold else None
    return delta, dc, None, rejected, cheats


# ---------------------------------------------------------------------------------------------- client side


class Sessions:
    """A client's protocol secrets, one JSON file per client under its own directory (mode 0600)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def load(self, cid: str, t: int) -> sa.Secrets:
        p = self.root / f"{cid}.json"
        if not p.is_file():
            raise PayloadError(f"{cid}: no secure-aggregation session for round {t} (a phase was skipped)")
        s = sa.Secrets.from_json(json.loads(p.read_text()))
        if s.round != t or s.client_id != cid:
            raise PayloadError(f"{cid}: its session is for round {s.round}, the server asks about round {t}")
        return s

    def masked_through(self, cid: str) -> int:
        """The last round this client masked an update in (-1: none). Kept apart from the session, which
        each round's keys phase replaces, so that no rerun of the protocol can make it mask a round twice."""
        p = self.root / f"{cid}.masked"
        if not p.is_file():
            return -1
        try:
            return int(p.read_text())
        except ValueError as exc:
            raise PayloadError(f"{cid}: its record of masked rounds is unreadable ({p}); refusing to mask") from exc

    def mark_masked(self, cid: str, t: int) -> None:
        """Atomically and durably records that round t is masked, before y_i leaves the client."""
        self._write(cid, f"{cid}.masked", str(int(t)))

    def check_fresh(self, cid: str, t: int) -> None:
        """Refuses round t if this client has masked round t or a later one: a second run of a round would give
        the server a second sum over a different set of clients, and the difference of the two sums is one
        client's update (it would retrain to the same Delta_i)."""
        done = self.masked_through(cid)
        if t <= done:
            raise PayloadError(f"{cid}: already masked an update in round {done}; refusing to run the protocol for "
                               f"round {t} (a rerun would let the server read an update off the difference of sums)")

    def save(self, s: sa.Secrets) -> None:
        """Atomically, and readable by the client's own user only (these are private keys)."""
        self._write(s.client_id, f"{s.client_id}.json", json.dumps(s.to_json()))

    def _write(self, cid: str, name: str, text: str) -> None:
        """root/name := text, atomically (os.replace) and fsynced, mode 0600 (mkstemp's, kept)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{cid}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.root / name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _meta_round(msg: bytes, t_field: str = "round") -> tuple[dict, dict, int]:
    comps, meta = wire.decode(msg)
    return comps, meta, wire.fields(meta, {t_field: "int"}, "secure aggregation message")[t_field]


def _reply(cid: str, t: int, comps: dict, **meta) -> bytes:
    return wire.encode(comps, {"client_id": cid, "round": t, **meta})[0]


def _train_phase(cfg: ExperimentConfig, sessions: Sessions, p: sa.Params, s: sa.Secrets, comps: dict, meta: dict,
                 inner: bytes, train, weight: int | None) -> tuple[bytes, dict]:
    """The secure train phase on the client: check n_i and the envelope, open the shares (reporting the peers whose
    shares fail), train, mask."""
    cid, t = s.client_id, p.round
    f = wire.fields(meta, {"weight": "int", "broadcast_bytes": "int"}, "secure train")
    if weight is None or f["weight"] != weight:
        raise PayloadError(f"{cid}: the server asks for weight {f['weight']}, its own rule gives {weight} "
                           "(algorithm.weighting: 1, or its own data size); refusing to mask")
    sessions.check_fresh(cid, t)
    if f["broadcast_bytes"] != len(inner):
        raise PayloadError(f"{cid}: the secure train message announces a broadcast of {f['broadcast_bytes']} "
                           f"bytes and carries {len(inner)}")
    if set(comps) - {"shares"}:
        raise PayloadError(f"{cid}: unexpected components {sorted(set(comps) - {'shares'})} in a secure train message")
    cts = blobs(comps.get("shares"), lambda k: k in s.peers, sa.MAX_CIPHERTEXT, "shares")
    s = sa.client_receive(p, s, cts)
    up, rec = train(inner)
    vec = {f"delta/{k}": v * weight for k, v in up.delta.items()}
    if cfg.algorithm.consensus_update == "scaffold":
        vec.update({f"dc/{k}": v for k, v in up.dc.items()})
    s, y = sa.client_mask(p, s, vec)
    sessions.save(s)
    sessions.mark_masked(cid, t)  # before y_i leaves
    failed = {"failed": list(s.failed)} if s.failed else {}  # the peers it reports (none: no field)
    return _reply(cid, t, {"masked": y}, **failed), records.private(rec)


def client_phase(phase: str, cfg: ExperimentConfig, sessions: Sessions, cid: str, msg: bytes,
                 train: Callable[[bytes], tuple[alg.Upload, dict]] | None = None, weight: int | None = None
                 ) -> tuple[bytes, dict]:
    """The client side of one secure-aggregation phase: (reply bytes, metrics record). `train(broadcast)` runs
    the client's round on the unwrapped broadcast and returns its upload (Delta_i in `delta`) and record;
    `weight` is the n_i the client accepts in the train phase (`own_weight`)."""
    inner = None
    if phase == "train":
        msg, inner = wire.split_tail(msg)
    comps, meta, t = _meta_round(msg)
    if phase == "secagg_keys":
        members = _ids(meta.get("members"), "members")
        p = params_for(cfg, t, members)
        sessions.check_fresh(cid, t)
        s, pub = sa.client_keys(p, cid)
        sessions.save(s)
        return _reply(cid, t, {"keys": {"c": _u8(pub["pk_c"]), "s": _u8(pub["pk_s"])}}, commit=pub["commit"]), {}
    s = sessions.load(cid, t)
    p = params_for(cfg, t, list(s.members))
    if phase == "secagg_shares":
        raw = blobs(comps.get("keys"), lambda k: k.count("/") == 1 and k.split("/")[1] in KEY_KINDS,
                    sa.MAX_KEY_BYTES, "keys")
        keys: dict[str, list] = {}
        for k, v in raw.items():
            owner, kind = k.split("/")
            keys.setdefault(owner, [None, None])[KEY_KINDS.index(kind)] = v
        if any(None in pair for pair in keys.values()):
            raise PayloadError(f"{cid}: a member's keys are incomplete")
        s, cts = sa.client_shares(p, s, {c: tuple(pair) for c, pair in keys.items()})
        sessions.save(s)
        return _reply(cid, t, {"shares": {d: _u8(ct) for d, ct in cts.items()}}), {}
    if phase == "train":
        return _train_phase(cfg, sessions, p, s, comps, meta, inner, train, weight)
    if phase == "secagg_unmask":
        active = _ids(meta.get("active"), "active", set(p.members))
        dropped = _ids(meta.get("dropped"), "dropped", set(p.members))
        s, out = sa.client_unmask(p, s, active, dropped)
        sessions.save(s)
        return _reply(cid, t, {"b": {c: _u8(v) for c, (k, v) in out.items() if k == "b"},
                               "sk": {c: _u8(v) for c, (k, v) in out.items() if k == "sk"}}), {}
    raise PayloadError(f"{cid}: no secure-aggregation phase {phase!r}")
