"""The data of one federated experiment: disjoint public (server TAKD), client and evaluation parts,
the client partition, and each client's held-out share, as tokenized features, plus a record of the
split for the run directory (docs/method.md#experiments-and-metrics).

data.task = custom: explicit files (public / eval / clients or one file per client), or (partition nodes)
public and eval only: each client reads its own file on its node (`workloads.edge`).
data.task = a named task (gsm8k, dolly, code, domains, math): the task's pool split by seed into public,
client and (unless the task has an official test split) evaluation parts, stratified per label with
data.per_label; the client part partitioned iid / natural / dirichlet through flwr-datasets.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple


from ciders.config import ExperimentConfig
from ciders.errors import CidersError
from ciders.tasks.partition import histograms, partition, skew
from ciders.tasks.registry import TASKS, load_task, split_indices
from ciders.tasks.sources import data_kw, load_records
from ciders.tasks.text import DataReport, Example, tokenize


@dataclass
class FederatedData:
    public: list[dict]
    global_eval: list[dict]
    global_eval_raw: list[dict]  # the evaluation records as loaded (for generation metrics)
    train: dict[str, list[dict]]
    heldout: dict[str, list[dict]]
    validation: dict[str, list[dict]] = field(default_factory=dict)  # federation.validation: never trained on
    eval_by_label: dict[str, list[dict]] = field(default_factory=dict)
    client_label: dict[str, str] = field(default_factory=dict)  # natural partitions: the client's label
    info: dict = field(default_factory=dict)


def _check_disjoint(groups: dict[str, list[Example]]) -> None:
    names = list(groups)
    sets = {k: {e.prompt for e in v} for k, v in groups.items()}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = sets[a] & sets[b]
            if both:
                raise CidersError(f"{len(both)} prompts occur in both the {a} and the {b} data; they must be disjoint")


class _Parts(NamedTuple):
    """The untokenized split that both data sources produce, in the shape `build` consumes."""

    pub: list[Example]
    ev: list[Example]
    ev_raw: list[dict]
    eval_labels: list[str | None]
    shards: list[list[Example]]
    natural: list[str]  # natural partitions: each shard's label, else empty
    split_info: dict


def _load_custom(cfg: ExperimentConfig, reports: dict[str, DataReport]) -> _Parts:
    """data.task = custom: public / eval / clients from explicit sources (files or hub ids, `tasks.sources`);
    data.clients split by federation.partition through flwr-datasets (iid; natural / dirichlet over
    data.label_key), or one source per client (partition files)."""
    dc, fed = cfg.data, cfg.federation
    kw = data_kw(dc)
    pub_r = load_records(dc.public, dc.format, dc.public_limit, **kw)
    ev_r = load_records(dc.eval, dc.format, dc.eval_limit, **kw)
    reports["public"], reports["eval"] = pub_r.report, ev_r.report
    pub, ev, ev_raw = pub_r.examples, ev_r.examples, ev_r.raw
    if fed.partition == "nodes":  # every client's data stays on its node
        return _Parts(pub, ev, ev_raw, [], [], [], {"kind": "nodes"})
    if fed.partition == "files":
        shards = []
        for i, f in enumerate(dc.client_files):
            r = load_records(f, dc.format, dc.clients_limit, **kw)
            reports[f"client{i}"] = r.report
            shards.append(r.examples)
        return _Parts(pub, ev, ev_raw, [], shards, [], {"kind": "files"})
    pool = load_records(dc.clients, dc.format, dc.clients_limit, label=dc.label_key, **kw)
    reports["clients"] = pool.report
    parts = partition(pool.labels, fed.clients, fed.partition, seed=cfg.seed, alpha=fed.dirichlet_alpha)
    shards = [[pool.examples[j] for j in part] for part in parts]
    labelled = dc.label_key is not None
    natural = [str(pool.labels[p[0]]) for p in parts] if fed.partition == "natural" else []
    info = {"kind": "custom", "partition": fed.partition, "client_pool": len(pool.examples),
            "dirichlet_alpha": fed.dirichlet_alpha, "label_key": dc.label_key,
            "histograms": histograms(parts, pool.labels) if labelled else [{"size": len(p)} for p in parts],
            "label_skew": skew(parts, pool.labels) if labelled else 0.0}
    return _Parts(pub, ev, ev_raw, [], shards, natural, info)


def check_sources(cfg: ExperimentConfig) -> None:
    """Every data source the config names parses and, if a file, exists: run before the model is loaded."""
    from ciders.tasks.sources import check

    dc, fed = cfg.data, cfg.federation
    if dc.task != "custom":
        if dc.source not in (None, "hub"):
            check(dc.source)
        return
    names = [dc.public, dc.eval]
    if fed.partition == "files":
        names += list(dc.client_files)
    elif fed.partition != "nodes" and dc.clients:
        names.append(dc.clients)
    for n in names:
        check(n)


def _limit_eval(ev_idx: list[int], labels: list, limit: int | None, by_label: Any) -> list[int]:
    """Apply data.eval_limit to the evaluation indices."""
    if limit is None:
        return ev_idx
    # with per_label the limit applies to each label: a plain prefix of the label-grouped split
    # would drop whole domains from the NLL matrix
    if by_label:
        count: dict = {}
        kept_ev = []
        for i in ev_idx:
            count[labels[i]] = count.get(labels[i], 0) + 1
            if count[labels[i]] <= limit:
                kept_ev.append(i)
        return kept_ev
    return ev_idx[:limit]


def _named_eval(cfg: ExperimentConfig, recs: Any, split: Any, official: bool, by_label: Any,
                reports: dict[str, DataReport]) -> tuple[list[Example], list[dict], list[str | None]]:
    """The evaluation part of a named task: its official test split, or the seeded split's eval share."""
    dc = cfg.data
    if official:
        ev_recs = load_task(dc.task, "hub" if dc.source == "hub" else None, eval_split=True, limit=dc.eval_limit)
        reports["eval"] = ev_recs.report
        return ev_recs.examples, ev_recs.raw, ev_recs.labels
    ev_idx = _limit_eval(list(split.eval), recs.labels, dc.eval_limit, by_label)
    return [recs.examples[i] for i in ev_idx], [recs.raw[i] for i in ev_idx], [recs.labels[i] for i in ev_idx]


def _cap_client_pool(pool_idx: list[int], labels: list, client_size: int | None, n_lab: int,
                     by_label: Any) -> list[int]:
    """Apply data.client_size to the client pool (per label with per_label)."""
    if client_size is None:
        return pool_idx
    if by_label:
        kept, seen = [], {}
        for i in pool_idx:
            if seen.get(labels[i], 0) < client_size:
                kept.append(i)
                seen[labels[i]] = seen.get(labels[i], 0) + 1
        return kept
    return pool_idx[: client_size * n_lab]


def _load_named(cfg: ExperimentConfig, reports: dict[str, DataReport]) -> _Parts:
    """A named task: its pool split by seed into public / client / eval parts, the client part partitioned."""
    dc, fed = cfg.data, cfg.federation
    spec = TASKS[dc.task]
    recs = load_task(dc.task, dc.source)
    reports["pool"] = recs.report
    labels = recs.labels
    by_label = dc.per_label and spec.label
    n_lab = len(set(labels)) if by_label else 1
    official = bool(spec.eval_local or spec.eval_hub)
    split = split_indices(len(recs.examples), dc.public_size * n_lab, 0 if official else dc.eval_size * n_lab,
                          cfg.seed, labels if by_label else None)
    pub = [recs.examples[i] for i in split.public]
    ev, ev_raw, eval_labels = _named_eval(cfg, recs, split, official, by_label, reports)
    pool_idx = _cap_client_pool(split.clients, labels, dc.client_size, n_lab, by_label)
    client_labels = [labels[i] for i in pool_idx]
    kind = "iid" if fed.partition == "iid" else fed.partition
    parts = partition(client_labels, fed.clients, kind, seed=cfg.seed, alpha=fed.dirichlet_alpha)
    shards = [[recs.examples[pool_idx[j]] for j in part] for part in parts]
    natural = [str(client_labels[p[0]]) for p in parts] if kind == "natural" else []
    split_info = {"kind": dc.task, "public": len(pub), "eval": len(ev), "client_pool": len(pool_idx),
                  "official_eval_split": official, "partition": kind, "dirichlet_alpha": fed.dirichlet_alpha,
                  "histograms": histograms(parts, client_labels) if spec.label else [{"size": len(p)} for p in parts],
                  "label_skew": skew(parts, client_labels) if spec.label else 0.0,
                  "indices": split.to_dict()}
    return _Parts(pub, ev, ev_raw, eval_labels, shards, natural, split_info)


def tokenize_clients(shards: list[list[Example]], natural: list[str], tok: Any, ml: int,
                     holdout: float, validation: float = 0.0) -> tuple[dict, dict, dict, dict, dict]:
    """Each shard's held-out head, then its validation part (`validation` of it; none by default), and the training
    rest as features, with per-client counts for the record."""
    train, heldout, valid, part = {}, {}, {}, {}
    client_label = {}
    for i, shard in enumerate(shards):
        cid = f"client{i}"
        n_hold, n_val = int(round(len(shard) * holdout)), int(round(len(shard) * validation))
        reps = [DataReport(f"{cid} {k}") for k in ("heldout", "validation", "train")]
        cuts = (shard[:n_hold], shard[n_hold:n_hold + n_val], shard[n_hold + n_val:])
        feats_h, feats_v, feats_t = (tokenize(c, tok, ml, r) for c, r in zip(cuts, reps))
        if not feats_t:
            raise CidersError(f"{cid} has no training examples after the holdout split ({reps[2].summary()})")
        train[cid], heldout[cid] = feats_t, feats_h
        part[cid] = {"train": len(feats_t), "heldout": len(feats_h), "truncated": sum(r.truncated for r in reps),
                     "skipped": dict(sum((r.skipped for r in reps), Counter()))}
        if validation:
            valid[cid] = feats_v
            part[cid]["validation"] = len(feats_v)
        if natural:
            client_label[cid] = natural[i]
    return train, heldout, part, client_label, valid


def _eval_by_label(ev: list[Example], eval_labels: list[str | None], tok: Any, ml: int) -> dict[str, list[dict]]:
    """The evaluation examples grouped by label and tokenized (empty when the task has no labels)."""
    eval_by_label: dict[str, list[dict]] = {}
    if eval_labels and any(x is not None for x in eval_labels):
        for e, lab in zip(ev, eval_labels):
            eval_by_label.setdefault(str(lab), []).append(e)
        eval_by_label = {k: tokenize(v, tok, ml) for k, v in sorted(eval_by_label.items())}
    return eval_by_label


def build(cfg: ExperimentConfig, tok: Any) -> FederatedData:
    dc, fed = cfg.data, cfg.federation
    ml = dc.max_length
    reports: dict[str, DataReport] = {}
    parts = _load_custom(cfg, reports) if dc.task == "custom" else _load_named(cfg, reports)
    _check_disjoint({"public": parts.pub, "eval": parts.ev, "clients": [e for s in parts.shards for e in s]})
    tok_reports = {"public": DataReport("public tokenization"), "eval": DataReport("eval tokenization")}
    public = tokenize(parts.pub, tok, ml, tok_reports["public"])
    global_eval = tokenize(parts.ev, tok, ml, tok_reports["eval"])
    if fed.partition == "nodes":  # known to the server by id only
        train, heldout, part, client_label, valid = ({f"client{i}": [] for i in range(fed.clients)},
                                                     {f"client{i}": [] for i in range(fed.clients)}, {}, {}, {})
    else:
        train, heldout, part, client_label, valid = tokenize_clients(parts.shards, parts.natural, tok, ml, fed.holdout,
                                                                     fed.validation)
    if not public or not global_eval:
        raise CidersError("public or evaluation data is empty after tokenization")
    eval_by_label = _eval_by_label(parts.ev, parts.eval_labels, tok, ml)
    info = {"reports": {k: r.to_dict() for k, r in reports.items()},
            "tokenization": {k: r.to_dict() for k, r in tok_reports.items()}, "partition": part,
            "split": parts.split_info, "partition_kind": fed.partition, "max_length": ml, "client_label": client_label}
    return FederatedData(public, global_eval, parts.ev_raw, train, heldout, valid, eval_by_label, client_label, info)
