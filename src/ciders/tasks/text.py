"""Prompt/response text data for causal-LM training and evaluation.

Records become (prompt, response) pairs; tokenization masks the prompt out of the labels so that the
loss and the perplexity count response tokens only (docs/method.md#the-client-loss-l_i). Malformed records are
counted by reason and reported, never silently dropped. The task layer of a later issue builds on
these functions (formats, splits, partitions).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ciders.errors import CidersError

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One (prompt, response) pair. `turns` set: the conversation before the response, as (role, content)
    pairs, rendered at tokenization with the tokenizer's chat template (then `prompt` is a plain rendering of
    the turns, used only to check that data parts are disjoint)."""

    prompt: str
    response: str
    turns: tuple[tuple[str, str], ...] | None = None


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


MAX_RECORD_BYTES = 4 * 2**20  # one JSON line; a longer one is skipped without being decoded (docs/data.md#limits)
TOKEN_CHARS = 256  # longer than any token of the vocabularies we know (SmolLM2's longest is 81 characters)


def read_records(path: str | Path, report: DataReport | None = None) -> list[dict]:
    """JSON Lines (optionally .gz). Undecodable, non-object, too deeply nested or over-long
    (MAX_RECORD_BYTES) lines are counted, not fatal; a file that cannot be read at all is one CidersError."""
    path = Path(path)
    if not path.is_file():
        raise CidersError(f"data file not found: {path}")
    report = report if report is not None else DataReport(str(path))
    out = []
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            for raw in _bounded_lines(f, report):
                rec = _decode(raw, report)
                if rec is not None:
                    out.append(rec)
    except UNREADABLE as exc:
        raise unreadable(path, exc) from exc
    return out


UNREADABLE = (OSError, EOFError, zlib.error)  # BadGzipFile is an OSError; EOFError: a truncated .gz


def unreadable(path: str | Path, exc: BaseException) -> CidersError:
    """One line for a data file that cannot be read at all (an I/O error, a corrupt or truncated .gz)."""
    gz = str(path).lower().endswith(".gz")
    return CidersError(f"cannot read {path}: {type(exc).__name__}: {str(exc)[:200]}"
                       + ("; is it a complete gzip file?" if gz else ""))


def _bounded_lines(f: Any, report: DataReport) -> Iterable[bytes]:
    """The non-blank lines of a binary file, none held beyond MAX_RECORD_BYTES: an over-long line is counted
    and skipped in chunks, so a hostile file cannot make the reader hold it whole."""
    while raw := f.readline(MAX_RECORD_BYTES + 1):
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
                pass
            report.records += 1
            report.skipped[f"longer than {MAX_RECORD_BYTES // 2**20} MiB"] += 1
            continue
        if raw.strip():
            report.records += 1
            yield raw


def _decode(raw: bytes, report: DataReport) -> dict | None:
    """One JSON line -> a dict, or None with the reason counted."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        report.skipped["non-UTF-8"] += 1
        return None
    except json.JSONDecodeError:
        report.skipped["invalid JSON"] += 1
        return None
    except RecursionError:  # json's C decoder recurses once per nesting level
        report.skipped["nested too deeply"] += 1
        return None
    if not isinstance(rec, dict):
        report.skipped["not a JSON object"] += 1
        return None
    return rec


FORMATS = ("gsm8k", "instruction", "mbpp", "metamath", "prompt_completion", "chat")
# Each format's (prompt field, response field); `data.prompt_key` / `data.response_key` rename them.
FIELDS = {"gsm8k": ("question", "answer"), "instruction": ("instruction", "response"), "mbpp": ("text", "code"),
          "metamath": ("query", "response"), "prompt_completion": ("prompt", "completion"), "chat": ("messages", None)}
ROLES = ("system", "user", "assistant")


def detect_format(rec: dict) -> str:
    if "question" in rec and "answer" in rec:
        return "gsm8k"
    if "instruction" in rec and "response" in rec:
        return "instruction"
    if "text" in rec and "code" in rec:
        return "mbpp"
    if "query" in rec and "response" in rec:
        return "metamath"
    if "prompt" in rec and "completion" in rec:
        return "prompt_completion"
    if "messages" in rec:
        return "chat"
    raise CidersError(f"cannot tell the record format from keys {sorted(rec)}; set data.format, or name the "
                      "fields with data.prompt_key and data.response_key")


def rename(rec: dict, fmt: str, prompt_key: str | None, response_key: str | None) -> dict:
    """The record with the user's field names mapped onto the format's own (a no-op without keys)."""
    if prompt_key is None and response_key is None:
        return rec
    want_p, want_r = FIELDS[fmt]
    out = dict(rec)
    for key, want in ((prompt_key, want_p), (response_key, want_r)):
        if key is not None and want is not None and key != want:
            out[want] = rec.get(key)
    return out


def _qa(rec: dict, q_key: str, a_key: str) -> tuple[str, str, str] | str:
    q, a = rec.get(q_key), rec.get(a_key)
    if not isinstance(q, str) or not isinstance(a, str):
        return f"missing {q_key}/{a_key}"
    if not a.strip():
        return "empty response"
    return f"Question: {q.strip()}\nAnswer:", " " + a.strip(), q.strip()


def _instruction(rec: dict) -> tuple[str, str, str] | str:
    ins, ctx, resp = rec.get("instruction"), rec.get("context", ""), rec.get("response")
    if not isinstance(ins, str) or not isinstance(resp, str) or not isinstance(ctx, (str, type(None))):
        return "missing instruction/response"
    if not resp.strip():
        return "empty response"
    prompt, user = f"### Instruction:\n{ins.strip()}\n", ins.strip()
    if ctx and ctx.strip():
        prompt += f"\n### Input:\n{ctx.strip()}\n"
        user += f"\n\n{ctx.strip()}"
    return prompt + "\n### Response:\n", resp.strip(), user


def _mbpp(rec: dict) -> tuple[str, str, str] | str:  # task text + its asserts -> Python solution
    text, code, tests = rec.get("text"), rec.get("code"), rec.get("test_list", [])
    if not isinstance(text, str) or not isinstance(code, str):
        return "missing text/code"
    if not code.strip():
        return "empty response"
    tests = "\n".join(t for t in tests if isinstance(t, str)) if isinstance(tests, list) else ""
    user = f"{text.strip()}\n{tests}".strip()
    return f"### Task:\n{text.strip()}\n{tests}\n\n### Python solution:\n", code.strip(), user


def _prompt_completion(rec: dict) -> tuple[str, str, str] | str:
    """Used verbatim, as prompt/completion datasets are written (the prompt carries its own scaffolding)."""
    p, c = rec.get("prompt"), rec.get("completion")
    if not isinstance(p, str) or not isinstance(c, str):
        return "missing prompt/completion"
    if not c.strip() or not p.strip():
        return "empty prompt" if not p.strip() else "empty response"
    return p, c, p.strip()


def _chat(rec: dict) -> Example | str:
    """`messages`: [{role, content}, ...] ending with the assistant turn the model learns."""
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or len(msgs) < 2:
        return "messages: not a list of at least 2 turns"
    turns = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return "messages: a turn without role (system/user/assistant) and string content"
        turns.append((m["role"], m["content"]))
    if turns[-1][0] != "assistant":
        return "messages: the last turn is not the assistant's"
    if not turns[-1][1].strip():
        return "empty response"
    if not any(r == "user" for r, _ in turns[:-1]):
        return "messages: no user turn"
    head = tuple(turns[:-1])
    return Example("\n".join(f"{r}: {c}" for r, c in head), turns[-1][1], head)


_BUILD = {"gsm8k": lambda r: _qa(r, "question", "answer"), "instruction": _instruction, "mbpp": _mbpp,
          "metamath": lambda r: _qa(r, "query", "response"), "prompt_completion": _prompt_completion}


def to_example(rec: dict, fmt: str, template: str = "plain") -> Example | str:
    """An Example, or the reason the record is unusable. template: plain = the format's prompt text; chat = the
    prompt as one user turn, rendered with the tokenizer's chat template (chat records always are)."""
    if fmt == "chat":
        return _chat(rec)
    if fmt not in _BUILD:
        raise CidersError(f"data.format: unknown format {fmt!r} (use {', '.join(FORMATS)})")
    out = _BUILD[fmt](rec)
    if isinstance(out, str):
        return out
    prompt, response, user = out
    if template == "chat":
        return Example(prompt, response.strip(), (("user", user),))
    return Example(prompt, response)


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


def validate(rows: Sequence[dict], fmt: str, label: str | None, report: DataReport, limit: int | None = None,
             template: str = "plain", keys: tuple[str | None, str | None] = (None, None)) -> Records:
    """Records -> Examples (+ labels); every unusable record is counted by reason in `report`.
    keys: the user's (prompt, response) field names, mapped onto the format's own."""
    ex, labels, raw = [], [], []
    for rec in rows:
        if limit is not None and len(ex) >= limit:
            break
        e = to_example(rename(rec, fmt, *keys), fmt, template)
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


def render_chat(ex: Example, tokenizer: Any) -> tuple[str, str]:
    """(prompt text, response text) of a chat Example through the tokenizer's chat template: the prompt is the
    template up to the assistant's header (add_generation_prompt), the response the rest of the rendered
    conversation, which closes the assistant turn with the template's own end-of-turn text."""
    if not getattr(tokenizer, "chat_template", None):
        raise CidersError("chat records (data.format: chat, or data.template: chat) need a tokenizer with a chat "
                          "template; this model's tokenizer has none: use data.template: plain with a non-chat "
                          "format, or an instruct model")
    turns = [{"role": r, "content": c} for r, c in ex.turns]
    prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": ex.response}], tokenize=False)
    if not full.startswith(prompt):  # templates that rewrite earlier turns (e.g. drop reasoning) cannot be split
        raise CidersError("the tokenizer's chat template does not render the conversation as the prompt followed "
                          "by the response; use data.template: plain")
    return prompt, full[len(prompt):]


def tokenize(examples: Sequence[Example], tokenizer: Any, max_length: int, report: DataReport | None = None) -> list[dict]:
    """Each example -> {input_ids, labels} (lists of ints); labels are IGNORE on prompt tokens.
    Appends EOS so the model learns to stop (chat examples end with the template's end of turn instead). An
    over-long example is truncated and counted: the response keeps what the prompt leaves, but at least a
    quarter of max_length, and the prompt loses its beginning (long contexts such as tables keep their end,
    next to the question and answer)."""
    eos = tokenizer.eos_token_id
    feats = []
    for ex in examples:
        if ex.turns is not None:
            prompt, response = render_chat(ex, tokenizer)
            tail = []
        else:
            prompt, response, tail = ex.prompt, ex.response, [eos] if eos is not None else []
        # Text beyond max_length * TOKEN_CHARS characters is truncated below anyway (every token is shorter), so
        # it is cut before tokenizing: a multi-MiB record costs its cut's tokens, not gigabytes of them.
        cap = max_length * TOKEN_CHARS
        p = tokenizer(prompt[-cap:], add_special_tokens=False)["input_ids"]
        r = tokenizer(response[:cap], add_special_tokens=False)["input_ids"] + tail
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
