"""Protocol B response-NLL matrix (docs/method.md#experiments-and-metrics): every source messenger on every target
domain's held-out set, L_ij = corpus NLL per response token of AdapEmu with messenger i on domain j, and Delta_cross =
mean_{i != j} L_ij - mean_i L_ii."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from ciders.core.tensors import State
from ciders.eval.metrics import perplexity
from ciders.tasks.text import batches


def nll_matrix(model, load_messenger: Callable[[State], None], messengers: Mapping[str, State],
               targets: Mapping[str, Sequence[dict]], pad_id: int, batch_size: int = 8, device=None) -> dict:
    cells: dict[str, dict[str, dict]] = {}
    for src, state in messengers.items():
        load_messenger(state)
        cells[src] = {}
        for tgt, feats in targets.items():
            r = perplexity(model, batches(feats, batch_size, pad_id, device))
            # an empty target has no NLL (not 0): it is reported and left out of Delta_cross
            cells[src][tgt] = {"nll": r["nll"] if r["tokens"] else None, "tokens": r["tokens"], "examples": len(feats)}
    return {"cells": cells, **cross_gap(cells)}


def cross_gap(cells: Mapping[str, Mapping[str, Mapping]]) -> dict:
    diag = [cells[s][s]["nll"] for s in cells if s in cells[s] and cells[s][s]["nll"] is not None]
    off = [cells[s][t]["nll"] for s in cells for t in cells[s] if t != s and cells[s][t]["nll"] is not None]
    if not diag or not off:
        return {"diag_mean": None, "off_mean": None, "delta_cross": None}
    d, o = sum(diag) / len(diag), sum(off) / len(off)
    return {"diag_mean": d, "off_mean": o, "delta_cross": o - d}
