"""Client partitions through flwr-datasets (IidPartitioner, NaturalIdPartitioner, DirichletPartitioner),
seeded, with per-client sizes and label histograms for the run directory."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from ciders.errors import CidersError


def partition(labels: Sequence[str | None], num_clients: int, kind: str, seed: int = 0, alpha: float = 0.5,
              min_size: int = 1) -> list[list[int]]:
    """Indices (into `labels`' records) of each client. kind: iid | natural | dirichlet."""
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner

    n = len(labels)
    if n < num_clients:
        raise CidersError(f"{n} records cannot be split over {num_clients} clients")
    ds = datasets.Dataset.from_dict({"idx": list(range(n)), "label": ["" if x is None else str(x) for x in labels]})
    if kind == "iid":
        p = IidPartitioner(num_partitions=num_clients)
        p.dataset = ds.shuffle(seed=seed)
    elif kind == "natural":
        uniq = sorted(set(ds["label"]))
        if len(uniq) != num_clients:
            raise CidersError(f"natural partition: {len(uniq)} distinct labels ({', '.join(uniq[:6])}) "
                              f"but federation.clients = {num_clients}; they must match")
        p = NaturalIdPartitioner(partition_by="label")
        p.dataset = ds
    elif kind == "dirichlet":
        if any(x is None for x in labels):
            raise CidersError("dirichlet partition needs a label on every record")
        p = DirichletPartitioner(num_partitions=num_clients, partition_by="label", alpha=alpha, seed=seed,
                                 min_partition_size=min_size, self_balancing=False, shuffle=True)
        p.dataset = ds
    else:
        raise CidersError(f"unknown partition {kind!r} (iid, natural, dirichlet)")
    out = [sorted(p.load_partition(i)["idx"]) for i in range(num_clients)]
    if kind == "natural":  # NaturalIdPartitioner numbers labels by first occurrence: order by label name
        out.sort(key=lambda idx: str(labels[idx[0]]))
    return out


def histograms(parts: Sequence[Sequence[int]], labels: Sequence[str | None]) -> list[dict]:
    return [{"size": len(ix), "labels": dict(sorted(Counter(str(labels[i]) for i in ix).items()))} for ix in parts]


def skew(parts: Sequence[Sequence[int]], labels: Sequence[str | None]) -> float:
    """Mean total-variation distance between each client's label distribution and the pool's
    (0 = IID, -> 1 = each client holds labels the others do not)."""
    pool = Counter(str(x) for x in labels)
    total = sum(pool.values())
    d = []
    for ix in parts:
        c = Counter(str(labels[i]) for i in ix)
        m = max(len(ix), 1)
        d.append(0.5 * sum(abs(c[k] / m - pool[k] / total) for k in pool))
    return sum(d) / len(d)
