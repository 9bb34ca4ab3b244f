"""Run untrusted programs (model-written code) contained.

Each run gets: a private temporary directory (removed afterwards), a new network namespace (no
network), CPU-time, address-space, process-count and file-size limits, a wall-clock timeout after
which its whole process group is killed, and, when ciders runs as root, an unprivileged uid of its
own (one per concurrency slot), so that afterwards every process that uid still owns is killed even
if it left the process group. Concurrency is bounded by `workers`. Without root, runs keep our uid
(rlimits and the timeout still apply) and network isolation needs unprivileged user namespaces.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from ciders.errors import CidersError

BASE_UID = 61000  # slot uids BASE_UID + k; unprivileged, no passwd entry needed
PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Limits:
    wall_s: float = 20.0
    cpu_s: int = 20
    memory_mb: int = 1024
    nproc: int = 64  # processes + threads of the sandbox uid
    file_mb: int = 16


@dataclass(frozen=True)
class Job:
    cmd: Sequence[str]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text
    env: dict[str, str] = field(default_factory=dict)
    limits: Limits | None = None
    prepare: Callable[[Path, int | None], None] | None = None  # (work dir, uid) -> None, runs as us before the job


@dataclass(frozen=True)
class Result:
    status: str  # passed | failed | timeout | crashed | error
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class Sandbox:
    def __init__(self, workers: int = 2, limits: Limits = Limits(), isolate_network: bool = True,
                 root: str | Path | None = None):
        self.workers, self.limits, self.net = max(1, workers), limits, isolate_network
        self.is_root = os.geteuid() == 0
        self.root = Path(root) if root else Path(tempfile.gettempdir())
        self._slots: queue.Queue[int] = queue.Queue()
        for k in range(self.workers):
            self._slots.put(k)
        probe = self.run(Job(["/bin/sh", "-c", "exit 0"]))
        if not probe.passed:
            raise CidersError(f"the code sandbox does not work here ({probe.stderr.strip() or probe.status}); "
                              "run as root, enable unprivileged user namespaces, or disable network isolation")

    def uid(self, slot: int) -> int | None:
        return BASE_UID + slot if self.is_root else None

    def run(self, job: Job) -> Result:
        slot = self._slots.get()
        try:
            return self._run(job, slot)
        finally:
            self._slots.put(slot)

    def map(self, jobs: Sequence[Job], progress: Callable[[int], None] | None = None) -> list[Result]:
        with ThreadPoolExecutor(self.workers) as pool:
            futures = [pool.submit(self.run, j) for j in jobs]
            out = []
            for f in futures:
                out.append(f.result())
                if progress:
                    progress(1)
            return out

    def _run(self, job: Job, slot: int) -> Result:
        lim = job.limits or self.limits
        uid = self.uid(slot)
        if uid is not None:
            _kill_uid(uid)  # nothing from an earlier run may survive into this one
        work = Path(tempfile.mkdtemp(prefix="ciders-sbx-", dir=self.root))
        logs = Path(tempfile.mkdtemp(prefix="ciders-sbx-log-", dir=self.root))
        try:
            for rel, text in job.files.items():
                p = work / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text, encoding="utf-8")
            if job.prepare:
                job.prepare(work, uid)
            if uid is not None:
                for dirpath, dirnames, filenames in os.walk(work):
                    os.chown(dirpath, uid, uid)
                    for f in filenames:
                        fp = os.path.join(dirpath, f)
                        if os.stat(fp).st_uid == 0 and os.stat(fp).st_nlink == 1:
                            os.chown(fp, uid, uid)
                os.chmod(work, 0o700)
            nproc = lim.nproc if uid is not None else _own_process_count() + lim.nproc
            env = {"PATH": PATH, "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
                   **{k: v.replace("$WORK", str(work)) for k, v in job.env.items()}}
            spec = {"net": self.net, "uid": uid, "cwd": str(work), "env": env,
                    "limits": {**asdict(lim), "nproc": nproc}}
            cmd = [sys.executable, "-m", "ciders.eval._sandbox_exec", json.dumps(spec), "--", *job.cmd]
            t0 = time.perf_counter()
            with open(logs / "out", "wb") as fo, open(logs / "err", "wb") as fe:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, start_new_session=True,
                                        env={"PATH": PATH, "PYTHONPATH": _ciders_path()})
                timed_out = False
                try:
                    rc = proc.wait(timeout=lim.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(proc.pid)
                    rc = proc.wait()
            seconds = time.perf_counter() - t0
            _kill_group(proc.pid)
            if uid is not None:
                _kill_uid(uid)
            out, err = _tail(logs / "out"), _tail(logs / "err")
            if timed_out or rc == -signal.SIGXCPU:
                status = "timeout"  # wall clock or CPU time
            elif rc == 0:
                status = "passed"
            elif rc < 0:
                status = "crashed"  # a signal: CPU limit (SIGKILL/SIGXCPU), SIGSEGV, SIGXFSZ, ...
            elif rc in (125, 127) and err.startswith("ciders-sandbox:"):
                status = "error"
            else:
                status = "failed"
            return Result(status, rc, seconds, out, err)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)


def _ciders_path() -> str:
    return str(Path(__file__).resolve().parents[2])


def _tail(p: Path, n: int = 4000) -> str:
    with open(p, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - n))
        return f.read().decode("utf-8", "replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pids_of(uid: int) -> list[int]:
    """Live processes of `uid` (zombies hold no resources; init reaps them)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid != uid:
                    continue
                with open(f"/proc/{d}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                if state != b"Z":
                    out.append(int(d))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


def _kill_uid(uid: int) -> None:
    """Kill every process of the slot uid (escapees from the process group included), until none is left."""
    for _ in range(50):
        pids = _pids_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _own_process_count() -> int:
    return len(_pids_of(os.getuid()))


def with_limits(limits: Limits, **kw) -> Limits:
    return replace(limits, **kw)
