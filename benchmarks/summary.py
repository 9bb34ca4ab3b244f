"""The one-screen summary that `make bench` ends with: the headline figures of every benchmark, read from the
`--json` line each one left in the run directory (<name>.json, the benchmark's stdout), printed as one table and
written beside them as summary.json with the date and the commit they were measured at. The README's performance
figures are copied from this table.

    python benchmarks/summary.py RUN_DIR      (make bench: runs/bench)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# benchmark -> the figures the README quotes, as paths into its --json object (`*`: every entry, each its own row)
HEADLINES: dict[str, list[str]] = {
    "client_step": ["fo_over_plain", "fd_over_plain", "fd_probes_over_plain", "fo_over_floor", "fd_over_floor",
                    "fd_probes_over_floor", "mfu", "peak_tensor_mib.*", "peak_rss_mib.plain"],
    "takd_round": ["speedup_cache", "ckpt_over_cache", "build_s", "peak_tensor_mib.*"],
    "round_profile": ["wall_s", "shares.*"],
    "consensus_units": ["delta_over_grad_paper", "corr_over_target_paper", "corr_over_target_gradient",
                        "corr_over_target_update"],
    "fd_accuracy": ["rel_err_fp32", "rel_err_bf16", "old_rel_err_bf16"],
    "hypergrad_cost": ["rafbo_over_rabo_seconds", "rel_err"],
    "submodel_cost": ["mean_over_mix.flops_fraction", "mean_over_mix.params_fraction", "mean_over_mix.down_fraction",
                      "mean_over_mix.up_fraction", "mean_over_mix.mean_r_squared"],
    "edge_download": ["full_model_mib", "downloads.bfloat16.mib", "downloads.bfloat16.ppl_change",
                      "downloads.float16.ppl_change"],
    "edge_client": ["*.warm.per_message_overhead_s", "*.warm.compute_s", "*.overhead_over_compute_warm",
                    "*.cold.per_message_overhead_s", "*.full_model_files_opened"],
    "edge_quantized": ["modes.int8.first_contact_mib", "diff.client_peak_rss_mib.mean", "diff.compute_s.mean",
                       "diff.server_nll.mean", "diff.edge_nll.mean"],
    "edge_export": ["onnx_mib", "gguf_mib", "onnx_tok_per_s", "torch_tok_per_s", "same_tokens"],
    "secagg_cost": ["up_ratio_range", "down_kib_range", "client_s_range", "server_s_range", "max_abs_error"],
    "paper_shape": ["models.*.steps.*.peak_mib", "models.*.steps.*.ratio"],
}


def resolve(obj, path: str) -> list[tuple[str, object]]:
    """(concrete path, value) of every match of a dotted path; `*` matches every entry of a dict or list, a number
    one entry of a list. No match is an empty list (a missing key is the caller's finding, not an exception)."""
    found = [("", obj)]
    for part in path.split("."):
        nxt = []
        for where, v in found:
            if part == "*" and isinstance(v, dict):
                nxt += [(f"{where}.{k}".lstrip("."), x) for k, x in v.items()]
            elif part == "*" and isinstance(v, list):
                nxt += [(f"{where}.{i}".lstrip("."), x) for i, x in enumerate(v)]
            elif isinstance(v, dict) and part in v:
                nxt.append((f"{where}.{part}".lstrip("."), v[part]))
            elif isinstance(v, list) and part.isdigit() and int(part) < len(v):
                nxt.append((f"{where}.{part}".lstrip("."), v[int(part)]))
        found = nxt
    return found


def numbers(v) -> list[float]:
    """Every number in a value, recursively; a string, None or bool inside is not a figure and raises."""
    if isinstance(v, bool) or not isinstance(v, (int, float, list, dict)):
        raise TypeError(f"{v!r} is not a number")
    if isinstance(v, dict):
        return [x for y in v.values() for x in numbers(y)]
    if isinstance(v, list):
        return [x for y in v for x in numbers(y)]
    return [float(v)]


def finite(v) -> bool:
    try:
        vals = numbers(v)
    except TypeError:
        return False
    return bool(vals) and all(math.isfinite(x) for x in vals)


def last_json_line(text: str) -> dict:
    """The object on the last non-empty line of a benchmark's stdout (the --json convention of common.emit)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("no output")
    obj = json.loads(lines[-1])
    if not isinstance(obj, dict):
        raise ValueError(f"the last line is a JSON {type(obj).__name__}, not an object")
    return obj


def headlines(name: str, res: dict) -> dict[str, object]:
    """{concrete path: value} of a benchmark's headline figures; a path that matches nothing maps to None."""
    out: dict[str, object] = {}
    for path in HEADLINES[name]:
        hits = resolve(res, path)
        out.update({p: v for p, v in hits} if hits else {path: None})
    return out


def commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def fmt(v) -> str:
    if v is None:
        return "missing"
    if isinstance(v, list):
        return " - ".join(fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def summarise(run: Path) -> dict:
    """{"date", "commit", "figures": {benchmark: {path: value}}, "failed": {benchmark: why}} from a run directory."""
    figures, failed = {}, {}
    for name in HEADLINES:
        f = run / f"{name}.json"
        if not f.is_file():
            failed[name] = f"not run (no {f.name})"
            continue
        try:
            figures[name] = headlines(name, last_json_line(f.read_text()))
        except ValueError as e:  # it failed before its --json line, or printed something else last
            failed[name] = f"{type(e).__name__}: {e}"
    return {"date": datetime.date.today().isoformat(), "commit": commit(), "figures": figures, "failed": failed}


def print_table(s: dict, width: int = 118) -> None:
    """Each benchmark's figures as `path value` pairs, wrapped under its name: one screen for all of them."""
    print(f"benchmark summary, {s['date']}, commit {s['commit']}")
    for name, figs in s["figures"].items():
        line = f"  {name:<16}"
        for path, v in figs.items():
            item = f"{path} {fmt(v)};  "
            if len(line) + len(item) > width and line.strip() != name:
                print(line.rstrip())
                line = " " * 18
            line += item
        print(line.rstrip().rstrip(";"))
    for name, why in s["failed"].items():
        print(f"  {name:<16}no result: {why[:width - 30]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="the directory of the benchmarks' <name>.json outputs")
    run = ap.parse_args().run
    s = summarise(run)
    print_table(s)
    (run / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    missing = any(v is None for figs in s["figures"].values() for v in figs.values())
    return 1 if s["failed"] or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
