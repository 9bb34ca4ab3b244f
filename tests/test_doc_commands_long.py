"""The documented commands that run for tens of minutes to hours on 2 cores (`ciders compare`, `ciders sweep`,
`ciders bilevel` on configs/cpu), run as written: the docs suite (`-m docs`).

Each test starts the command exactly as the README or docs/rabo.md shows it (the same argv, the installed `ciders`,
from the root of a copy of a fresh checkout, CIDERS_DATA as CI sets it) in a process group of its own, waits until
the command's first run has committed its first round (the `round` record of round 0 in that run's metrics.jsonl
and the run's checkpoints/LATEST at round 0), checks that record, then stops the whole process group as Ctrl-C
would (SIGINT; the command must end by itself with `ciders: interrupted`, nothing of it left running) and checks
that nothing failed before that: the command was still running and its output holds no traceback or error.

Why this is "as written": everything a later run of the same command does goes through the same code path with
other values. compare runs every (method, seed) with `run_compare`'s one loop; sweep runs that loop at every grid
point; bilevel runs every (grid point, seed, method) with `run_bilevel` (or Flower's simulation for
`--engine flower-sim`). What differs between the first run and a later one is its config, and
`test_doc_commands.test_every_documented_command_parses_and_its_files_exist` builds the effective config of
every later run with the command's own functions (`doc_helpers.sub_runs`), so none of them can fail on config.

`ciders report runs/compare-cpu-protocol-a` runs as written too, on the directory the compare line made, once
that comparison's first (method, seed) run is complete (`compare.json` is written after every finished run).
"""

import json
import math
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from doc_helpers import CONCRETE, LONG_COMMANDS, argv, checkout_copy, ciders, lines_starting, shell_env, sub_runs
from helpers import shared

pytestmark = [pytest.mark.docs, pytest.mark.full_data]  # the commands as written read $CIDERS_DATA

LONG = [(w, t) for w, t in CONCRETE if argv(t)[0] in LONG_COMMANDS]
FIRST_ROUND_S = 1800  # generous: the slowest (sweep) took 68 s on 2 idle cores, 10 min beside other jobs on them


class Command:
    """A documented command started as written, in its own process group, output in a file."""

    def __init__(self, words: list[str], root: Path):
        self.root, self.words = root, words
        self.log_path = root / "command.log"
        self.log = open(self.log_path, "w")
        self.started = time.monotonic()
        # a process group of its own (stopped as a whole), with Ctrl-C's default action even where the test runs
        # in the background of a shell without job control (which starts its children with SIGINT ignored)
        self.proc = subprocess.Popen(ciders(words), cwd=root, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=shell_env(), start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """A failed test leaves nothing running."""
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
        self.log.close()

    def output(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def wait_for(self, found, timeout: float, what: str):
        """Poll `found()` until it returns something; the command must not exit first."""
        deadline = time.monotonic() + timeout
        while True:
            got = found()
            if got:
                return got
            assert self.proc.poll() is None, f"`ciders {' '.join(self.words)}` exited ({self.proc.returncode}) " \
                                             f"before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s:\n{self.output()}"
            time.sleep(2)

    def stop(self, grace: float = 120) -> None:
        """Ctrl-C to the whole process group, as a terminal sends it: the command must end by itself (exit 130,
        `ciders: interrupted`) within `grace` seconds, and nothing of its group may outlive it."""
        assert self.proc.poll() is None, f"the command exited ({self.proc.returncode}) before it was stopped"
        os.killpg(self.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace
        while (self.proc.poll() is None or _group_alive(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _group(self.proc.pid)
        self.log.close()
        assert self.proc.poll() == 130 and not left, \
            f"Ctrl-C did not stop the command within {grace:.0f} s (exit {self.proc.poll()}, still running: " \
            f"{left})\n{self.output()}"

    def assert_nothing_failed(self) -> None:
        """No traceback and no error in the command's output, before or after the Ctrl-C."""
        out = self.log_path.read_text(errors="replace")
        assert "Traceback" not in out and "Error:" not in out and "error:" not in out, out[-6000:]
        # (under --engine flower-sim the ServerApp thread may still log the round it was committing)
        assert "ciders: interrupted" in out, out[-3000:]


def _group(pgid: int) -> list[str]:
    r = subprocess.run(["ps", "-eo", "pgid=,stat=,args="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in r.stdout.splitlines()]
    return [x[2] for x in rows if len(x) == 3 and int(x[0]) == pgid and not x[1].startswith("Z")]


def _group_alive(pgid: int) -> bool:
    return bool(_group(pgid))


def _records(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")]  # a line being written is skipped


def _first_round(run: Path):
    """Round 0's `round` record once the run has committed round 0 (its checkpoints/LATEST)."""
    latest = run / "checkpoints" / "LATEST"
    if not latest.is_file() or json.loads(latest.read_text())["round"] < 0:
        return None
    return next((r for r in _records(run) if r["event"] == "round" and r["round"] == 0), None)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_ciders_round(run: Path, rec: dict, cfg) -> None:
    """A CIDERS-family round 0: clients sampled, their losses finite, bytes down and up counted."""
    rows = _records(run)
    assert [r["event"] for r in rows[:2]] == ["prealign", "eval"], rows[:2]  # round -1: pre-alignment, evaluation
    n = cfg.federation.per_round or cfg.federation.clients
    assert len(rec["clients"]) == n and len(set(rec["clients"])) == n, rec
    clients = [r for r in rows if r["event"] == "client" and r["round"] == 0]
    assert sorted(c["client"] for c in clients) == sorted(rec["clients"])
    assert all(_finite(c["loss"]) and c["loss"] > 0 for c in clients) and _finite(rec["loss"]), clients
    down = rec["bytes_down"]
    assert down and all(isinstance(v, int) and v > 0 for v in down.values()) and "messenger" in down, rec
    if cfg.algorithm.method != "localot":  # LocalOT uploads nothing
        assert sum(rec["bytes_up"].values()) > 0, rec


def check_bilevel_round(run: Path, rec: dict, cfg) -> None:
    """A bilevel round 0: every client answered the first phase, each client's records have finite figures and
    bytes on the wire both ways, the covering numbers are at least 1."""
    rows = _records(run)
    ids = [f"client{i}" for i in range(cfg.federation.clients)]
    first = next(k for k in rec if k.endswith("_clients"))  # the first phase's accepted clients
    assert rec[first] == ids, rec
    assert rec["covering_x"] >= 1 and rec["covering_y"] >= 1, rec
    clients = [r for r in rows if r["event"] == "client" and r["round"] == 0]
    assert {c["client"] for c in clients} == set(ids), clients
    for c in clients:
        assert c["bytes_up"] > 0 and c["bytes_down"] > 0 and c["calls"] > 0, c
        assert all(_finite(v) for v in c.values() if isinstance(v, float)), c


def start(text: str, tmp: Path) -> Command:
    return Command(argv(text), checkout_copy(tmp))


def wait_for_first_round(cmd: Command) -> dict:
    words, root = cmd.words, cmd.root
    runs = sub_runs(words, root)
    first, cfg = runs[0]
    rec = cmd.wait_for(lambda: _first_round(root / first), FIRST_ROUND_S, f"committed round 0 in {first}")
    elapsed = time.monotonic() - cmd.started
    others = [str(d) for d, _ in runs[1:] if (root / d / "metrics.jsonl").is_file()]
    assert not others, f"runs started before the first one: {others}"
    (check_bilevel_round if words[0] == "bilevel" else check_ciders_round)(root / first, rec, cfg)
    print(f"\n{' '.join(words)[:90]}: round 0 of {first} committed after {elapsed:.0f} s")
    return rec


def _data(text: str) -> None:
    shared("omniglot" if argv(text)[0] == "bilevel" else "gsm8k")  # a failure where CIDERS_DATA lacks them


@pytest.mark.parametrize("where, text", [(w, t) for w, t in LONG if argv(t)[0] != "compare"],
                         ids=[w for w, t in LONG if argv(t)[0] != "compare"])
def test_documented_long_command_runs_as_written_until_its_first_round(where, text):
    _data(text)
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ck") as tmp, start(text, Path(tmp)) as cmd:
        wait_for_first_round(cmd)  # short root above: Ray's socket paths
        cmd.stop()
        cmd.assert_nothing_failed()


def test_documented_compare_then_report_run_as_written():
    """README's compare line until its first (method, seed) run is complete, then README's report line on the
    directory it wrote (a comparison in progress: compare.json holds the finished runs and lists the rest)."""
    (compare,) = [t for _, t in LONG if argv(t)[0] == "compare"]
    (report,) = lines_starting("ciders report runs/compare-")
    _data(compare)
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ck") as tmp, start(compare, Path(tmp)) as cmd:
        wait_for_first_round(cmd)
        root = cmd.root
        runs = sub_runs(argv(compare), root)
        out = root / argv(report)[1]
        assert (root / runs[0][0]).parent.parent == out, "the report line must name the compare line's directory"
        info = cmd.wait_for(lambda: (out / "compare.json").is_file() and json.loads((out / "compare.json").read_text()),
                            FIRST_ROUND_S, "the first run's entry in compare.json")
        print(f"first (method, seed) run complete after {time.monotonic() - cmd.started:.0f} s")
        cmd.stop()
        cmd.assert_nothing_failed()
        m0 = runs[0][0].parent.name
        assert list(info["per_seed"][m0]) == ["0"] and _finite(info["per_seed"][m0]["0"]["nll"]), info["per_seed"]
        assert len(info["pending"]) == len(runs) - 1, info["pending"]
        r = subprocess.run(ciders(argv(report)), cwd=root, env=shell_env(), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        page = (out / "report" / "index.html").read_text()
        assert m0 in page and f"in progress: {len(runs) - 1} runs" in page
