"""`ciders` command line. Every user-facing failure is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from ciders import __version__
from ciders.errors import CidersError


def _cmd_plan(a: argparse.Namespace) -> int:
    from ciders.config import DEFAULT_LORA_TARGETS, LoraConfig
    from ciders.models.plan import Workload, make_plan, render

    targets = tuple(t.strip() for t in a.lora_targets.split(",") if t.strip()) if a.lora_targets else DEFAULT_LORA_TARGETS
    msg = LoraConfig(r=a.lora_rank, alpha=a.lora_alpha, targets=targets)
    stu = LoraConfig(r=a.student_lora_rank or a.lora_rank, alpha=a.lora_alpha, targets=targets)
    msg.validate("--lora-rank"), stu.validate("--student-lora-rank")
    p = make_plan(a.model, a.messenger_layers, beta=a.beta, drop_ratio=a.drop_ratio, student_layers=a.student_layers,
                  rounding=a.rounding, messenger_lora=msg, student_lora=stu,
                  upload_personalized_messenger=a.upload_personalized_messenger,
                  workload=Workload(dtype=a.dtype, batch_size=a.batch_size, seq_len=a.seq_len,
                                    takd_batch_size=a.takd_batch_size, public_examples=a.public_examples))
    print(json.dumps(p.to_dict(), indent=2) if a.json else render(p))
    return 0


def _names(family: str) -> list[str]:
    """Method names for the help texts, from the config layer's Literals (no algorithm import)."""
    import typing

    from ciders.config import AlgorithmName, BilevelMethod

    if family == "bilevel":
        return list(typing.get_args(BilevelMethod))
    return ["ciders-fo", "ciders-fd", *(n for n in typing.get_args(AlgorithmName) if n != "ciders")]


def _load_cfg(a: argparse.Namespace, family: str = "ciders"):
    """The experiment of `a.config` (its declared family must be `family`)."""
    from ciders.config import load_experiment

    cfg = load_experiment(a.config, a.set or [])
    if cfg.family != family:
        other = "ciders bilevel CONFIG" if cfg.family == "bilevel" else "ciders run CONFIG"
        raise CidersError(f"{a.config} is a {cfg.family}-family experiment (family: {cfg.family}); run it with "
                          f"`{other}`")
    return cfg


# Files that mark a directory an earlier version of a command wrote before output markers existed: such a
# directory is still the command's own (`fileio.check_output`); anything else non-empty needs --force.
LEGACY_OUTPUTS = {"run": ("checkpoints/LATEST",), "distill": ("adapters/student",),
                  "bilevel": ("bilevel.md", "table.md"), "compare": ("compare.json",), "sweep": ("sweep.json",),
                  "export": ("ciders_export.json",), "report": ("index.html",)}


def _claim(a: argparse.Namespace, out: Path, command: str | None = None) -> Path:
    """Refuse an --out that holds someone else's files (unless --force); mark it as this command's."""
    from ciders.fileio import claim_output

    command = command or a.cmd
    return claim_output(out, command, getattr(a, "force", False), LEGACY_OUTPUTS.get(command, ()))


def _cmd_distill(a: argparse.Namespace) -> int:
    from ciders.workloads.prealign import run_prealign

    cfg = _load_cfg(a)
    out = _claim(a, Path(a.out) if a.out else Path("runs") / cfg.name)
    run_prealign(cfg, out)
    print(f"run directory: {out}")
    return 0


def _cmd_bilevel(a: argparse.Namespace) -> int:
    from ciders.experiments.bilevel import run_experiment

    exp = _load_cfg(a, "bilevel")
    out = _claim(a, Path(a.out) if a.out else Path("runs") / exp.name, "bilevel")  # also `compare` on this family
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if getattr(a, "tune", None):
        from ciders.experiments.bilevel_tune import run_tuned
        from ciders.experiments.compare import parse_seeds
        from ciders.experiments.sweep import parse_grid

        if a.grid:
            raise CidersError("--tune and --grid cannot be combined: tune at one grid point at a time")
        run_tuned(exp, methods, parse_seeds(a.seeds or str(exp.seed)), parse_grid(a.tune), out, engine=a.engine,
                  last=getattr(a, "last_rounds", 1))
        print((out / "tune.md").read_text())
    elif a.seeds is None and not a.grid:
        run_experiment(exp, out, methods, engine=a.engine, resume=getattr(a, "resume", False))
        print((out / "bilevel.md").read_text())
    else:
        from ciders.experiments.bilevel_table import run_table
        from ciders.experiments.compare import parse_seeds
        from ciders.experiments.sweep import parse_grid

        run_table(exp, methods, parse_seeds(a.seeds or str(exp.seed)), parse_grid(a.grid or []), out, engine=a.engine,
                  last=getattr(a, "last_rounds", 1))
        print((out / "table.md").read_text())
    print(f"output directory: {out}")
    return 0


def _cmd_run(a: argparse.Namespace) -> int:
    import logging

    from ciders.federation import console
    from ciders.workloads.llm import LLMTask, render
    from ciders.federation.loop import RunDir
    from ciders.federation.ciders_loop import run_federation

    cfg = _load_cfg(a)
    out = Path(a.out) if a.out else Path("runs") / cfg.name
    if RunDir(out).refuse_unless(a.resume) is not None:  # before the model loads (the run checks again)
        from ciders.algorithms import configure
        from ciders.federation.rundir import check_same_config

        check_same_config(RunDir(out), configure(cfg), extend_rounds=True)
    _claim(a, out)
    console.quiet(a.quiet)
    handler = console.to_console(logging.WARNING if a.quiet else logging.INFO)
    try:
        with console.run_log(out):  # model, data and cache lines too, not only the rounds'
            if a.engine == "flower-sim":
                from ciders.transports.flower.server_app import run_simulation

                summary = run_simulation(cfg, out, resume=a.resume)
            else:
                summary = run_federation(cfg, LLMTask(cfg, out, log=console.info), out, resume=a.resume)
    finally:
        console.LOGGER.removeHandler(handler)
        console.quiet(False)
    print(render(summary))
    print(f"run directory: {out}")
    return 0


def _control_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", default="takd-only",
                   help="the control row, run once per seed: a CIDERS-family method, or none (default takd-only: the "
                        "same TAKD schedule with no client learning); the tables mark every method that does not "
                        "beat it beyond the seed spread")


def _cmd_compare(a: argparse.Namespace) -> int:
    from ciders.config import family_of
    from ciders.experiments.compare import parse_control, parse_methods, parse_seeds, run_compare

    if family_of(Path(a.config)) == "bilevel":  # a RABO-family experiment: `ciders bilevel --seeds`
        a.methods, a.grid, a.engine = a.algorithms or "rabo,rafbo,fedmbo", [], "local"
        a.seeds = a.seeds or "0"
        return _cmd_bilevel(a)
    a.algorithms = a.algorithms or "ciders-fo,ciders-fd,fedbiot,fedot,localot"
    cfg = _load_cfg(a)
    methods, seeds = parse_methods(a.algorithms), parse_seeds(a.seeds)
    out = _claim(a, Path(a.out) if a.out else Path("runs") / f"compare-{cfg.name}")
    if a.tune:
        from ciders.experiments.compare_tune import run_tuned_compare
        from ciders.experiments.sweep import parse_grid

        run_tuned_compare(cfg, methods, seeds, out, parse_grid(a.tune), a.tune_rounds, control=parse_control(a.control))
    else:
        run_compare(cfg, methods, seeds, out, control=parse_control(a.control))
    print((out / "compare.md").read_text())
    print(f"comparison directory: {out} (compare.md, compare.json; `ciders report {out}` draws it)")
    return 0


def _cmd_sweep(a: argparse.Namespace) -> int:
    from ciders.experiments.compare import parse_control, parse_methods, parse_seeds
    from ciders.experiments.sweep import parse_grid, run_sweep

    cfg = _load_cfg(a)
    grid = parse_grid(a.grid or [])
    if not grid:
        raise CidersError("sweep: give at least one --grid KEY=v1,v2")
    out = _claim(a, Path(a.out) if a.out else Path("runs") / f"sweep-{cfg.name}")
    metrics = tuple(m.strip() for m in a.metrics.split(",") if m.strip())
    run_sweep(cfg, grid, parse_methods(a.algorithms), parse_seeds(a.seeds), out, metrics,
              control=parse_control(a.control))
    print((out / "sweep.md").read_text())
    print(f"sweep directory: {out} (sweep.md, sweep.json, one compare directory per point)")
    return 0


def _cmd_report(a: argparse.Namespace) -> int:
    from ciders.report.html import write_report

    page = write_report(a.path, a.out, force=a.force)
    print(f"report: {page}")
    return 0


def _cmd_theory(a: argparse.Namespace) -> int:
    from ciders.experiments.theory import run_theory

    for row in run_theory(a.clients, a.dim, a.K, a.eta, a.gamma, a.alpha, a.eps_prox, a.rounds, a.loss, a.seed, a.tau,
                          a.consensus_space):
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"round {row['round']:4d}  DR {row['dr']:+.6f} (1-psi {row['dr_pred']:+.6f})  "
                  f"PPR {row['ppr']:.6f} (psi {row['psi']:.6f})")
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from ciders.config import load_run_config
    from ciders.workloads.prealign import build
    from ciders.fileio import check_output
    from ciders.models.export import export_edge_model
    from ciders.models.model_card import model_card

    run = Path(a.run_dir)
    if (run / "edge" / "ciders_edge.json").is_file():
        return _export_node(a, run)
    if not (run / "config.yaml").is_file():
        raise CidersError(f"{run}: not a run directory (no config.yaml) nor a Flower node's state directory "
                          "(no edge/ciders_edge.json)")
    # before the model is built: a bad --out (under a file, /proc, a dangling link) fails in a second
    check_output(a.out, "export", a.force, LEGACY_OUTPUTS["export"], beside=True)  # export_edge_model marks it
    cfg = load_run_config(run / "config.yaml")
    d, tok = build(cfg)
    if a.client:
        from ciders.workloads.evaluation import load_personalized

        messenger = load_personalized(run, a.client, d)
    else:
        messenger = d.read_adapter(Path(a.messenger) if a.messenger else run / "adapters" / "messenger", "messenger")
    student = d.read_adapter(run / "adapters" / "student", "student")
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8")) if (run / "summary.json").is_file() else None
    which = {"client": a.client} if a.client else {"messenger": str(Path(a.messenger).resolve()) if a.messenger else "global"}
    out = export_edge_model(d, a.out, fmt=a.format, messenger=messenger, student=student, tokenizer=tok,
                            meta={"run_dir": str(run.resolve()), **which}, gguf_dtype=a.gguf_dtype,
                            card=lambda info: model_card(info, cfg, summary, a.client))
    print(f"edge model ({d.split.edge_layers} layers, LoRA merged, {a.format}) written to {out}")
    return 0


def _export_node(a: argparse.Namespace, state: Path) -> int:
    """`ciders export NODE_STATE_DIR`: on the device, from what the node holds (no full model, no server)."""
    from ciders.fileio import check_output
    from ciders.models.export import export_edge_model
    from ciders.models.model_card import model_card
    from ciders.workloads.edge import node_model

    if a.messenger:
        raise CidersError("--messenger: a node exports its own personalized messenger; drop --messenger")
    check_output(a.out, "export", a.force, LEGACY_OUTPUTS["export"], beside=True)  # before the model is built
    d, tok, cfg, messenger, cid, rnd = node_model(state)
    if a.client and a.client != cid:
        raise CidersError(f"{state} is {cid}'s node, not {a.client}'s")
    out = export_edge_model(d, a.out, fmt=a.format, messenger=messenger, tokenizer=tok, gguf_dtype=a.gguf_dtype,
                            meta={"node_state_dir": str(state.resolve()), "client": cid, "record_round": rnd},
                            card=lambda info: model_card(info, cfg, None, cid))
    print(f"{cid}'s edge model (round {rnd} record; {d.split.edge_layers} layers, LoRA merged, {a.format}) "
          f"written to {out}")
    return 0


def _cmd_eval(a: argparse.Namespace) -> int:
    from ciders.workloads.evaluation import eval_run

    tasks = tuple(t.strip() for t in a.tasks.split(",") if t.strip()) if a.tasks else None
    out = eval_run(a.run_dir, tasks, a.path, a.messenger, a.limit)
    print(json.dumps({t: _brief(r) for t, r in out["tasks"].items()}, indent=2))
    return 0


def _brief(r: dict) -> dict:
    keep = ("ppl", "nll", "tokens", "exact_match", "strict_match", "flexible_extract", "correct", "questions",
            "rouge_l", "pass@1", "statuses", "tasks", "examples", "delta_cross", "diag_mean", "off_mean")
    return {k: r[k] for k in keep if k in r}


def _cmd_score_code(a: argparse.Namespace) -> int:
    from collections import Counter

    from ciders.eval import humaneval

    path = Path(a.completions)
    if not path.is_file():
        raise CidersError(f"completions file not found: {path}")
    recs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            recs.append({"task_id": str(r["task_id"]), "completion": str(r["completion"])})
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CidersError(f"{path}:{n}: expected {{\"task_id\", \"completion\"}} per line ({exc})") from exc
    if a.samples_per_task:
        counts = Counter(r["task_id"] for r in recs)
        bad = {t: c for t, c in counts.items() if c != a.samples_per_task}
        if bad:
            t, c = next(iter(bad.items()))
            raise CidersError(f"--samples-per-task {a.samples_per_task}: task {t} has {c} samples ({len(bad)} tasks differ)")
    ks = sorted({1, *(int(k) for k in a.k.split(",") if k.strip())}) if a.k else [1]
    if a.samples_per_task:
        ks = sorted({*ks, a.samples_per_task})
    probs = humaneval.load_problems(a.language, a.problems)
    res = humaneval.score(a.language, recs, probs, ks=tuple(ks), workers=a.workers)
    print(json.dumps(res))
    return 0


def _cmd_config(a: argparse.Namespace) -> int:
    from ciders.config import describe_keys, dump_yaml

    if a.keys:
        for key, default, help_ in describe_keys():
            print(f"{key:<34} {default:<28} {help_}")
        return 0
    print(dump_yaml(_load_cfg(a)), end="")
    return 0


def _cmd_cache(a: argparse.Namespace) -> int:
    from ciders.models.load import cache_dir, clear_cache, ensure_smollm2

    if a.clear:
        print(("removed " if clear_cache(a.clear) else "not cached: ") + a.clear)
        return 0
    if a.convert:
        if a.convert != "smollm2-135m":
            raise CidersError(f"--convert: only smollm2-135m is a built-in conversion, got {a.convert!r}")
        print(ensure_smollm2())
        return 0
    root = cache_dir() / "models"
    print(f"ciders cache: {cache_dir()}")
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.name.startswith("."):
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            print(f"  {p.name:<20} {size / 2**20:8.1f} MiB")
    return 0


def _finite(text: str) -> float:
    """argparse type: a float that is finite (float() also reads nan and inf)."""
    v = float(text)
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def _at_least(low: int):
    def check(text: str) -> int:
        v = int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return v

    check.__name__ = f"integer >= {low}"  # argparse names the type in its 'invalid ... value' message
    return check


def _seed(text: str) -> int:
    """argparse type: a seed in the range the config's `seed` key accepts."""
    from ciders.config import SEED_RANGE

    v = int(text)
    if not 0 <= v < SEED_RANGE:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {v}")
    return v


def _experiment_args(p: argparse.ArgumentParser, config_help: str, out_help: str) -> None:
    """The arguments every experiment command shares: CONFIG, --set overrides, --out, --force."""
    p.add_argument("config", help=config_help)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--out", help=out_help)
    _force_arg(p)


def _force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty --out that is not this command's earlier output (files with the "
                        "names it writes are replaced; nothing else is deleted)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ciders", description="Cloud-edge collaborative LLM fine-tuning (CIDERS)")
    ap.add_argument("--version", action="version", version=f"ciders {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="decomposition and payload sizes from a model config (no weights)")
    p.add_argument("model", help="hub id, model directory, config.json path, or built-in name")
    p.add_argument("--messenger-layers", "-a", type=int, required=True, help="a: top layers in the messenger")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--drop-ratio", type=_finite, help="1 - beta (default 0.2)")
    g.add_argument("--beta", type=_finite, help="compression rate in (0, 1]")
    g.add_argument("--student-layers", type=int, help="n' explicitly")
    p.add_argument("--rounding", choices=("round", "floor"), default="round")
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--student-lora-rank", type=int, default=None, help="default: --lora-rank")
    p.add_argument("--lora-alpha", type=_finite, default=16.0)
    p.add_argument("--lora-targets", default=None, help="comma-separated module names (default q,k,v,o,gate,up,down _proj)")
    p.add_argument("--upload-personalized-messenger", action="store_true",
                   help="count the client's messenger in the uplink (what the paper's Table VI counts)")
    m = p.add_argument_group("peak training memory (README: Sizing machines)")
    m.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the base weights' dtype (default: the checkpoint's)")
    m.add_argument("--batch-size", type=_at_least(1), default=2, help="client micro-batch (algorithm.batch_size)")
    m.add_argument("--seq-len", type=_at_least(1), default=512, help="tokens per example (data.max_length)")
    m.add_argument("--takd-batch-size", type=_at_least(1), default=4, help="takd.batch_size")
    m.add_argument("--public-examples", type=_at_least(1), default=500, help="examples in the teacher cache")
    p.add_argument("--json", action="store_true", help="emit JSON")
    p.set_defaults(fn=_cmd_plan)

    for name, fn, help_ in (("distill", _cmd_distill, "TAKD pre-alignment of B_L on public data (the demo job)"),):
        p = sub.add_parser(name, help=help_)
        _experiment_args(p, "experiment YAML", "run directory (default runs/<name>)")
        p.set_defaults(fn=fn)

    p = sub.add_parser("run", help="a federation (CIDERS or the baseline in algorithm.name)")
    _experiment_args(p, "experiment YAML", "run directory (default runs/<name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run in --out (same config), or a finished one for more rounds "
                        "(--set federation.rounds=N, larger: the only key that may change)")
    p.add_argument("--engine", choices=("local", "flower-sim"), default="local",
                   help="local: in this process (default); flower-sim: Flower's simulation runtime (Ray), one "
                        "virtual SuperNode per client; same config and seed give the same numbers")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars and no per-round lines on the console (OUT/run.log still gets every line)")
    p.set_defaults(fn=_cmd_run)

    from ciders.transports.flower.commands import add_parser as add_flower

    add_flower(sub)

    p = sub.add_parser("bilevel", help="RABO / RAFBO / FedMBO on a bilevel task (few-shot Omniglot, loss tuning)")
    _experiment_args(p, "bilevel experiment YAML (configs/cpu/rabo_*.yaml)", "output directory (default runs/<name>)")
    p.add_argument("--methods", default="rabo,rafbo,fedmbo",
                   help=f"comma-separated, of: {', '.join(_names('bilevel'))}")
    p.add_argument("--seeds", help="comma-separated seeds: a table of mean +- std over them (OUT/table.md)")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2",
                   help="a config key and its values, repeatable (e.g. task.n_way=5,20: Table II; "
                        "federation.clients=10,20,30,50: scalability); one table column per point")
    p.add_argument("--engine", choices=("local", "flower-sim"), default="local",
                   help="local: this process; flower-sim: Flower's simulation runtime (Ray), the same numbers")
    p.add_argument("--tune", action="append", metavar="KEY=V1,V2",
                   help="tune each method's step sizes on the tuning split (task.tune_per_class), repeatable: "
                        "rabo.* keys for the bilevel methods, fedmeta.* for the full-model baselines; then run the "
                        "winner at every --seeds (OUT/tune.md)")
    p.add_argument("--last-rounds", type=int, default=1, metavar="K",
                   help="tables: the final figure is the mean of the last K rounds' evaluations (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="continue each method from its last checkpoint (same config); tables always do")
    p.set_defaults(fn=_cmd_bilevel)

    p = sub.add_parser("compare", help="run several methods x seeds on the same data; write a Table III-shaped table")
    _experiment_args(p, "experiment YAML (the shared settings; each method fixes its own knobs)",
                     "comparison directory (default runs/compare-<name>); finished runs are reused")
    p.add_argument("--algorithms", default=None,
                   help=f"comma-separated, of: {', '.join(_names('ciders'))} "
                        "(default ciders-fo,ciders-fd,fedbiot,fedot,localot); for a RABO-family config the "
                        "`ciders bilevel --methods` names (default rabo,rafbo,fedmbo)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (mean +- std over them)")
    _control_arg(p)
    p.add_argument("--tune", action="append", metavar="KEY=V1,V2",
                   help="tune each method's client step size first, on the clients' validation parts "
                        "(federation.validation > 0), over this grid (repeatable; the same grid and budget for "
                        "every method), e.g. algorithm.lr=3e-4,1e-3,3e-3")
    p.add_argument("--tune-rounds", type=int, default=None, help="rounds of each tuning run (default: the config's)")
    p.set_defaults(fn=_cmd_compare)

    p = sub.add_parser("sweep", help="a comparison at every point of a config grid (compression sweep, ablations)")
    _experiment_args(p, "experiment YAML", "sweep directory (default runs/sweep-<name>)")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="a config key and its values (repeatable)")
    p.add_argument("--algorithms", default="ciders-fo,fedbiot,fedot", help="comma-separated methods")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--metrics", default="nll,stored_mib", help="columns per method (keys of ciders.report.tables.METRICS)")
    _control_arg(p)
    p.set_defaults(fn=_cmd_sweep)

    p = sub.add_parser("report", help="self-contained HTML page + PNG figures for a run, compare or sweep directory")
    p.add_argument("path", help="a run directory, a `ciders compare` directory or a `ciders sweep` directory")
    p.add_argument("--out", help="write DIR/report/ instead of PATH/report/")
    _force_arg(p)
    p.set_defaults(fn=_cmd_report)

    p = sub.add_parser("theory", help="Prop. 2 (docs/method.md) on synthetic clients: measured DR/PPR vs psi_t per round")
    p.add_argument("--clients", type=_at_least(1), default=5)
    p.add_argument("--dim", type=_at_least(1), default=16)
    p.add_argument("--K", type=int, default=5)
    p.add_argument("--eta", type=_finite, default=0.05)
    p.add_argument("--gamma", type=_finite, default=0.5)
    p.add_argument("--alpha", type=_finite, default=0.1)
    p.add_argument("--eps-prox", type=_finite, default=0.0)
    p.add_argument("--tau", type=_finite, default=0.02)
    p.add_argument("--rounds", type=_at_least(0), default=30)
    p.add_argument("--loss", choices=("linear", "quadratic"), default="linear")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--consensus-space", choices=("update", "gradient", "paper"), default="update",
                   help="algorithm.consensus_space (all three agree under SGD without clipping, as here)")
    p.add_argument("--json", action="store_true", help="one JSON object per round")
    p.set_defaults(fn=_cmd_theory)

    p = sub.add_parser("export", help="write the edge model (AdapEmu, LoRA merged) as an HF directory, ONNX or GGUF")
    p.add_argument("run_dir", help="a run directory, or a Flower node's state directory (exports its own model)")
    p.add_argument("--out", required=True, help="the edge model's directory (a new or empty one, or an earlier export)")
    p.add_argument("--format", choices=("hf", "onnx", "gguf"), default="hf",
                   help="hf: transformers directory; onnx: onnxruntime with a KV cache; gguf: llama.cpp (docs/edge.md)")
    p.add_argument("--gguf-dtype", choices=("f32", "f16", "q8_0"), default="f32",
                   help="GGUF matrices' type; q8_0: 8-bit blocks, as llama.cpp's converter writes them (norms stay f32)")
    _force_arg(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--messenger", help="PEFT messenger directory to use instead of the run's global one")
    g.add_argument("--client", help="use this client's personalized messenger from the run's client store")
    p.set_defaults(fn=_cmd_export)

    p = sub.add_parser("eval", help="evaluate a run's model: ppl, gsm8k, rouge_l, humaneval:LANG, nll_matrix")
    p.add_argument("run_dir")
    p.add_argument("--tasks", help="comma-separated (default: ppl plus the run's eval.tasks)")
    p.add_argument("--path", default="adapemu", choices=("adapemu", "adapfu", "teacher"),
                   help="edge path (messenger + B_L), full path (messenger + B_F), or the pretrained model")
    p.add_argument("--messenger", default="global", help="global, or client:ID for a personalized messenger")
    p.add_argument("--limit", type=_at_least(1), help="evaluate only the first N examples of each task")
    p.set_defaults(fn=_cmd_eval)

    p = sub.add_parser("score-code", help="score pre-generated HumanEval-X completions in the sandbox (pass@k)")
    p.add_argument("--language", required=True, choices=("python", "java", "go"))
    p.add_argument("--completions", required=True, help="jsonl: {task_id, completion} per line")
    p.add_argument("--samples-per-task", type=_at_least(1), help="completions per task (checked); adds pass@N")
    p.add_argument("--k", help="comma-separated k for pass@k (default 1)")
    p.add_argument("--problems", help="problems file (default $CIDERS_DATA/humaneval-x/humaneval_<lang>.jsonl.gz)")
    p.add_argument("--workers", type=_at_least(1), default=2, help="concurrent sandboxed programs")
    p.set_defaults(fn=_cmd_score_code)

    p = sub.add_parser("config", help="print the resolved config, or every key with its default and help")
    p.add_argument("config", nargs="?")
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--keys", action="store_true")
    p.set_defaults(fn=_cmd_config)

    p = sub.add_parser("cache", help="show, fill or clear the model cache ($CIDERS_CACHE)")
    p.add_argument("--clear", metavar="NAME")
    p.add_argument("--convert", metavar="NAME", help="convert a built-in model now (smollm2-135m)")
    p.set_defaults(fn=_cmd_cache)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except CidersError as exc:
        print(f"ciders: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ciders: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `ciders config --keys | head`
        return 0
    except Exception as exc:  # the machine's limits, met below code that could not name them
        err = _storage(exc) or _out_of_memory(exc)
        if err is None:
            raise
        print(f"ciders: error: {err}", file=sys.stderr)
        return 2


def _out_of_memory(exc: BaseException) -> CidersError | None:
    """A config whose sizes do not fit in memory (e.g. task.width: 1e8): torch raises MemoryError, its
    OutOfMemoryError (CUDA) or a RuntimeError from the CPU allocator."""
    text = str(exc)
    oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()))
    if not oom:
        return None
    tried = re.search(r"tried to allocate ([^;]+?)(?:\. |[.;]?$)", text, re.IGNORECASE)
    return CidersError(f"out of memory{f' (tried to allocate {tried.group(1)})' if tried else ''}: the config's "
                       "sizes (model, batch sizes, widths, clients in memory) do not fit this machine; make them "
                       "smaller")


def _storage(exc: BaseException) -> CidersError | None:
    """The one-line error for a failure caused by a full or read-only disk (also as the cause of another
    exception), else None. Permission errors keep their traceback here: they need not come from a write."""
    from ciders.fileio import FULL_OR_READ_ONLY, storage_error

    for e in (exc, exc.__cause__, exc.__context__):
        if e is not None and (err := storage_error(e, getattr(e, "filename", None) or "a file",
                                                   FULL_OR_READ_ONLY)) is not None:
            return err
    return None


if __name__ == "__main__":
    sys.exit(main())
