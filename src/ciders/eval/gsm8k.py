"""GSM8K exact match (Protocol A; docs/method.md#experiments-and-metrics): greedy generation with a stop rule, the
final number extracted as in the GSM8K convention (`#### answer`, commas stripped; otherwise the last number in the
text), compared numerically."""

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


def exact_match(model: Any, tokenizer: Any, records: Sequence[dict], max_new_tokens: int = 256, batch_size: int = 8,
                progress=None) -> dict:
    """records: {question, answer}. Prompts use the training format `Question: ...\\nAnswer:`."""
    prompts = [f"Question: {r['question'].strip()}\nAnswer:" for r in records]
    outs = generate(model, tokenizer, prompts, max_new_tokens, batch_size, STOPS, progress)
    preds = [extract_answer(o) for o in outs]
    refs = [reference_answer(r["answer"]) for r in records]
    correct = [is_correct(p, r) for p, r in zip(preds, refs)]
    return {"exact_match": sum(correct) / max(len(correct), 1), "correct": sum(correct), "questions": len(correct),
            "unparsed": sum(p is None for p in preds), "samples": [{"prediction": p, "reference": r, "text": o}
                                                                    for p, r, o in list(zip(preds, refs, outs))[:5]]}
