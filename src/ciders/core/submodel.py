"""A client's sub-model on the wire (only the masked coordinates travel:
docs/rabo.md#per-coordinate-aggregation-and-covering-numbers).

Downlink (`pack` / `unpack`): the receiver does not know the mask, so each tensor travels as its kept
entries (1-D, in row-major order) plus where they sit. A structured mask (`core.masks.structured_masks`:
the product of kept units along dim 0 and dim 1) sends `name@rows` (the kept indices of dim 0, int32) and,
for a >= 2-D tensor, `name@cols` (of dim 1); the kept entries in row-major order are then exactly the
extracted sub-tensor `t[rows][:, cols]` flattened, and `unpack` hands the client that dense sub-model
(shape [len(rows), len(cols), ...]) with an all-ones mask: the client computes on the small tensors, so
its seconds and memory are the sub-model's. An unstructured mask (the FIARSE-style magnitude rule) sends
`name@idx`, flat int32 positions, and the client gets the full-shape tensor, zero outside its mask, with
the mask; one unstructured tensor makes the whole set travel this way (`structures`), so the client's
tensors keep consistent shapes. A full mask is a structured one with every row and column.
Uplink (`gather` / `scatter`): the server computed the mask, so only the kept entries travel, in the
same order (a client's gradient on its sub-tensor, flattened, is `gather` of the full-shape one).
`extract(values, mask)` is what the client holds (for tests and for the server's cost accounting:
`sub_shapes`).

Every unpacking step checks what it is given against the receiver's reference tensor (shape, dtype,
sorted in-range unique indices, entry count) and raises `core.wire.PayloadError`; a bad payload never
reaches the state.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ciders.core.tensors import State
from ciders.core.wire import PayloadError


def structure(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(rows, cols) if the mask is the product of kept indices along dim 0 and dim 1 (cols None for a
    tensor of < 2 dims), else None (unstructured). Indices int64, sorted."""
    if m.dim() == 0:
        return None
    on = m > 0
    rows = torch.nonzero(on.reshape(m.shape[0], -1).any(1)).flatten()
    if m.dim() == 1:
        return rows, None
    cols = torch.nonzero(on.transpose(0, 1).reshape(m.shape[1], -1).any(1)).flatten()
    want = torch.zeros_like(on)
    want[rows[:, None], cols[None, :]] = True
    return (rows, cols) if torch.equal(want, on) else None


def structures(mask: Mapping[str, torch.Tensor]) -> dict:
    """{name: (rows, cols)} if every tensor's mask is structured (a sub-model), else {name: None}: one
    unstructured tensor (the magnitude rule) makes the client hold every tensor at full shape, so that a
    bias whose mask happens to be a set of rows stays the size of its weight's output."""
    st = {k: structure(m) for k, m in mask.items()}
    return st if all(v is not None for v in st.values()) else {k: None for k in mask}


def extract(values: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor], sts: dict | None = None) -> State:
    """What a client holds: the dense sub-tensor t[rows][:, cols] of a structured mask, t * mask otherwise
    (`sts`: `structures(mask)`, when the caller has it)."""
    out = {}
    sts = structures(mask) if sts is None else sts
    for k, v in values.items():
        st = sts[k]
        if st is None:
            out[k] = v * mask[k]
        else:
            rows, cols = st
            sub = v.index_select(0, rows.to(v.device))
            out[k] = sub if cols is None else sub.index_select(1, cols.to(v.device))
    return out


def client_view(values: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor]) -> tuple[State, State]:
    """(values, mask) as the client receives them (`unpack` of `pack`, without the wire): the dense
    sub-tensor and an all-ones mask where the mask is structured, the masked full tensor and the mask where
    it is not."""
    sts = structures(mask)
    sub = extract(values, mask, sts)
    return sub, {k: torch.ones_like(v) if sts[k] is not None else mask[k] for k, v in sub.items()}


def sub_shapes(mask: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Shapes of the client's tensors under each mask (`extract`), without the values."""
    out = {}
    sts = structures(mask)
    for k, m in mask.items():
        st = sts[k]
        if st is None:
            out[k] = tuple(m.shape)
        else:
            rows, cols = st
            out[k] = (len(rows),) + ((len(cols),) + tuple(m.shape[2:]) if cols is not None else ())
    return out


def gather(values: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor]) -> State:
    """{name: the kept entries of values[name], 1-D, row-major}."""
    return {k: v.detach().reshape(-1)[mask[k].reshape(-1) > 0].contiguous() for k, v in values.items()}


def scatter(kept: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor],
            what: str = "payload") -> State:
    """Inverse of `gather` under a known mask: full-shape tensors, zero where the mask is 0."""
    if kept.keys() != ref.keys():
        diff = sorted(set(kept) ^ set(ref))
        raise PayloadError(f"{what}: keys differ from the expected ones (e.g. {diff[0]!r})")
    out = {}
    for k, r in ref.items():
        v, m = kept[k], mask[k].reshape(-1) > 0
        if v.dim() != 1 or v.dtype != r.dtype or v.numel() != int(m.sum()):
            raise PayloadError(f"{what}: {k!r} is {tuple(v.shape)} {v.dtype}, expected ({int(m.sum())},) {r.dtype}")
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise PayloadError(f"{what}: {k!r} has NaN or Inf")
        full = torch.zeros(r.numel(), dtype=r.dtype, device=r.device)
        full[m.to(r.device)] = v.to(r.device)
        out[k] = full.view(r.shape)
    return out


def pack(values: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor]) -> State:
    """The kept entries of each tensor and where they sit (see the module docstring)."""
    out = gather(values, mask)
    sts = structures(mask)
    for k, m in mask.items():
        st = sts[k]
        if st is not None:
            out[f"{k}@rows"] = st[0].to(torch.int32)
            if st[1] is not None:
                out[f"{k}@cols"] = st[1].to(torch.int32)
        else:
            out[f"{k}@idx"] = torch.nonzero(m.reshape(-1) > 0).flatten().to(torch.int32)
    return out


def _positions(packed: Mapping[str, torch.Tensor], key: str, n: int, what: str, k: str) -> torch.Tensor | None:
    pos = packed.get(key)
    if pos is None:
        return None
    if pos.dtype != torch.int32 or pos.dim() != 1:
        raise PayloadError(f"{what}: {k!r} needs int32 1-D index tensors, got {key} {pos.dtype} {tuple(pos.shape)}")
    p = pos.long()
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n or bool((p[1:] <= p[:-1]).any())):
        raise PayloadError(f"{what}: {k!r} indices must be sorted, unique and in [0, {n})")
    return p


def unpack(packed: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], what: str = "payload"
           ) -> tuple[State, State]:
    """(values, mask) of a `pack`ed payload, as the client computes on them: for a structured tensor the
    dense sub-tensor [len(rows), len(cols), ...] and an all-ones mask; for an unstructured one (`@idx`) the
    full shape, zero outside the mask, and the 0/1 mask. `ref` is the receiver's copy of the architecture
    (full shapes, dtypes, device); every index and count is checked against it."""
    want = set(ref)
    names = {k.split("@")[0] for k in packed}
    n_index = sum(1 for k, r in ref.items() for s in ("@rows", "@cols", "@idx") if f"{k}{s}" in packed)
    if names != want or len(packed) != len(ref) + n_index:
        diff = sorted(names ^ want) or ["(an index tensor)"]
        raise PayloadError(f"{what}: tensors differ from the expected ones (e.g. {diff[0]!r})")
    values, mask = {}, {}
    for k, r in ref.items():
        v = packed[k]
        if v.dim() != 1 or v.dtype != r.dtype:
            raise PayloadError(f"{what}: {k!r} is {tuple(v.shape)} {v.dtype}, expected 1-D {r.dtype}")
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise PayloadError(f"{what}: {k!r} has NaN or Inf")
        idx = _positions(packed, f"{k}@idx", r.numel(), what, k)
        rows = _positions(packed, f"{k}@rows", r.shape[0] if r.dim() else 1, what, k)
        cols = _positions(packed, f"{k}@cols", r.shape[1], what, k) if r.dim() >= 2 else None
        if idx is not None and (rows is not None or f"{k}@cols" in packed):
            raise PayloadError(f"{what}: {k!r} has both @idx and @rows/@cols")
        if idx is None and (rows is None or r.dim() == 0 or (r.dim() >= 2) != (cols is not None)
                            or (r.dim() < 2 and f"{k}@cols" in packed)):
            raise PayloadError(f"{what}: {k!r} needs int32 1-D {k}@rows (and {k}@cols for a >= 2-D tensor) "
                               f"or {k}@idx")
        if idx is not None:
            if v.numel() != idx.numel():
                raise PayloadError(f"{what}: {k!r} has {v.numel()} entries for {idx.numel()} positions, expected")
            m = torch.zeros(r.numel(), dtype=r.dtype, device=r.device)
            m[idx.to(r.device)] = 1
            full = torch.zeros(r.numel(), dtype=r.dtype, device=r.device)
            full[idx.to(r.device)] = v.to(r.device)
            values[k], mask[k] = full.view(r.shape), m.view(r.shape)
            continue
        shape = (len(rows),) + ((len(cols),) + tuple(r.shape[2:]) if cols is not None else ())
        if v.numel() != int(torch.Size(shape).numel()):
            raise PayloadError(f"{what}: {k!r} has {v.numel()} entries, expected {torch.Size(shape).numel()} "
                               f"(a {shape} sub-tensor)")
        values[k] = v.to(r.device).view(shape).clone()
        mask[k] = torch.ones(shape, dtype=r.dtype, device=r.device)
    return values, mask
