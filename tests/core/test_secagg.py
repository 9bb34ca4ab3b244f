"""Secure aggregation's protocol (core.secagg): the masks cancel exactly, dropouts at every stage are recovered,
and every request a malicious server could make to learn one client's vector is refused."""

import numpy as np
import pytest
import torch

from ciders.core import secagg as sa
from ciders.errors import PayloadError


def members(n):
    return tuple(f"client{i}" for i in range(n))


def vectors(p, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {c: {"a": torch.randn(3, 4, generator=g), "b": torch.randn(7, generator=g, dtype=torch.float64)}
            for c in p.members}


def protocol(p, vecs, drop_keys=(), drop_shares=(), drop_masked=(), drop_unmask=(), tamper=None):
    """One round of the protocol between honest clients and an honest server; returns (sum, active, state)."""
    secrets, keys, commits = {}, {}, {}
    for c in p.members:
        if c in drop_keys:
            continue
        secrets[c], pub = sa.client_keys(p, c)
        keys[c], commits[c] = (pub["pk_c"], pub["pk_s"]), pub["commit"]
    routed, u2 = {}, []
    for c in keys:
        if c in drop_shares:
            continue
        secrets[c], cts = sa.client_shares(p, secrets[c], {j: keys[j] for j in p.group(c) if j in keys})
        u2.append(c)
        for d, ct in cts.items():
            routed.setdefault(d, {})[c] = ct
    masked = {}
    for c in u2:
        secrets[c] = sa.client_receive(p, secrets[c], {s: ct for s, ct in routed.get(c, {}).items() if s in u2})
        secrets[c], y = sa.client_mask(p, secrets[c], vecs[c])
        if c not in drop_masked:
            masked[c] = y
    active = sorted(masked)
    dropped = [c for c in u2 if c not in masked]
    answers = {}
    for c in active:
        secrets[c], a = sa.client_unmask(p, secrets[c], active, dropped)
        if c not in drop_unmask:
            answers[c] = a
    if tamper is not None:
        tamper(answers)
    total = sa.unmask(p, masked, dropped, keys, commits, answers)
    return total, active, dict(secrets=secrets, masked=masked, keys=keys, commits=commits, dropped=dropped)


def exact(vecs, ids, key):
    return sum(vecs[c][key].double() for c in ids)


def check_sum(p, vecs, total, active, tol=None):
    got = sa.dequantize(total, p.frac_bits, {k: torch.zeros(v.shape, dtype=torch.float64)
                                             for k, v in vecs[active[0]].items()})
    bound = len(active) * 2.0 ** -(p.frac_bits + 1) if tol is None else tol
    for k in got:
        assert (got[k] - exact(vecs, active, k)).abs().max().item() <= bound


def test_the_masks_cancel_and_the_sum_is_within_the_quantization_bound():
    p = sa.Params(3, members(5), threshold=3)
    vecs = vectors(p)
    total, active, _ = protocol(p, vecs)
    assert active == list(p.members)
    check_sum(p, vecs, total, active)  # n * 2^-(f+1) per coordinate: 5 * 1.2e-10


@pytest.mark.parametrize("frac_bits", [8, 16, 32])
def test_the_error_bound_follows_the_fraction_bits(frac_bits):
    p = sa.Params(0, members(4), threshold=3, frac_bits=frac_bits)
    vecs = vectors(p, 1)
    total, active, _ = protocol(p, vecs)
    check_sum(p, vecs, total, active)
    got = sa.dequantize(total, frac_bits, {"a": torch.zeros(3, 4, dtype=torch.float64)})["a"]
    err = (got - exact(vecs, active, "a")).abs().max().item()
    assert err > 2.0 ** -(frac_bits + 8) or frac_bits == 32  # the bound is not vacuous: coarse formats do err


def test_a_single_masked_vector_looks_uniform_and_says_nothing_about_the_vector():
    p = sa.Params(0, members(3), threshold=2)
    vecs = vectors(p)
    _, _, st = protocol(p, vecs)
    y = sa.from_wire(st["masked"]["client0"])["a"].view(np.int64).astype(np.float64) / 2.0**p.frac_bits
    # the plain vector is O(1); its masked form is spread over the whole 2^64 ring (|y| ~ 2^31 after scaling)
    assert np.abs(y).mean() > 2.0**28
    assert np.corrcoef(y.ravel(), vecs["client0"]["a"].numpy().ravel())[0, 1] ** 2 < 0.5


@pytest.mark.parametrize("where", ["keys", "shares", "masked", "unmask"])
def test_a_client_dropping_at_any_stage_does_not_stop_the_sum(where):
    p = sa.Params(1, members(6), threshold=4)
    vecs = vectors(p, 2)
    kw = {f"drop_{where}": ("client2",)}
    total, active, _ = protocol(p, vecs, **kw)
    # a client that sent its masked vector and then vanished is still in the sum (its seed is rebuilt)
    assert ("client2" in active) == (where == "unmask")
    check_sum(p, vecs, total, active)


def test_two_dropouts_after_the_shares_are_unmasked_from_their_rebuilt_keys():
    p = sa.Params(2, members(7), threshold=4)
    vecs = vectors(p, 3)
    total, active, st = protocol(p, vecs, drop_masked=("client1", "client5"))
    assert st["dropped"] == ["client1", "client5"] and len(active) == 5
    check_sum(p, vecs, total, active)


def test_secagg_plus_ring_neighbours_with_dropouts():
    p = sa.Params(0, members(9), threshold=3, neighbours=4)
    assert p.group("client0") == ("client0", "client1", "client2", "client7", "client8")
    assert all(c in p.group(j) for c in p.members for j in p.group(c))  # the ring is symmetric
    vecs = vectors(p, 4)
    total, active, _ = protocol(p, vecs, drop_shares=("client4",), drop_masked=("client6",))
    check_sum(p, vecs, total, active)


def test_too_few_answers_cannot_unmask():
    p = sa.Params(0, members(5), threshold=4)
    with pytest.raises(sa.SecAggError, match="fewer than the threshold"):
        protocol(p, vectors(p), drop_unmask=("client0", "client1"))


def test_a_bad_share_is_caught_by_the_commitment_and_another_subset_is_used():
    p = sa.Params(0, members(6), threshold=3)
    vecs = vectors(p, 5)

    def corrupt_one(answers):
        kind, share = answers["client0"]["client3"]
        answers["client0"]["client3"] = (kind, share[:4] + bytes(b ^ 0xFF for b in share[4:]))

    total, active, _ = protocol(p, vecs, tamper=corrupt_one)
    check_sum(p, vecs, total, active)


def test_shares_that_cannot_rebuild_a_secret_fail_loudly_not_silently():
    p = sa.Params(0, members(4), threshold=3)

    def corrupt_all(answers):
        for a in answers.values():
            if "client1" in a:
                kind, share = a["client1"]
                a["client1"] = (kind, share[:4] + bytes(len(share) - 4))

    with pytest.raises(sa.SecAggError, match="client1"):
        protocol(p, vectors(p), tamper=corrupt_all)


# ------------------------------------------------------------------------------ a malicious server


def _round_to_unmask(p, vecs):
    _, _, st = protocol(p, vecs)
    s = st["secrets"]["client0"]
    import dataclasses

    return dataclasses.replace(s, answered=False)


def test_a_client_never_reveals_both_secrets_of_one_client():
    p = sa.Params(0, members(5), threshold=3)
    s = _round_to_unmask(p, vectors(p))
    with pytest.raises(PayloadError, match="both active and dropped"):
        sa.client_unmask(p, s, ["client0", "client1", "client2"], ["client2"])


def test_a_client_answers_the_unmask_request_once():
    p = sa.Params(0, members(5), threshold=3)
    s = _round_to_unmask(p, vectors(p))
    s, _ = sa.client_unmask(p, s, list(p.members), [])
    with pytest.raises(PayloadError, match="already answered"):
        sa.client_unmask(p, s, ["client0", "client1", "client2"], ["client3", "client4"])


def test_a_client_refuses_fewer_active_clients_than_the_threshold():
    p = sa.Params(0, members(5), threshold=3)
    s = _round_to_unmask(p, vectors(p))
    with pytest.raises(PayloadError, match="fewer than the threshold"):
        sa.client_unmask(p, s, ["client0", "client1"], ["client2", "client3", "client4"])


def test_a_client_checks_the_keys_the_server_relays():
    p = sa.Params(0, members(4), threshold=3)
    s0, pub0 = sa.client_keys(p, "client0")
    others = {c: sa.client_keys(p, c)[1] for c in p.members[1:]}
    keys = {"client0": (pub0["pk_c"], pub0["pk_s"]), **{c: (o["pk_c"], o["pk_s"]) for c, o in others.items()}}
    with pytest.raises(PayloadError, match="own public keys"):  # the server swapped in keys of its own
        sa.client_shares(p, s0, {**keys, "client0": keys["client1"]})
    with pytest.raises(PayloadError, match="identical"):  # one key relayed for two clients
        sa.client_shares(p, s0, {**keys, "client2": keys["client3"]})
    with pytest.raises(PayloadError, match="fewer than the threshold"):  # a group cut below t
        sa.client_shares(p, s0, {c: keys[c] for c in ("client0", "client1")})
    with pytest.raises(PayloadError, match="outside its group"):
        sa.client_shares(sa.Params(0, members(7), 3, neighbours=2), s0, {**keys, "client5": keys["client1"]})


def test_shares_from_an_impostor_do_not_decrypt():
    p = sa.Params(0, members(3), threshold=2)
    s = {c: sa.client_keys(p, c) for c in p.members}
    keys = {c: (pub["pk_c"], pub["pk_s"]) for c, (_, pub) in s.items()}
    s0, _ = sa.client_shares(p, s["client0"][0], keys)
    _, cts1 = sa.client_shares(p, s["client1"][0], keys)
    _, cts2 = sa.client_shares(p, s["client2"][0], keys)
    # client2's ciphertext passed off as client1's: client1 is reported (not masked with) instead of the round
    # failing, and the client still refuses to go on with fewer than t - 1 valid neighbours
    with pytest.raises(PayloadError, match="valid shares from 0"):
        sa.client_receive(p, s0, {"client1": cts2["client0"]})
    got = sa.client_receive(p, s0, {"client1": cts2["client0"], "client2": cts2["client0"]})
    assert got.failed == ("client1",) and set(got.held) == {"client0", "client2"}
    got = sa.client_receive(p, s0, {"client1": cts1["client0"], "client2": cts2["client0"]})
    assert got.failed == () and set(got.held) == set(p.members)
    assert sa.Secrets.from_json(sa.client_receive(p, s0, {"client1": cts2["client0"], "client2": cts2["client0"]})
                                .to_json()).failed == ("client1",)
    assert all(sa.fernet_shaped(ct) for ct in (*cts1.values(), *cts2.values()))
    assert not any(sa.fernet_shaped(b) for b in (b"", b"x" * 200, bytes(range(200)), cts1["client0"][:-4]))


def test_the_fixed_point_sum_cannot_wrap_within_the_configured_range():
    p = sa.Params(0, members(3), threshold=2, frac_bits=32, clip=2.0**20)
    big = {c: {"a": torch.full((4,), 2.0**20 - 1, dtype=torch.float64)} for c in p.members}
    total, active, _ = protocol(p, big)
    check_sum(p, big, total, active)
    q = sa.quantize({"a": torch.tensor([1e30, -1e30, float(2**20)])}, 32, 2.0**20)["a"].view(np.int64)
    assert q.tolist() == [2**52, -(2**52), 2**52]  # clipped to +-clip before scaling


def test_masks_come_from_the_whole_key_not_a_32_bit_fold():
    shapes = {"a": (1000,)}
    a = sa.prg(b"\x00" * 32, b"l", shapes)["a"]
    b = sa.prg(b"\x00" * 31 + b"\x01", b"l", shapes)["a"]
    c = sa.prg(b"\x01" + b"\x00" * 30 + b"\x01", b"l", shapes)["a"]  # XOR-folds to the same 32 bits as b
    assert not np.array_equal(a, b) and not np.array_equal(b, c)
    assert np.array_equal(a, sa.prg(b"\x00" * 32, b"l", shapes)["a"])
    assert 0.45 < (a >> np.uint64(63)).mean() < 0.55  # uniform top bits


def test_the_masks_do_not_depend_on_the_order_a_client_lists_its_tensors():
    """Two clients whose state dicts list the same tensors in other orders (a state read back from safetensors,
    an edge client's own model) still draw the same mask per name, so the pair masks cancel."""
    p = sa.Params(0, members(3), threshold=2)
    vecs = vectors(p, 6)
    vecs["client1"] = dict(reversed(list(vecs["client1"].items())))
    total, active, _ = protocol(p, vecs)
    check_sum(p, vecs, total, active)


def _split_view_attack(t: int, told_active: tuple) -> dict | None:
    """A server with one colluder (client4) that tells the clients of `told_active` that every client sent its
    vector and the others that client0 dropped, to collect b_0 from the first and sk_s_0 from the second
    (issue 34, 1c). Returns client0's vector when both secrets are rebuilt, else None."""
    from ciders.core.secagg import _crypto, _pair_label, _rebuild, _self_label

    _, sym, _, asym = _crypto()
    p = sa.Params(0, members(5), threshold=t)
    vecs = vectors(p, 11)
    sec, keys, commits = {}, {}, {}
    for c in p.members:
        sec[c], pub = sa.client_keys(p, c)
        keys[c], commits[c] = (pub["pk_c"], pub["pk_s"]), pub["commit"]
    routed = {}
    for c in p.members:
        sec[c], cts = sa.client_shares(p, sec[c], keys)
        for d, ct in cts.items():
            routed.setdefault(d, {})[c] = ct
    masked = {}
    for c in p.members:
        sec[c], masked[c] = sa.client_mask(p, sa.client_receive(p, sec[c], routed[c]), vecs[c])
    b_shares, sk_shares = [sec["client4"].held["client0"][0]], [sec["client4"].held["client0"][1]]  # the colluder
    for c in ("client0", "client1", "client2", "client3"):  # honest: each answers the one request it is sent
        if c in told_active:
            _, a = sa.client_unmask(p, sec[c], list(p.members), [])
            b_shares.append(a["client0"][1])
        else:
            _, a = sa.client_unmask(p, sec[c], list(p.members[1:]), ["client0"])
            sk_shares.append(a["client0"][1])
    b0 = _rebuild(b_shares, t, lambda b: sa.commitment(b) == commits["client0"])
    sk0 = _rebuild(sk_shares, t, lambda k: asym.public_key_to_bytes(asym.bytes_to_private_key(k).public_key())
                   == keys["client0"][1])
    if b0 is None or sk0 is None:
        return None
    y = sa.from_wire(masked["client0"])
    shapes = {k: v.shape for k, v in y.items()}
    y = sa.add(y, sa.prg(b0, _self_label(p), shapes), -1)
    for j in p.members[1:]:
        key = sym.generate_shared_key(asym.bytes_to_private_key(sk0), asym.bytes_to_public_key(keys[j][1]))
        y = sa.add(y, sa.prg(key, _pair_label(p, "client0", j), shapes), -sa.sign("client0", j))
    got = sa.dequantize(y, p.frac_bits, {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in vecs["client0"].items()})
    assert all(torch.allclose(got[k], vecs["client0"][k].double(), atol=1e-6) for k in got)  # the attack is real
    return got


def test_a_lying_server_with_one_colluder_needs_2t_at_most_g_plus_1():
    """Secrecy against a server that tells clients different dropout sets, helped by c colluders, holds iff
    2 t > g + c (docs/security.md#secure-aggregation): with g = 5 and c = 1 the server reads client0's vector at
    t = 3 (the strict majority) and at no split of the honest clients at t = 4, the default for one colluder."""
    import itertools

    assert _split_view_attack(3, ("client0", "client1")) is not None
    honest = ("client0", "client1", "client2", "client3")
    splits = [s for k in range(len(honest) + 1) for s in itertools.combinations(honest, k) if "client0" in s]
    assert all(_split_view_attack(4, s) is None for s in splits)
