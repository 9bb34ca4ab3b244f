"""Child side of `ciders.eval.sandbox`: run one untrusted program contained, then report how it ended.

    python -m ciders.eval._sandbox_exec SPEC_JSON -- CMD...

Three processes. The supervisor (this one, started by the sandbox; it stays outside every namespace and
the program cannot see or signal it) enters new namespaces and forks the init; the init (pid 1 of a new pid
namespace, still privileged) builds a private root, forks the program and reaps orphans until the program
exits; the program drops to the sandbox uid, sets rlimits, no_new_privs and a seccomp filter, and execs.
When the init exits the kernel kills every other process of the namespace, however it detached, and waits
for them, so the supervisor's waitpid on the init returns only once nothing of the run is left. The
supervisor enforces the wall clock itself (it kills the init) and writes one JSON line to the status fd:
{"status": raw wait status or null, "timeout": bool, "error": str or null, "enforced": [...]}.

spec["mode"] == "plain" (no namespaces on this machine): no init, no private root; the supervisor forks the
program directly, after an optional network namespace. Kept to the standard library and free of threads,
so nothing can interfere between fork and exec.
"""

import ctypes
import json
import os
import resource
import select
import signal
import struct
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
KEEP_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + noatime, nodiratime, relatime (locked)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
# per architecture: (AUDIT_ARCH, unshare, clone, clone3, pivot_root) syscall numbers
ARCH = {"x86_64": (0xC000003E, 272, 56, 435, 155), "aarch64": (0xC00000B7, 97, 220, 435, 41)}
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


class SandboxSetupError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SandboxSetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(src, dst, fstype, flags, data=None) -> None:
    enc = (lambda s: s.encode() if isinstance(s, str) else s)
    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


def _bind(src: str, dst: str, extra: int) -> None:
    """Bind src on dst, then remount the bind with `extra` flags; flags the kernel locks are kept."""
    _mount(src, dst, None, MS_BIND | MS_REC)
    keep = os.statvfs(dst).f_flag & KEEP_FLAGS
    _mount(None, dst, None, MS_REMOUNT | MS_BIND | keep | extra)


def _tmpfs(dst: str, mode: str, size_mb: int, flags: int = MS_NOSUID | MS_NODEV) -> None:
    os.makedirs(dst, exist_ok=True)
    _mount("tmpfs", dst, "tmpfs", flags, f"mode={mode},size={size_mb}m,nr_inodes=8192")


def enter_namespaces(spec: dict) -> list[str]:
    """unshare everything at once (a user namespace first when we are not root); return what that gives."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNET if spec["net"] else 0)
    uid, gid = os.getuid(), os.getgid()
    if not spec["root"]:
        flags |= CLONE_NEWUSER
    _check(libc.unshare(flags), "unshare")
    if not spec["root"]:  # map only ourselves: inside, files of other users stay other users'
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    return ["filesystem", "processes"] + (["network"] if spec["net"] else [])


def build_root(spec: dict) -> None:
    """A fresh tmpfs root holding read-only system dirs, fresh /proc /dev /tmp /var/tmp /dev/shm, and
    the work dir; pivot into it so nothing else of the host (project, data, runs, /run sockets) exists."""
    new, tmp_mb = spec["mnt"], spec["tmpfs_mb"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    _tmpfs(new, "0755", 1)
    _tmpfs(new + "/dev", "0755", 1, MS_NOSUID | MS_NOEXEC)
    for n in (n for n in DEVICES if os.path.exists(f"/dev/{n}")):
        open(f"{new}/dev/{n}", "w").close()
        _mount(f"/dev/{n}", f"{new}/dev/{n}", None, MS_BIND)
    for n, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                      ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{n}")
    for d in ("/dev/shm", "/tmp", "/var/tmp"):
        _tmpfs(new + d, "1777", tmp_mb)
    os.makedirs(new + "/proc")
    # hidepid=2: the init (root) is invisible; the program sees only its own processes
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    # then the exposed dirs (an explicitly exposed path under /tmp shows through the private /tmp)
    for d in spec["expose"]:
        dst = new + d
        if os.path.islink(d) and os.path.dirname(d) == "/":
            os.symlink(os.readlink(d), dst)  # merged /usr: /bin -> usr/bin
        elif os.path.isdir(d):
            os.makedirs(dst, exist_ok=True)
            _bind(d, dst, MS_RDONLY | MS_NOSUID | MS_NODEV)
    for d in spec["hide"]:  # a project path inside an exposed dir: cover it
        dst = new + d
        if os.path.isdir(dst) and not os.path.islink(dst):
            _mount("tmpfs", dst, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
        elif os.path.exists(dst):
            _mount("/dev/null", dst, None, MS_BIND)
    os.makedirs(new + spec["inside"])
    _bind(spec["work"], new + spec["inside"], MS_NOSUID | MS_NODEV)
    _pivot(new)


def _pivot(new: str) -> None:
    os.chdir(new)
    nr = ARCH.get(os.uname().machine, (0, 0, 0, 0, 0))[4]
    if nr == 0 or libc.syscall(ctypes.c_long(nr), b".", b".") != 0:  # pivot_root(".", "."): old root on top
        raise SandboxSetupError(f"pivot_root: errno {ctypes.get_errno()} on {os.uname().machine}")
    _check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def seccomp_filter() -> bytes | None:
    """BPF: unshare/clone asking for CLONE_NEWUSER -> EPERM; clone3 (flags out of reach) -> ENOSYS, so libc
    falls back to clone; x32 and foreign-arch syscalls -> EPERM; everything else allowed."""
    arch = ARCH.get(os.uname().machine)
    if arch is None:
        return None
    audit, unshare, clone, clone3, _ = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit), (ret, 0, 0, eperm),          # 0-2 arch
            (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, eperm),     # 3-5 nr; x32
            (jeq, 0, 1, clone3), (ret, 0, 0, enosys),                       # 6-7
            (jeq, 1, 0, unshare), (jeq, 0, 3, clone),                       # 8-9
            (ld, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm),  # 10-12 args[0]
            (ret, 0, 0, allow)]                                             # 13
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def _install_seccomp(prog: bytes) -> None:
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")


def run_program(spec: dict, cmd: list[str]) -> None:
    """In the forked program: limits, the sandbox uid, no_new_privs, seccomp, then exec (never returns)."""
    try:
        lim = spec["limits"]
        # CPU: SIGXCPU at the soft limit (reported as a timeout), SIGKILL one second later
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        for name, value in (("RLIMIT_AS", lim["memory_mb"] << 20), ("RLIMIT_NPROC", lim["nproc"]),
                            ("RLIMIT_FSIZE", lim["file_mb"] << 20), ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", 512)):
            resource.setrlimit(getattr(resource, name), (value, value))
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")  # setuid programs gain nothing
        prog = seccomp_filter()
        if prog:
            _install_seccomp(prog)
        os.umask(0o077)
        os.chdir(spec["cwd"])
        os.execve(_which(cmd[0], spec["env"].get("PATH", "")), cmd, spec["env"])
    except SandboxSetupError as exc:
        os.write(2, f"ciders-sandbox: {exc}\n".encode())
        os._exit(125)
    except OSError as exc:
        os.write(2, f"ciders-sandbox: cannot execute {cmd[0]}: {exc}\n".encode())
        os._exit(127)


def _which(name: str, path: str) -> str:
    """PATH lookup without os.execvpe, which imports modules lazily: after pivot_root our own Python's
    standard library may be out of sight (it can live under /root)."""
    if "/" in name:
        return name
    for d in path.split(":"):
        cand = os.path.join(d or ".", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError(2, "not found on PATH", name)


def init(spec: dict, cmd: list[str], report: int) -> None:
    """pid 1 of the namespace: build the root, fork the program, reap orphans until the program ends, then
    send its wait status on `report` and exit, which makes the kernel kill what is left."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the supervisor gone: the whole run goes
    try:
        build_root(spec)
    except (SandboxSetupError, OSError) as exc:
        os.write(report, json.dumps({"error": str(exc)}).encode())
        os._exit(1)
    child = os.fork()
    if child == 0:
        os.close(report)
        run_program(spec, cmd)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os.write(report, json.dumps({"status": status}).encode())
            os._exit(0)


def supervise(pid: int, wall_s: float) -> tuple[bool, int | None]:
    """Wait for `pid`; past the wall clock kill it. (timed out, raw wait status)."""
    deadline = time.monotonic() + wall_s
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False, status
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True, None
        if fd is not None:
            select.select([fd], [], [], left)
        else:
            time.sleep(min(left, 0.01))


def main() -> None:
    spec = json.loads(sys.argv[1])
    cmd = sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:]
    out = {"status": None, "timeout": False, "error": None, "enforced": []}
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        if spec["mode"] == "ns":
            out["enforced"] = enter_namespaces(spec)
        elif spec["net"]:
            _check(libc.unshare(CLONE_NEWNET), "cannot create a network namespace")
            out["enforced"] = ["network"]
    except (SandboxSetupError, OSError) as exc:
        out["error"] = str(exc)
    else:
        out["enforced"] += (["uid"] if spec["uid"] is not None else []) + (["userns"] if seccomp_filter() else [])
        out.update(_fork_and_wait(spec, cmd))
    with os.fdopen(spec["status_fd"], "w") as f:
        f.write(json.dumps(out))


def _fork_and_wait(spec: dict, cmd: list[str]) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(spec["status_fd"])
        if spec["mode"] == "ns":
            init(spec, cmd, w)
        os.close(w)
        run_program(spec, cmd)
    os.close(w)
    timeout, status = supervise(pid, spec["wall_s"])
    if spec["mode"] != "ns":
        return {"timeout": timeout, "status": status}
    got = os.read(r, 65536)  # the init's report: the program's wait status, or why the root failed
    msg = json.loads(got) if got else {}
    return {"timeout": timeout, "status": msg.get("status"), "error": msg.get("error")}


if __name__ == "__main__":
    main()
