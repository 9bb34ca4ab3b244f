"""Named seed streams (ciders.runtime.derive_seed): distinct per stream and key, stable, strict about names."""

import itertools

import pytest

from ciders.runtime import SEED_STREAMS, derive_seed

# the streams of the round loop and the workloads
LEAD_STREAMS = {"client-sampling", "client-batches", "eval-split", "synthetic-client", "synthetic-batch",
                "bilevel-episodes", "bilevel-eval", "bilevel-init"}


def fnv1a_reference(words):
    """FNV-1a on 64-bit words, written out independently of ciders.runtime (the package's offset basis is
    FNV's 14695981039346656037 without its last digit, kept from earlier releases)."""
    h = 1469598103934665603
    for w in words:
        h = ((h ^ (w % 2**64)) * 0x100000001B3) % 2**64
    return h


def test_values_are_pinned_and_follow_the_documented_hash():
    assert derive_seed(0, "task-split") == 6154859958881570507
    assert derive_seed(0, "takd-order", 1) == 7974082981525029600
    assert derive_seed(7, "client-batches", 2, 3, 4) == 6485480665917728192
    # (name bytes, name length, number of keys, seed, keys...), truncated to 63 bits
    name = b"client-batches"
    assert derive_seed(7, "client-batches", 2, 3, 4) == \
        fnv1a_reference([*name, len(name), 3, 7, 2, 3, 4]) % 2**63


def test_streams_and_keys_give_distinct_seeds():
    assert LEAD_STREAMS <= SEED_STREAMS
    seeds = {}
    for stream, seed, keys in itertools.product(sorted(SEED_STREAMS), (0, 1, 2**40),
                                                ((), (0,), (1,), (0, 0), (1, 0), (0, 1), (3, 2, 1))):
        v = derive_seed(seed, stream, *keys)
        assert 0 <= v < 2**63
        assert v == derive_seed(seed, stream, *keys)  # deterministic
        seeds.setdefault(v, []).append((stream, seed, keys))
    assert all(len(who) == 1 for who in seeds.values()), [w for w in seeds.values() if len(w) > 1]
    # trailing zero keys count: (seed, "a", 1) and (seed, "a", 1, 0) are different streams of draws
    assert derive_seed(5, "takd-order", 1) != derive_seed(5, "takd-order", 1, 0)
    assert derive_seed(5, "takd-dropout", 1, 2) != derive_seed(5, "takd-dropout", 2, 1)


def test_the_same_keys_in_two_streams_never_coincide():
    # for fixed (seed, keys) the map from the stream's state is a bijection mod 2^63: check it over many keys
    a, b = "takd-order", "client-batches"
    for seed in range(3):
        for k in range(200):
            assert derive_seed(seed, a, k) != derive_seed(seed, b, k)


def test_unknown_stream_is_refused():
    with pytest.raises(ValueError, match="unknown seed stream 'takd-ordr'.*SEED_STREAMS"):
        derive_seed(0, "takd-ordr", 1)
    with pytest.raises(ValueError, match="unknown seed stream"):
        derive_seed(0, 17)  # the old magic-number style


def test_every_stream_named_in_the_package_is_registered():
    """A typo in a rarely run path fails here, not only when the path runs."""
    import re
    from pathlib import Path

    import ciders

    used = {}
    for f in Path(ciders.__file__).parent.rglob("*.py"):
        for m in re.finditer(r"derive_seed\([^,()]+(?:\([^()]*\))?[^,()]*,\s*\"([^\"]+)\"", f.read_text(encoding="utf-8")):
            used.setdefault(m.group(1), []).append(f.name)
    assert {"task-split", "omniglot-shards", "student-lora-init", "takd-order"} <= set(used)
    assert set(used) <= SEED_STREAMS, {k: v for k, v in used.items() if k not in SEED_STREAMS}
