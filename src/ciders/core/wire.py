"""Wire format of a message: named components, each a safetensors blob, plus a JSON header.

Bytes are counted per component from the blobs actually produced, so communication figures are
measured, not computed. Decoding validates against what the receiver expects (keys, shapes, dtypes,
finite values) before anything is applied; no pickle anywhere.

Layout: b"CIDR" | u32 header length | header JSON {meta, components: [[name, nbytes], ...]} | blobs.

Every byte may come from a hostile peer, so decoding raises nothing but `PayloadError`: the header is at
most MAX_HEADER bytes and MAX_DEPTH levels deep, holds no NaN/Infinity and no number that does not fit in a
float64 or in +-2**53, and its structure is checked before it is read; `fields` checks the types of the
metadata a receiver reads (a list where a name is expected is rejected, not crashed on).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Mapping

import torch

from ciders.core.tensors import State
from ciders.errors import CidersError, PayloadError  # noqa: F401  (PayloadError: re-exported, it lived here)
from ciders.phases import phase

MAGIC = b"CIDR"
MAX_HEADER = 64 * 1024  # bytes; a real header is a few hundred
MAX_DEPTH = 8  # JSON nesting of a header or a client record
MAX_COMPONENTS = 64
MAX_INT = 2**53  # exact in float64 and in every JSON parser
MAX_NAME = 128  # characters of a component or key name


@phase("serialization")
def encode(components: Mapping[str, Mapping[str, torch.Tensor] | None], meta: dict) -> tuple[bytes, dict[str, int]]:
    """Serialize; returns (message, bytes per component). None components are left out."""
    from safetensors.torch import save

    blobs, sizes = [], {}
    for name, st in components.items():
        if st is None:
            continue
        blob = save({k: v.detach().to("cpu").contiguous() for k, v in st.items()})
        blobs.append((name, blob))
        sizes[name] = len(blob)
    header = json.dumps({"meta": meta, "components": [[n, len(b)] for n, b in blobs]}).encode()
    msg = MAGIC + struct.pack("<I", len(header)) + header + b"".join(b for _, b in blobs)
    sizes["header"] = len(MAGIC) + 4 + len(header)
    return msg, sizes


@phase("serialization")
def decode(msg: bytes, expect: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
           device: torch.device | str | None = None) -> tuple[dict[str, State], dict]:
    """Parse a message. With `expect` (component -> reference state), every present component must
    match its reference exactly in keys, shapes and dtypes, and be finite; unknown components fail."""
    from safetensors.torch import load

    comps, meta, pos = _header(msg)
    out: dict[str, State] = {}
    for name, n in comps:
        if pos + n > len(msg):
            raise PayloadError(f"component {name!r}: truncated message")
        try:
            # clone: tensors viewing the message buffer sit at arbitrary alignments, and CPU kernels
            # round differently on unaligned data, which breaks bitwise reproducibility across processes
            raw = load(bytes(msg[pos : pos + n]))
            order = list(expect[name]) if expect is not None and name in expect and raw.keys() == expect[name].keys() else sorted(raw)
            st = {k: raw[k].clone() for k in order}  # the receiver's key order; own storage
        except Exception as exc:  # noqa: BLE001 - whatever the parser makes of hostile bytes is a bad payload
            raise PayloadError(f"component {name!r}: unreadable tensors ({str(exc)[:200]})") from None
        pos += n
        if expect is not None:
            if name not in expect:
                raise PayloadError(f"unexpected component {name!r}")
            check(st, expect[name], name)
        out[name] = {k: v.to(device) for k, v in st.items()} if device is not None else st
    if pos != len(msg):
        raise PayloadError("trailing bytes after the last component")
    return out, meta


def check(st: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], name: str) -> None:
    if st.keys() != ref.keys():
        diff = sorted(set(st) ^ set(ref))
        raise PayloadError(f"component {name!r}: keys differ from the expected ones (e.g. {diff[0]!r})")
    for k, v in st.items():
        r = ref[k]
        if tuple(v.shape) != tuple(r.shape) or v.dtype != r.dtype:
            raise PayloadError(f"component {name!r}: {k!r} is {tuple(v.shape)} {v.dtype}, "
                               f"expected {tuple(r.shape)} {r.dtype}")
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise PayloadError(f"component {name!r}: {k!r} has NaN or Inf")


def _header(msg: bytes) -> tuple[list, dict, int]:
    """(components [[name, nbytes], ...], meta, offset of the first blob), or PayloadError."""
    if len(msg) < 8 or msg[:4] != MAGIC:
        raise PayloadError("not a ciders message (bad magic)")
    (hlen,) = struct.unpack("<I", msg[4:8])
    if hlen > MAX_HEADER or 8 + hlen > len(msg):
        raise PayloadError(f"message header of {hlen} bytes (at most {MAX_HEADER}, and within the message)")
    header = loads_json(msg[8 : 8 + hlen], "message header")
    if not isinstance(header, dict) or set(header) != {"meta", "components"}:
        raise PayloadError("message header must be an object with exactly 'meta' and 'components'")
    comps, meta = header["components"], header["meta"]
    if not isinstance(meta, dict):
        raise PayloadError("message header: 'meta' must be an object")
    if not isinstance(comps, list) or len(comps) > MAX_COMPONENTS:
        raise PayloadError(f"message header: 'components' must be a list of at most {MAX_COMPONENTS}")
    names = set()
    for c in comps:
        ok = isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and 0 < len(c[0]) <= MAX_NAME
        if not ok or type(c[1]) is not int or c[1] < 0 or c[0] in names:
            raise PayloadError(f"message header: a component must be [unique name, size >= 0], got {str(c)[:80]}")
        names.add(c[0])
    return comps, meta, 8 + hlen


def loads_json(raw: bytes | str, what: str, max_bytes: int = MAX_HEADER, max_depth: int = MAX_DEPTH,
               allow_nonfinite: bool = False):
    """JSON from a peer: bounded size and nesting, every integer within +-MAX_INT and (unless
    `allow_nonfinite`, for metrics a diverged client may report) no NaN/Infinity and every number finite
    in float64; PayloadError otherwise."""
    if len(raw) > max_bytes:
        raise PayloadError(f"{what}: {len(raw)} bytes, at most {max_bytes}")

    def bad_constant(c):
        raise ValueError(f"{c} is not allowed")

    def num_float(x):
        v = float(x)
        if not (allow_nonfinite or math.isfinite(v)):
            raise ValueError(f"number {x[:20]} does not fit in a float64")
        return v

    def num_int(x):
        if len(x) > 17 or abs(int(x)) > MAX_INT:
            raise ValueError(f"integer {x[:20]} is out of range (|n| <= 2**53)")
        return int(x)

    try:
        out = json.loads(raw, parse_float=num_float, parse_int=num_int,
                         **({} if allow_nonfinite else {"parse_constant": bad_constant}))
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        raise PayloadError(f"unreadable {what}: {str(exc)[:200]}") from None
    if _depth(out) > max_depth:
        raise PayloadError(f"{what}: nested deeper than {max_depth} levels")
    return out


def _depth(x) -> int:
    """Nesting depth of parsed JSON, without recursion (the input already parsed, so it is bounded)."""
    deepest, todo = 0, [(x, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


_KINDS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "floats": (list,)}


def fields(meta: dict, spec: Mapping[str, str], what: str = "message") -> dict:
    """The metadata fields a receiver reads, type-checked: spec is {name: "int" | "float" | "str" | "bool" |
    "floats"} ("floats" = a list of numbers). A missing field or a wrong type is a PayloadError (bool is
    not an int here, and a str is at most MAX_NAME characters)."""
    out = {}
    for name, kind in spec.items():
        if name not in meta:
            raise PayloadError(f"{what}: metadata lacks {name!r}")
        v = meta[name]
        ok = isinstance(v, _KINDS[kind]) and (kind == "bool" or not isinstance(v, bool))
        if ok and kind == "str":
            ok = len(v) <= MAX_NAME
        if ok and kind == "floats":
            ok = all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v)
        if not ok:
            raise PayloadError(f"{what}: metadata {name!r} must be {kind}, got {type(v).__name__} {str(v)[:40]}")
        out[name] = v
    return out


def sizes(msg: bytes) -> dict[str, int]:
    """Bytes per component of an encoded message, read from its header (what `encode` returned)."""
    comps, _, start = _header(msg)
    out = {n: b for n, b in comps}
    out["header"] = start
    return out


def split_tail(msg: bytes) -> tuple[bytes, bytes]:
    """(the message its header describes, the bytes after it): for a message that carries another message
    unencoded behind it (a secure train message and its broadcast), so that a large broadcast is copied once
    instead of being re-encoded as a tensor. The receiver checks the tail's length against its own metadata."""
    comps, _, start = _header(msg)
    end = start + sum(n for _, n in comps)
    if end > len(msg):
        raise PayloadError("truncated message (its components end past its last byte)")
    return msg[:end], msg[end:]
