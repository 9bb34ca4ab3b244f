"""Loss tuning on a long-tailed training set (the RABO paper, Sec. V; docs/rabo.md#task-2-loss-tuning-with-the-vs-loss).

Data: CIFAR-10 JPEGs from `$CIDERS_DATA/cifar10` (a 500-per-class train subset and the full test set;
see its SOURCE.md: re-encoded JPEGs, no formal licence, cite Krizhevsky 2009). The long-tailed training
set keeps n_c = floor(n_max * rho^(-c / (C - 1))) images of class c (rho = imbalance ratio, e.g. 100:
500 ... 5). The balanced validation set (the outer loss) and the balanced test set both come from the
official test split, `val_per_class` and the rest of each class (our decision: the 500-per-class train
subset has nothing left over for the head classes).

VS-loss (Kini et al., NeurIPS 2021), per example of class y with logits f:
  -w_y log( exp(Delta_y f_y + l_y) / sum_c exp(Delta_c f_c + l_c) )
x = (w, l, Delta) per class (the outer variable), y = the classifier (the inner variable).
"""

from __future__ import annotations

import io
import math
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ciders.errors import CidersError

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def load_cifar10(zip_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 3, 32, 32] in [0, 1], labels [N]) in the zip's sorted path order."""
    import numpy as np
    from PIL import Image

    p = Path(zip_path)
    if not p.is_file():
        raise CidersError(f"CIFAR-10 zip not found: {p} (set CIDERS_DATA to the datasets directory)")
    xs, ys = [], []
    with zipfile.ZipFile(p) as z:
        for name in sorted(z.namelist()):
            parts = name.split("/")
            if len(parts) != 3 or not parts[2].endswith(".jpg"):
                continue
            if parts[1] not in CLASSES:
                raise CidersError(f"{p}: unknown class directory {parts[1]!r}")
            with Image.open(io.BytesIO(z.read(name))) as im:
                xs.append(torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32).copy()))
            ys.append(CLASSES.index(parts[1]))
    if not xs:
        raise CidersError(f"{p}: no <split>/<class>/<image>.jpg entries")
    return torch.stack(xs).permute(0, 3, 1, 2) / 255.0, torch.tensor(ys)


def long_tail_counts(n_max: int, n_classes: int, imbalance: float) -> list[int]:
    if imbalance < 1:
        raise CidersError(f"imbalance ratio must be >= 1, got {imbalance}")
    return [max(1, math.floor(n_max * imbalance ** (-c / (n_classes - 1)))) for c in range(n_classes)]


def per_class_subset(labels: torch.Tensor, counts: list[int], offset: int = 0) -> torch.Tensor:
    """Indices of the first counts[c] examples of each class c (after skipping `offset` of each)."""
    idx = []
    for c, n in enumerate(counts):
        members = (labels == c).nonzero().flatten()
        if members.numel() < offset + n:
            raise CidersError(f"class {CLASSES[c] if c < len(CLASSES) else c} has {members.numel()} examples, "
                              f"{offset + n} needed")
        idx.append(members[offset : offset + n])
    return torch.cat(idx)


def vs_loss(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, l: torch.Tensor,  # noqa: E741
            delta: torch.Tensor) -> torch.Tensor:
    """Mean VS-loss over the batch (w, l, delta: [C])."""
    adjusted = logits * delta + l
    return (w[labels] * F.cross_entropy(adjusted, labels, reduction="none")).mean()


def balanced_accuracy(logits: torch.Tensor, labels: torch.Tensor, n_classes: int) -> float:
    pred = logits.argmax(1)
    accs = [float((pred[labels == c] == c).float().mean()) for c in range(n_classes) if bool((labels == c).any())]
    return sum(accs) / len(accs)
