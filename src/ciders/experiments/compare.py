"""`ciders compare CONFIG --algorithms ... --seeds ...`: every method on the same partitions and
evaluations, one comparison table (docs/method.md#experiments-and-metrics; the paper's Table III shape).

Runs go to OUT/<method>/seed<s>, each a normal run directory (`ciders report`, `ciders eval` and
`--resume` work on it). For one seed, every method sees the same data split and partition: both are
derived from (seed, data config) only, and data.json is checked to be identical across methods. Methods
whose pre-alignment inputs agree share one TAKD pre-alignment (OUT/prealign, `workloads.prealign.key`). A
finished run is reused, an interrupted one resumed, so re-running the command completes a comparison.

Every comparison has a control row (`--control`, default takd-only: the same TAKD schedule with no client
learning, one run per seed; docs/method.md#the-control-takd-only). The tables mark each method that does not beat
it beyond the seed spread (`report.tables.against_control`).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ciders import algorithms
from ciders.config import ExperimentConfig, check_seed, dump_yaml
from ciders.errors import CidersError
from ciders.fileio import write_json, write_text
from ciders.report import tables


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in algorithms.METHODS]
    if bad or not methods:
        raise CidersError(f"--algorithms: unknown {', '.join(bad) or '(none given)'}; choose from "
                          f"{', '.join(algorithms.METHODS)}")
    if len(set(methods)) != len(methods):
        raise CidersError("--algorithms: a method is listed twice")
    return methods


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise CidersError(f"--seeds: expected comma-separated integers, got {text!r}") from exc
    if not seeds or len(set(seeds)) != len(seeds):
        raise CidersError(f"--seeds: expected distinct integers, got {text!r}")
    return [check_seed(s, "--seeds") for s in seeds]  # each becomes a config's seed (dataclasses.replace)


CONTROL = "takd-only"


def parse_control(text: str | None) -> str | None:
    """`--control NAME` (a CIDERS-family method) or `none`."""
    if text is None or text.strip().lower() == "none":
        return None
    methods = parse_methods(text)
    if len(methods) != 1:
        raise CidersError(f"--control: one method or none, got {text!r}")
    return methods[0]


def run_compare(cfg: ExperimentConfig, methods: list[str], seeds: list[int], out: str | Path,
                make_task: Callable[[ExperimentConfig, Path], object] | None = None,
                log: Callable[[str], None] = print, progress: bool = True, control: str | None = CONTROL,
                overrides: dict[str, list[str]] | None = None) -> dict:
    """Run (or reuse) every (method, seed), and the `control` method once per seed (appended unless listed; None:
    no control), and write compare.json and compare.md in `out` (after every finished run, over the finished
    ones: an interrupted comparison still has its table so far). `overrides`: KEY=VALUE settings per method
    (e.g. its tuned learning rate, `compare_tune`), applied to `cfg` before the method's own knobs."""
    from ciders.federation.loop import RunDir, check_same_config
    from ciders.federation.ciders_loop import run_federation

    if control is not None and control not in methods:
        methods = [*methods, control]

    if make_task is None:
        from ciders.workloads.llm import LLMTask

        def make_task(c, o):  # one TAKD pre-alignment per seed for the methods whose inputs to it agree
            return LLMTask(c, o, log=log, prealign_cache=out / "prealign")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "base_config.yaml", dump_yaml(cfg))
    per_seed: dict[str, dict[int, dict]] = {m: {} for m in methods}
    runs: dict[str, dict[int, str]] = {m: {} for m in methods}
    total, j = len(methods) * len(seeds), 0
    for s in seeds:
        data_info = None
        for m in methods:
            j += 1
            c = algorithms.configure(replace(with_overrides(cfg, (overrides or {}).get(m, [])), seed=s,
                                             name=f"{cfg.name}-{m}-seed{s}"), m)
            rd = out / m / f"seed{s}"
            runs[m][s] = str(rd)
            if (rd / "summary.json").is_file() and RunDir(rd).committed() == c.federation.rounds - 1:
                check_same_config(RunDir(rd), c)  # a finished run is reused only for the same config
                log(f"[{j}/{total}] {m} seed {s}: finished earlier, reusing {rd}")
            else:
                resume = RunDir(rd).committed() is not None
                log(f"[{j}/{total}] {m} seed {s}: {'resuming' if resume else 'running'} in {rd}")
                t0 = time.perf_counter()
                rd.mkdir(parents=True, exist_ok=True)
                run_federation(c, make_task(c, rd), rd, resume=resume, log=log, progress=progress)
                log(f"[{j}/{total}] {m} seed {s}: done in {time.perf_counter() - t0:.0f} s")
            info = _split_of(rd)
            if data_info is None:
                data_info = info
            elif info != data_info:
                raise CidersError(f"{rd}: its data split differs from the other methods' for seed {s}; the "
                                  "comparison would not be like for like (was a run made with another config?)")
            per_seed[m][s] = tables.final_metrics(rd)
            # the table so far after every finished run: `ciders report OUT` draws a comparison in progress
            result = write_tables(out, cfg.name, methods, seeds, runs, per_seed, control)
    return result


def with_overrides(cfg: ExperimentConfig, over: list[str]) -> ExperimentConfig:
    """`cfg` with KEY=VALUE settings applied and checked as `--set` overrides are."""
    if not over:
        return cfg
    from ciders.config import apply_overrides, from_dict, to_dict

    return from_dict(ExperimentConfig, apply_overrides(to_dict(cfg), list(over))).validate()


def write_tables(out: Path, name: str, methods: list[str], seeds: list[int], runs: dict[str, dict[int, str]],
                 per_seed: dict[str, dict[int, dict]], control: str | None = None) -> dict:
    """compare.json and compare.md over the finished runs; `pending` lists the (method, seed) runs still to do
    (empty once the comparison is complete); `against_control` holds each method's seed-paired difference from
    the control and whether it beats it beyond the seed spread."""
    done = {m: {s: per_seed[m][s] for s in seeds if s in per_seed[m]} for m in methods}
    pending = [f"{m}/seed{s}" for s in seeds for m in methods if s not in done[m]]
    agg = tables.aggregate({m: v for m, v in done.items() if v})
    result = {"config": name, "methods": methods, "seeds": seeds,
              "runs": {m: {s: runs[m][s] for s in done[m]} for m in methods}, "per_seed": done,
              "aggregate": agg, "ranks": {k: tables.ranks(agg, k) for k in tables.METRICS}, "pending": pending}
    vs = tables.against_control(done, control) if control in done and done[control] else {}
    result["control"], result["against_control"] = control, vs
    md = tables.markdown(agg, title=f"{name}: {', '.join(methods)}", seeds=seeds, control=control,
                         marks=tables.control_marks(vs))
    if pending:
        md = (f"In progress: {len(pending)} of {len(methods) * len(seeds)} runs still to do "
              f"({', '.join(pending)}); the table is over the finished ones.\n\n") + md
    pairs = {k: tables.pairwise(done, k) for k in tables.CONTROL_METRICS}
    result["pairwise"] = pairs
    if len(seeds) > 1:
        md += "".join("\n" + tables.pairwise_markdown(rows, k) for k, rows in pairs.items() if rows)
    write_json(out / "compare.json", result)
    write_text(out / "compare.md", md)
    return result


def _split_of(rd: Path):
    p = rd / "data.json"
    if not p.is_file():
        return None
    info = json.loads(p.read_text())
    return info.get("split", info)
