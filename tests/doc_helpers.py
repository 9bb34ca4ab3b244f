"""The `ciders ...` commands shown in README.md and docs/*.md, and what the tests that run them as written share.

A line is a *synopsis* when it holds a placeholder (RUN_DIR, EXPERIMENT.yaml, N, i, `a|b`, `[...]`, `<x>`, `...`):
only its subcommand is checked. Every other (*concrete*) line is run as written, from the root of a copy of a fresh
checkout, by one of these tests (`test_doc_commands.test_every_concrete_documented_command_runs_as_written_somewhere`
checks that each concrete line is claimed):

- `test_doc_commands.py`: the quick ones (`theory`, `config`, local runs of configs/tiny.yaml), to completion;
- `test_doc_commands.py`, flower suite: the Flower simulation and `loopback` lines, to completion;
- `transports/test_flower_docs.py`, flower suite: docs/flower.md's role-per-host block, and the "real hosts"
  lines that name no user path (`superlink --bind 0.0.0.0`, `register fleet ...`) inside that workflow;
- `test_doc_commands_long.py`, docs suite (`make test` runs it last, `make test-docs` alone): `compare`, `sweep`,
  `bilevel` (hours on 2 cores) until their first run has committed its first round, and `report` on the comparison
  the compare line wrote.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{2,}\b|\.\.\.|\[|\||<|(?<= )[Ni](?= |$)")  # RUN_DIR, a|b, [--x], N


def doc_commands() -> list[tuple[str, str]]:
    """(where, command) for every `ciders` line in a bash / sh / console block, continuations joined."""
    out = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        in_block, i = False, 0
        while i < len(lines):
            line = lines[i]
            if line.strip().startswith("```"):
                in_block = not in_block and line.strip()[3:].strip() in ("bash", "sh", "console", "shell")
                i += 1
                continue
            if in_block:
                start = i
                text = line.strip()
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                text = text[2:] if text.startswith("$ ") else text
                if text.startswith("ciders "):
                    out.append((f"{doc.relative_to(ROOT)}:{start + 1}", text))
            i += 1
    return out


COMMANDS = doc_commands()


def synopsis(text: str) -> bool:
    return bool(PLACEHOLDER.search(text.split("#")[0]))


CONCRETE = [(w, t) for w, t in COMMANDS if not synopsis(t)]


def argv(text: str) -> list[str]:
    """The words after `ciders`, as the shell splits them (comments and a trailing `&` dropped)."""
    return [w for w in shlex.split(text, comments=True) if w != "&"][1:]


def bash_block(doc: Path, containing: str) -> list[str]:
    """The lines of the bash block of `doc` that holds `containing`, continuations joined."""
    blocks, cur = [], None
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            if cur is None and line.strip()[3:].strip() == "bash":
                cur = []
            elif cur is not None:
                blocks.append(cur)
                cur = None
        elif cur is not None:
            if cur and cur[-1].endswith("\\"):
                cur[-1] = cur[-1][:-1] + " " + line.strip()
            else:
                cur.append(line.strip())
    (block,) = [b for b in blocks if any(containing in x for x in b)]
    return [x for x in block if x and not x.startswith("#")]


def documented(prefix: str, containing: str = "") -> list[str]:
    """Every documented line (synopses too) that starts with `prefix` and holds `containing` (at least one)."""
    found = [t for _, t in COMMANDS if t.startswith(prefix) and containing in t]
    assert found, f"no documented command starts with {prefix!r} any more: update the test that runs it"
    return found


def lines_starting(prefix: str) -> list[str]:
    """The concrete documented lines that start with `prefix`, in document order (at least one)."""
    found = [t for _, t in CONCRETE if t.startswith(prefix)]
    assert found, f"no documented command starts with {prefix!r} any more: update the test that runs it"
    return found


def checkout_copy(tmp: Path) -> Path:
    """The tracked files a fresh checkout has, that these commands read (configs and the vendored data)."""
    files = subprocess.run(["git", "ls-files", "configs", "data"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        (tmp / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tmp / f)
    return tmp


def shell_env(extra: dict | None = None) -> dict:
    """The environment a user's shell has after `make install`: the virtualenv's `ciders` first on PATH, and
    CIDERS_DATA absolute (the commands run in the checkout copy, where a relative one would not resolve)."""
    from ciders.tasks.paths import data_root

    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["CIDERS_DATA"] = str(data_root().resolve())
    env.update(extra or {})
    return env


def ciders(words: list[str]) -> list[str]:
    """The argv of a documented `ciders WORDS...` line: the installed console script, as a shell would find it."""
    exe = Path(sys.executable).parent / "ciders"
    return [str(exe), *words] if exe.is_file() else [sys.executable, "-m", "ciders.cli", *words]


LONG_COMMANDS = ("compare", "sweep", "bilevel")


def make_commands(makefile: Path = ROOT / "Makefile") -> list[tuple[str, str]]:
    """(target, command) for every `ciders` line of the Makefile's recipes, continuations joined, the shell loop
    variable `$$P` of a `for P in A B; do` line expanded to each of its values and the `|| exit 1;` tails dropped."""
    out, target, loop = [], "", ["$$P"]
    lines = makefile.read_text().splitlines()
    i = 0
    while i < len(lines):
        text = lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        if text and not text[0].isspace() and ":" in text:
            target, loop = text.split(":", 1)[0], ["$$P"]
        m = re.search(r"for P in ([^;]+); do", text)
        if m:
            loop = m.group(1).split()
        for part in text.split("$(BIN)/ciders ")[1:]:  # a loop's body joins several commands into one line
            cmd = "ciders " + re.split(r"\|\||;", part)[0].strip()
            out += [(target, cmd.replace("$$P", v)) for v in loop]
    return out  # hours on 2 cores: the docs suite runs them to a first round


def sub_runs(words: list[str], root: Path = ROOT) -> list[tuple[Path, object]]:
    """(run directory relative to `root`, its effective config) of every run a documented `compare`, `sweep` or
    `bilevel` line makes, in the order it makes them, built by the functions the command itself uses
    (parse_methods / parse_seeds / parse_grid, sweep.points, algorithms.configure, bilevel_config). Any (method x
    grid point x seed) whose config would fail raises here, not hours into the command."""
    from dataclasses import replace

    from ciders.cli import parser
    from ciders.config import load_experiment
    from ciders.experiments.compare import parse_methods, parse_seeds
    from ciders.experiments.sweep import parse_grid, points

    a = parser().parse_args(words)
    cfg = load_experiment(root / a.config, a.set or [])
    runs = []
    if a.cmd in ("compare", "sweep"):
        from ciders import algorithms
        from ciders.experiments.compare import parse_control

        methods, seeds = parse_methods(a.algorithms or "ciders-fo,ciders-fd,fedbiot,fedot,localot"), parse_seeds(a.seeds)
        control = parse_control(a.control)
        methods += [control] if control is not None and control not in methods else []  # run_compare's control row
        out = Path(a.out or f"runs/{a.cmd}-{cfg.name}")
        if getattr(a, "tune", None):  # compare_tune.tune: every grid point of every learning method, first
            from ciders.experiments.compare_tune import tuning_config

            for point, c in points(tuning_config(cfg, a.tune_rounds), parse_grid(a.tune)):
                for m in methods:
                    eff = algorithms.configure(replace(c, name=f"{c.name}-{m}-seed{c.seed}"), m).validate()
                    if eff.algorithm.client_learning:
                        runs.append((out / "tune" / m / point / m / f"seed{c.seed}", eff))
        for point, c in (points(cfg, parse_grid(a.grid or [])) if a.cmd == "sweep" else [("", cfg)]):
            for s in seeds:  # run_compare: seeds outside, methods inside
                for m in methods:
                    eff = algorithms.configure(replace(c, seed=s, name=f"{c.name}-{m}-seed{s}"), m).validate()
                    runs.append((out / point / m / f"seed{s}", eff))
        return runs
    assert a.cmd == "bilevel", words
    from ciders.algorithms.registry import bilevel_config
    from ciders.config import BilevelExperiment
    from ciders.experiments.bilevel_table import check_last

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    out = Path(a.out or f"runs/{cfg.name}")
    if a.tune:  # bilevel_tune.run_tuned: every point of each method's own grid (the winners' seeds reuse them)
        from ciders.experiments.bilevel_tune import method_grid

        check_last(a.last_rounds)
        for m in methods:
            for point, c in points(cfg, method_grid(m, parse_grid(a.tune)), cls=BilevelExperiment):
                runs.append((out / "tune" / m / point / m, bilevel_config(c, m)))
        return runs
    if a.seeds is None and not a.grid:  # run_experiment: OUT/<method>
        return [(out / m, bilevel_config(cfg, m)) for m in methods]
    check_last(a.last_rounds)
    pts = points(cfg, parse_grid(a.grid), cls=BilevelExperiment) if a.grid else [("default", cfg)]
    for point, c in pts:  # run_table: OUT/<point>/seed<s>/<method>
        for s in parse_seeds(a.seeds or str(cfg.seed)):
            runs += [(out / point / f"seed{s}" / m, bilevel_config(replace(c, seed=s), m)) for m in methods]
    return runs
