"""`ciders bilevel CONFIG --methods ... --seeds 0,1,2 --grid task.n_way=5,20 --grid task.k_shot=1,5`: every
method at every grid point and seed, and one table in the shape of the RABO paper's Table II (methods x
settings, final accuracy as the mean over seeds with its 95% t-interval) or of its scalability table (`--grid
federation.clients=10,20,30,50`), with compute and communication relative to FedMBO at the same point and
seed (the mean of those ratios over seeds), and paired contrasts of RABO / RAFBO against the sub-model
baselines and the full-model methods (`contrasts`).

Layout: OUT/<point>/seed<s>/<method>/ (one `run_bilevel` directory each). A finished run whose config is
unchanged is reused, so an interrupted table resumes where it stopped. OUT/table.md and OUT/table.json.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ciders.eval.stats import mean_ci95
from ciders.experiments.bilevel import UNTRAINED, initial_eval
from ciders.fileio import read_jsonl, write_json, write_text

COST_KEYS = ("op_estimate", "seconds", "bytes_up", "bytes_down")  # a run summary's costs, reported over FedMBO's

def _metric(final: dict) -> tuple[float, float]:
    """(value in %, its 95% CI half width over test episodes or 0)."""
    if "accuracy" in final:
        return 100 * final["accuracy"], 100 * final.get("ci95", 0.0)
    return 100 * final["balanced_accuracy"], 0.0


def check_last(last) -> None:
    """--last-rounds must be an integer >= 1 (a ConfigError naming the flag)."""
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        from ciders.errors import ConfigError

        raise ConfigError(f"--last-rounds: must be an integer >= 1, got {last!r}")


def _point(vals: list[tuple[float, float]]) -> dict:
    """One table cell from per-seed (value, CI half width over test episodes) pairs: mean, sample std, the 95%
    t-interval half-width over seeds (`ci95`), the mean episode CI (`episodes_ci95`), the values."""
    return {**mean_ci95([v for v, _ in vals]), "episodes_ci95": statistics.fmean(c for _, c in vals),
            "seeds": [v for v, _ in vals]}


def last_rounds_mean(evals: list[dict], k: int) -> dict:
    """The mean of each numeric metric over the last k evaluations (accuracy oscillates round to round, so one
    round's value is a noisy final figure); k = 1 is the last evaluation as it is."""
    if k < 1:
        raise ValueError(f"last rounds must be >= 1, got {k}")
    tail = [e for e in evals if e.get("round", 0) >= 0][-k:]
    if not tail:
        raise ValueError("no evaluation after a round to average")
    keys = [key for key, v in tail[-1].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and key not in ("round", "episodes", "test_examples") and all(key in e for e in tail)]
    out = {key: statistics.fmean(float(e[key]) for e in tail) for key in keys}
    return {**{key: v for key, v in tail[-1].items() if key not in out}, **out, "rounds_averaged": len(tail)}


def run_table(exp, methods: list[str], seeds: list[int], grid: list[tuple[str, list[str]]], out: str | Path,
              engine: str = "local", log: Callable[[str], None] = print, last: int = 1) -> dict:
    from ciders.config import dump_yaml
    from ciders.config.bilevel import BilevelExperiment
    from ciders.experiments.bilevel import run_experiment
    from ciders.algorithms.registry import bilevel_config
    from ciders.experiments.sweep import points

    check_last(last)
    if 0 < exp.federation.eval_rounds < last:
        from ciders.errors import ConfigError

        raise ConfigError(f"--last-rounds {last} averages more rounds than are evaluated: set federation.eval_rounds "
                          f">= {last} (or 0, every round)")
    out = Path(out)
    pts = points(exp, grid, cls=BilevelExperiment) if grid else [("default", exp)]
    for _, c in pts:  # every method must fit every point before anything runs
        for m in methods:
            bilevel_config(c, m)
    cells: dict = {}
    for k, (name, c) in enumerate(pts):
        for seed in seeds:
            d = out / name / f"seed{seed}"
            cs = replace(c, seed=seed)
            todo = [m for m in methods if not _done(d / m, dump_yaml(bilevel_config(cs, m)))]
            log(f"== point {k + 1}/{len(pts)} {name}, seed {seed}: running {', '.join(todo) or 'nothing (reused)'}")
            if todo:
                run_experiment(cs, d, todo, log=log, engine=engine, resume=True)  # an interrupted run goes on
            for m in methods:
                cells[(name, seed, m)] = cell = json.loads((d / m / "summary.json").read_text())
                recs = read_jsonl(d / m / "metrics.jsonl")
                cell["covering_x_min"] = min(r["covering_x"] for r in recs if r["event"] == "round")
                cell["initial"] = initial_eval(recs)
                if last > 1:  # the final figure: the mean of the last `last` rounds' evaluations
                    cell["final_last_round"] = cell["final"]
                    cell["final"] = last_rounds_mean([r for r in recs if r["event"] == "eval"], last)
    result = {"methods": methods, "seeds": seeds, "points": [n for n, _ in pts], "last_rounds": last,
              "rows": untrained_rows(cells, pts, methods, seeds) + _rows(cells, pts, methods, seeds), "contrasts": contrasts(cells, [n for n, _ in pts], methods, seeds)}
    write_json(out / "table.json", result)
    write_text(out / "table.md", render(result))
    return result


def untrained_rows(cells: dict, pts, methods, seeds) -> list[dict]:
    """The table's first row: the initial model's metric, so that a reader sees what training added. Every
    method of the family starts from the same weights at a seed (one row); a method whose initial evaluation
    differs at some point and seed gets its own row. No row where a run lacks the evaluation (older runs)."""
    if any(cells[(p, s, m)].get("initial") is None for p, _ in pts for s in seeds for m in methods):
        return []
    first = methods[0]
    same = all(_metric(cells[(p, s, m)]["initial"]) == _metric(cells[(p, s, first)]["initial"])
               for p, _ in pts for s in seeds for m in methods)
    rows = []
    for m in ([first] if same else methods):
        row = {"method": UNTRAINED if same else f"{m}, {UNTRAINED}", "untrained": True, "points": {},
               "relative_to_fedmbo": {}}
        for name, _ in pts:
            row["points"][name] = _point([_metric(cells[(name, s, m)]["initial"]) for s in seeds])
        rows.append(row)
    return rows


def _done(d: Path, config_text: str) -> bool:
    return (d / "summary.json").is_file() and (d / "config.yaml").is_file() and \
        (d / "config.yaml").read_text() == config_text


def _rows(cells: dict, pts, methods, seeds) -> list[dict]:
    rows = []
    for m in methods:
        row = {"method": m, "points": {}}
        ratios: dict[str, list[float]] = {k: [] for k in COST_KEYS}
        for name, _ in pts:
            row["points"][name] = _point([_metric(cells[(name, s, m)]["final"]) for s in seeds])
            off = [100 * cells[(name, s, m)]["final"]["official_runs_accuracy"] for s in seeds
                   if "official_runs_accuracy" in cells[(name, s, m)]["final"]]
            if len(off) == len(seeds):  # the 20 official 20-way one-shot runs (few-shot task)
                row["points"][name]["official_runs"] = mean_ci95(off)
            for s in seeds:
                ref = cells.get((name, s, "fedmbo"))
                for key in ratios:
                    if ref and ref[key]:
                        ratios[key].append(cells[(name, s, m)][key] / ref[key])
        row["relative_to_fedmbo"] = {k: statistics.fmean(v) if v else None for k, v in ratios.items()}
        row["covering_x_min"] = min(cells[(name, s, m)].get("covering_x_min", 0) for name, _ in pts for s in seeds)
        rows.append(row)
        rows += _capacity_rows(cells, pts, m, seeds)
    return rows


def _capacity_rows(cells: dict, pts, m: str, seeds) -> list[dict]:
    """One row per capacity R < 1 of a sub-model method: the global model's sub-model at R (what a client of
    that capacity holds at the end, `BilevelServer.evaluate_capacities`), over the same seeds."""
    caps = [set(cells[(name, s, m)].get("final_by_capacity", {})) for name, _ in pts for s in seeds]
    if not caps or not caps[0] or any(c != caps[0] for c in caps):
        return []
    rows = []
    for r in sorted(caps[0], key=lambda c: -float(c)):
        row = {"method": f"{m} (R = {r})", "capacity": float(r), "points": {}, "relative_to_fedmbo": {}}
        for name, _ in pts:
            row["points"][name] = _point([_metric(cells[(name, s, m)]["final_by_capacity"][r]) for s in seeds])
        rows.append(row)
    return rows


def _value(cells: dict, point: str, seed: int, method: str) -> float:
    return _metric(cells[(point, seed, method)]["final"])[0]


def contrasts(cells: dict, pts: list[str], methods: list[str], seeds: list[int]) -> list[dict]:
    """Paired differences (same point, same seed: the same shards, initial weights and test episodes) of each
    bilevel sub-model method (RABO, RAFBO) against the mean of the single-level sub-model baselines in the
    table (the RABO paper's "+9.43% on average") and against each full-model method, per point and averaged
    over the points; each a mean with its 95% t-interval over seeds (`eval.stats.mean_ci95`)."""
    from ciders.algorithms.registry import REGISTRY

    subs = [m for m in methods if REGISTRY[m].submodel_local]
    full = [m for m in methods if m == "fedmbo" or (REGISTRY[m].local_update is not None and m not in subs)]
    out = []
    for a in (m for m in methods if REGISTRY[m].rabo_method in ("rabo", "rafbo")):
        for label, group in ([("sub-model baselines (" + ", ".join(subs) + ")", subs)] if subs else []) + \
                [(b, [b]) for b in full]:
            diff = {p: [_value(cells, p, s, a) - statistics.fmean(_value(cells, p, s, b) for b in group) for s in seeds]
                    for p in pts}
            row = {"method": a, "against": label, "points": {p: {**mean_ci95(d), "seeds": d} for p, d in diff.items()}}
            avg = [statistics.fmean(diff[p][k] for p in pts) for k in range(len(seeds))]
            row["mean_over_points"] = {**mean_ci95(avg), "seeds": avg}
            out.append(row)
    return out


def signed(c: dict) -> str:
    """'d ± h', starred when the 95% interval excludes 0."""
    star = "*" if c["n"] > 1 and abs(c["mean"]) > c["ci95"] else ""
    return f"{c['mean']:+.2f} ± {c['ci95']:.2f}{star}"


def render(result: dict) -> str:
    pts = result["points"]
    head = "| method | " + " | ".join(pts) + " | C_x* (min) | op estimate / FedMBO | measured s / FedMBO " \
           "| uplink / FedMBO | downlink / FedMBO |"
    last = result.get("last_rounds", 1)
    what = f"mean of the last {last} rounds' evaluations" if last > 1 else "last round's evaluation"
    seeds = result["seeds"]
    lines = [f"Final metric in % ({what}; mean over seeds {', '.join(map(str, seeds))} ± the 95% t-interval "
             f"half-width over seeds, t_0.975,{max(len(seeds) - 1, 1)} s / sqrt({len(seeds)}); in brackets the sample "
             "std over seeds). Ratios: mean over points and seeds of method / FedMBO.", "",
             head, "|---" * (len(pts) + 6) + "|"]
    for r in result["rows"]:
        cells = [f"{c['mean']:.2f} ± {c['ci95']:.2f} [sd {c['std']:.2f}]" for c in (r["points"][p] for p in pts)]
        rel = [f"{v:.3f}" if v is not None else "-" for v in r["relative_to_fedmbo"].values()] or ["-"] * 4
        lines.append(f"| {r['method']} | " + " | ".join(cells + [str(r.get("covering_x_min", "-"))] + rel) + " |")
    if any(r.get("untrained") for r in result["rows"]):
        lines += ["", f"Row `{UNTRAINED}`: the initial model, evaluated before any training on the same test episodes "
                  "(every method starts from these weights at a seed); the rows below it show what training added."]
    if any("capacity" in r for r in result["rows"]):
        lines += ["", "Rows `method (R = r)`: the final global model's sub-model at capacity r, as a client of that "
                  "capacity holds it (its extraction rule, the same test episodes)."]
    trained = [r for r in result["rows"] if "capacity" not in r and not r.get("untrained")]
    if all("official_runs" in r["points"][p] for r in trained for p in pts):
        lines += ["", "The same feature extractors on the 20 official 20-way one-shot runs (Lake et al.), accuracy in % "
                  "(mean ± 95% t-interval over seeds):",
                  "", "| method | " + " | ".join(pts) + " |", "|---" * (len(pts) + 1) + "|"]
        for r in trained:
            cells = [f"{r['points'][p]['official_runs']['mean']:.2f} ± {r['points'][p]['official_runs']['ci95']:.2f}"
                     for p in pts]
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    if result.get("contrasts"):
        lines += ["", "Paired differences in points of % (same seed: the same shards, initial weights and test episodes), "
                  "mean ± 95% t-interval over seeds; * = the interval excludes 0:", "",
                  "| method | minus | " + " | ".join(pts) + " | mean over points |", "|---" * (len(pts) + 3) + "|"]
        for c in result["contrasts"]:
            lines.append(f"| {c['method']} | {c['against']} | " + " | ".join(
                signed(c["points"][p]) for p in pts) + f" | {signed(c['mean_over_points'])} |")
    return "\n".join(lines) + "\n"
