"""GSM8K exact match (Protocol A; docs/method.md#experiments-and-metrics): greedy generation with a stop rule, the
final number extracted as in the GSM8K convention (`#### answer`, commas stripped; otherwise the last number in the
text), compared numerically.

Beside this lenient scorer (`extract_answer` / `is_correct`, reported as `exact_match`), the same completions are
scored in lm-evaluation-harness's two gsm8k conventions, as its `gsm8k.yaml` defines them: `strict_match` (the
"strict-match" filter: the first `#### number`, else invalid) and `flexible_extract` (the "flexible-extract" filter:
the last number-like run in the text), each compared as a string after the task's exact_match normalization (delete
",", "$", everything up to the last "#### " and one final "."; lower case) applied to both sides. Only the scoring is
theirs: the prompt here is zero-shot and the stop strings are ours, not the harness's 5-shot prompt."""

from __future__ import annotations

import re
from typing import Any, Sequence

from ciders.eval.generate import generate

_NUM = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
STOPS = ("\nQuestion:", "\n\n\n")


def _to_float(tok: str) -> float | None:
    try:
        return float(tok.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The number after `####` if present, else the last number in the text."""
    if "####" in text:
        m = _NUM.search(text.split("####", 1)[1])
        if m:
            return _to_float(m.group())
    nums = _NUM.findall(text)
    return _to_float(nums[-1]) if nums else None


def reference_answer(answer: str) -> float:
    """The reference's own final answer: the text after '####', commas stripped."""
    return float(answer.split("####")[-1].strip().replace(",", ""))


def is_correct(prediction: float | None, reference: float) -> bool:
    return prediction is not None and abs(prediction - reference) <= 1e-6 * max(1.0, abs(reference))


# lm-evaluation-harness lm_eval/tasks/gsm8k/gsm8k.yaml: metric exact_match (ignore_case: true, ignore_punctuation:
# false, regexes_to_ignore in this order) and the two filters, each regex -> take_first.
LM_EVAL_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # group_select 0: the first match
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # group_select -1: the last match
INVALID = "[invalid]"  # the regex filter's fallback when nothing matches


def _regex_filter(pattern: re.Pattern, text: str, group_select: int) -> str:
    """lm-eval's `regex` filter on one response: findall, pick a match, of a tuple the first non-empty group."""
    matches = pattern.findall(text)
    if not matches:
        return INVALID
    m = matches[group_select]
    if isinstance(m, tuple):
        m = next((g for g in m if g), INVALID)
    return m.strip()


def lm_eval_normalize(text: str) -> str:
    """lm-eval's exact_match preprocessing for gsm8k: each regex of LM_EVAL_IGNORE deleted in turn, then lower case."""
    for rx in LM_EVAL_IGNORE:
        text = re.sub(rx, "", text)
    return text.lower()


def strict_answer(completion: str) -> str:
    """The "strict-match" filter's output: the number of the first `#### N`, else "[invalid]"."""
    return _regex_filter(STRICT_RE, completion, 0)


def flexible_answer(completion: str) -> str:
    """The "flexible-extract" filter's output: the last number-like run (digits, "$", ".", ","), else "[invalid]"."""
    return _regex_filter(FLEXIBLE_RE, completion, -1)


def strict_match(completion: str, answer: str) -> bool:
    """lm-eval gsm8k exact_match under "strict-match"; `answer` is the dataset's full answer field."""
    return lm_eval_normalize(strict_answer(completion)) == lm_eval_normalize(answer)


def flexible_extract(completion: str, answer: str) -> bool:
    """lm-eval gsm8k exact_match under "flexible-extract"; `answer` is the dataset's full answer field."""
    return lm_eval_normalize(flexible_answer(completion)) == lm_eval_normalize(answer)


def exact_match(model: Any, tokenizer: Any, records: Sequence[dict], max_new_tokens: int = 256, batch_size: int = 8,
                progress=None) -> dict:
    """records: {question, answer}. Prompts use the training format `Question: ...\\nAnswer:`."""
    prompts = [f"Question: {r['question'].strip()}\nAnswer:" for r in records]
    outs = generate(model, tokenizer, prompts, max_new_tokens, batch_size, STOPS, progress)
    preds = [extract_answer(o) for o in outs]
    refs = [reference_answer(r["answer"]) for r in records]
    correct = [is_correct(p, r) for p, r in zip(preds, refs)]
    strict = [strict_match(o, r["answer"]) for o, r in zip(outs, records)]
    flexible = [flexible_extract(o, r["answer"]) for o, r in zip(outs, records)]
    n = max(len(correct), 1)
    return {"exact_match": sum(correct) / n, "correct": sum(correct), "questions": len(correct),
            "strict_match": sum(strict) / n, "strict_correct": sum(strict),
            "flexible_extract": sum(flexible) / n, "flexible_correct": sum(flexible),
            "unparsed": sum(p is None for p in preds), "samples": [{"prediction": p, "reference": r, "text": o}
                                                                    for p, r, o in list(zip(preds, refs, outs))[:5]]}
