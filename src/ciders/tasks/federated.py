"""The data of one federated experiment: disjoint public (server TAKD), client and evaluation parts,
the client partition, and each client's held-out share, as tokenized features, plus a record of the
split for the run directory (docs/method.md#experiments-and-metrics).

data.task = custom: explicit files (public / eval / clients or one file per client).
data.task = a named task (gsm8k, dolly, code, domains, math): the task's pool split by seed into public,
client and (unless the task has an official test split) evaluation parts, stratified per label with
data.per_label; the client part partitioned iid / natural / dirichlet through flwr-datasets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ciders.config import ExperimentConfig
from ciders.errors import CidersError
from ciders.runtime import derive_seed
from ciders.tasks.paths import resolve
from ciders.tasks.partition import histograms, partition, skew
from ciders.tasks.registry import TASKS, load_task, split_indices
from ciders.tasks.text import DataReport, Example, load_examples, tokenize


@dataclass
class FederatedData:
    public: list[dict]
    global_eval: list[dict]
    global_eval_raw: list[dict]  # the evaluation records as loaded (for generation metrics)
    train: dict[str, list[dict]]
    heldout: dict[str, list[dict]]
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


def build(cfg: ExperimentConfig, tok: Any) -> FederatedData:
    dc, fed = cfg.data, cfg.federation
    ml = dc.max_length
    reports: dict[str, DataReport] = {}
    eval_labels: list[str | None] = []
    client_labels: list[str | None] = []
    if dc.task == "custom":
        pub, reports["public"] = load_examples(resolve(dc.public), dc.format, dc.public_limit)
        ev, reports["eval"] = load_examples(resolve(dc.eval), dc.format, dc.eval_limit)
        from ciders.tasks.text import read_records

        ev_raw = read_records(resolve(dc.eval))[: len(ev)]
        if fed.partition == "iid":
            pool, reports["clients"] = load_examples(resolve(dc.clients), dc.format, dc.clients_limit)
            perm = torch.randperm(len(pool), generator=torch.Generator().manual_seed(derive_seed(cfg.seed, "data-split")))
            shards = [[pool[j] for j in perm[i :: fed.clients].tolist()] for i in range(fed.clients)]
        else:
            shards = []
            for i, f in enumerate(dc.client_files):
                ex, reports[f"client{i}"] = load_examples(resolve(f), dc.format, dc.clients_limit)
                shards.append(ex)
        split_info = {"kind": "files"}
        natural = []
    else:
        spec = TASKS[dc.task]
        recs = load_task(dc.task, dc.source)
        reports["pool"] = recs.report
        labels = recs.labels
        n_lab = len(set(labels)) if dc.per_label and spec.label else 1
        official = bool(spec.eval_local or spec.eval_hub)
        split = split_indices(len(recs.examples), dc.public_size * n_lab, 0 if official else dc.eval_size * n_lab,
                              cfg.seed, labels if dc.per_label and spec.label else None)
        pub = [recs.examples[i] for i in split.public]
        if official:
            ev_recs = load_task(dc.task, "hub" if dc.source == "hub" else None, eval_split=True, limit=dc.eval_limit)
            reports["eval"] = ev_recs.report
            ev, ev_raw, eval_labels = ev_recs.examples, ev_recs.raw, ev_recs.labels
        else:
            ev_idx = list(split.eval)
            if dc.eval_limit is not None:
                # with per_label the limit applies to each label: a plain prefix of the label-grouped split
                # would drop whole domains from the NLL matrix
                if dc.per_label and spec.label:
                    count: dict = {}
                    kept_ev = []
                    for i in ev_idx:
                        count[labels[i]] = count.get(labels[i], 0) + 1
                        if count[labels[i]] <= dc.eval_limit:
                            kept_ev.append(i)
                    ev_idx = kept_ev
                else:
                    ev_idx = ev_idx[: dc.eval_limit]
            ev = [recs.examples[i] for i in ev_idx]
            ev_raw = [recs.raw[i] for i in ev_idx]
            eval_labels = [labels[i] for i in ev_idx]
        pool_idx = split.clients
        if dc.client_size is not None:
            cap = dc.client_size * n_lab
            if dc.per_label and spec.label:
                kept, seen = [], {}
                for i in pool_idx:
                    if seen.get(labels[i], 0) < dc.client_size:
                        kept.append(i)
                        seen[labels[i]] = seen.get(labels[i], 0) + 1
                pool_idx = kept
            else:
                pool_idx = pool_idx[:cap]
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
    _check_disjoint({"public": pub, "eval": ev, "clients": [e for s in shards for e in s]})
    tok_reports = {"public": DataReport("public tokenization"), "eval": DataReport("eval tokenization")}
    public = tokenize(pub, tok, ml, tok_reports["public"])
    global_eval = tokenize(ev, tok, ml, tok_reports["eval"])
    train, heldout, part = {}, {}, {}
    client_label = {}
    for i, shard in enumerate(shards):
        cid = f"client{i}"
        n_hold = int(round(len(shard) * fed.holdout))
        rep_h, rep_t = DataReport(f"{cid} heldout"), DataReport(f"{cid} train")
        feats_h, feats_t = tokenize(shard[:n_hold], tok, ml, rep_h), tokenize(shard[n_hold:], tok, ml, rep_t)
        if not feats_t:
            raise CidersError(f"{cid} has no training examples after the holdout split ({rep_t.summary()})")
        train[cid], heldout[cid] = feats_t, feats_h
        part[cid] = {"train": len(feats_t), "heldout": len(feats_h), "truncated": rep_h.truncated + rep_t.truncated,
                     "skipped": dict(rep_h.skipped + rep_t.skipped)}
        if natural:
            client_label[cid] = natural[i]
    if not public or not global_eval:
        raise CidersError("public or evaluation data is empty after tokenization")
    eval_by_label: dict[str, list[dict]] = {}
    if eval_labels and any(x is not None for x in eval_labels):
        for e, lab in zip(ev, eval_labels):
            eval_by_label.setdefault(str(lab), []).append(e)
        eval_by_label = {k: tokenize(v, tok, ml) for k, v in sorted(eval_by_label.items())}
    info = {"reports": {k: r.to_dict() for k, r in reports.items()},
            "tokenization": {k: r.to_dict() for k, r in tok_reports.items()}, "partition": part, "split": split_info,
            "partition_kind": fed.partition, "max_length": ml, "client_label": client_label}
    return FederatedData(public, global_eval, ev_raw, train, heldout, eval_by_label, client_label, info)
