"""Prompt/response text data for causal-LM training and evaluation.

Records become (prompt, response) pairs; tokenization masks the prompt out of the labels so that the
loss and the perplexity count response tokens only (docs/method.md#the-client-loss-l_i). Malformed records are
counted by reason and reported, never silently dropped. The task layer of a later issue builds on
these functions (formats, splits, partitions).
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ciders.errors import CidersError

IGNORE = -100


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str


@dataclass
class DataReport:
    """What happened to the records of one file."""

    source: str
    records: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {"source": self.source, "records": self.records, "kept": self.kept,
                "truncated": self.truncated, "skipped": dict(self.skipped)}

    def summary(self) -> str:
        s = f"{self.source}: {self.kept}/{self.records} records used"
        if self.truncated:
            s += f", {self.truncated} truncated"
        if self.skipped:
            s += ", skipped " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return s


def read_records(path: str | Path, report: DataReport | None = None) -> list[dict]:
    """JSON Lines (optionally .gz). Undecodable or non-object lines are counted, not fatal."""
    path = Path(path)
    if not path.is_file():
        raise CidersError(f"data file not found: {path}")
    report = report if report is not None else DataReport(str(path))
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            report.records += 1
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                report.skipped["non-UTF-8"] += 1
                continue
            except json.JSONDecodeError:
                report.skipped["invalid JSON"] += 1
                continue
            if not isinstance(rec, dict):
                report.skipped["not a JSON object"] += 1
                continue
            out.append(rec)
    return out


FORMATS = ("gsm8k", "instruction", "mbpp", "metamath")


def detect_format(rec: dict) -> str:
    if "question" in rec and "answer" in rec:
        return "gsm8k"
    if "instruction" in rec and "response" in rec:
        return "instruction"
    if "text" in rec and "code" in rec:
        return "mbpp"
    if "query" in rec and "response" in rec:
        return "metamath"
    raise CidersError(f"cannot tell the record format from keys {sorted(rec)}; set data.format")


def _qa(rec: dict, q_key: str, a_key: str) -> Example | str:
    q, a = rec.get(q_key), rec.get(a_key)
    if not isinstance(q, str) or not isinstance(a, str):
        return f"missing {q_key}/{a_key}"
    if not a.strip():
        return "empty response"
    return Example(f"Question: {q.strip()}\nAnswer:", " " + a.strip())


def to_example(rec: dict, fmt: str) -> Example | str:
    """An Example, or the reason the record is unusable."""
    if fmt == "gsm8k":
        return _qa(rec, "question", "answer")
    if fmt == "instruction":
        ins, ctx, resp = rec.get("instruction"), rec.get("context", ""), rec.get("response")
        if not isinstance(ins, str) or not isinstance(resp, str) or not isinstance(ctx, (str, type(None))):
            return "missing instruction/response"
        if not resp.strip():
            return "empty response"
        prompt = f"### Instruction:\n{ins.strip()}\n"
        if ctx and ctx.strip():
            prompt += f"\n### Input:\n{ctx.strip()}\n"
        return Example(prompt + "\n### Response:\n", resp.strip())
    if fmt == "mbpp":  # task text + its asserts -> Python solution
        text, code, tests = rec.get("text"), rec.get("code"), rec.get("test_list", [])
        if not isinstance(text, str) or not isinstance(code, str):
            return "missing text/code"
        if not code.strip():
            return "empty response"
        tests = "\n".join(t for t in tests if isinstance(t, str)) if isinstance(tests, list) else ""
        return Example(f"### Task:\n{text.strip()}\n{tests}\n\n### Python solution:\n", code.strip())
    if fmt == "metamath":
        return _qa(rec, "query", "response")
    raise CidersError(f"data.format: unknown format {fmt!r} (use {', '.join(FORMATS)})")


@dataclass
class Records:
    """Validated examples of one source, with their labels and raw records, and what was dropped."""

    examples: list[Example]
    labels: list[str | None]
    raw: list[dict]
    report: DataReport


def record_label(label: str | None, rec: dict, fmt: str) -> str | None:
    """A record's partition label. GSM8K has no category column: its category is derived from the
    number of solution steps; MetaMathQA's is its `type`."""
    if label is None:
        return None
    if label == "category" and fmt == "gsm8k" and "category" not in rec:
        return gsm8k_steps_category(rec.get("answer", ""))
    if label == "category" and "type" in rec and "category" not in rec:
        return str(rec["type"])
    v = rec.get(label)
    return None if v is None else str(v)


def gsm8k_steps_category(answer: str) -> str:
    """Solution steps (lines before '####'), bucketed 1-2, 3, 4, 5, 6+."""
    n = len([ln for ln in answer.split("####")[0].strip().splitlines() if ln.strip()])
    return "steps_1-2" if n <= 2 else ("steps_6+" if n >= 6 else f"steps_{n}")


def validate(rows: Sequence[dict], fmt: str, label: str | None, report: DataReport, limit: int | None = None) -> Records:
    """Records -> Examples (+ labels); every unusable record is counted by reason in `report`."""
    ex, labels, raw = [], [], []
    for rec in rows:
        if limit is not None and len(ex) >= limit:
            break
        e = to_example(rec, fmt)
        if isinstance(e, str):
            report.skipped[e] += 1
            continue
        lab = record_label(label, rec, fmt)
        if label is not None and lab is None:
            report.skipped[f"missing {label}"] += 1
            continue
        ex.append(e)
        labels.append(lab)
        raw.append(rec)
    report.kept = len(ex)
    return Records(ex, labels, raw, report)


def load_examples(path: str | Path, fmt: str = "auto", limit: int | None = None) -> tuple[list[Example], DataReport]:
    report = DataReport(str(path))
    recs = read_records(path, report)
    if not recs:
        raise CidersError(f"{path}: no usable records ({report.summary()})")
    fmt = detect_format(recs[0]) if fmt == "auto" else fmt
    out = validate(recs, fmt, None, report, limit).examples
    if not out:
        raise CidersError(f"{path}: no usable records ({report.summary()})")
    return out, report


def tokenize(examples: Sequence[Example], tokenizer: Any, max_length: int, report: DataReport | None = None) -> list[dict]:
    """Each example -> {input_ids, labels} (lists of ints); labels are IGNORE on prompt tokens.
    Appends EOS so the model learns to stop. An over-long example is truncated and counted: the
    response keeps what the prompt leaves, but at least a quarter of max_length, and the prompt loses
    its beginning (long contexts such as tables keep their end, next to the question and answer)."""
    eos = tokenizer.eos_token_id
    feats = []
    for ex in examples:
        p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(ex.response, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        if len(p) + len(r) > max_length:
            keep_r = min(len(r), max(max_length // 4, max_length - len(p)))
            p, r = p[len(p) - (max_length - keep_r):] if max_length > keep_r else [], r[:keep_r]
            if report is not None:
                report.truncated += 1
        feats.append({"input_ids": p + r, "labels": [IGNORE] * len(p) + r})
    if report is not None:
        report.kept = len(feats)
    return feats


def collate(features: Sequence[dict], pad_id: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (IGNORE on padding)."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), n), pad_id, dtype=torch.long)
    labels = torch.full((len(features), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(features), n), dtype=torch.long)
    for i, f in enumerate(features):
        k = len(f["input_ids"])
        ids[i, :k] = torch.tensor(f["input_ids"])
        labels[i, :k] = torch.tensor(f["labels"])
        mask[i, :k] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def length_order(features: Sequence[dict]) -> list[int]:
    """Indices of `features`, longest first (ties in their order): batches cut from this order pad little."""
    return sorted(range(len(features)), key=lambda i: -len(features[i]["input_ids"]))


def batches(features: Sequence[dict], batch_size: int, pad_id: int, device=None,
            by_length: bool = True) -> Iterable[dict[str, torch.Tensor]]:
    """Right-padded batches (none for no features). by_length: cut from `length_order`, so each batch holds
    examples of similar length and pads (and computes) little; for sums over examples, such as perplexity,
    only float rounding depends on the order. Otherwise consecutive."""
    order = length_order(features) if by_length else range(len(features))
    order = list(order)
    for i in range(0, len(order), batch_size):
        yield collate([features[j] for j in order[i : i + batch_size]], pad_id, device)
