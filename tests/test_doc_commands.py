"""Every `ciders ...` command shown in the README and docs holds as written, from a checkout's root.

Each command in a shell code block is parsed by the real argument parser, its config file must exist in the
checkout and load with the command's own --set values, its method names must be known, and its data paths must
exist; for `compare`, `sweep` and `bilevel`, every run the command would make (each method x grid point x seed) gets
its effective config built by the command's own functions, so no later run can fail on config. Synopsis lines
(placeholders such as RUN_DIR, alternatives `a|b`, optional `[...]`) are checked for their subcommand only.

Every concrete line also runs as written, from the root of a copy of a fresh checkout, in one of these tests
(`test_every_concrete_documented_command_runs_as_written_somewhere` keeps that true): here, the ones that finish in
seconds (theory, config, local runs of configs/tiny.yaml) and (Flower suite) the simulation and loopback commands; the role-per-host and real-hosts lines of
docs/flower.md in tests/transports/test_flower_docs.py (Flower suite); compare, sweep, bilevel and the report of the
compare line's directory in tests/test_doc_commands_long.py (docs suite, `make test-docs`).
"""

import subprocess
import tempfile
from pathlib import Path

import pytest

from ciders.cli import main, parser
from doc_helpers import (COMMANDS, CONCRETE, LONG_COMMANDS, ROOT, argv, bash_block, checkout_copy, ciders,
                         make_commands, shell_env, sub_runs, synopsis)


def _argv(text: str) -> list[str]:
    return argv(text.replace("$((9094 + i))", "9094").replace("$i", "0"))  # docs/flower.md's per-node loop variable


def test_the_docs_show_commands():
    assert len(COMMANDS) > 30  # the extraction works (README and docs/flower.md, docs/rabo.md hold most)


@pytest.mark.parametrize("where, text", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses_and_its_files_exist(where, text, monkeypatch):
    from ciders.config import load_experiment

    monkeypatch.chdir(ROOT)
    words = _argv(text)
    sub = [c for c in parser()._subparsers._group_actions[0].choices]  # noqa: SLF001 - the real subcommands
    assert words and words[0] in sub, f"{where}: unknown subcommand in {text!r}"
    if synopsis(text):
        return  # a synopsis: subcommand checked only
    try:
        a = parser().parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"{where}: {text!r} does not parse (exit {exc.code})")
    config = getattr(a, "config", None)
    if isinstance(config, str) and config.endswith(".yaml"):
        assert (ROOT / config).is_file(), f"{where}: {config} is not in the checkout (a user's own file is a " \
                                          "placeholder: EXPERIMENT.yaml)"
        load_experiment(ROOT / config, list(getattr(a, "set", None) or []))
    if words[0] in LONG_COMMANDS:  # every run the command makes, configured as the command configures it
        runs = sub_runs(words)
        assert len({d for d, _ in runs}) == len(runs), f"{where}: two runs share a directory"


@pytest.mark.parametrize("target, text", make_commands(), ids=[f"{t}: {c[:60]}" for t, c in make_commands()])
def test_every_make_target_command_parses_and_configures_every_run(target, text, monkeypatch):
    """The long `make cpu-*` targets (hours each) are code too: every run they would make is configured here, by
    the commands' own functions, so a renamed key or a bad grid fails in seconds, not hours in."""
    monkeypatch.chdir(ROOT)
    words = argv(text)
    assert words[0] in ("compare", "sweep", "bilevel", "report", "run", "distill"), f"make {target}: {text!r}"
    if words[0] in LONG_COMMANDS:
        runs = sub_runs(words)
        assert runs and len({d for d, _ in runs}) == len(runs), f"make {target}: two runs share a directory"


def test_the_make_targets_show_their_commands():
    targets = {t for t, _ in make_commands()}
    assert {"demo", "cpu-protocol-h", "cpu-lambda-task", "cpu-protocol-r"} <= targets
    lam = [c for t, c in make_commands() if t == "cpu-lambda-task"]
    assert len(lam) == 6 and sum("protocol_a.yaml" in c for c in lam) == 3  # the loop expanded over both protocols


# Which test runs each concrete line as written (the first word after `ciders`, or the line's start).
CHEAP = [t for _, t in CONCRETE if argv(t)[0] in ("theory", "config")]
# local runs of the tiny config: seconds each
TINY_RUNS = sorted({" ".join(argv(t)) for _, t in CONCRETE
                    if t.startswith("ciders run configs/tiny.yaml ") and "--engine" not in t})
FLOWER = sorted({" ".join(argv(t)) for _, t in CONCRETE
                 if t.startswith(("ciders run configs/tiny.yaml --engine flower-sim", "ciders flower loopback "))})
ROLE_BLOCK = bash_block(ROOT / "docs" / "flower.md", "ciders flower credentials runs/fleet")
RUN_BY = {
    "tests/test_doc_commands.py::test_the_quick_documented_commands_run_as_written": lambda t: t in CHEAP,
    "tests/test_doc_commands.py::test_the_documented_tiny_runs_run_as_written_from_a_checkout":
        lambda t: " ".join(argv(t)) in TINY_RUNS,
    "tests/test_doc_commands.py::test_the_documented_flower_commands_run_as_written_from_a_checkout":
        lambda t: " ".join(argv(t)) in FLOWER,
    "tests/transports/test_flower_docs.py::test_documented_role_commands_deploy_and_stop_cleanly":
        lambda t: t in ROLE_BLOCK,
    "tests/transports/test_flower_docs.py::test_real_hosts_workflow_on_loopback":
        lambda t: t.startswith(("ciders flower superlink fleet ", "ciders flower register fleet ")),
    "tests/test_doc_commands_long.py::test_documented_long_command_runs_as_written_until_its_first_round":
        lambda t: argv(t)[0] in LONG_COMMANDS and argv(t)[0] != "compare",
    "tests/test_doc_commands_long.py::test_documented_compare_then_report_run_as_written":
        lambda t: argv(t)[0] == "compare" or t.startswith("ciders report runs/compare-"),
}


def test_every_concrete_documented_command_runs_as_written_somewhere():
    """A new concrete command in the docs needs a test that runs it (or placeholders that make it a synopsis)."""
    unclaimed = [f"{w}: {t}" for w, t in CONCRETE if not any(claims(t) for claims in RUN_BY.values())]
    assert not unclaimed, "documented commands that no test runs as written:\n" + "\n".join(unclaimed)
    for test in RUN_BY:
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test


@pytest.mark.parametrize("text", CHEAP)
def test_the_quick_documented_commands_run_as_written(text, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(argv(text)) == 0


@pytest.mark.parametrize("args", TINY_RUNS)
def test_the_documented_tiny_runs_run_as_written_from_a_checkout(args, tmp_path):
    root = checkout_copy(tmp_path)
    r = subprocess.run(ciders(args.split()), cwd=root, env=shell_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    words = args.split()
    assert (root / words[words.index("--out") + 1] / "summary.json").is_file()


@pytest.mark.flower
@pytest.mark.parametrize("args", FLOWER)
def test_the_documented_flower_commands_run_as_written_from_a_checkout(args):
    """The loopback command once failed from a fresh checkout: its ServerApp runs in the work directory, where the
    config's relative data paths did not resolve. Config paths now resolve against the config file."""
    # a short root: a SuperNode's worker socket path (under --work) must fit a Unix socket's 100 characters
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ck") as tmp:
        root = checkout_copy(Path(tmp))
        r = subprocess.run(ciders(args.split()), cwd=root, env=shell_env(), capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        words = args.split()
        assert (root / words[words.index("--out") + 1] / "summary.json").is_file()
