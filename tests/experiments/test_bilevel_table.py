"""experiments.bilevel_table: the Table II / scalability table from per-run summaries (no training here)."""

import json

import pytest

from ciders.experiments.bilevel_table import _rows, render


def summary(acc, up, off=None, cover=1):
    final = {"accuracy": acc, "ci95": 0.02, **({"official_runs_accuracy": off} if off is not None else {})}
    return {"final": final, "op_estimate": up, "seconds": 1.0, "bytes_up": up, "bytes_down": 2 * up,
            "covering_x_min": cover}


def test_mean_and_t_interval_over_seeds_and_ratios_to_fedmbo_at_the_same_point_and_seed():
    pts = [("task.k_shot=1", None), ("task.k_shot=5", None)]
    cells = {}
    for p, _ in pts:
        for s, (a, b) in enumerate([(0.50, 0.60), (0.54, 0.62)]):
            cells[(p, s, "fedmbo")] = summary(b, 100.0 * (s + 1), off=0.3, cover=10)
            cells[(p, s, "rabo")] = summary(a, 25.0 * (s + 1), off=0.2, cover=2 + s)
    rows = {r["method"]: r for r in _rows(cells, pts, ["rabo", "fedmbo"], [0, 1])}
    cell = rows["rabo"]["points"]["task.k_shot=1"]
    assert abs(cell["mean"] - 52.0) < 1e-9 and abs(cell["std"] - 2 ** 0.5 * 2) < 1e-9 and cell["seeds"] == [50.0, 54.0]
    assert abs(cell["ci95"] - 12.706 * 2.0) < 1e-9 and abs(cell["episodes_ci95"] - 2.0) < 1e-9  # t_0.975,1 s / sqrt 2
    assert rows["rabo"]["relative_to_fedmbo"]["bytes_up"] == 0.25 and rows["fedmbo"]["relative_to_fedmbo"]["seconds"] == 1.0
    md = render({"seeds": [0, 1], "points": [p for p, _ in pts], "rows": list(rows.values())})
    assert "| rabo | 52.00 ± 25.41 [sd 2.83] | 52.00 ± 25.41 [sd 2.83] | 2 | 0.250 | 1.000 | 0.250 | 0.250 |" in md
    assert "official 20-way one-shot runs" in md and "| rabo | 20.00 ± 0.00 | 20.00 ± 0.00 |" in md
    json.dumps(rows)  # table.json is plain JSON


def test_rows_per_capacity_from_the_final_sub_models():
    pts = [("default", None)]
    cells = {}
    for s in (0, 1):
        cells[("default", s, "fedmbo")] = summary(0.6, 100.0)
        cells[("default", s, "rabo")] = {**summary(0.5 + 0.02 * s, 30.0),
                                        "final_by_capacity": {"0.5": {"accuracy": 0.4 + 0.02 * s, "ci95": 0.01},
                                                              "0.25": {"accuracy": 0.3, "ci95": 0.01}}}
    rows = _rows(cells, pts, ["rabo", "fedmbo"], [0, 1])
    assert [r["method"] for r in rows] == ["rabo", "rabo (R = 0.5)", "rabo (R = 0.25)", "fedmbo"]
    assert abs(rows[1]["points"]["default"]["mean"] - 41.0) < 1e-9 and rows[2]["points"]["default"]["seeds"] == [30.0, 30.0]
    md = render({"seeds": [0, 1], "points": ["default"], "rows": rows})
    assert "| rabo (R = 0.5) | 41.00 ± 12.71 [sd 1.41] | - | - | - | - | - |" in md and "capacity r" in md


def test_the_final_figure_can_average_the_last_rounds():
    from ciders.experiments.bilevel_table import last_rounds_mean

    evals = [{"event": "eval", "round": -1, "accuracy": 0.2, "ci95": 0.1, "episodes": 4}] + \
        [{"event": "eval", "round": q, "accuracy": a, "ci95": 0.02, "episodes": 4} for q, a in enumerate([0.3, 0.5, 0.4, 0.6])]
    got = last_rounds_mean(evals, 3)
    assert abs(got["accuracy"] - 0.5) < 1e-12 and got["rounds_averaged"] == 3 and got["episodes"] == 4
    assert last_rounds_mean(evals, 1)["accuracy"] == 0.6
    assert last_rounds_mean(evals, 10)["rounds_averaged"] == 4  # the evaluation before round 0 never counts
    import pytest

    with pytest.raises(ValueError, match=">= 1"):
        last_rounds_mean(evals, 0)


def test_paired_contrasts_against_the_sub_model_baselines_and_fedmbo():
    """rabo - mean(static, fedrolex) per seed, per point and averaged over points, with the t-interval; the
    pairing is by seed, so a shift shared by every method at a seed cancels."""
    from ciders.experiments.bilevel_table import contrasts

    pts = ["a", "b"]
    acc = {"rabo": (0.60, 0.80), "static": (0.50, 0.70), "fedrolex": (0.54, 0.66), "fedmbo": (0.62, 0.84)}
    cells = {(p, s, m): summary(v[k] + 0.1 * s + (0.01 * s if m == "rabo" else 0.0), 1.0)
             for m, v in acc.items() for k, p in enumerate(pts) for s in range(3)}
    got = {c["against"]: c for c in contrasts(cells, pts, ["rabo", "static", "fedrolex", "fedmbo"], [0, 1, 2])}
    assert set(got) == {"sub-model baselines (static, fedrolex)", "fedmbo"}
    sub = got["sub-model baselines (static, fedrolex)"]
    assert sub["method"] == "rabo" and sub["points"]["a"]["mean"] == pytest.approx(8.0 + 1.0)  # 60 - 52, + 1 s
    assert sub["points"]["b"]["mean"] == pytest.approx(12.0 + 1.0)
    assert sub["mean_over_points"]["mean"] == pytest.approx(11.0) and sub["mean_over_points"]["std"] == pytest.approx(1.0)
    assert sub["mean_over_points"]["ci95"] == pytest.approx(4.303 / 3 ** 0.5)  # the shared 0.1 s shift cancels
    assert got["fedmbo"]["points"]["a"]["mean"] == pytest.approx(-2.0 + 1.0)
    md = render({"seeds": [0, 1, 2], "points": pts, "rows": _rows(cells, [(p, None) for p in pts],
                 ["rabo", "static", "fedrolex", "fedmbo"], [0, 1, 2]), "contrasts": list(got.values())})
    assert "| rabo | sub-model baselines (static, fedrolex) | +9.00 ± 2.48* | +13.00 ± 2.48* | +11.00 ± 2.48* |" in md
    assert "| rabo | fedmbo | -1.00 ± 2.48 | -3.00 ± 2.48* | -2.00 ± 2.48 |" in md


def test_an_untrained_row_first_from_the_initial_evaluation():
    """Issue 33, point 1: the initial model's metric heads the table (one row: every method starts from the
    same weights at a seed); methods that start apart get a row each; older runs without it, no row."""
    from ciders.experiments.bilevel_table import UNTRAINED, untrained_rows

    pts = [("default", None)]
    cells = {}
    for s, a0 in enumerate([0.40, 0.44]):
        for m, a in (("rabo", 0.6), ("fedmbo", 0.7)):
            cells[("default", s, m)] = {**summary(a, 1.0), "initial": {"event": "eval", "round": -1, "accuracy": a0,
                                                                        "ci95": 0.01}}
    rows = untrained_rows(cells, pts, ["rabo", "fedmbo"], [0, 1]) + _rows(cells, pts, ["rabo", "fedmbo"], [0, 1])
    assert [r["method"] for r in rows] == [UNTRAINED, "rabo", "fedmbo"]
    assert rows[0]["points"]["default"]["seeds"] == pytest.approx([40.0, 44.0])
    md = render({"seeds": [0, 1], "points": ["default"], "rows": rows})
    assert f"| {UNTRAINED} | 42.00 ± 25.41 [sd 2.83] | - | - | - | - | - |" in md and "what training added" in md
    cells[("default", 1, "fedmbo")]["initial"] = {"accuracy": 0.2, "ci95": 0.0}
    assert [r["method"] for r in untrained_rows(cells, pts, ["rabo", "fedmbo"], [0, 1])] == \
        [f"rabo, {UNTRAINED}", f"fedmbo, {UNTRAINED}"]
    cells[("default", 1, "fedmbo")]["initial"] = None
    assert untrained_rows(cells, pts, ["rabo", "fedmbo"], [0, 1]) == []


def test_the_tuned_table_heads_with_the_untrained_model():
    from ciders.experiments.bilevel_tune import render as render_tune, untrained

    u = untrained({"rabo": [30.0, 34.0], "fedmbo": [30.0, 34.0]})
    assert u["mean"] == pytest.approx(32.0) and u["seeds"] == [30.0, 34.0]
    assert untrained({"rabo": [30.0, 34.0], "fedmbo": [30.0, 35.0]}) is None
    assert untrained({"rabo": [30.0, None]}) is None
    row = {"method": "rabo", "budget": 2, "chosen": "p", "tune_best": 50.0,
           "test": {"mean": 50.0, "std": 1.0, "ci95": 9.0}, "costs": []}
    md = render_tune({"seeds": [0, 1], "tuning_seed": 0, "last_rounds": 1, "rows": [row], "untrained": u})
    lines = md.splitlines()
    assert lines.index("| untrained (round 0) | - | - | - | 32.00 ± 25.41 [sd 2.83] | - | - | - | - |") < \
        next(i for i, ln in enumerate(lines) if ln.startswith("| rabo |"))


def test_the_initial_model_is_evaluated_whatever_eval_rounds_says():
    from ciders.config.bilevel import BilevelExperiment

    fed = BilevelExperiment().federation
    from dataclasses import replace

    fed = replace(fed, rounds=10, eval_rounds=2)
    assert [q for q in range(-1, 10) if fed.evaluates(q)] == [-1, 8, 9]
