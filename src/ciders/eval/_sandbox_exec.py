"""Child side of `ciders.eval.sandbox`: applied after fork, before the untrusted program runs.

    python -m ciders.eval._sandbox_exec SPEC_JSON -- CMD...

New network namespace (no interfaces but a down loopback), resource limits, then (when started as
root) an unprivileged uid/gid with no supplementary groups, then exec. Kept free of threads and
imports beyond the standard library, so nothing can interfere between fork and exec.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNET = 0x40000000


def main() -> None:
    spec = json.loads(sys.argv[1])
    cmd = sys.argv[3:] if sys.argv[2] == "--" else sys.argv[2:]
    if spec["net"]:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            os.write(2, b"ciders-sandbox: cannot create a network namespace (errno %d)\n" % ctypes.get_errno())
            os._exit(125)
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
    os.umask(0o077)
    os.chdir(spec["cwd"])
    try:
        os.execvpe(cmd[0], cmd, spec["env"])
    except OSError as exc:
        os.write(2, f"ciders-sandbox: cannot execute {cmd[0]}: {exc}\n".encode())
        os._exit(127)


if __name__ == "__main__":
    main()
