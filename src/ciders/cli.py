"""`ciders` command line. Every user-facing failure is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ciders import __version__
from ciders.errors import CidersError


def _cmd_plan(a: argparse.Namespace) -> int:
    from ciders.config import DEFAULT_LORA_TARGETS, LoraConfig
    from ciders.models.plan import make_plan, render

    targets = tuple(t.strip() for t in a.lora_targets.split(",") if t.strip()) if a.lora_targets else DEFAULT_LORA_TARGETS
    msg = LoraConfig(r=a.lora_rank, alpha=a.lora_alpha, targets=targets)
    stu = LoraConfig(r=a.student_lora_rank or a.lora_rank, alpha=a.lora_alpha, targets=targets)
    msg.validate("--lora-rank"), stu.validate("--student-lora-rank")
    p = make_plan(a.model, a.messenger_layers, beta=a.beta, drop_ratio=a.drop_ratio, student_layers=a.student_layers,
                  rounding=a.rounding, messenger_lora=msg, student_lora=stu,
                  upload_personalized_messenger=a.upload_personalized_messenger)
    print(json.dumps(p.to_dict(), indent=2) if a.json else render(p))
    return 0


def _load_cfg(a: argparse.Namespace):
    from ciders.config import load_config

    return load_config(a.config, a.set or [])


def _cmd_distill(a: argparse.Namespace) -> int:
    from ciders.engines.prealign import run_prealign

    cfg = _load_cfg(a)
    out = Path(a.out) if a.out else Path("runs") / cfg.name
    run_prealign(cfg, out)
    print(f"run directory: {out}")
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from ciders.config import load_config
    from ciders.engines.prealign import build
    from ciders.models.export import export_edge_model

    run = Path(a.run_dir)
    if not (run / "config.yaml").is_file():
        raise CidersError(f"{run}: not a run directory (no config.yaml)")
    cfg = load_config(run / "config.yaml")
    d, tok = build(cfg)
    messenger = d.read_adapter(Path(a.messenger) if a.messenger else run / "adapters" / "messenger", "messenger")
    student = d.read_adapter(run / "adapters" / "student", "student")
    out = export_edge_model(d, a.out, messenger=messenger, student=student, tokenizer=tok,
                            meta={"run_dir": str(run.resolve())})
    print(f"edge model ({d.split.edge_layers} layers, LoRA merged) written to {out}")
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ciders", description="Cloud-edge collaborative LLM fine-tuning (CIDERS)")
    ap.add_argument("--version", action="version", version=f"ciders {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="decomposition and payload sizes from a model config (no weights)")
    p.add_argument("model", help="hub id, model directory, config.json path, or built-in name")
    p.add_argument("--messenger-layers", "-a", type=int, required=True, help="a: top layers in the messenger")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--drop-ratio", type=float, help="1 - beta (default 0.2)")
    g.add_argument("--beta", type=float, help="compression rate in (0, 1]")
    g.add_argument("--student-layers", type=int, help="n' explicitly")
    p.add_argument("--rounding", choices=("round", "floor"), default="round")
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--student-lora-rank", type=int, default=None, help="default: --lora-rank")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-targets", default=None, help="comma-separated module names (default q,k,v,o,gate,up,down _proj)")
    p.add_argument("--upload-personalized-messenger", action="store_true",
                   help="count the client's messenger in the uplink (what the paper's Table VI counts)")
    p.add_argument("--json", action="store_true", help="emit JSON")
    p.set_defaults(fn=_cmd_plan)

    for name, fn, help_ in (("distill", _cmd_distill, "TAKD pre-alignment of B_L on public data (the demo job)"),):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", help="experiment YAML")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
        p.add_argument("--out", help="run directory (default runs/<name>)")
        p.set_defaults(fn=fn)

    p = sub.add_parser("export", help="write the edge model (AdapEmu, LoRA merged) as a plain HF directory")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--messenger", help="PEFT messenger directory to use instead of the run's (e.g. a personalized one)")
    p.set_defaults(fn=_cmd_export)

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


if __name__ == "__main__":
    sys.exit(main())
