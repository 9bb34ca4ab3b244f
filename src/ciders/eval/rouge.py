"""ROUGE-L (longest common subsequence F-measure) via Google's rouge-score package, as the Dolly
evaluations report it; offline (evaluate.load('rouge') needs the hub).

Tokens are stemmed with the Porter stemmer by default (`RougeScorer(["rougeL"], use_stemmer=True)`: "running"
and "run" match), whereas Hugging Face evaluate's rouge defaults to use_stemmer=False, so our figures differ from
scores computed with that default (they agree with `rouge.compute(..., use_stemmer=True)` up to evaluate's bootstrap
aggregation; we report the plain mean over pairs). `stem=False` gives the unstemmed score."""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence


@lru_cache(maxsize=2)
def _scorer(stem: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=stem)


def rouge_l(predictions: Sequence[str], references: Sequence[str], stem: bool = True) -> dict:
    """Mean ROUGE-L precision / recall / F1 over pairs."""
    if len(predictions) != len(references):
        raise ValueError("predictions and references differ in length")
    scores = [_scorer(stem).score(r, p)["rougeL"] for p, r in zip(predictions, references)]
    n = max(len(scores), 1)
    return {"rouge_l": sum(s.fmeasure for s in scores) / n, "precision": sum(s.precision for s in scores) / n,
            "recall": sum(s.recall for s in scores) / n, "pairs": len(scores)}
