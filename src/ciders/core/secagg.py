"""Secure aggregation: the server learns the sum of the round's vectors and nothing else about any one of
them (SecAgg, Bonawitz et al. CCS 2017; with a ring of neighbours, SecAgg+, Bell et al. CCS 2020).
docs/privacy.md#secure-aggregation gives the protocol, its guarantees and its limits.

Cryptography is Flower's (`flwr.supercore.primitives.asymmetric`: EC key pairs on SECP384R1;
`flwr.common.secure_aggregation.crypto`: ECDH + HKDF key agreement, Fernet encryption, Shamir sharing;
`secaggplus_utils.share_keys_plaintext_*`: the share envelope). Two deliberate differences from Flower's
SecAgg+ mod: masks come from AES-256-CTR keyed by the whole 256-bit agreed key or seed (Flower's
`pseudo_rand_gen` folds its seed into 32 bits for NumPy's Mersenne Twister, which a server could search),
and values are quantized deterministically to fixed point (Flower rounds stochastically from NumPy's global
generator, which would make runs irreproducible). The arithmetic is exact in Z_2^64 (NumPy uint64 wraps).

Round with members S (the sampled clients, in sampling order) and threshold t; G_i = i and its neighbours:
  keys    client i: two key pairs (c: encryption, s: masks) and a self-mask seed b_i -> pk_c, pk_s, H(b_i)
  shares  client i: Shamir shares (t of |G_i|) of b_i and sk_s_i, one per member of G_i, each encrypted
          for its recipient j with KA(sk_c_i, pk_c_j)                      -> {j: ciphertext}
  mask    client i, with the ciphertexts addressed to it (their senders A_i are its live neighbours):
            y_i = q(v_i) + PRG(b_i) + sum_{j in A_i} sign(i, j) PRG(KA(sk_s_i, pk_s_j))   (mod 2^64)
          sign(i, j) = +1 if i sorts after j else -1, so each pair's masks cancel in the sum
  unmask  the server names who sent y (active) and who did not (dropped); client i returns its b-share of
          every active member of G_i and its sk_s-share of every dropped one, never both for one client
  server  sum_i y_i - sum_{active} PRG(b_i) - the pair masks the active clients added for dropped ones
          = sum_{active} q(v_i); then q^-1. A rebuilt secret is checked (b against H(b), sk_s against pk_s)
          before it is used, so a bad share cannot silently corrupt the sum; the sum must lie within what
          |active| clipped inputs can add up to (an altered masked vector fails the round, it cannot be named).
Cheating clients (`unmask_checked`'s `cheats`): a peer whose shares do not open is reported (A_i leaves it out)
and dropped for the round; the server proves, from what it holds, a commitment that the agreeing shares of at
least t + 1 holders contradict, and a report whose pair mask the client added after all.
Quantization q(v) = round(clamp(v, -clip, clip) * 2^f) (round half to even, in float64): the sum of n
clients is within n * 2^-(f+1) of the exact sum per coordinate, and cannot wrap while n * clip * 2^f < 2^63.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ciders.core.tensors import State
from ciders.errors import PayloadError

MAX_KEY_BYTES = 1024  # a PEM public key on SECP384R1 is 215 bytes
MAX_CIPHERTEXT = 8192  # an encrypted share pair is under 1 KiB
MAX_SUBSETS = 64  # share subsets tried when a rebuilt secret fails its check
MAX_CLAIMS = 8  # complaints of a round whose truth the server tests (2^8 sums at most)


class SecAggError(RuntimeError):
    """The round's secure sum cannot be formed (too few clients, a secret that cannot be rebuilt)."""


def _crypto():
    """Flower's primitives, imported on first use (the flower extra: pip install 'ciders[flower]')."""
    try:
        from flwr.common.secure_aggregation.crypto import shamir, symmetric_encryption as sym
        from flwr.common.secure_aggregation import secaggplus_utils as env
        from flwr.supercore.primitives import asymmetric as asym
    except ImportError as exc:  # pragma: no cover - flwr is in requirements.txt
        raise SecAggError("federation.secure_aggregation needs Flower's primitives: pip install 'ciders[flower]'") from exc
    return shamir, sym, env, asym


# ------------------------------------------------------------------------------------------ round layout


@dataclass(frozen=True)
class Params:
    """What every party of round `round` agrees on: the members (sampling order), the neighbour count (None:
    everyone), the threshold and the fixed-point format."""

    round: int
    members: tuple[str, ...]
    threshold: int
    neighbours: int | None = None
    frac_bits: int = 32
    clip: float = 65536.0

    def index(self, cid: str) -> int:
        """The member's number in the share envelope (its position in the sample)."""
        return self.members.index(cid)

    def group(self, cid: str) -> tuple[str, ...]:
        """G_i: the client and its ring neighbours (h = neighbours / 2 on each side), in sampling order."""
        n, k = len(self.members), self.index(cid)
        if self.neighbours is None or self.neighbours + 1 >= n:
            return self.members
        h = self.neighbours // 2
        near = {(k + d) % n for d in range(-h, h + 1)}
        return tuple(m for j, m in enumerate(self.members) if j in near)


def sign(a: str, b: str) -> int:
    """+1 if a sorts after b else -1: the pair mask of (a, b) is added by one and subtracted by the other."""
    return 1 if a > b else -1


# ------------------------------------------------------------------------------------------ fixed point


def quantize(st: State, frac_bits: int, clip: float) -> dict[str, np.ndarray]:
    """q(v) = round(clamp(v, -clip, clip) * 2^frac_bits) as uint64 (two's complement), per tensor."""
    out = {}
    for k, v in st.items():
        x = v.detach().to("cpu", torch.float64).clamp(-clip, clip) * 2.0**frac_bits
        out[k] = torch.round(x).to(torch.int64).numpy().view(np.uint64).copy()
    return out


def dequantize(total: dict[str, np.ndarray], frac_bits: int, like: State) -> State:
    """The signed fixed-point sum back to tensors of `like`'s dtypes and devices."""
    out = {}
    for k, ref in like.items():
        x = torch.from_numpy(total[k].view(np.int64).astype(np.float64)) / 2.0**frac_bits
        out[k] = x.to(ref.dtype).to(ref.device)
    return out


def to_wire(st: dict[str, np.ndarray]) -> State:
    """uint64 arrays as int64 tensors (what safetensors carries); `from_wire` undoes it bit for bit."""
    return {k: torch.from_numpy(v.view(np.int64).copy()) for k, v in st.items()}


def from_wire(st: State) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu").contiguous().numpy().view(np.uint64).copy() for k, v in st.items()}


def add(a: dict[str, np.ndarray], b: dict[str, np.ndarray], s: int = 1) -> dict[str, np.ndarray]:
    """a + s * b in Z_2^64 (s = +1 or -1)."""
    return {k: (a[k] + b[k]) if s > 0 else (a[k] - b[k]) for k in a}


def prg(key: bytes, label: bytes, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Uniform uint64 masks of the given shapes from AES-256-CTR keyed by SHA-256(label | key). The stream is
    cut in sorted name order, so two parties whose dicts list the tensors in different orders (a state read
    back from safetensors, a clipped copy) draw the same mask for each name."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    sizes = {k: int(np.prod(s)) for k, s in shapes.items()}
    enc = Cipher(algorithms.AES(hashlib.sha256(label + b"|" + key).digest()), modes.CTR(bytes(16))).encryptor()
    stream = np.frombuffer(enc.update(bytes(8 * sum(sizes.values()))) + enc.finalize(), dtype="<u8")
    out, pos = {}, 0
    for k in sorted(shapes):
        s = shapes[k]
        out[k] = stream[pos : pos + sizes[k]].reshape(s).astype(np.uint64)
        pos += sizes[k]
    return out


def _self_label(p: Params) -> bytes:
    return f"ciders-secagg-self|{p.round}".encode()


def _pair_label(p: Params, a: str, b: str) -> bytes:
    lo, hi = sorted((a, b))
    return f"ciders-secagg-pair|{p.round}|{lo}|{hi}".encode()


def commitment(seed: bytes) -> str:
    return hashlib.sha256(b"ciders-secagg-commit|" + seed).hexdigest()


# ------------------------------------------------------------------------------------------ client side


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode())


@dataclass(frozen=True)
class Secrets:
    """One client's protocol state for one round (kept on the client, never sent)."""

    client_id: str
    round: int
    sk_c: bytes
    sk_s: bytes
    pk_c: bytes
    pk_s: bytes
    seed: bytes  # b_i
    members: tuple = ()  # the round's members, as the server named them in phase keys
    peers: dict = field(default_factory=dict)  # cid -> (pk_c, pk_s): G_i's keys, after the shares phase
    held: dict = field(default_factory=dict)  # src -> (b share, sk_s share), own included
    masked: bool = False  # sent y_i
    answered: bool = False  # sent its unmask shares (at most once a round)
    failed: tuple = ()  # peers whose shares did not decrypt or check: reported to the server, not masked with

    def to_json(self) -> dict:
        return {"client_id": self.client_id, "round": self.round, "masked": self.masked, "answered": self.answered,
                "members": list(self.members), "failed": list(self.failed),
                **{k: _b64(getattr(self, k)) for k in ("sk_c", "sk_s", "pk_c", "pk_s", "seed")},
                "peers": {c: [_b64(a), _b64(b)] for c, (a, b) in self.peers.items()},
                "held": {c: [_b64(a), _b64(b)] for c, (a, b) in self.held.items()}}

    @staticmethod
    def from_json(d: dict) -> "Secrets":
        return Secrets(d["client_id"], int(d["round"]), *(_unb64(d[k]) for k in ("sk_c", "sk_s", "pk_c", "pk_s", "seed")),
                       members=tuple(d["members"]), peers={c: (_unb64(a), _unb64(b)) for c, (a, b) in d["peers"].items()},
                       held={c: (_unb64(a), _unb64(b)) for c, (a, b) in d["held"].items()},
                       masked=bool(d["masked"]), answered=bool(d["answered"]), failed=tuple(d.get("failed", ())))


def client_keys(p: Params, cid: str) -> tuple[Secrets, dict]:
    """Phase keys: fresh key pairs and self-mask seed (from the OS's random source, never the run seed)."""
    _, _, _, asym = _crypto()
    if cid not in p.members:
        raise PayloadError(f"{cid} is not a member of round {p.round}'s secure aggregation")
    sk_c, pk_c = asym.generate_key_pairs()
    sk_s, pk_s = asym.generate_key_pairs()
    seed = os.urandom(32)
    s = Secrets(cid, p.round, asym.private_key_to_bytes(sk_c), asym.private_key_to_bytes(sk_s),
                asym.public_key_to_bytes(pk_c), asym.public_key_to_bytes(pk_s), seed, p.members)
    return s, {"pk_c": s.pk_c, "pk_s": s.pk_s, "commit": commitment(seed)}


def client_shares(p: Params, s: Secrets, keys: dict[str, tuple[bytes, bytes]]) -> tuple[Secrets, dict[str, bytes]]:
    """Phase shares: `keys` = the public keys of the live members of G_i (its own included, as the server
    echoes it). Returns the ciphertext for each other member."""
    shamir, sym, env, asym = _crypto()
    group = [c for c in p.group(s.client_id) if c in keys]
    if set(keys) != set(group):
        raise PayloadError(f"{s.client_id}: the server sent keys of clients outside its group: "
                           f"{sorted(set(keys) - set(group))[:3]}")
    if keys.get(s.client_id) != (s.pk_c, s.pk_s):
        raise PayloadError(f"{s.client_id}: the server did not echo this client's own public keys")
    flat = [k for pair in keys.values() for k in pair]
    if len(set(flat)) != len(flat):
        raise PayloadError(f"{s.client_id}: two public keys of round {p.round} are identical")
    if len(group) < p.threshold:
        raise PayloadError(f"{s.client_id}: {len(group)} live members in its group, fewer than the threshold "
                           f"{p.threshold}")
    b_shares = shamir.create_shares(s.seed, p.threshold, len(group))
    sk_shares = shamir.create_shares(s.sk_s, p.threshold, len(group))
    sk_c = asym.bytes_to_private_key(s.sk_c)
    out, held = {}, {}
    for j, cid in enumerate(group):
        if cid == s.client_id:
            held[cid] = (b_shares[j], sk_shares[j])
            continue
        key = sym.generate_shared_key(sk_c, asym.bytes_to_public_key(keys[cid][0]))
        out[cid] = sym.encrypt(key, env.share_keys_plaintext_concat(p.index(s.client_id), p.index(cid),
                                                                    b_shares[j], sk_shares[j]))
    return replace(s, peers=dict(keys), held=held), out


def client_receive(p: Params, s: Secrets, cts: dict[str, bytes]) -> Secrets:
    """Phase mask, first half: decrypt the shares addressed to this client and check their envelopes. A peer
    whose ciphertext does not decrypt or whose envelope names the wrong pair is not masked with and is reported
    (`Secrets.failed`): the server drops it for the round, as a dropout, instead of the round failing."""
    held, failed = dict(s.held), []
    for src, ct in cts.items():
        if src not in s.peers or src == s.client_id:
            raise PayloadError(f"{s.client_id}: shares from {src!r}, which is not in its group")
        got = _open_share(p, s, src, ct)
        if got is None:
            failed.append(src)
        else:
            held[src] = got
    if len(held) < p.threshold:
        raise PayloadError(f"{s.client_id}: valid shares from {len(held) - 1} neighbours, fewer than threshold - 1 = "
                           f"{p.threshold - 1}")
    return replace(s, held=held, failed=tuple(failed))


def _open_share(p: Params, s: Secrets, src: str, ct: bytes) -> tuple[bytes, bytes] | None:
    """(b share, sk_s share) from src's ciphertext, or None if it does not decrypt or names another pair."""
    _, sym, env, asym = _crypto()
    try:
        key = sym.generate_shared_key(asym.bytes_to_private_key(s.sk_c), asym.bytes_to_public_key(s.peers[src][0]))
        a, b, b_share, sk_share = env.share_keys_plaintext_separate(sym.decrypt(key, ct))
    except Exception:  # noqa: BLE001 - a wrong key, a forged ciphertext, a plaintext that is no envelope
        return None
    if (a, b) != (p.index(src), p.index(s.client_id)):
        return None
    return b_share, sk_share


def fernet_shaped(ct: bytes) -> bool:
    """Whether ct can be a Fernet token at all (base64url; version 0x80, timestamp, IV, whole AES blocks, HMAC):
    what the server can check of a ciphertext without its key. Random bytes fail it."""
    try:
        raw = base64.urlsafe_b64decode(ct)
    except Exception:  # noqa: BLE001 - not base64
        return False
    if base64.urlsafe_b64encode(raw) != ct:
        return False
    return len(raw) >= 73 and raw[0] == 0x80 and (len(raw) - 57) % 16 == 0


def client_mask(p: Params, s: Secrets, vector: State) -> tuple[Secrets, State]:
    """Phase mask, second half: y_i (int64 tensors) from the vector (float tensors) and the live neighbours
    A_i (the senders of the shares it holds)."""
    if s.masked:
        raise PayloadError(f"{s.client_id}: already sent its masked vector in round {p.round}")
    _, sym, _, asym = _crypto()
    y = quantize(vector, p.frac_bits, p.clip)
    shapes = {k: v.shape for k, v in y.items()}
    y = add(y, prg(s.seed, _self_label(p), shapes))
    sk_s = asym.bytes_to_private_key(s.sk_s)
    for j in sorted(c for c in s.held if c != s.client_id):
        key = sym.generate_shared_key(sk_s, asym.bytes_to_public_key(s.peers[j][1]))
        y = add(y, prg(key, _pair_label(p, s.client_id, j), shapes), sign(s.client_id, j))
    return replace(s, masked=True), to_wire(y)


def client_unmask(p: Params, s: Secrets, active: list[str], dropped: list[str]) -> tuple[Secrets, dict[str, tuple[str, bytes]]]:
    """Phase unmask: {owner: ("b" | "sk", share)}. Refuses a second request, an owner named both active and
    dropped, fewer than t active clients, or itself named dropped."""
    if s.answered:
        raise PayloadError(f"{s.client_id}: already answered round {p.round}'s unmask request")
    if set(active) & set(dropped):
        raise PayloadError(f"{s.client_id}: the unmask request names {sorted(set(active) & set(dropped))[0]} both "
                           "active and dropped (its two secrets would give away its vector)")
    if len(set(active)) < p.threshold:
        raise PayloadError(f"{s.client_id}: {len(set(active))} active clients, fewer than the threshold {p.threshold}")
    if s.client_id in dropped or not s.masked:
        raise PayloadError(f"{s.client_id}: named dropped, or asked before it sent its vector")
    out = {c: ("b", s.held[c][0]) for c in active if c in s.held}
    out.update({c: ("sk", s.held[c][1]) for c in dropped if c in s.held})
    return replace(s, answered=True), out


# ------------------------------------------------------------------------------------------ server side


def _rebuild(shares: list[bytes], t: int, ok) -> bytes | None:
    """A secret from t of the shares that passes `ok`, trying other subsets when one fails (a bad share)."""
    shamir, _, _, _ = _crypto()
    if len(shares) < t:
        return None
    for sub in itertools.islice(itertools.combinations(shares, t), MAX_SUBSETS):
        try:
            secret = shamir.combine_shares(list(sub))
        except Exception:  # noqa: BLE001 - inconsistent shares fail to unpad
            continue
        if ok(secret):
            return secret
    return None


@dataclass(frozen=True)
class Unmasked:
    """What the unmask step gives: the sum (None when it cannot be formed, with why), and the clients whose
    cheating the server has proven from what it holds itself ({client: reason})."""

    total: dict | None
    why: str | None = None
    cheats: dict = field(default_factory=dict)


def unmask(p: Params, masked: dict[str, State], dropped: list[str], keys: dict[str, tuple[bytes, bytes]],
           commits: dict[str, str], answers: dict[str, dict[str, tuple[str, bytes]]],
           omitted: dict[str, set] | None = None) -> dict[str, np.ndarray]:
    """sum_{active} q(v_i) in Z_2^64 (`unmask_checked`); SecAggError when it cannot be formed."""
    got = unmask_checked(p, masked, dropped, keys, commits, answers, omitted)
    if got.total is None:
        raise SecAggError(got.why)
    return got.total


def unmask_checked(p: Params, masked: dict[str, State], dropped: list[str], keys: dict[str, tuple[bytes, bytes]],
                   commits: dict[str, str], answers: dict[str, dict[str, tuple[str, bytes]]],
                   omitted: dict[str, set] | None = None) -> Unmasked:
    """sum_{active} q(v_i) in Z_2^64 from the masked vectors y_i of the active clients, the public keys and
    commitments of the round, and the unmask answers {replier: {owner: (kind, share)}}. `omitted`: active
    client -> the peers it reported and did not mask with. The sum fails (with why) when a secret cannot be
    rebuilt, or when it lies outside what |active| clipped inputs can add up to (an altered masked vector)."""
    active, omitted = sorted(masked), omitted or {}
    if len(answers) < p.threshold:
        return Unmasked(None, f"{len(answers)} clients answered the unmask request, fewer than the threshold "
                              f"{p.threshold}")
    total = None
    for cid in active:
        y = from_wire(masked[cid])
        total = y if total is None else add(total, y)
    shapes, cheats = {k: v.shape for k, v in total.items()}, {}
    for cid in active:
        shares = [a[cid][1] for a in answers.values() if cid in a and a[cid][0] == "b"]
        seed, why = _seed_of(p, shares, commits[cid])
        if seed is None:
            return Unmasked(None, f"cannot rebuild {cid}'s self-mask seed from {len(shares)} shares (threshold "
                                  f"{p.threshold})", cheats)
        if why is not None:
            cheats[cid] = why
        total = add(total, prg(seed, _self_label(p), shapes), -1)
    claims: dict = {}  # (j, dropped cid) -> the pair mask j says it did not add (it reported cid's shares)
    for cid in dropped:
        near = [j for j in active if j in p.group(cid) and j in keys]
        if not near:
            continue
        masks = _pair_masks(p, cid, near, keys, answers, shapes)
        if masks is None and all(cid in omitted.get(j, ()) for j in near):
            continue  # every neighbour reported it (none holds a share of its key): no mask to remove
        if masks is None:
            return Unmasked(None, f"cannot rebuild dropped {cid}'s mask key from its shares", cheats)
        for j, m in masks.items():
            if cid in omitted.get(j, ()):
                claims[(j, cid)] = m
            else:
                total = add(total, m, -1)
    total, liars = _settle(p, total, len(active), claims)
    cheats.update({j: f"it reported {cid}'s shares as failing and masked with them" for j, cid in liars})
    why = _out_of_range(p, total, len(active))
    return Unmasked(None if why else total, why, cheats)


def _settle(p: Params, total: dict, n: int, claims: dict) -> tuple[dict, list]:
    """The sum when a reporter masked with the peer it reported after all: the smallest set of claimed pair masks
    whose removal brings the sum within range (a uniform mask left in it cannot be, but with negligible odds),
    and those reporters (their claim was false: proof). Up to MAX_CLAIMS claims are tried."""
    if not claims or _out_of_range(p, total, n) is None or len(claims) > MAX_CLAIMS:
        return total, []
    for k in range(1, len(claims) + 1):
        for sub in itertools.combinations(sorted(claims), k):
            got = total
            for c in sub:
                got = add(got, claims[c], -1)
            if _out_of_range(p, got, n) is None:
                return got, list(sub)
    return total, []


def _seed_of(p: Params, shares: list[bytes], commit: str) -> tuple[bytes | None, str | None]:
    """(b_i, None) when t shares rebuild the committed seed; (the seed, why) when at least t + 1 shares all lie
    on one polynomial whose secret is not the committed one: the owner dealt shares of another seed or
    committed to another one (proof that needs no trust in any single replier); (None, None) otherwise."""
    seed = _rebuild(shares, p.threshold, lambda b: commitment(b) == commit)
    if seed is not None:
        return seed, None
    agreed = _agreed(shares, p.threshold)
    if agreed is None:
        return None, None
    return agreed, f"its {len(shares)} self-mask shares agree on a seed that does not match its commitment"


def _agreed(shares: list[bytes], t: int) -> bytes | None:
    """The secret of the one polynomial that all the shares (at least t + 1, distinct holders) lie on, else None.
    A share x lies on the polynomial P of shares[:t] iff shares[:t-1] + [x] rebuild P(0)."""
    shamir, _, _, _ = _crypto()
    if len(shares) < t + 1 or len({sh[:4] for sh in shares}) != len(shares):
        return None
    try:
        secret = shamir.combine_shares(shares[:t])
        if all(shamir.combine_shares(shares[: t - 1] + [x]) == secret for x in shares[t:]):
            return secret
    except Exception:  # noqa: BLE001 - inconsistent shares fail to unpad
        return None
    return None


def _pair_masks(p: Params, cid: str, near: list[str], keys: dict, answers: dict, shapes: dict) -> dict | None:
    """{j: the pair mask sign(j, cid) PRG(s_j,cid) that active neighbour j adds for dropped `cid`}, from cid's
    sk_s rebuilt from the sk shares and checked against pk_s; None when it cannot be rebuilt."""
    _, sym, _, asym = _crypto()
    shares = [a[cid][1] for a in answers.values() if cid in a and a[cid][0] == "sk"]

    def matches(sk: bytes) -> bool:
        try:
            return asym.public_key_to_bytes(asym.bytes_to_private_key(sk).public_key()) == keys[cid][1]
        except Exception:  # noqa: BLE001 - not a key at all
            return False

    sk = _rebuild(shares, p.threshold, matches)
    if sk is None:
        return None
    sk_key, zero = asym.bytes_to_private_key(sk), {k: np.zeros(v, dtype=np.uint64) for k, v in shapes.items()}
    out = {}
    for j in near:
        key = sym.generate_shared_key(sk_key, asym.bytes_to_public_key(keys[j][1]))
        out[j] = add(zero, prg(key, _pair_label(p, j, cid), shapes), sign(j, cid))
    return out


def _out_of_range(p: Params, total: dict[str, np.ndarray], n: int) -> str | None:
    """Why the sum of n clipped inputs (|q(v)| <= clip 2^f each) cannot be `total`, or None: a masked vector
    altered after masking (scaled, offset) leaves a sum spread over the ring. It does not say whose."""
    bound = n * (int(p.clip * 2.0**p.frac_bits) + 1)
    for k, v in total.items():
        x = v.view(np.int64)
        if x.size and (int(x.max()) > bound or int(x.min()) < -bound):
            return (f"the unmasked sum ({k}) is outside what {n} clipped inputs can add up to: a masked vector was "
                    "altered (which client's cannot be told without range proofs)")
    return None
