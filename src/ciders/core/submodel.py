"""A client's sub-model on the wire (only the masked coordinates travel:
docs/rabo.md#per-coordinate-aggregation-and-covering-numbers).

Downlink (`pack` / `unpack`): the receiver does not know the mask, so each tensor travels as its kept
entries (1-D, in row-major order) plus where they sit: `name@rows`, the kept output units (int32, dim 0)
of a structured mask (whole channels / neurons: `core.masks.structured_masks`), or `name@idx`, flat int32
positions for an unstructured one (the FIARSE-style magnitude rule). A full mask is a structured one
with every row.
Uplink (`gather` / `scatter`): the server computed the mask, so only the kept entries travel.

Every unpacking step checks what it is given against the receiver's reference tensor (shape, dtype,
sorted in-range unique indices, entry count) and raises `core.wire.PayloadError`; a bad payload never
reaches the state.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ciders.core.tensors import State
from ciders.core.wire import PayloadError


def _rows(m: torch.Tensor) -> torch.Tensor | None:
    """The kept rows if the mask keeps whole rows (structured), else None."""
    if m.dim() == 0:
        return None
    flat = m.reshape(m.shape[0], -1)
    keep = flat.amax(1) > 0
    return torch.nonzero(keep).flatten().to(torch.int32) if bool((flat[keep] > 0).all()) else None


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
    for k, m in mask.items():
        rows = _rows(m)
        if rows is not None:
            out[f"{k}@rows"] = rows
        else:
            out[f"{k}@idx"] = torch.nonzero(m.reshape(-1) > 0).flatten().to(torch.int32)
    return out


def unpack(packed: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], what: str = "payload"
           ) -> tuple[State, State]:
    """(values: full shape, zero outside the mask; mask: 0/1 in ref's dtype) from a `pack`ed payload."""
    want = set(ref)
    names = {k.split("@")[0] for k in packed}
    if names != want or len(packed) != 2 * len(ref):
        diff = sorted(names ^ want) or ["(an index tensor)"]
        raise PayloadError(f"{what}: tensors differ from the expected ones (e.g. {diff[0]!r})")
    mask = {}
    for k, r in ref.items():
        rows, idx = packed.get(f"{k}@rows"), packed.get(f"{k}@idx")
        pos, n = (rows, r.shape[0] if r.dim() else 1) if rows is not None else (idx, r.numel())
        if pos is None or pos.dtype != torch.int32 or pos.dim() != 1:
            raise PayloadError(f"{what}: {k!r} needs int32 1-D {k}@rows or {k}@idx")
        p = pos.long()
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n or bool((p[1:] <= p[:-1]).any())):
            raise PayloadError(f"{what}: {k!r} indices must be sorted, unique and in [0, {n})")
        m = torch.zeros(n, dtype=r.dtype, device=r.device)
        m[p.to(r.device)] = 1
        if rows is not None and r.dim() > 1:
            m = m.view(-1, *([1] * (r.dim() - 1))).expand(r.shape).contiguous()
        mask[k] = m.view(r.shape)
    return scatter({k: packed[k] for k in ref}, mask, ref, what), mask
