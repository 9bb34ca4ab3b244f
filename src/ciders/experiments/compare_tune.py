"""`ciders compare CONFIG --algorithms ... --seeds ... --tune KEY=v1,v2 [--tune ...] [--tune-rounds R]`: every
method's client step sizes tuned on the clients' validation parts with the same grid and budget, then the chosen
settings compared over the seeds on the test parts (docs/method.md#fair-tuning-ciders-compare---tune).

  1. The validation parts: federation.validation of each client's examples, after its held-out part, never trained
     on (`tasks.federated.tokenize_clients`). Tuning runs and final runs set it alike, so they train on the same
     examples; the tuning runs evaluate the validation parts (eval.split = validation), the final runs the test
     parts (the global evaluation set and each client's held-out part).
  2. Every method with client learning runs every grid point once, at the config's seed, for `tune_rounds` rounds
     (default: the config's). Its score is the global response NLL on the validation parts after the last round;
     the lowest wins, ties going to the first point in grid order. The budget (grid points) is the same for every
     method. The control (no client learning) has no client step size and is not tuned.
  3. The final comparison (`run_compare`) runs each method with its winner at every seed.

Layout: OUT/tune/<method>/<point>/ (one `run_compare` directory per point, reused when finished), OUT/tune.json
and OUT/tune.md, then OUT/<method>/seed<s> as a plain comparison; all share OUT/prealign.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from ciders.config import ExperimentConfig
from ciders.errors import ConfigError
from ciders.experiments.compare import CONTROL, run_compare
from ciders.experiments.sweep import point_names, points
from ciders.fileio import write_json, write_text

TUNE_METRIC = "nll"  # global response NLL on the validation parts, lower is better


def tuning_config(cfg: ExperimentConfig, rounds: int | None) -> ExperimentConfig:
    """The tuning runs' config: evaluations on the validation parts, perplexities only, `rounds` rounds."""
    if cfg.federation.validation == 0:
        raise ConfigError("--tune scores each setting on the clients' validation parts: set federation.validation "
                          "(e.g. --set federation.validation=0.2); the final runs keep the same training data")
    if rounds is not None and rounds < 1:
        raise ConfigError(f"--tune-rounds: must be >= 1, got {rounds}")
    ev = replace(cfg.eval, split="validation", tasks=(), fidelity=False)
    fed = replace(cfg.federation, rounds=rounds or cfg.federation.rounds, eval_every=0)
    return replace(cfg, eval=ev, federation=fed).validate()


def shared_prealign(out: Path, log: Callable[[str], None]) -> Callable:
    """The LLM task of every tuning and final run, all sharing one pre-alignment cache per seed (OUT/prealign)."""
    from ciders.workloads.llm import LLMTask

    return lambda c, o: LLMTask(c, o, log=log, prealign_cache=out / "prealign")


def _learns(cfg: ExperimentConfig, method: str) -> bool:
    from ciders import algorithms

    return algorithms.configure(cfg, method).algorithm.client_learning


def tune(cfg: ExperimentConfig, methods: list[str], grid: list[tuple[str, list[str]]], out: Path,
         rounds: int | None = None, make_task: Callable | None = None, log: Callable[[str], None] = print,
         progress: bool = True) -> dict:
    """Every grid point for every method with client learning; {method: {"winner": [KEY=VALUE], "scores": ...}}."""
    pts = points(tuning_config(cfg, rounds), grid)
    make_task = make_task or shared_prealign(out, log)
    result = {}
    for m in methods:
        if not _learns(cfg, m):
            continue
        scores = []
        for i, (name, c) in enumerate(pts):
            log(f"== tuning {m}, point {i + 1}/{len(pts)}: {name}")
            res = run_compare(c, [m], [c.seed], out / "tune" / m / name, make_task=make_task, log=log,
                              progress=progress, control=None)
            scores.append({"point": name, TUNE_METRIC: res["per_seed"][m][c.seed][TUNE_METRIC]})
        best = min(range(len(scores)), key=lambda j: (scores[j][TUNE_METRIC], j))  # ties: the first in grid order
        winner = scores[best]["point"].split(",")
        result[m] = {"winner": winner, "scores": scores, "edge": at_edge(winner, grid)}
        if result[m]["edge"]:
            log(f"warning: {m}'s best setting is at the edge of the grid ({', '.join(result[m]['edge'])}); its "
                "optimum may lie outside it: widen the grid there")
    return result


def at_edge(winner: list[str], grid: list[tuple[str, list[str]]]) -> list[str]:
    """The KEY=VALUE settings of `winner` that are the first or last value of their key's grid (of 3 or more
    values): a winner there has not been bracketed, so the tuning cannot say the method got its best rate."""
    chosen = dict(w.split("=", 1) for w in winner)
    return [f"{k}={chosen[k]}" for k, vals in grid if len(vals) >= 3 and chosen.get(k) in (vals[0], vals[-1])]


def markdown(tuned: dict, grid: list[tuple[str, list[str]]], rounds: int, seed: int) -> str:
    names = point_names(grid)
    head = (f"Client step sizes tuned on the validation parts (global response NLL after {rounds} rounds, seed {seed}; "
            f"the same {len(names)}-point grid for every method: "
            + "; ".join(f"{k} in {', '.join(v)}" for k, v in grid) + "). Lowest NLL **bold**.")
    lines = [head, "", "| method | " + " | ".join(names) + " | chosen |", "|---" * (len(names) + 2) + "|"]
    for m, r in tuned.items():
        cells = [f"**{s[TUNE_METRIC]:.4f}**" if s["point"] == ",".join(r["winner"]) else f"{s[TUNE_METRIC]:.4f}"
                 for s in r["scores"]]
        edge = " (grid edge)" if r.get("edge") else ""
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {', '.join(r['winner'])}{edge} |")
    edged = [m for m, r in tuned.items() if r.get("edge")]
    if edged:
        lines += ["", f"**Not bracketed:** {', '.join(edged)} chose a setting at the edge of the grid, so a "
                      "better one may lie beyond it; widen the grid there before reading their comparison as "
                      "tuned."]
    return "\n".join(lines) + "\n"


def run_tuned_compare(cfg: ExperimentConfig, methods: list[str], seeds: list[int], out: str | Path,
                      grid: list[tuple[str, list[str]]], rounds: int | None = None, control: str | None = CONTROL,
                      make_task: Callable | None = None, log: Callable[[str], None] = print,
                      progress: bool = True) -> dict:
    """Tune (`tune`), then the comparison with each method's winner; tune.md heads compare.md."""
    out = Path(out)
    tuned = tune(cfg, methods, grid, out, rounds, make_task, log, progress)
    write_json(out / "tune.json", {"grid": grid, "rounds": rounds or cfg.federation.rounds, "seed": cfg.seed,
                                   "metric": TUNE_METRIC, "methods": tuned})
    md = markdown(tuned, grid, rounds or cfg.federation.rounds, cfg.seed)
    write_text(out / "tune.md", md)
    res = run_compare(cfg, methods, seeds, out, make_task=make_task or shared_prealign(out, log), log=log,
                      progress=progress, control=control,
                      overrides={m: r["winner"] for m, r in tuned.items()})
    res["tuned"] = {m: r["winner"] for m, r in tuned.items()}
    write_json(out / "compare.json", res)
    write_text(out / "compare.md", md + "\n" + (out / "compare.md").read_text())
    return res

