"""Benchmarks are tested code: every script in benchmarks/ runs end to end with `--smoke` (the tiny built-in model,
one repeat, no dataset) and its `--json` line carries the keys its module docstring lists, each a finite number or a
container of finite numbers; benchmarks/summary.py finds its headline figures there, and `make bench` runs it. A
refactor that breaks a benchmark's imports or its output fails here, not months later in `make bench`."""

import ast
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = ROOT / "benchmarks"
HELPERS = {"common", "summary"}  # shared code, not benchmarks
# every benchmark and the marks of its smoke: edge_client and edge_quantized deploy Flower on loopback (SuperLink,
# SuperNodes, ClientApps), so they run in the Flower suite (`make test`, CI); the rest in the default suite
SMOKES = {"client_step": (), "consensus_units": (), "edge_client": (pytest.mark.flower,), "edge_download": (),
          "edge_quantized": (pytest.mark.flower,),
          "edge_export": (), "fd_accuracy": (), "hypergrad_cost": (), "round_profile": (), "secagg_cost": (),
          "submodel_cost": (), "takd_round": (), "paper_shape": ()}
TIMEOUT_S = 600  # a smoke takes seconds; this only stops a hung one on a loaded machine


def load_summary():
    spec = importlib.util.spec_from_file_location("bench_summary", BENCH / "summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


summary = load_summary()


def scripts() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS)


def documented_keys(name: str) -> list[str]:
    """The paths of the module docstring's `--json keys:` paragraph (parenthesised notes dropped)."""
    doc = ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text())) or ""
    m = re.search(r"^--json keys:(.*?)(?:\n\s*\n|\Z)", doc, re.M | re.S)
    if m is None:
        return []
    text = re.sub(r"\(.*?\)", "", m.group(1), flags=re.S)
    return [k.strip() for k in text.split(",") if k.strip()]


def problems(res: dict, keys: list[str]) -> list[str]:
    """What is wrong with a --json object against its documented keys: a key that matches nothing, or a value that
    is not a finite number or a container of finite numbers."""
    bad = []
    for key in keys:
        hits = summary.resolve(res, key)
        if not hits:
            bad.append(f"{key}: missing")
        bad += [f"{path}: {v!r} is not finite" for path, v in hits if not summary.finite(v)]
    return bad


def run_smoke(name: str, cwd) -> dict:
    """The benchmark's `--smoke --json` run, from a scratch directory; the object on its last stdout line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--json"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{name} --smoke failed:\n{proc.stderr[-4000:]}"
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1]
    assert last.startswith("{") and last.endswith("}"), f"the last stdout line is not one JSON object: {last[:200]}"
    return summary.last_json_line(proc.stdout)


def test_every_benchmark_has_a_smoke_documented_keys_headlines_and_a_make_bench_line():
    """A new script in benchmarks/ cannot skip the smoke, the key list, the summary or `make bench`."""
    assert scripts() == sorted(SMOKES), "add the new benchmark to SMOKES (and summary.HEADLINES, make bench)"
    assert sorted(summary.HEADLINES) == sorted(SMOKES)
    assert [n for n in SMOKES if not documented_keys(n)] == []
    bench = re.search(r"^bench:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    ran = set(re.findall(r"benchmarks/(\w+)\.py --json > \$\(BENCH_OUT\)/\1\.json", bench))
    assert ran == set(SMOKES) and "benchmarks/summary.py $(BENCH_OUT)" in bench


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, m in SMOKES.items()])
def test_smoke_runs_and_reports_its_documented_keys(name, tmp_path):
    res = run_smoke(name, tmp_path)
    assert problems(res, documented_keys(name)) == []
    heads = summary.headlines(name, res)
    assert [p for p, v in heads.items() if not summary.finite(v)] == []


def test_the_key_checker_finds_missing_keys_and_non_finite_values():
    res = {"a": 1.0, "b": {"x": float("nan"), "y": 2}, "rows": [{"v": 1}, {"v": "s"}], "c": math.inf, "d": [1, 2]}
    assert problems(res, ["a", "d", "rows.0"]) == []
    assert problems(res, ["zz", "b.*", "rows.*.v", "c", "b"]) == [
        "zz: missing", "b.x: nan is not finite", "rows.1.v: 's' is not finite", "c: inf is not finite",
        "b: {'x': nan, 'y': 2} is not finite"]
    assert documented_keys("secagg_cost")[:2] == ["up_ratio_range", "down_kib_range"]


def test_summary_prints_the_table_writes_summary_json_and_fails_on_a_missing_result(tmp_path):
    (tmp_path / "secagg_cost.json").write_text("human text on stdout before it\n" + summary.json.dumps(
        {"up_ratio_range": [2.0, 2.04], "down_kib_range": [6, 25], "client_s_range": [0.02, 0.09],
         "server_s_range": [0.02, 0.49], "max_abs_error": 2.1e-7}) + "\n")
    (tmp_path / "takd_round.json").write_text('{"speedup_cache": 1.3,\n "indented": true}\n')
    proc = subprocess.run([sys.executable, str(BENCH / "summary.py"), str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1  # benchmarks without a result
    assert "up_ratio_range 2 - 2.04" in proc.stdout and len(proc.stdout.splitlines()) < 50
    s = summary.json.loads((tmp_path / "summary.json").read_text())
    assert s["figures"]["secagg_cost"]["max_abs_error"] == 2.1e-7
    assert "takd_round" in s["failed"] and "client_step" in s["failed"] and re.fullmatch(r"\w+(\+dirty)?", s["commit"])
