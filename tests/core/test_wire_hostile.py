"""Hostile bytes: decoding raises nothing but PayloadError, whatever a peer sends."""

import json
import random
import struct

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.core import wire
from ciders.core.wire import MAGIC, PayloadError

REF = {"x": torch.zeros(6, dtype=torch.float64), "w": torch.zeros(2, 3)}


def raw(header, blobs=b"") -> bytes:
    text = header if isinstance(header, (bytes, str)) else json.dumps(header)
    text = text.encode() if isinstance(text, str) else text
    return MAGIC + struct.pack("<I", len(text)) + text + blobs


def upload(**meta) -> bytes:
    up = alg.Upload("client0", 0, 0, dc={k: torch.ones_like(v) for k, v in REF.items()})
    msg, _ = codec.encode_upload(up)
    comps, _ = wire.decode(msg)
    base = {"client_id": "client0", "round": 0, "base_version": 0, "resync_request": False}
    return wire.encode(comps, {**base, **meta})[0]


@pytest.mark.parametrize("header", [
    "[" * 5000 + "]" * 5000,  # deeply nested: RecursionError in the JSON parser
    {"meta": {"a": [[[[[[[[[[[1]]]]]]]]]]]}, "components": []},  # nested beyond MAX_DEPTH
    {"meta": {}, "components": [[["a list"], 4]]},  # a list where a name is expected
    {"meta": {}, "components": [["dc", 1e400]]},  # overflows to Infinity
    '{"meta": {"round": NaN}, "components": []}',
    '{"meta": {"round": 1e400}, "components": []}',
    '{"meta": {"round": 123456789012345678901234567890}, "components": []}',
    {"meta": {}, "components": [["dc", -1]]},
    {"meta": {}, "components": [["dc", 0], ["dc", 0]]},  # a name twice
    {"meta": {}, "components": [["dc", True]]},
    {"meta": {}, "components": {"dc": 4}},
    {"meta": [], "components": []},
    {"meta": {}},
    [1, 2],
    b"\xff\xfe not utf-8",
])
def test_malformed_headers_are_payload_errors(header):
    with pytest.raises(PayloadError):
        wire.decode(raw(header))
    with pytest.raises(PayloadError):
        wire.sizes(raw(header))


def test_header_size_is_capped_before_it_is_parsed():
    big = raw({"meta": {"pad": "x" * (wire.MAX_HEADER + 1)}, "components": []})
    with pytest.raises(PayloadError, match="at most"):
        wire.decode(big)
    lying = MAGIC + struct.pack("<I", 2**31) + b"{}"  # claims a header longer than the message
    with pytest.raises(PayloadError):
        wire.decode(lying)


@pytest.mark.parametrize("meta", [
    {"round": [0]}, {"round": "0"}, {"round": True}, {"round": 1.5}, {"client_id": ["client0"]},
    {"client_id": 7}, {"client_id": "c" * 1000}, {"base_version": None}, {"resync_request": "yes"},
])
def test_upload_metadata_of_the_wrong_type_is_rejected(meta):
    with pytest.raises(PayloadError, match="metadata"):
        codec.decode_upload(upload(**meta), REF)


def test_a_claimed_example_count_is_ignored():
    """The server weighs by the sizes it registered; an upload's claim of n_examples is not read."""
    up = codec.decode_upload(upload(n_examples=10**15), REF)
    assert not hasattr(up, "n_examples")


@pytest.mark.parametrize("meta", [{"lrs": ["a"]}, {"lrs": [], "eta_ins": []}, {"version": "1"},
                                  {"applied": [0]}, {"applied": "x"}, {"gamma": [1]}])
def test_broadcast_metadata_of_the_wrong_type_is_rejected(meta):
    b = alg.Broadcast(0, REF, None, 0.1, (0.1,), (0.1,), c_i_digest="abc")
    msg, _ = codec.encode_broadcast(b)
    comps, good = wire.decode(msg)
    with pytest.raises(PayloadError):
        codec.decode_broadcast(wire.encode(comps, {**good, **meta})[0], REF)


def test_random_corruptions_only_raise_payload_errors():
    """1,000 random byte flips, truncations and splices of a valid upload: each either decodes to a
    well-typed upload or raises PayloadError, never anything else."""
    good = upload()
    rng = random.Random(0)
    for _ in range(1000):
        m = bytearray(good)
        op = rng.randrange(3)
        if op == 0:
            for _ in range(rng.randint(1, 8)):
                m[rng.randrange(len(m))] = rng.randrange(256)
        elif op == 1:
            m = m[: rng.randrange(len(m))]
        else:
            i = rng.randrange(len(m))
            m = m[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))) + m[i:]
        try:
            up = codec.decode_upload(bytes(m), REF)
        except PayloadError:
            continue
        assert isinstance(up.round, int) and isinstance(up.client_id, str)


def test_loads_json_bounds():
    with pytest.raises(PayloadError):
        wire.loads_json("[" * 100 + "]" * 100, "x")
    with pytest.raises(PayloadError):
        wire.loads_json("9" * 5000, "x")
    assert wire.loads_json('{"a": NaN}', "x", allow_nonfinite=True)["a"] != 0
    with pytest.raises(PayloadError):
        wire.loads_json('{"a": NaN}', "x")
