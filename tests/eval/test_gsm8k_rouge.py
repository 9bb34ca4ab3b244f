import json

import pytest

from ciders.eval.gsm8k import (extract_answer, flexible_answer, flexible_extract, is_correct, lm_eval_normalize,
                               reference_answer, strict_answer, strict_match)
from ciders.eval.rouge import rouge_l
from helpers import shared


@pytest.mark.full_data
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


def _ours(completion, answer):
    return is_correct(extract_answer(completion), reference_answer(answer))


# (completion, dataset answer field, ours, lm-eval strict-match, lm-eval flexible-extract), each worked out by hand:
# strict = the first "#### (-?[0-9.,]+)", flexible = the last "(-?[$0-9.,]{2,})|(-?[0-9]+)" match; both sides then
# lose ",", "$", everything through the last "#### " and a final ".", and are lower-cased before an exact string
# comparison (the reference "... #### 50" becomes "50").
DISAGREE = [
    # no "####": strict invalid; flexible "50.0" != "50" as strings; ours 50.0 == 50 numerically
    ("The answer is 50.0", "5 * 10 = <<5*10=50>>50\n#### 50", True, False, False),
    # commas: strict "1,234" -> "1234"; flexible's last match "1,234" -> "1234"
    ("#### 1,234", "1000 + 234 = <<1000+234=1234>>1,234\n#### 1,234", True, True, True),
    # a comma only in the reference: equal once "," is deleted on both sides
    ("#### 1234", "1000 + 234 = <<1000+234=1234>>1,234\n#### 1,234", True, True, True),
    # strict takes the first "#### 5." -> "5"; flexible's last match is "7"; ours reads the number after "####"
    ("#### 5. Then 7", "#### 5", True, True, False),
    # two markers: strict and ours take the first (5); flexible the last number (7)
    ("#### 5\n#### 7", "#### 5", True, True, False),
    # no "####": flexible "$18." -> "18"; ours parses "$18"
    ("So the total is $18.", "9 * 2 = $<<9*2=18>>18\n#### 18", True, False, True),
    # "$" right after "#### " does not fit strict's [0-9.,-]; flexible "$18" -> "18"
    ("#### $18", "#### 18", True, False, True),
    # "####5" without the space: strict needs "#### "; flexible's only match is "5" (group 2)
    ("####5", "#### 5", True, False, True),
    # a trailing ellipsis is flexible's last match: "..." -> ".." != "12"
    ("The answer is 12. Let me double-check...", "#### 12", True, False, False),
    # ours equal numerically; strict "50.00" and flexible "50.00" keep their zeros ("\.$" removes only a final ".")
    ("#### 50.00", "#### 50", True, False, False),
    # ours takes the first number after the first "####" (3); strict needs a number after "#### "; flexible: last 8
    ("#### eight, i.e. 3 + 5 = 8", "#### 8", False, False, True),
    # ours reads after the first "####" (2); strict skips "#### m" and matches "#### 7"; flexible: last "7"
    ("The #### marker comes last: 2 + 5 = 7\n#### 7", "#### 7", False, True, True),
    # negative numbers: strict "-5"; flexible "-5" (group 1, two characters)
    ("It drops by 5, so -5\n#### -5", "#### -5", True, True, True),
    # nothing numeric: all three fail (the harness's fallback "[invalid]")
    ("no number here", "#### 3", False, False, False),
]


@pytest.mark.parametrize("completion, answer, ours, strict, flexible", DISAGREE)
def test_three_gsm8k_conventions_by_hand(completion, answer, ours, strict, flexible):
    assert (_ours(completion, answer), strict_match(completion, answer), flexible_extract(completion, answer)) == \
        (ours, strict, flexible)


def test_lm_eval_filters_and_normalization():
    assert strict_answer("#### 5. Then 7") == "5." and flexible_answer("#### 5. Then 7") == "7"
    assert strict_answer("So 18.") == "[invalid]" and flexible_answer("no digits") == "[invalid]"
    assert flexible_answer("she paid $1,234.50.") == "$1,234.50."
    assert flexible_answer("paid $1,234.50 in all") == "$1,234.50"
    # the ignore regexes in the task's order, then lower case: "," and "$" go before "(?s).*#### " (so a "$" before
    # the marker does not matter), and one final "." goes last
    assert lm_eval_normalize("Cost: $5\nThen\n#### $1,234.") == "1234"
    assert lm_eval_normalize("#### ABC.") == "abc"
    assert lm_eval_normalize("[INVALID]") == "[invalid]"


@pytest.mark.full_data
def test_gsm8k_test_set_in_all_three_conventions():
    recs = [json.loads(line) for line in shared("gsm8k", "test.jsonl").read_text().splitlines()]
    assert len(recs) == 1319
    for r in recs:  # the gold solution itself as the completion scores 1 in every convention
        a = r["answer"]
        assert _ours(a, a) and strict_match(a, a) and flexible_extract(a, a), a[-60:]
    # 14 gold answers carry commas ("#### 2,125"); a completion without them still matches the reference
    commas = [r["answer"] for r in recs if "," in r["answer"].split("####")[-1]]
    assert len(commas) == 14
    for a in commas:
        head, num = a.rsplit("#### ", 1)
        plain = f"{head}#### {num.replace(',', '')}"
        assert _ours(plain, a) and strict_match(plain, a) and flexible_extract(plain, a), a[-60:]
    # the reasoning without its "#### N" line: strict never matches
    assert not any(strict_match(r["answer"].rsplit("\n####", 1)[0], r["answer"]) for r in recs)
    # record 0 ends "... = $<<9*2=18>>18 every day at the farmer's market.": ours 18, flexible "18"
    # record 2 ends "... =$<<200000-130000=70000>>70,000" (gold "#### 70000"): ours 70000, flexible "70,000" -> "70000"
    for i, gold in ((0, "18"), (2, "70000")):
        a = recs[i]["answer"]
        assert a.endswith(f"#### {gold}")
        reasoning = a.rsplit("\n####", 1)[0]
        assert _ours(reasoning, a) and flexible_extract(reasoning, a) and not strict_match(reasoning, a)
    # the model writing the comma the reference lacks ("#### 70,000" for "#### 70000")
    a = recs[2]["answer"]
    assert strict_match("#### 70,000", a) and flexible_extract("#### 70,000", a) and _ours("#### 70,000", a)


def test_exact_match_records_all_three_over_the_same_questions(monkeypatch):
    import ciders.eval.gsm8k as g
    from ciders.report.tables import metrics_of

    rows = DISAGREE[:4]  # ours 4/4, strict 3/4, flexible 2/4
    monkeypatch.setattr(g, "generate", lambda model, tok, prompts, *a, **k: [c for c, *_ in rows][:len(prompts)])
    out = g.exact_match(None, None, [{"question": "q", "answer": a} for _, a, *_ in rows])
    assert out["questions"] == 4 and (out["correct"], out["strict_correct"], out["flexible_correct"]) == (4, 3, 2)
    assert (out["exact_match"], out["strict_match"], out["flexible_extract"]) == (1.0, 0.75, 0.5)
    m = metrics_of({"gsm8k": out})
    assert (m["gsm8k"], m["gsm8k_strict_match"], m["gsm8k_flexible_extract"]) == (1.0, 0.75, 0.5)


def test_rouge_l_matches_the_lcs_by_hand():
    # LCS("the cat sat on the mat", "the cat on the mat") = 5 tokens: P = 5/5 (prediction), R = 5/6
    r = rouge_l(["the cat on the mat"], ["the cat sat on the mat"], stem=False)
    assert r["precision"] == pytest.approx(1.0) and r["recall"] == pytest.approx(5 / 6)
    assert r["rouge_l"] == pytest.approx(2 * (5 / 6) / (1 + 5 / 6))
    assert rouge_l(["completely different words"], ["the cat sat"], stem=False)["rouge_l"] == 0.0
    from rouge_score import rouge_scorer

    ref = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score("Cats are running home", "the cat runs home")
    assert rouge_l(["the cat runs home"], ["Cats are running home"])["rouge_l"] == pytest.approx(ref["rougeL"].fmeasure)


def test_rouge_l_uses_the_porter_stemmer_by_default():
    # Porter: "running" -> "run", "cats" -> "cat"; Hugging Face evaluate's rouge defaults to use_stemmer=False
    assert rouge_l(["run"], ["running"])["rouge_l"] == pytest.approx(1.0)
    assert rouge_l(["the cat runs"], ["the cats running"])["rouge_l"] == pytest.approx(1.0)
    assert rouge_l(["run"], ["running"], stem=False)["rouge_l"] == 0.0
