"""Every `ciders ...` command shown in the README and docs holds as written, from a checkout's root.

Each command in a shell code block is parsed by the real argument parser, its config file must exist in the
checkout and load with the command's own --set / --grid values, its method names must be known, and its data
paths must exist. The commands that finish in seconds run here as written; the Flower simulation and loopback
commands run as written, from a copy of the checkout, in the Flower suite. Synopsis lines (placeholders such as
RUN_DIR, alternatives `a|b`, optional `[...]`) are checked for their subcommand only.
"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ciders.cli import main, parser

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


def _argv(text: str) -> list[str]:
    text = text.replace("$((9094 + i))", "9094").replace("$i", "0")  # docs/flower.md's per-node loop variable
    return [w for w in shlex.split(text, comments=True) if w != "&"][1:]


def test_the_docs_show_commands():
    assert len(COMMANDS) > 30  # the extraction works (README and docs/flower.md, docs/rabo.md hold most)


@pytest.mark.parametrize("where, text", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses_and_its_files_exist(where, text, monkeypatch):
    from ciders.config import load_experiment

    monkeypatch.chdir(ROOT)
    argv = _argv(text)
    sub = [c for c in parser()._subparsers._group_actions[0].choices]  # noqa: SLF001 - the real subcommands
    assert argv and argv[0] in sub, f"{where}: unknown subcommand in {text!r}"
    if PLACEHOLDER.search(text.split("#")[0]):
        return  # a synopsis: subcommand checked only
    try:
        a = parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: {text!r} does not parse (exit {exc.code})")
    config = getattr(a, "config", None)
    if isinstance(config, str) and config.endswith(".yaml"):
        if not (ROOT / config).is_file():  # examples of the user's own file (experiment.yaml) are not ours
            assert not config.startswith("configs/"), f"{where}: {config} is not in the checkout"
            return
        overrides = list(getattr(a, "set", None) or [])
        for item in getattr(a, "grid", None) or []:
            key, values = item.split("=", 1)
            overrides.append(f"{key}={values.split(',')[0]}")
        load_experiment(ROOT / config, overrides)
    for names, parse in ((getattr(a, "algorithms", None), "ciders.experiments.compare"),):
        if names:
            __import__(parse, fromlist=["parse_methods"]).parse_methods(names)


CHEAP = [t for _, t in COMMANDS if t.split()[1] in ("theory", "config") and not PLACEHOLDER.search(t.split("#")[0])]


@pytest.mark.parametrize("text", CHEAP)
def test_the_quick_documented_commands_run_as_written(text, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(_argv(text)) == 0


def _checkout_copy(tmp: Path) -> Path:
    """The tracked files a fresh checkout has, that these commands read (configs and the vendored data)."""
    files = subprocess.run(["git", "ls-files", "configs", "data"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        (tmp / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tmp / f)
    return tmp


FLOWER = sorted({" ".join(_argv(t)) for _, t in COMMANDS
                 if t.startswith(("ciders run configs/tiny.yaml --engine flower-sim", "ciders flower loopback "))})


@pytest.mark.flower
@pytest.mark.parametrize("args", FLOWER)
def test_the_documented_flower_commands_run_as_written_from_a_checkout(args):
    """The loopback command once failed from a fresh checkout: its ServerApp runs in the work directory, where the
    config's relative data paths did not resolve. Config paths now resolve against the config file."""
    import tempfile

    # a short root: a SuperNode's worker socket path (under --work) must fit a Unix socket's 100 characters
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ck") as tmp:
        root = _checkout_copy(Path(tmp))
        r = subprocess.run([sys.executable, "-m", "ciders.cli", *args.split()], cwd=root, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        words = args.split()
        assert (root / words[words.index("--out") + 1] / "summary.json").is_file()
