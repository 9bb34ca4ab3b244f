"""Wire format of a message: named components, each a safetensors blob, plus a JSON header.

Bytes are counted per component from the blobs actually produced, so communication figures are
measured, not computed. Decoding validates against what the receiver expects (keys, shapes, dtypes,
finite values) before anything is applied; no pickle anywhere.

Layout: b"CIDR" | u32 header length | header JSON {meta, components: [[name, nbytes], ...]} | blobs.
"""

from __future__ import annotations

import json
import struct
from typing import Mapping

import torch

from ciders.core.tensors import State
from ciders.errors import CidersError

MAGIC = b"CIDR"


class PayloadError(CidersError):
    """A message that must be rejected (malformed, or not what the receiver expects)."""


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


def decode(msg: bytes, expect: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
           device: torch.device | str | None = None) -> tuple[dict[str, State], dict]:
    """Parse a message. With `expect` (component -> reference state), every present component must
    match its reference exactly in keys, shapes and dtypes, and be finite; unknown components fail."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    comps, meta, pos = _header(msg)
    out: dict[str, State] = {}
    for name, n in comps:
        if not isinstance(n, int) or n < 0 or pos + n > len(msg):
            raise PayloadError(f"component {name!r}: truncated message")
        try:
            # clone: tensors viewing the message buffer sit at arbitrary alignments, and CPU kernels
            # round differently on unaligned data, which breaks bitwise reproducibility across processes
            raw = load(bytes(msg[pos : pos + n]))
            order = list(expect[name]) if expect is not None and name in expect and raw.keys() == expect[name].keys() else sorted(raw)
            st = {k: raw[k].clone() for k in order}  # the receiver's key order; own storage
        except (SafetensorError, ValueError) as exc:
            raise PayloadError(f"component {name!r}: unreadable tensors ({exc})") from exc
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
    try:
        header = json.loads(msg[8 : 8 + hlen])
        return header["components"], header["meta"], 8 + hlen
    except (ValueError, KeyError, TypeError) as exc:
        raise PayloadError(f"unreadable message header: {exc}") from exc


def sizes(msg: bytes) -> dict[str, int]:
    """Bytes per component of an encoded message, read from its header (what `encode` returned)."""
    comps, _, start = _header(msg)
    try:
        out = {str(n): int(b) for n, b in comps}
    except (ValueError, TypeError) as exc:
        raise PayloadError(f"unreadable message header: {exc}") from exc
    out["header"] = start
    return out
