"""HumanEval-X pass@k (Protocol A; docs/method.md#experiments-and-metrics): assemble each completion with the
benchmark's own test harness as CodeGeeX does, compile and run it in the sandbox, and estimate pass@k without bias.

  python : prompt + completion + "\\n" + test + print(token)   (the test ends with check(<entry point>))
  java   : prompt + completion + "\\n" + test + class CidersCheck (runs Main.main, then prints the token)
           in Main.java (class Solution + public class Main), javac, java CidersCheck
  go     : test_setup + import + prompt without its import block + completion + test, in main_test.go, and
           a TestMain printing the token in ciders_check_test.go; `go test` against Debian's testify
           (GO111MODULE=off, GOPATH=/usr/share/gocode)
The token is a fresh secret per sample; the sandbox passes a sample only if it exits 0 with the token on
stdout, so a completion that exits early with status 0 (sys.exit, System.exit, os.Exit) fails.
Toolchains come from Debian (python3, default-jdk, golang-go, golang-github-stretchr-testify-dev).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import secrets
import shutil
import subprocess
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from ciders.errors import CidersError
from ciders.eval.sandbox import Job, Limits, Result, Sandbox
from ciders.tasks.paths import data_root

LANGUAGES = ("python", "java", "go")
JVM = ["-Xmx256m", "-Xss8m", "-XX:+UseSerialGC", "-XX:CompressedClassSpaceSize=64m",
       "-XX:ReservedCodeCacheSize=48m", "-XX:MaxMetaspaceSize=128m", "-XX:TieredStopAtLevel=1"]
GOPATH = "/usr/share/gocode"
PY_HELPER = ["import math", "import re", "import sys", "import copy", "import datetime", "import itertools",
             "import collections", "import heapq", "import statistics", "import functools", "import hashlib",
             "import string", "from typing import *", "from collections import *"]
GO_HELPER = ["math", "strings", "fmt", "strconv", "time", "bytes", "regexp", "sort", "math/rand", "crypto/md5"]
# Where generation stops (the function body is complete); CodeGeeX-style stop sequences.
STOPS = {
    "python": ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert"],
    "java": ["\npublic static void main", "\nclass ", "\npublic class"],
    "go": ["\nfunc main", "\nfunc Test", "\ntype ", "\npackage "],
}
LIMITS = {"python": Limits(wall_s=15, cpu_s=10, memory_mb=1024, nproc=32),
          "java": Limits(wall_s=30, cpu_s=30, memory_mb=1536, nproc=96),
          "go": Limits(wall_s=60, cpu_s=60, memory_mb=1536, nproc=128)}


def problems_path(language: str) -> Path:
    return data_root() / "humaneval-x" / f"humaneval_{language}.jsonl.gz"


def load_problems(language: str, path: str | Path | None = None) -> list[dict]:
    """The 164 problems of one language, from a local jsonl(.gz) (default: $CIDERS_DATA/humaneval-x)."""
    if language not in LANGUAGES:
        raise CidersError(f"language {language!r} is not supported (use {', '.join(LANGUAGES)})")
    p = Path(path) if path else problems_path(language)
    if not p.is_file():
        raise CidersError(f"HumanEval-X {language} problems not found at {p} (set CIDERS_DATA or pass a path)")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate(language: str, completion: str) -> str:
    """Cut a generated completion at the first stop sequence (generation runs past the function)."""
    cut = len(completion)
    for s in STOPS[language]:
        i = completion.find(s)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut]


def program(language: str, problem: dict, completion: str,
            token: str) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """(files, command, env) that run one completion against the problem's tests and print `token` only once
    the tests have run to the end (the sandbox passes a sample only with that token on stdout, so a completion
    that exits early with status 0 fails)."""
    if language == "python":
        code = ("\n".join(PY_HELPER) + "\n" + problem["prompt"] + completion + "\n" + problem["test"] + "\n"
                + f"print({token!r}, flush=True)\n")
        return {"prog.py": code}, [python_executable(), "prog.py"], {}
    if language == "java":
        jflags = " ".join(JVM)
        jcflags = " ".join("-J" + f for f in JVM)
        # a second class runs the benchmark's Main.main and prints the token if it returned normally
        runner = ("class CidersCheck {\n    public static void main(String[] args) throws Throwable {\n"
                  f"        Main.main(args);\n        System.out.println(\"{token}\");\n        System.out.flush();\n"
                  "    }\n}\n")
        return ({"Main.java": problem["prompt"] + completion + "\n" + problem["test"] + "\n" + runner},
                ["/bin/sh", "-c", f"javac {jcflags} -encoding UTF-8 Main.java && java {jflags} CidersCheck"], {})
    if language == "go":
        setup = problem["test_setup"]
        imp = problem.get("import", "")
        prompt = problem["prompt"].replace(imp, "") if imp else problem["prompt"]
        extra = [f'"{pkg}"' for pkg in GO_HELPER if pkg not in setup and pkg.split("/")[-1] + "." in completion]
        imports = ("import (\n" + "".join(f"    {p}\n" for p in extra) + ")\n") if extra else ""
        code = setup + "\n" + imports + prompt + completion + "\n" + problem["test"] + "\n"
        env = {"GOPATH": GOPATH, "GO111MODULE": "off", "GOFLAGS": "-count=1", "GOCACHE": "$WORK/.gocache",
               "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}
        # local directory mode (`go test`, no package): the test binary's stdout is shown even when it passes
        return {"main_test.go": code, "ciders_check_test.go": _go_check(token)}, ["go", "test"], env
    raise CidersError(f"language {language!r} is not supported")


def _go_check(token: str) -> str:
    """A TestMain, in a file of its own (own imports, aliased): the token only after every test passed."""
    return ('package main\n\nimport (\n    ciders_fmt "fmt"\n    ciders_os "os"\n    ciders_testing "testing"\n)\n\n'
            "func TestMain(m *ciders_testing.M) {\n    code := m.Run()\n    if code == 0 {\n"
            f'        ciders_fmt.Println("{token}")\n    }}\n    ciders_os.Exit(code)\n}}\n')


@lru_cache(maxsize=1)
def python_executable() -> str:
    """A Python the unprivileged sandbox user can run (ours may live under /root)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(cand, os.X_OK):
            return cand
    return shutil.which("python3") or "python3"


def check_toolchain(language: str) -> None:
    need = {"python": [python_executable()], "java": ["javac", "java"], "go": ["go"]}[language]
    missing = [t for t in need if shutil.which(t) is None and not os.access(t, os.X_OK)]
    if language == "go" and not Path(GOPATH, "src/github.com/stretchr/testify/assert").is_dir():
        missing.append("golang-github-stretchr-testify-dev")
    if missing:
        pkgs = {"python": "python3", "java": "default-jdk", "go": "golang-go golang-github-stretchr-testify-dev"}
        raise CidersError(f"HumanEval-X {language} needs {', '.join(missing)}: apt-get install {pkgs[language]}")


class _GoCache:
    """A build cache with testify compiled once; each sample gets a hardlinked (root mode) or copied
    private view, so no sample recompiles testify (3.4 s -> 0.4 s) and none can alter the shared one."""

    def __init__(self, root: Path):
        self.dir = root / "go-warm-cache"
        if not (self.dir / "READY").exists():
            src = root / "go-warm-src"
            src.mkdir(parents=True, exist_ok=True)
            (src / "main_test.go").write_text('package main\nimport (\n "testing"\n "github.com/stretchr/testify/assert"\n)\n'
                                              'func TestWarm(t *testing.T) { assert.Equal(t, 1, 1) }\n')
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(src), "GOPATH": GOPATH,
                   "GO111MODULE": "off", "GOCACHE": str(self.dir), "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}
            r = subprocess.run(["go", "test", "-count=1", "."], cwd=src, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise CidersError(f"cannot build the Go test harness: {r.stderr.strip()[:300]}")
            (self.dir / "READY").write_text("ok")

    def prepare(self, work: Path, uid: int | None) -> None:
        dst = work / ".gocache"
        if uid is not None:
            subprocess.run(["cp", "-al", str(self.dir), str(dst)], check=True)  # root-owned files: read-only to the sample
        else:
            shutil.copytree(self.dir, dst)


class Scorer:
    """Score completions of one or more languages with one sandbox."""

    def __init__(self, workers: int = 2, work_root: str | Path | None = None):
        self.sandbox = Sandbox(workers=workers, root=work_root)
        self._go: _GoCache | None = None
        self._root = Path(work_root) if work_root else Path(os.environ.get("CIDERS_CACHE", Path.home() / ".cache" / "ciders"))

    def job(self, language: str, problem: dict, completion: str) -> Job:
        token = secrets.token_hex(16)  # fresh per sample: no completion can know it in advance
        files, cmd, env = program(language, problem, completion, token)
        prepare = None
        if language == "go":
            if self._go is None:
                self._go = _GoCache(self._root)
            prepare = self._go.prepare
        return Job(cmd, files, env, LIMITS[language], prepare, pass_token=token)

    def run(self, language: str, problems: Sequence[dict], completions: Sequence[str], progress=None) -> list[Result]:
        check_toolchain(language)
        jobs = [self.job(language, p, c) for p, c in zip(problems, completions)]
        return self.sandbox.map(jobs, progress)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def score(language: str, completions: Iterable[dict], problems: Sequence[dict] | None = None, ks=(1,),
          workers: int = 2, progress=None) -> dict:
    """human-eval's convention: records {task_id, completion}; several per task for pass@k > 1."""
    problems = problems if problems is not None else load_problems(language)
    by_id = {p["task_id"]: p for p in problems}
    samples = list(completions)
    unknown = sorted({s["task_id"] for s in samples} - set(by_id))
    if unknown:
        raise CidersError(f"{len(unknown)} completions name unknown task ids (e.g. {unknown[0]!r}) for {language}")
    results = Scorer(workers).run(language, [by_id[s["task_id"]] for s in samples], [s["completion"] for s in samples],
                                  progress)
    per_task: dict[str, list[Result]] = defaultdict(list)
    for s, r in zip(samples, results):
        per_task[s["task_id"]].append(r)
    out = {"language": language, "tasks": len(per_task), "samples": len(samples)}
    for k in ks:
        vals = [pass_at_k(len(rs), sum(r.passed for r in rs), k) for rs in per_task.values() if len(rs) >= k]
        out[f"pass@{k}"] = sum(vals) / len(vals) if vals else float("nan")
    statuses: dict[str, int] = defaultdict(int)
    for r in results:
        statuses[r.status] += 1
    out["statuses"] = dict(statuses)
    out["failed_tasks"] = sorted(t for t, rs in per_task.items() if not any(r.passed for r in rs))
    return out
