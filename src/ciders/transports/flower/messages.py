"""What the Flower engine puts in a Message.

A payload is the exact byte string the in-process engine passes between server and client (`core.wire`:
safetensors blobs + a JSON header), carried as one uint8 `Array` (Flower serializes it with
`np.save(allow_pickle=False)`); routing fields ride in a ConfigRecord. Keeping the ciders wire format
means both engines count the same bytes, validate with the same code (keys, shapes, dtypes, finite values
against what the receiver expects) and handle bf16 tensors, which numpy-backed Arrays cannot hold.
"""

from __future__ import annotations

from ciders.errors import PayloadError

KIND = "ciders"  # ConfigRecord with the routing fields
PAYLOAD = "payload"  # ArrayRecord holding the wire bytes under "wire"


def pack(fields: dict, payload: bytes | None = None):
    """A RecordDict: routing fields (str/int/float/bool values) and optionally a wire payload."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    rd = RecordDict({KIND: ConfigRecord(dict(fields))})
    if payload is not None:
        rd[PAYLOAD] = ArrayRecord({"wire": Array(np.frombuffer(payload, dtype=np.uint8).copy())})
    return rd


def fields_of(content) -> dict:
    if KIND not in content.config_records:
        raise PayloadError(f"message has no {KIND!r} ConfigRecord")
    return dict(content.config_records[KIND])


def payload_of(content) -> bytes:
    """The wire bytes, or PayloadError if the record is missing or not a flat uint8 array."""
    rec = content.array_records.get(PAYLOAD)
    if rec is None or list(rec.keys()) != ["wire"]:
        raise PayloadError(f"message has no {PAYLOAD!r} ArrayRecord with exactly one 'wire' array")
    arr = rec["wire"]
    if arr.dtype != "uint8" or len(arr.shape) != 1:
        raise PayloadError(f"payload must be a flat uint8 array, got {arr.dtype} {list(arr.shape)}")
    return arr.numpy().tobytes()


def record_of(fields: dict) -> dict:
    """A client's metrics record, sent as JSON text (nested, and not only numbers): bounded in size and
    nesting here (`federation.records.parse`); its keys and types are checked by the server's round code."""
    from ciders.federation.records import parse

    text = fields.get("record", "{}")
    if not isinstance(text, str):
        raise PayloadError(f"client record must be JSON text, got {type(text).__name__}")
    return parse(text)
