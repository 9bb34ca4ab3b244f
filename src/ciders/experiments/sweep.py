"""`ciders sweep CONFIG --grid KEY=v1,v2 [--grid ...] --algorithms ... --seeds ...`: a comparison at
every point of a grid of config values (docs/method.md#experiments-and-metrics): the compression sweep (messenger
depth x drop ratio; Table V shape: response NLL and stored FP32 LoRA MiB per method) and the Output-KL ablation
(takd.lambda_out = 0 vs 0.5; Fig. 2 / Table IV shape). Each point is a `ciders compare` directory
OUT/<key=value,...>/, so finished points are reused and interrupted ones resumed.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

from ciders.config import ExperimentConfig, apply_overrides, from_dict, to_dict
from ciders.experiments.compare import CONTROL, run_compare
from ciders.errors import CidersError
from ciders.fileio import write_json, write_text
from ciders.report import tables

DEFAULT_METRICS = ("nll", "stored_mib")


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    grid = []
    for item in items:
        key, sep, vals = item.partition("=")
        values = [v.strip() for v in vals.split(",") if v.strip()]
        if not sep or not key.strip() or not values:
            raise CidersError(f"--grid {item!r}: expected KEY=v1,v2,... (e.g. decomposition.drop_ratio=0.2,0.5)")
        grid.append((key.strip(), values))
    if len({k for k, _ in grid}) != len(grid):
        raise CidersError("--grid: a key is given twice")
    return grid


def point_names(grid: list[tuple[str, list[str]]]) -> list[str]:
    """'KEY=v,KEY2=w' for every grid point, in grid order (the first key varies slowest)."""
    return [",".join(f"{k}={v}" for k, v in combo)
            for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in grid])]


def points(cfg, grid: list[tuple[str, list[str]]], cls: type = ExperimentConfig) -> list[tuple[str, object]]:
    """(name, config) for every grid point; values are checked like `--set` overrides."""
    return [(name, from_dict(cls, apply_overrides(to_dict(cfg), name.split(","), cls=cls)).validate())
            for name in point_names(grid)]


def run_sweep(cfg: ExperimentConfig, grid: list[tuple[str, list[str]]], methods: list[str], seeds: list[int],
              out: str | Path, metrics: tuple[str, ...] = DEFAULT_METRICS, make_task: Callable | None = None,
              log: Callable[[str], None] = print, progress: bool = True, control: str | None = CONTROL) -> dict:
    out = Path(out)
    bad = [m for m in metrics if m not in tables.METRICS]
    if bad:
        raise CidersError(f"--metrics: unknown {', '.join(bad)}; choose from {', '.join(tables.METRICS)}")
    rows = []
    pts = points(cfg, grid)
    for i, (name, c) in enumerate(pts):
        log(f"== sweep point {i + 1}/{len(pts)}: {name}")
        res = run_compare(c, methods, seeds, out / name, make_task=make_task, log=log, progress=progress,
                          control=control)
        kw = c.decomposition.split_kwargs()  # the point's drop ratio (1 - beta; None when n' is given)
        rows.append({"point": name, "values": dict(kv.split("=", 1) for kv in name.split(",")),
                     "aggregate": res["aggregate"],
                     "drop_ratio": kw.get("drop_ratio", 1 - kw["beta"] if "beta" in kw else None)})
    methods = res["methods"] if pts else methods  # with the control row, when one was added
    result = {"config": cfg.name, "grid": grid, "methods": methods, "seeds": seeds, "metrics": list(metrics),
              "rows": rows, "control": control}
    write_json(out / "sweep.json", result)
    write_text(out / "sweep.md", markdown(result))
    return result


def markdown(result: dict) -> str:
    """Rows = grid points, columns = method x metric (mean +- std), the lowest / highest of each metric
    in a row in bold (by the metric's direction)."""
    keys = [k for k, _ in result["grid"]]
    methods, metrics = result["methods"], result["metrics"]
    head = keys + [f"{m} {tables.METRICS[k][0]}" for m in methods for k in metrics]
    lines = [f"mean ± std over seeds {', '.join(map(str, result['seeds']))}; **best** of each metric within a row.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [row["values"][k] for k in keys]
        best = {}
        for k in metrics:
            sign = tables.METRICS[k][1]
            vals = {m: row["aggregate"].get(m, {}).get(k, {}).get("mean") for m in methods}
            vals = {m: v for m, v in vals.items() if v is not None}
            if sign and len(vals) > 1 and len(set(vals.values())) > 1:
                best[k] = (max if sign > 0 else min)(vals, key=vals.get)
        for m in methods:
            for k in metrics:
                a = row["aggregate"].get(m, {}).get(k)
                if a is None:
                    cells.append("–")
                    continue
                _, _, scale, fmt = tables.METRICS[k]
                s = fmt.format(a["mean"] * scale) + (f" ± {fmt.format(a['std'] * scale)}" if a["n"] > 1 else "")
                cells.append(f"**{s}**" if best.get(k) == m else s)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
