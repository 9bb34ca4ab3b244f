"""Run untrusted programs (model-written code) contained.

What one run gets depends on what the machine allows; `Sandbox.capabilities` says what is enforced and the
sandbox logs, once per process, what it could not enforce. With root and namespaces (the normal case):

- filesystem: a private root built from scratch for each run (a mount namespace + pivot_root): read-only
  /usr, /etc and the /bin, /lib links, fresh /proc, a /dev with null/zero/full/random/urandom only, its own
  empty /tmp, /var/tmp and /dev/shm (size-capped tmpfs, gone with the run), and its work dir at /work.
  Nothing else of the host exists there: not the project, its runs or $CIDERS_DATA, not /root, /home, /run
  or /var, so no host unix socket either (abstract ones are per network namespace).
- processes: a pid namespace whose init is ours; the program sees only its own processes, and when it
  exits (or the wall clock runs out) the init exits and the kernel kills everything left in the namespace
  (double forks, setsid, threads behind an exited leader) before the run is over.
- network: a network namespace with only a down loopback; also its own IPC and UTS namespaces.
- uid: an unprivileged uid of its own, from a block of uids this process holds a lock on, so concurrent
  sandboxes (several `ciders score-code`) never share a uid.
- userns: no_new_privs (setuid programs gain nothing) and a seccomp filter that refuses new user
  namespaces (unshare/clone with CLONE_NEWUSER -> EPERM; clone3 -> ENOSYS, so libc falls back to clone).
- always: CPU-time, address-space, process-count and file-size rlimits and a wall-clock timeout.

Without root the namespaces come from an unprivileged user namespace and the program keeps our uid; with no
namespaces at all ("plain" mode: e.g. a container without CAP_SYS_ADMIN) only the rlimits, the timeout,
no_new_privs/seccomp, the network namespace (if root) and a kill of the process group and of the slot uid
are left. A sample passes only if it exits 0 AND prints its job's `pass_token` (a per-run secret the
harness prints after the checks; humaneval.py), so exiting early with status 0 fails. Not defended: code
that reads the harness out of its own source or memory and prints the token, or that defeats the checks
from inside the process (e.g. returns an object equal to everything); docs/method.md#the-code-sandbox.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from ciders.errors import CidersError

# Sandbox uids: block b of a process holds BASE_UID + b * UID_BLOCK + k; above systemd's container
# ranges and below 2^31, so no real account or container uid; no passwd entry needed.
BASE_UID, UID_BLOCK, UID_BLOCKS = 1_900_000_000, 256, 4096
PATH = "/usr/local/bin:/usr/bin:/bin"
EXPOSE = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # read-only in the root
INSIDE = "/work"  # the work dir, as the program sees it
HELPER = str(Path(__file__).with_name("_sandbox_exec.py"))
FEATURES = {
    "filesystem": "private root (own /tmp, /var/tmp, /dev/shm; project, data, runs, host sockets hidden)",
    "processes": "own pid namespace (no view of other processes; nothing survives a run)",
    "network": "no network (network namespace)",
    "uid": "an unprivileged uid per sample",
    "userns": "no new user namespaces (seccomp)",
    "limits": "rlimits and the wall clock",
}
log = logging.getLogger(__name__)


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
    pass_token: str | None = None  # when set, passing needs it on stdout as well as exit status 0


@dataclass(frozen=True)
class Result:
    status: str  # passed | failed | timeout | crashed | error
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    enforced: tuple[str, ...] = ()  # what the helper applied to this run (FEATURES keys)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class Sandbox:
    def __init__(self, workers: int = 2, limits: Limits = Limits(), isolate_network: bool = True,
                 root: str | Path | None = None, expose: Sequence[str] = ()):
        self.workers, self.limits, self.net = max(1, workers), limits, isolate_network
        self.is_root = os.geteuid() == 0
        self.root = Path(root) if root else Path(tempfile.gettempdir())
        self.expose = tuple(EXPOSE) + tuple(str(Path(p).resolve()) for p in expose)
        self._uids, self._uid_lock = _claim_uids(self.workers) if self.is_root else (None, None)
        self._slots: queue.Queue[int] = queue.Queue()
        for k in range(self.workers):
            self._slots.put(k)
        self.mode = "ns"
        self.capabilities = probe(self)
        self.mode = self.capabilities.mode
        _report_once(self.capabilities)

    def uid(self, slot: int) -> int | None:
        return self._uids[slot] if self._uids else None

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
        plain = self.mode == "plain"
        if uid is not None and plain:
            _kill_uid(uid)  # nothing from an earlier run may survive into this one
        run_dir = Path(tempfile.mkdtemp(prefix="ciders-sbx-", dir=self.root))
        try:
            work = run_dir / "work"
            work.mkdir()
            (run_dir / "root").mkdir()
            os.chmod(run_dir, 0o711)  # plain mode: the program reaches work/, but cannot list its logs
            _populate(work, job, uid)
            spec = self._spec(job, lim, uid, run_dir)
            t0 = time.perf_counter()
            rc_info, out, err = _launch(spec, job.cmd, run_dir, lim.wall_s)
            seconds = time.perf_counter() - t0
            if uid is not None and plain:
                _kill_uid(uid)
            return replace(_result(rc_info, out, err, seconds, job.pass_token),
                           enforced=tuple(rc_info.get("enforced", ())))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _spec(self, job: Job, lim: Limits, uid: int | None, run_dir: Path) -> dict:
        plain = self.mode == "plain"
        work = str(run_dir / "work") if plain else INSIDE
        nproc = lim.nproc if uid is not None else _own_process_count() + lim.nproc
        env = {"PATH": PATH, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               **{k: v.replace("$WORK", work) for k, v in job.env.items()}}
        return {"mode": self.mode, "net": self.net, "root": self.is_root, "uid": uid, "cwd": work, "env": env,
                "limits": {**asdict(lim), "nproc": nproc}, "wall_s": lim.wall_s, "tmpfs_mb": 4 * lim.file_mb,
                "work": str(run_dir / "work"), "mnt": str(run_dir / "root"), "inside": INSIDE,
                "expose": list(self.expose), "hide": _hidden_paths(self.root, self.expose)}


def probe(sandbox: Sandbox) -> "Capabilities":
    """What this machine lets the sandbox enforce: a trivial run with namespaces, else one without."""
    ns_error = ""
    for mode in ("ns", "plain"):
        sandbox.mode = mode
        r, enforced = _probe_run(sandbox)
        if r.passed:
            got = set(enforced) | {"limits"}
            why = {"uid": "not running as root", "filesystem": f"no namespaces: {ns_error}",
                   "processes": f"no namespaces: {ns_error}", "network": "network isolation turned off",
                   "userns": f"no seccomp filter for {platform.machine()}"}
            return Capabilities(mode, frozenset(got), tuple((f, why[f]) for f in FEATURES if f not in got))
        ns_error = ns_error or r.stderr.strip().rsplit("ciders-sandbox: ", 1)[-1] or r.status
    raise CidersError(f"the code sandbox does not work here ({ns_error}); run as root, enable unprivileged "
                      "user namespaces, or disable network isolation")


def _probe_run(sandbox: Sandbox) -> tuple[Result, tuple[str, ...]]:
    r = sandbox.run(Job(["/bin/sh", "-c", "echo probe-ok"], pass_token="probe-ok"))
    return r, r.enforced


@dataclass(frozen=True)
class Capabilities:
    mode: str  # ns | plain
    enforced: frozenset[str]
    not_enforced: tuple[tuple[str, str], ...] = ()  # (feature, why) for each FEATURES key not enforced

    @property
    def missing(self) -> list[str]:
        return [f for f, _ in self.not_enforced]

    def report(self) -> str:
        if not self.not_enforced:
            return "code sandbox: everything enforced (" + ", ".join(FEATURES) + ")"
        return "code sandbox: NOT enforced here: " + "; ".join(f"{f} ({FEATURES[f]}): {why}"
                                                               for f, why in self.not_enforced)


_REPORTED: set[str] = set()
_REPORT_LOCK = threading.Lock()


def _report_once(caps: Capabilities) -> None:
    """Log what is not enforced, once per process (each Scorer makes a Sandbox; the machine is the same)."""
    text = caps.report()
    with _REPORT_LOCK:
        if text in _REPORTED:
            return
        _REPORTED.add(text)
    (log.warning if caps.missing else log.info)(text)


def _populate(work: Path, job: Job, uid: int | None) -> None:
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


def _launch(spec: dict, cmd: Sequence[str], run_dir: Path, wall_s: float) -> tuple[dict, str, str]:
    """Start the helper (it enforces the wall clock itself; ours is a backstop) and read its report."""
    r, w = os.pipe()
    spec = {**spec, "status_fd": w}
    argv = [sys.executable, "-I", "-S", HELPER, json.dumps(spec), "--", *cmd]
    try:
        with open(run_dir / "out", "wb") as fo, open(run_dir / "err", "wb") as fe:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, start_new_session=True,
                                    env={"PATH": PATH}, pass_fds=(w,), cwd="/")
        os.close(w)
        w = -1
        try:
            proc.wait(timeout=wall_s + 15)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
        _kill_group(proc.pid)
        with os.fdopen(r, "rb") as f:
            r = -1
            raw = f.read()
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    info = json.loads(raw) if raw else {"error": f"the sandbox helper died (exit {proc.returncode})"}
    return info, _tail(run_dir / "out"), _tail(run_dir / "err")


def _result(info: dict, out: str, err: str, seconds: float, token: str | None) -> Result:
    if info.get("status") is None:
        if info.get("timeout"):
            return Result("timeout", None, seconds, out, err)
        return Result("error", None, seconds, out, err + f"ciders-sandbox: {info.get('error')}\n")
    rc = os.waitstatus_to_exitcode(info["status"])
    if rc == -signal.SIGXCPU:
        status = "timeout"  # CPU time
    elif rc == 0 and token is not None and token not in out:
        status = "failed"  # exited 0 without the harness having finished
        err += "ciders-sandbox: exit status 0 but no pass token: the checks did not run to the end\n"
    elif rc == 0:
        status = "passed"
    elif rc < 0:
        status = "crashed"  # a signal: CPU limit (SIGKILL/SIGXCPU), SIGSEGV, SIGXFSZ, ...
    elif rc in (125, 127) and err.startswith("ciders-sandbox:"):
        status = "error"
    else:
        status = "failed"
    return Result(status, rc, seconds, out, err)


def _hidden_paths(root: Path, expose: Sequence[str]) -> list[str]:
    """Paths of ours (the project, data, caches) that lie inside an exposed system dir: to be covered.
    Usually none: they live under /work, /home, /root or /srv, which the private root does not have."""
    cands = [os.getcwd(), os.environ.get("CIDERS_DATA"), os.environ.get("CIDERS_CACHE"), str(root),
             os.path.expanduser("~")]
    paths = {str(Path(c).resolve()) for c in cands if c}
    return sorted(p for p in paths if any(p.startswith(e.rstrip("/") + "/") for e in expose))


def _claim_uids(workers: int) -> tuple[list[int], object]:
    """A block of uids no other sandbox on this machine holds: the first block whose lock file we can flock
    (the lock goes when this process, or the Sandbox, does)."""
    if workers > UID_BLOCK:
        raise CidersError(f"at most {UID_BLOCK} sandbox workers (asked for {workers})")
    lock_dir = Path("/run/lock" if os.path.isdir("/run/lock") else "/tmp") / "ciders-sandbox"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    for b in range(UID_BLOCKS):
        f = open(lock_dir / f"{b}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return [BASE_UID + b * UID_BLOCK + k for k in range(workers)], f
    raise CidersError(f"all {UID_BLOCKS} sandbox uid blocks are taken (locks in {lock_dir})")


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
    """Live processes of `uid` (true zombies hold no resources; init reaps them). A zombie-looking leader
    whose other threads still run counts as live."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid != uid:
                    continue
                with open(f"/proc/{d}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                if state != b"Z" or len(os.listdir(f"/proc/{d}/task")) > 1:
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
