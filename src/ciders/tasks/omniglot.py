"""Omniglot for the few-shot hyper-representation task (the RABO paper, Sec. V;
docs/rabo.md#task-1-few-shot-hyper-representation).

Reads the upstream zips directly (`$CIDERS_DATA/omniglot`: images_background_small1/2.zip, all_runs.zip;
MIT, Lake et al., Science 2015). Images are 105x105 binary strokes on white; we invert them (ink = 1) and
resize to `size` x `size` with area averaging, the usual 28x28 of few-shot work. A character is a class
with 20 drawings. N-way K-shot episodes draw N characters and K support + Q query drawings of each, with
labels 0..N-1 in a random order; clients hold disjoint shards of characters.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ciders.errors import CidersError
from ciders.runtime import derive_seed


def _image(data: bytes, size: int) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        t = torch.from_numpy(np.asarray(im.convert("L"), dtype=np.float32).copy())[None, None]
    t = 1.0 - t / 255.0  # ink = 1
    return F.interpolate(t, size=(size, size), mode="area")[0]


def load_characters(zip_path: str | Path, size: int = 28) -> dict[str, torch.Tensor]:
    """{"<alphabet>/<character>": [n_drawings, 1, size, size]} from a background zip, sorted by name."""
    p = Path(zip_path)
    if not p.is_file():
        raise CidersError(f"Omniglot zip not found: {p} (set CIDERS_DATA to the datasets directory)")
    groups: dict[str, list[tuple[str, bytes]]] = {}
    with zipfile.ZipFile(p) as z:
        for name in z.namelist():
            parts = name.split("/")
            if len(parts) == 4 and parts[3].endswith(".png"):
                groups.setdefault(f"{parts[1]}/{parts[2]}", []).append((parts[3], z.read(name)))
    if not groups:
        raise CidersError(f"{p}: no <root>/<alphabet>/<character>/<image>.png entries")
    return {c: torch.stack([_image(b, size) for _, b in sorted(files)]) for c, files in sorted(groups.items())}


def rotations(pool: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Each character at k rotations by multiples of 90 degrees, every rotation a class of its own: the standard
    Omniglot augmentation of few-shot work (Santoro et al. 2016; Vinyals et al. 2016; Snell et al. 2017), which
    multiplies the classes by k. Rotation r > 0 of "<a>/<c>" is "<a>/<c>@rot<90 r>"; k = 1 is the pool itself."""
    if k not in (1, 2, 3, 4):
        raise CidersError(f"rotations must be 1, 2, 3 or 4 (multiples of 90 degrees), got {k}")
    return {f"{c}@rot{90 * r}" if r else c: torch.rot90(v, r, dims=(-2, -1)) if r else v
            for c, v in pool.items() for r in range(k)}


def shard(characters: list[str], n_clients: int, seed: int, size: int = 0) -> list[list[str]]:
    """Disjoint, near-equal shards of characters (a seeded permutation dealt round-robin); with `size` > 0,
    each client instead draws its own `size` characters (seeded per client; shards may overlap: for more
    clients x classes than the shipped character pool holds, e.g. 20-way or 50 clients at CPU scale)."""
    if size > 0:
        if size > len(characters):
            raise CidersError(f"shard size {size} is more than the {len(characters)} characters")
        return [sorted(characters[j] for j in torch.randperm(len(characters), generator=torch.Generator().manual_seed(
            derive_seed(seed, "omniglot-shards", i))).tolist()[:size]) for i in range(n_clients)]
    if n_clients < 1 or n_clients > len(characters):
        raise CidersError(f"cannot shard {len(characters)} characters over {n_clients} clients")
    g = torch.Generator().manual_seed(derive_seed(seed, "omniglot-shards"))
    perm = torch.randperm(len(characters), generator=g).tolist()
    return [sorted(characters[j] for j in perm[i::n_clients]) for i in range(n_clients)]


@dataclass(frozen=True)
class Episode:
    support: torch.Tensor  # [N*K, 1, s, s]
    support_labels: torch.Tensor  # [N*K]
    query: torch.Tensor  # [N*Q, 1, s, s]
    query_labels: torch.Tensor


def episode(pool: dict[str, torch.Tensor], chars: list[str], n_way: int, k_shot: int, q_query: int,
            generator: torch.Generator) -> Episode:
    if len(chars) < n_way:
        raise CidersError(f"an {n_way}-way episode needs {n_way} characters, the shard has {len(chars)}")
    pick = torch.randperm(len(chars), generator=generator)[:n_way].tolist()
    sx, sy, qx, qy = [], [], [], []
    for label, j in enumerate(pick):
        imgs = pool[chars[j]]
        if imgs.size(0) < k_shot + q_query:
            raise CidersError(f"{chars[j]} has {imgs.size(0)} drawings, fewer than K + Q = {k_shot + q_query}")
        order = torch.randperm(imgs.size(0), generator=generator)
        sx.append(imgs[order[:k_shot]])
        qx.append(imgs[order[k_shot : k_shot + q_query]])
        sy += [label] * k_shot
        qy += [label] * q_query
    return Episode(torch.cat(sx), torch.tensor(sy), torch.cat(qx), torch.tensor(qy))


def one_shot_runs(zip_path: str | Path, size: int = 28) -> list[Episode]:
    """The 20 official 20-way one-shot runs: support = the 20 training images (label = class index),
    query = the 20 test images labelled through class_labels.txt."""
    runs = []
    with zipfile.ZipFile(zip_path) as z:
        for r in range(1, 21):
            lines = z.read(f"run{r:02d}/class_labels.txt").decode().split()
            pairs = list(zip(lines[0::2], lines[1::2]))
            train = sorted({t for _, t in pairs})
            idx = {t: i for i, t in enumerate(train)}
            sx = torch.stack([_image(z.read(t), size) for t in train])
            qx = torch.stack([_image(z.read(q), size) for q, _ in pairs])
            runs.append(Episode(sx, torch.arange(len(train)), qx, torch.tensor([idx[t] for _, t in pairs])))
    return runs
