"""`tables.pairwise`: paired differences over seeds and whether a gap exceeds the seed spread."""

import pytest

from ciders.report import tables


def seeds(*vals):
    return {s: {"nll": v} for s, v in enumerate(vals)}


def test_a_consistent_gap_larger_than_both_spreads_exceeds():
    rows = tables.pairwise({"a": seeds(1.0, 1.1, 0.9), "b": seeds(1.5, 1.7, 1.4)}, "nll")
    (r,) = rows
    assert (r["a"], r["b"], r["n"], r["better"], r["exceeds"]) == ("a", "b", 3, "a", True)  # lower NLL is better
    assert r["diff_mean"] == pytest.approx((-0.5 - 0.6 - 0.5) / 3)
    assert r["std_a"] == pytest.approx(0.1) and r["std_b"] == pytest.approx(0.152753, rel=1e-5)


def test_a_gap_inside_the_spread_or_with_mixed_signs_does_not():
    inside = tables.pairwise({"a": seeds(1.0, 1.4, 0.6), "b": seeds(1.1, 1.5, 0.7)}, "nll")[0]
    assert inside["better"] == "a" and not inside["exceeds"]  # same sign every seed, but 0.1 < std 0.4
    mixed = tables.pairwise({"a": seeds(1.0, 2.0, 1.0), "b": seeds(1.9, 1.0, 1.9)}, "nll")[0]
    assert abs(mixed["diff_mean"]) < max(mixed["std_a"], mixed["std_b"]) and not mixed["exceeds"]
    flipped = tables.pairwise({"a": seeds(1.0, 1.0, 1.0, 1.0), "b": seeds(2.0, 2.0, 2.0, 0.9)}, "nll")[0]
    assert abs(flipped["diff_mean"]) > max(flipped["std_a"], flipped["std_b"]) and not flipped["exceeds"]  # seed 3
    higher = tables.pairwise({"a": {0: {"gsm8k": 0.2}, 1: {"gsm8k": 0.3}}, "b": {0: {"gsm8k": 0.5}, 1: {"gsm8k": 0.6}}},
                             "gsm8k")[0]
    assert higher["better"] == "b" and higher["exceeds"]  # higher accuracy is better


def test_only_shared_seeds_are_paired_and_markdown_renders():
    rows = tables.pairwise({"a": seeds(1.0, 1.1, 5.0), "b": {0: {"nll": 2.0}, 1: {"nll": 2.2}}}, "nll")
    assert rows[0]["n"] == 2 and rows[0]["diff_mean"] == pytest.approx(-1.05)
    md = tables.pairwise_markdown(rows, "nll")
    assert "| a | b | -1.0500 ± 0.0707 |" in md and md.rstrip().endswith("| a | yes |")


def test_against_the_control_marks_every_method_that_does_not_beat_it():
    per_seed = {
        "good": {s: {"nll": v, "agreement": a} for s, (v, a) in enumerate([(1.0, 0.6), (1.1, 0.62), (0.9, 0.61)])},
        "worse": {s: {"nll": v} for s, v in enumerate([2.0, 2.2, 2.1])},  # beyond the spread, the wrong way
        "tied": {s: {"nll": v} for s, v in enumerate([1.45, 1.72, 1.35])},  # inside the spread
        "takd-only": {s: {"nll": v, "agreement": a} for s, (v, a) in enumerate([(1.5, 0.5), (1.7, 0.52), (1.4, 0.5)])},
    }
    vs = tables.against_control(per_seed, "takd-only")
    assert {r["a"]: r["beats"] for r in vs["nll"]} == {"good": True, "worse": False, "tied": False}
    assert all(r["b"] == "takd-only" for rows in vs.values() for r in rows)
    assert {r["a"]: r["beats"] for r in vs["agreement"]} == {"good": True}  # higher agreement is better
    marks = tables.control_marks(vs)
    assert marks == {("worse", "nll"), ("tied", "nll")}
    agg = tables.aggregate(per_seed)
    md = tables.markdown(agg, seeds=[0, 1, 2], control="takd-only", marks=marks)
    assert "| takd-only (control) |" in md and "does not beat the takd-only control" in md
    row = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "†" in row["worse"] and "†" in row["tied"] and "†" not in row["good"] and "†" not in row["takd-only (control)"]
    one_seed = tables.against_control({m: {0: v[0]} for m, v in per_seed.items()}, "takd-only")
    assert not any(r["beats"] for rows in one_seed.values() for r in rows)  # one seed can show nothing
