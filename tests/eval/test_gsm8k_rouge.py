import json

import pytest

from ciders.eval.gsm8k import extract_answer, is_correct, reference_answer
from ciders.eval.rouge import rouge_l
from helpers import shared


def test_every_gsm8k_test_reference_parses_to_its_own_answer():
    path = shared("gsm8k", "test.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 1319
    for r in recs:
        ref = reference_answer(r["answer"])
        assert is_correct(extract_answer(r["answer"]), ref), r["answer"][-40:]


@pytest.mark.parametrize("text, value", [
    ("She pays 3 * 4 = 12 dollars.\n#### 12", 12.0),
    ("#### 1,234", 1234.0),
    ("#### -5", -5.0),
    ("So the total is $18.", 18.0),
    ("It costs 3.50 dollars, so 7 in total", 7.0),
    ("The answer is 2,000,000.", 2000000.0),
    ("no number here", None),
])
def test_extraction_from_model_text(text, value):
    assert extract_answer(text) == value


def test_numeric_comparison():
    assert is_correct(18.0, 18) and is_correct(1e9 + 1e-3, 1e9) and not is_correct(17.5, 18) and not is_correct(None, 1)


def test_rouge_l_matches_the_lcs_by_hand():
    # LCS("the cat sat on the mat", "the cat on the mat") = 5 tokens: P = 5/5 (prediction), R = 5/6
    r = rouge_l(["the cat on the mat"], ["the cat sat on the mat"], stem=False)
    assert r["precision"] == pytest.approx(1.0) and r["recall"] == pytest.approx(5 / 6)
    assert r["rouge_l"] == pytest.approx(2 * (5 / 6) / (1 + 5 / 6))
    assert rouge_l(["completely different words"], ["the cat sat"], stem=False)["rouge_l"] == 0.0
    from rouge_score import rouge_scorer

    ref = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score("Cats are running home", "the cat runs home")
    assert rouge_l(["the cat runs home"], ["Cats are running home"])["rouge_l"] == pytest.approx(ref["rougeL"].fmeasure)
