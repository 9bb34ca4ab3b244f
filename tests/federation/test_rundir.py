"""Run directories against operator mistakes and a hostile machine: two processes on one directory, what a
killed process leaves behind, a full or read-only disk, and the permissions of what a run writes."""

import errno
import json
import os
import signal
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import ciders

from ciders.algorithms.registry import bilevel_config
from ciders.config import load_config
from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig
from ciders.errors import CidersError
from ciders.federation.bilevel_loop import run_bilevel
from ciders.federation.loop import Faults, RunDir, SimulatedCrash
from ciders.federation.ciders_loop import run_federation
from conftest import ROOT
from helpers import QuadTask
from synthetic import VectorTask

CIDERS = ["federation.clients=4", "federation.rounds=3", "federation.per_round=2", "algorithm.local_steps=2",
          "algorithm.lr=0.05", "algorithm.gamma=0.3", "algorithm.alpha=0.2", "algorithm.tau=0.5"]


def ciders_cfg():
    return load_config(None, CIDERS)


def bilevel_exp():
    base = BilevelExperiment(federation=BilevelFederationConfig(clients=3, rounds=3))
    return bilevel_config(replace(base, rabo=replace(base.rabo, inner_steps=2, solver_iters=4)), "rabo")


def run_ciders(out, resume=False, task=None, faults=None):
    return run_federation(ciders_cfg(), task or VectorTask(4), out, resume=resume, faults=faults, progress=False,
                          log=lambda s: None)


def run_rabo(out, resume=False, task=None, faults=None):
    return run_bilevel(bilevel_exp(), task or QuadTask(), out, resume=resume, faults=faults, log=lambda s: None)


RUNS = {"ciders": run_ciders, "bilevel": run_rabo}
SRC = str(Path(ciders.__file__).parents[1])  # the second process runs the same code as this one

# A second process: the same run, resumed, in the same directory (what `ciders run --resume` does).
SECOND = """
import sys
sys.path[:0] = [{src!r}, {tests!r}, {here!r}]
import test_rundir
from ciders.errors import CidersError
try:
    test_rundir.RUNS[sys.argv[1]](sys.argv[2], resume=True)
except CidersError as exc:
    print(exc)
    sys.exit(3)
print("RAN")
"""


def second_process(family: str, out: Path) -> subprocess.CompletedProcess:
    code = SECOND.format(src=SRC, tests=str(ROOT / "tests"), here=str(Path(__file__).parent))
    return subprocess.run([sys.executable, "-c", code, family, str(out)], capture_output=True, text=True,
                          timeout=300)


class Interloper:
    """Wraps a task: in round 1, while this process holds the run, a second process resumes the same
    directory; what it printed and returned is kept."""

    def __init__(self, task, family, out, hook):
        self.task, self.family, self.out, self.seen = task, family, out, None
        setattr(self, hook, self._hook(getattr(task, hook)))

    def _hook(self, inner):
        def call(*a, **kw):
            if self.seen is None and (a[1] if self.family == "bilevel" else a[0]) == 1:
                self.seen = second_process(self.family, self.out)
            return inner(*a, **kw)
        return call

    def __getattr__(self, name):
        return getattr(self.task, name)


@pytest.mark.parametrize("family, hook", [("ciders", "begin_round"), ("bilevel", "batches")])
def test_a_second_process_on_a_running_directory_is_refused(tmp_path, family, hook):
    base = {"ciders": VectorTask(4), "bilevel": QuadTask()}[family]
    RUNS[family](tmp_path / "ref")
    out = tmp_path / "x"
    task = Interloper(base, family, out, hook)
    RUNS[family](out, task=task)
    assert task.seen.returncode == 3, task.seen.stdout + task.seen.stderr
    assert f"{out} is in use by another process (pid {os.getpid()})" in task.seen.stdout
    # the refused process wrote nothing: the run is the uninterrupted one
    assert (out / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    # once the run is over, the directory is free again
    assert second_process(family, out).returncode == 0


def test_a_killed_holder_leaves_no_lock_behind(tmp_path):
    out = tmp_path / "r"
    run_ciders(out)
    kill = "\nfrom ciders.fileio import acquire_lock\nimport os, signal\n" \
           f"acquire_lock({str(out)!r})\nos.kill(os.getpid(), signal.SIGKILL)\n"
    code = SECOND.format(src=SRC, tests=str(ROOT / "tests"), here=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code.split("try:")[0] + kill], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL and (out / ".ciders.lock").is_file()  # the file stays, the lock does not
    run_ciders(out, resume=True)


# ------------------------------------------------------------------------------------------- leftovers


def plant_leftovers(out: Path, committed: int) -> list[Path]:
    """What kills at the worst moments leave: atomic-write scratch files and directories, a checkpoint
    written but never committed, store records that a newer committed one superseded."""
    planted = [out / ".metrics.jsonl.k2j4h5g6.tmp", out / "eval" / ".before.json.a1b2c3d4.tmp",
               out / "checkpoints" / ".round_000002.zz9y8x7w.partial", out / "checkpoints" / "round_000007"]
    for p in planted[:2]:
        p.write_text("{")
    for d in planted[2:]:
        d.mkdir()
        (d / "state.json").write_text("{}")
    for store in ("clients", "server"):
        for key in (out / store).iterdir():
            done = [int(p.stem[1:]) for p in key.glob("r*.safetensors") if int(p.stem[1:]) <= committed]
            if done and max(done) > 0:
                planted.append(key / f"r{max(done) - 1:08d}.safetensors")
                planted[-1].write_bytes(b"superseded: never read")
            planted.append(key / ".r00000001.safetensors.q1w2e3r4.tmp")
            planted[-1].write_bytes(b"half")
    return planted


def test_resume_removes_what_a_killed_process_left(tmp_path):
    run_ciders(tmp_path / "ref")
    out = tmp_path / "x"
    with pytest.raises(SimulatedCrash):
        run_ciders(out, faults=Faults(crash=(2, "checkpoint")))
    assert RunDir(out).committed() == 1
    # the operator's files: not of the scratch pattern, or in a directory a run does not write
    (out / "mine").mkdir()
    mine = [out / "notes.tmp", out / "keep.partial.txt", out / "mine" / ".draft.txt.abcd1234.tmp"]
    for p in mine:
        p.write_text("mine")
    planted = plant_leftovers(out, 1)
    assert sum(p.name.startswith("r0") for p in planted) >= 2
    run_ciders(out, resume=True)
    assert [p for p in planted if p.exists()] == []
    for store in ("clients", "server"):
        for key in (out / store).iterdir():
            assert len(list(key.iterdir())) == 1, key  # the newest committed record only
    assert all(p.read_text() == "mine" for p in mine)
    assert (out / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()


def test_bilevel_resume_removes_scratch_and_uncommitted_checkpoints(tmp_path):
    out = tmp_path / "x"
    with pytest.raises(SimulatedCrash):
        run_rabo(out, faults=Faults(crash=(1, "checkpoint")))
    scratch = [out / ".final.safetensors.abcd1234.tmp", out / "checkpoints" / ".round_000002.abcd1234.partial"]
    scratch[0].write_bytes(b"half")
    scratch[1].mkdir()
    (out / "checkpoints" / "round_000005").mkdir()
    run_rabo(out, resume=True)
    assert not any(p.exists() for p in scratch)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["LATEST", "round_000002", "round_000003"]


# ------------------------------------------------------------------------------------------- full disk


def refuse_replace(monkeypatch, code, when):
    real = os.replace

    def replace_(src, dst, *a, **kw):
        if when(Path(dst)):
            raise OSError(code, os.strerror(code), str(dst))
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace_)


def test_a_full_disk_at_the_commit_keeps_the_last_commit_and_resume_continues(tmp_path, monkeypatch):
    run_ciders(tmp_path / "ref")
    out = tmp_path / "x"
    with monkeypatch.context() as m:
        # the round-1 commit point cannot be written (round 0's went through)
        refuse_replace(m, errno.ENOSPC, lambda dst: dst.name == "LATEST" and RunDir(out).committed() == 0)
        full = r"cannot write .*LATEST: disk full \(ENOSPC\); what was last committed is intact"
        with pytest.raises(CidersError, match=full):
            run_ciders(out)
    assert RunDir(out).committed() == 0 and json.loads((out / "checkpoints" / "LATEST").read_text()) == {"round": 0}
    assert not [p for p in out.rglob("*.tmp")]  # the failed write cleaned up after itself
    run_ciders(out, resume=True)
    assert (out / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize("code, why", [(errno.ENOSPC, "disk full"), (errno.EROFS, "read-only file system")])
def test_storage_failures_inside_safetensors_and_appends_are_one_line(tmp_path, monkeypatch, code, why):
    """safetensors reports the OSError inside its own exception ("... (os error 28)"); appends hit the
    error in write() itself."""
    import safetensors.torch

    out = tmp_path / "r"
    run_rabo(out)
    before = (out / "checkpoints" / "LATEST").read_bytes()

    def save_file(*a, **kw):
        raise Exception(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", save_file)
        with pytest.raises(CidersError, match=f"cannot write .*round_000.*: {why}"):
            run_rabo(tmp_path / "other")
    def fsync(fd):
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", fsync)
        with pytest.raises(CidersError, match=f"cannot write .*metrics.jsonl: {why}"):
            run_rabo(tmp_path / "third")
    assert (out / "checkpoints" / "LATEST").read_bytes() == before


# ------------------------------------------------------------------------------------------- permissions


def modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = stat.S_IMODE(p.stat().st_mode)
    return out


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_what_a_run_writes_has_the_umask_permissions(tmp_path, mask, file_mode, dir_mode):
    old = os.umask(mask)
    try:
        run_ciders(tmp_path / "c")
        run_rabo(tmp_path / "b")
    finally:
        os.umask(old)
    for root in (tmp_path / "c", tmp_path / "b"):
        got = modes(root)
        assert {"config.yaml", "metrics.jsonl", "checkpoints/LATEST", "checkpoints/round_000003/state.safetensors",
                "summary.json"} <= set(got)
        want = {k: dir_mode if (root / k).is_dir() else file_mode for k in got}
        assert got == want
    assert any(k.startswith("server/") and k.endswith(".safetensors") for k in modes(tmp_path / "c"))


# ----------------------------------------------------------------- --resume with more rounds: the one key that may change

EXTEND = ["federation.clients=4", "federation.per_round=2", "algorithm.local_steps=3", "algorithm.lr=0.05",
          "algorithm.schedule=warmup_cosine", "algorithm.warmup_steps=2", "algorithm.min_lr_ratio=0.1",
          "algorithm.gamma_schedule=protocol_c"]


def run_extend(out, rounds, *extra, resume=False):
    cfg = load_config(None, EXTEND + [f"federation.rounds={rounds}", *extra])
    return run_federation(cfg, VectorTask(4), out, resume=resume, progress=False, log=lambda s: None)


def client_lrs(out, t):
    from ciders.fileio import read_jsonl

    return {r["client"]: [s["lr"] for s in r["steps"]] for r in read_jsonl(out / "metrics.jsonl")
            if r["event"] == "client" and r["round"] == t}


def test_resume_extends_a_finished_run_and_the_schedule_follows_the_new_total(tmp_path):
    from ciders.algorithms.ciders import round_schedule
    from ciders.fileio import read_jsonl

    out = tmp_path / "run"
    run_extend(out, 2)
    before = read_jsonl(out / "metrics.jsonl")
    s = run_extend(out, 3, resume=True)
    rows = read_jsonl(out / "metrics.jsonl")
    assert s["rounds"] == 3 and sorted({r["round"] for r in rows if r["event"] == "round"}) == [0, 1, 2]
    assert rows[:len(before)] == before  # the rounds already run stay as they were
    ext = [r for r in rows if r["event"] == "extend"]
    assert len(ext) == 1 and ext[0]["round"] == 1 and (ext[0]["rounds_before"], ext[0]["rounds"]) == (2, 3)
    assert "new total" in ext[0]["schedules"] and load_config(out / "config.yaml").federation.rounds == 3
    assert RunDir(out).committed() == 2 and {r["round"] for r in rows if r["event"] == "eval"} == {-1, 0, 1, 2}
    # round 2's learning rates: the warmup-cosine over 3 rounds x 3 steps, as a 3-round run has them
    acfg = load_config(None, EXTEND + ["federation.rounds=3"]).algorithm
    lrs, _, gamma = round_schedule(acfg, 2, 3)
    assert all(v == pytest.approx(list(lrs)) for v in client_lrs(out, 2).values()) and len(client_lrs(out, 2)) == 2
    run_extend(tmp_path / "fresh3", 3)
    assert client_lrs(out, 2) == client_lrs(tmp_path / "fresh3", 2)
    assert client_lrs(out, 1) != client_lrs(tmp_path / "fresh3", 1)  # rounds 0-1 ran on the 2-round curve
    server = [r for r in rows if r["event"] == "server" and r["round"] == 2][0]
    assert server["gamma"] == pytest.approx(gamma)  # protocol_c: by round number, unchanged by the extension
    run_extend(out, 3, resume=True)  # the same config again: nothing to do, no second extension
    assert [r["event"] for r in read_jsonl(out / "metrics.jsonl")].count("extend") == 1


@pytest.mark.parametrize("rounds, extra, err", [
    (1, [], r"federation.rounds can only grow \(the run's config.yaml has 2, got 1\)"),
    (2, ["algorithm.lr=0.01"], r"differs from the run's config.yaml at 'algorithm.lr'; .*only federation.rounds may "
                               r"change, and only upwards"),
    (4, ["algorithm.lr=0.01"], r"at 'algorithm.lr'"),
    (4, ["algorithm.lr=0.01", "seed=3"], r"at 'seed' \(and 1 more: algorithm.lr\)"),
])
def test_resume_refuses_fewer_rounds_and_any_other_change(tmp_path, rounds, extra, err):
    from ciders.fileio import read_jsonl

    out = tmp_path / "run"
    run_extend(out, 2)
    before = (out / "metrics.jsonl").read_bytes(), (out / "config.yaml").read_bytes()
    with pytest.raises(CidersError, match=err):
        run_extend(out, rounds, *extra, resume=True)
    assert ((out / "metrics.jsonl").read_bytes(), (out / "config.yaml").read_bytes()) == before
    assert RunDir(out).committed() == 1 and "extend" not in {r["event"] for r in read_jsonl(out / "metrics.jsonl")}


def test_bilevel_resume_still_refuses_more_rounds(tmp_path):
    run_rabo(tmp_path)
    exp = bilevel_exp()
    longer = replace(exp, federation=replace(exp.federation, rounds=4))
    with pytest.raises(CidersError, match="at 'federation.rounds'; resume with the same config$"):
        run_bilevel(longer, QuadTask(), tmp_path, resume=True, log=lambda s: None)


@pytest.mark.parametrize("keep", [1, 3])
def test_both_families_keep_the_checkpoints_their_config_says(tmp_path, keep):
    run_federation(load_config(None, CIDERS + [f"federation.checkpoint_keep={keep}"]), VectorTask(4),
                   tmp_path / "c", progress=False, log=lambda s: None)
    exp = bilevel_exp()
    run_bilevel(replace(exp, federation=replace(exp.federation, checkpoint_keep=keep)), QuadTask(), tmp_path / "b",
                log=lambda s: None)
    for run in ("c", "b"):
        rounds = sorted(p.name for p in (tmp_path / run / "checkpoints").iterdir() if p.name != "LATEST")
        assert rounds == [f"round_{r:06d}" for r in range(4 - keep, 4)], run  # rounds 1-3 committed
