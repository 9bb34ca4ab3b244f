"""Task definitions (docs/method.md#experiments-and-metrics): where each dataset comes from, its record format, its
label column (for natural and Dirichlet partitions), how it splits into disjoint public / client / evaluation parts, and
which metrics apply.

Data loads through `datasets.load_dataset`: from a local file (the shared datasets under $CIDERS_DATA, or any
jsonl / json / csv / parquet file of the user's, `tasks.sources`) and, for users with internet, from the hub.
Every record is validated; malformed ones (invalid JSON, non-UTF-8, missing fields, empty responses)
are counted by reason in the DataReport, never silently dropped; over-long ones are truncated and
counted at tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ciders.errors import CidersError
from ciders.runtime import derive_seed
from ciders.tasks.paths import data_root
from ciders.tasks.text import DataReport, Records, gsm8k_steps_category, validate  # noqa: F401

DOMAINS = ("medical", "finance", "customer_support", "code", "general")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    format: str
    local: tuple[str, ...]  # paths under $CIDERS_DATA (pooled, in order)
    hub: tuple[str, str | None, str] | None  # (dataset id, config, split) for `datasets.load_dataset`
    label: str | None  # column for natural / Dirichlet partitions
    metrics: tuple[str, ...]
    eval_local: tuple[str, ...] = ()  # a separate official evaluation split, if the dataset has one
    eval_hub: tuple[str, str | None, str] | None = None


TASKS: dict[str, TaskSpec] = {
    "gsm8k": TaskSpec("gsm8k", "gsm8k", ("gsm8k/train.jsonl",), ("openai/gsm8k", "main", "train"), None,
                      ("exact_match", "ppl"), ("gsm8k/test.jsonl",), ("openai/gsm8k", "main", "test")),
    "dolly": TaskSpec("dolly", "instruction", ("dolly/databricks-dolly-15k.jsonl.gz",),
                      ("databricks/databricks-dolly-15k", None, "train"), "category", ("ppl", "rouge_l")),
    # code: MBPP trains (HumanEval-X is the evaluation benchmark, never training data)
    "code": TaskSpec("code", "mbpp", ("mbpp/mbpp.jsonl",), ("google-research-datasets/mbpp", "full", "train"), None,
                     ("pass@1",)),
    "domains": TaskSpec("domains", "instruction", tuple(f"personalization/{d}.jsonl" for d in DOMAINS), None, "domain",
                        ("nll_matrix",)),
    # math with a category column: MetaMathQA's `type` online; offline, GSM8K train with a derived
    # category = number of solution steps (lines before '####'), bucketed 1-2, 3, 4, 5, 6+
    "math": TaskSpec("math", "gsm8k", ("gsm8k/train.jsonl",), ("meta-math/MetaMathQA", None, "train"), "category",
                     ("exact_match", "ppl")),
}


def read_local(path: str | Path) -> tuple[list[dict], DataReport]:
    """A local data file through `datasets.load_dataset` (`tasks.sources`; malformed JSON lines counted)."""
    from ciders.tasks.sources import read

    return read(str(path))


def read_hub(hub: tuple[str, str | None, str]) -> tuple[list[dict], DataReport]:
    import datasets

    name, config, split = hub
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, gated, renamed...
        raise CidersError(f"cannot load {name} from the Hugging Face hub ({str(exc).splitlines()[0][:160]}); "
                          f"put the data under $CIDERS_DATA or pass a local path") from exc
    return [dict(r) for r in ds], DataReport(f"hub:{name}", records=len(ds))


def load_task(name: str, source: str | None = None, eval_split: bool = False, limit: int | None = None) -> Records:
    """A task's training pool (or its official evaluation split) as validated Records.
    `source`: a local file overriding the default location; 'hub' forces the hub."""
    if name not in TASKS:
        raise CidersError(f"unknown task {name!r} (known: {', '.join(TASKS)})")
    spec = TASKS[name]
    local, hub = (spec.eval_local, spec.eval_hub) if eval_split else (spec.local, spec.hub)
    if eval_split and not local and not hub:
        raise CidersError(f"task {name} has no separate evaluation split; use a held-out fraction")
    rows: list[dict] = []
    reports = []
    if source == "hub":
        if hub is None:
            raise CidersError(f"task {name} has no hub source")
        r, rep = read_hub(hub)
        rows, reports = r, [rep]
    else:
        paths = [Path(source)] if source else [data_root() / p for p in local]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing and source is None and hub is not None and not any(p.is_file() for p in paths):
            raise CidersError(f"task {name}: {missing[0]} not found (set CIDERS_DATA to the datasets directory, "
                              f"or use the hub source {hub[0]!r} with internet)")
        if missing:
            raise CidersError(f"task {name}: data file not found: {missing[0]}")
        for p in paths:
            r, rep = read_local(p)
            rows += r
            reports.append(rep)
    report = DataReport(",".join(r.source for r in reports), records=sum(r.records for r in reports))
    for r in reports:
        report.skipped.update(r.skipped)
    fmt = spec.format
    if source and rows and not eval_split:
        from ciders.tasks.text import detect_format

        fmt = detect_format(rows[0]) if fmt not in _fmt_keys(rows[0]) else fmt
    recs = validate(rows, fmt, spec.label, report, limit)
    if not recs.examples:
        raise CidersError(f"task {name}: no usable records ({report.summary()})")
    return recs


def _fmt_keys(rec: dict) -> tuple[str, ...]:
    from ciders.tasks.text import detect_format

    try:
        return (detect_format(rec),)
    except CidersError:
        return ()


@dataclass(frozen=True)
class Split:
    public: list[int]
    clients: list[int]
    eval: list[int]

    def to_dict(self) -> dict:
        return {"public": self.public, "clients": self.clients, "eval": self.eval}


def split_indices(n: int, public: int, eval_n: int, seed: int, stratify: Sequence | None = None) -> Split:
    """Disjoint seeded public / client / evaluation index sets over n records (eval_n = 0 when the
    task has an official evaluation split). With `stratify` labels, each label contributes its share."""
    if public + eval_n >= n:
        raise CidersError(f"cannot take {public} public + {eval_n} evaluation examples from {n}; lower the sizes")
    g = torch.Generator().manual_seed(derive_seed(seed, "task-split"))
    if stratify is None:
        perm = torch.randperm(n, generator=g).tolist()
    else:
        # interleave labels so that any prefix is stratified
        groups: dict = {}
        for i in torch.randperm(n, generator=g).tolist():
            groups.setdefault(stratify[i], []).append(i)
        keys = sorted(groups, key=str)
        perm, k = [], 0
        while any(groups[key] for key in keys):
            key = keys[k % len(keys)]
            if groups[key]:
                perm.append(groups[key].pop())
            k += 1
    return Split(sorted(perm[:public]), sorted(perm[public + eval_n :]), sorted(perm[public : public + eval_n]))
