"""`ciders bilevel CONFIG --methods ... --tune KEY=v1,v2 [--tune ...] --seeds 0,1,2 --last-rounds K`: every method's
step sizes tuned on the task's tuning split with the same budget, then the chosen setting run over the seeds and
reported on the test split (docs/rabo.md#fair-step-size-tuning).

  1. Each method is tuned over the `--tune` keys it reads: `rabo.*` for RABO / RAFBO / FedMBO, `fedmeta.*` for
     the baselines with their own local step (the full-model and the single-level sub-model ones). Its budget is the number of grid points; methods with
     different budgets are reported as such (the table shows each budget).
  2. Every grid point runs once, at the config's seed. Its score is the tuning-split metric, averaged over the last
     K rounds: loss tuning's `tune_balanced_accuracy` (`task.tune_per_class` images per class, disjoint from
     validation and test), few-shot's `tune_accuracy` (episodes of `task.tune_alphabets`, training alphabets held
     out of training). The best point wins; ties go to the first point in grid order.
  3. The winner runs at every seed of `--seeds`. The final figure is the test metric averaged over the last K
     rounds, the mean over the seeds with its 95% t-interval; paired contrasts (same seed) against untuned FedAvg
     and FedMBO, and compute and bytes relative to FedMBO. A seed equal to the tuning seed reuses the tuning run.

Layout: OUT/tune/<method>/<point>/<method>/ and OUT/final/seed<s>/<method>/ (`run_bilevel` directories, reused
when finished with the same config); OUT/tune.md and OUT/tune.json.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ciders.errors import ConfigError
from ciders.eval.stats import mean_ci95
from ciders.experiments.bilevel import UNTRAINED
from ciders.experiments.bilevel_table import COST_KEYS, signed
from ciders.fileio import read_jsonl, write_json, write_text

# (tuning-split metric, test metric) of each task kind, both in [0, 1], higher is better
METRICS = {"losstune": ("tune_balanced_accuracy", "balanced_accuracy"), "fewshot": ("tune_accuracy", "accuracy")}


def step_section(method: str) -> str:
    """The config section holding `method`'s step sizes: fedmeta for a baseline with its own local step, rabo
    otherwise."""
    from ciders.algorithms.registry import get

    return "fedmeta" if get(method, "bilevel").local_update is not None else "rabo"


def method_grid(method: str, tune: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The `--tune` keys `method` reads (those of its `step_section`)."""
    return [(k, v) for k, v in tune if k.split(".", 1)[0] == step_section(method)]


def _score(run: Path, key: str, last: int) -> float:
    from ciders.experiments.bilevel_table import last_rounds_mean

    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "eval"]
    got = last_rounds_mean(evals, last)
    if key not in got:
        raise ConfigError(f"{run}: its evaluations have no {key!r}; set task.tune_per_class > 0 (loss tuning) or "
                          "task.tune_alphabets (few-shot)")
    return float(got[key])


def _run(cfg, d: Path, method: str, log, engine: str) -> Path:
    from ciders.config import dump_yaml
    from ciders.experiments.bilevel import run_experiment
    from ciders.experiments.bilevel_table import _done

    if not _done(d / method, dump_yaml(cfg)):
        run_experiment(cfg, d, [method], log=log, engine=engine, resume=True)
    return d / method


def run_tuned(exp, methods: list[str], seeds: list[int], tune: list[tuple[str, list[str]]], out: str | Path,
              last: int = 1, engine: str = "local", log: Callable[[str], None] = print) -> dict:
    from ciders.algorithms.registry import bilevel_config
    from ciders.config.bilevel import BilevelExperiment
    from ciders.experiments.bilevel_table import check_last
    from ciders.experiments.sweep import points

    if (exp.task.tune_per_class < 1) if exp.task.kind == "losstune" else not exp.task.tune_alphabets:
        raise ConfigError("--tune needs a tuning split: task.tune_per_class >= 1 (loss tuning) or "
                          "task.tune_alphabets (few-shot, e.g. --set \"task.tune_alphabets=[Early_Aramaic]\")")
    tune_key, test_key = METRICS[exp.task.kind]
    check_last(last)
    out = Path(out)
    grids = {m: method_grid(m, tune) for m in methods}
    for m, g in grids.items():
        if not g:
            raise ConfigError(f"{m}: none of the --tune keys is a step size it reads (give {step_section(m)}.* keys)")
    pts = {m: [(name, bilevel_config(c, m)) for name, c in points(exp, g, cls=BilevelExperiment)]
           for m, g in grids.items()}  # every point must be a valid config before anything runs
    rows, initial = [], {}
    for m in methods:
        scores = []
        for k, (name, c) in enumerate(pts[m]):
            log(f"== tune {m} point {k + 1}/{len(pts[m])}: {name}")
            scores.append(_score(_run(c, out / "tune" / m / name, m, log, engine), tune_key, last))
        best = max(range(len(scores)), key=lambda j: (scores[j], -j))
        name, chosen = pts[m][best]
        finals, costs = [], []
        for s in seeds:
            d = out / "tune" / m / name if s == exp.seed else out / "final" / f"seed{s}"
            log(f"== final {m} ({name}) seed {s}")
            d = _run(replace(chosen, seed=s), d, m, log, engine)
            finals.append(100 * _score(d, test_key, last))
            costs.append(_costs(d))
            initial.setdefault(m, []).append(_initial(d, test_key))
        rows.append({"method": m, "budget": len(scores), "chosen": name, "tune_scores": dict(
            zip((n for n, _ in pts[m]), (100 * v for v in scores))), "tune_best": 100 * scores[best],
            "test": {**mean_ci95(finals), "seeds": finals}, "costs": costs})
    result = {"seeds": seeds, "tuning_seed": exp.seed, "last_rounds": last, "tune": tune, "rows": rows,
              "metric": test_key,
              "untrained": untrained(initial),
              "contrasts": contrasts(rows), "relative_to_fedmbo": relative_costs(rows)}
    write_json(out / "tune.json", result)
    write_text(out / "tune.md", render(result))
    return result


def _initial(run: Path, key: str) -> float | None:
    """The test metric of the initial (untrained) model in % (round -1), None in a run made before it was recorded."""
    from ciders.experiments.bilevel import initial_eval

    ev = initial_eval(read_jsonl(run / "metrics.jsonl"))
    return None if ev is None or key not in ev else 100 * float(ev[key])


def untrained(initial: dict[str, list[float | None]]) -> dict | None:
    """The untrained model's test metric over the seeds (mean ± 95% t-interval), when every method's run at a seed
    starts from the same weights (they do in this family); None when a run lacks it or the methods disagree."""
    vals = list(initial.values())
    if not vals or any(v is None for vs in vals for v in vs) or any(vs != vals[0] for vs in vals):
        return None
    return {**mean_ci95(vals[0]), "seeds": vals[0]}


def _costs(run: Path) -> dict:
    import json

    summary = json.loads((run / "summary.json").read_text())
    return {k: float(summary[k]) for k in COST_KEYS}


def contrasts(rows: list[dict]) -> list[dict]:
    """Each method's test accuracy minus untuned FedAvg's and FedMBO's at the same seed (the same data,
    clients and initial weights), mean ± 95% t-interval over the seeds."""
    by = {r["method"]: r["test"]["seeds"] for r in rows}
    return [{"method": m, "against": b, **mean_ci95([x - y for x, y in zip(by[m], by[b])])}
            for b in ("fedavg-notune", "fedmbo") if b in by for m in by if m != b]


def relative_costs(rows: list[dict]) -> dict:
    """{method: {cost: mean over seeds of method / FedMBO at the same seed}} (empty without FedMBO)."""
    ref = next((r["costs"] for r in rows if r["method"] == "fedmbo"), None)
    if ref is None:
        return {}
    return {r["method"]: {k: statistics.fmean(c[k] / f[k] for c, f in zip(r["costs"], ref)) if all(f[k] for f in ref)
                          else None for k in COST_KEYS} for r in rows}


def render(result: dict) -> str:
    last = result["last_rounds"]
    rel = result.get("relative_to_fedmbo") or {}
    what = "balanced test accuracy" if result.get("metric", "balanced_accuracy") == "balanced_accuracy" else \
        "test accuracy (held-out alphabets' episodes)"
    lines = [f"Step sizes tuned on the tuning split (seed {result['tuning_seed']}), then {what} in % "
             f"(mean of the last {last} rounds' evaluations; mean over seeds {', '.join(map(str, result['seeds']))} "
             "± the 95% t-interval half-width, [sd]). Costs: mean over seeds of method / FedMBO.", "",
             "| method | budget (grid points) | chosen | tuning-split accuracy | test accuracy | op estimate | seconds "
             "| uplink | downlink |", "|---" * 9 + "|"]
    u = result.get("untrained")
    if u:  # the initial model: what training added is read against it
        lines.append(f"| {UNTRAINED} | - | - | - | {u['mean']:.2f} ± {u.get('ci95', 0.0):.2f} [sd {u['std']:.2f}] "
                     "| - | - | - | - |")
    for r in result["rows"]:
        t = r["test"]
        c = [f"{v:.3f}" if v is not None else "-" for v in rel.get(r["method"], {}).values()] or ["-"] * 4
        lines.append(f"| {r['method']} | {r['budget']} | {r['chosen']} | {r['tune_best']:.2f} | "
                     f"{t['mean']:.2f} ± {t.get('ci95', 0.0):.2f} [sd {t['std']:.2f}] | " + " | ".join(c) + " |")
    if result.get("contrasts"):
        lines += ["", "Paired differences in points of % (same seed), mean ± 95% t-interval; * = excludes 0:", "",
                  "| method | minus | difference |", "|---|---|---|"]
        for d in result["contrasts"]:
            lines.append(f"| {d['method']} | {d['against']} | {signed(d)} |")
    budgets = {r["budget"] for r in result["rows"]}
    if len(budgets) > 1:
        each = ", ".join(f"{r['method']} {r['budget']}" for r in result["rows"])
        lines += ["", f"**Unequal budgets** ({each}): the comparison favours the methods with more grid points."]
    return "\n".join(lines) + "\n"
