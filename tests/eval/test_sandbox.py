import glob
import os
import tempfile

import pytest

from ciders.eval import humaneval as he
from ciders.eval.sandbox import BASE_UID, UID_BLOCK, UID_BLOCKS, Job, Limits, Sandbox
from helpers import shared, toolchain

PY = he.python_executable()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    # a scratch root of its own: other test processes' sandboxes (or a killed run's) do not count here
    return Sandbox(workers=2, limits=Limits(wall_s=4, cpu_s=4, memory_mb=512, nproc=32),
                   root=tmp_path_factory.mktemp("sbx-root"))


def sandbox_threads(uids=None) -> list[str]:
    """Every thread on the machine owned by a sandbox uid (zombie-looking leaders' threads included), or
    by one of `uids`."""
    out = []
    for task in glob.glob("/proc/[0-9]*/task/[0-9]*/status"):
        try:
            with open(task) as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if (uid in uids) if uids is not None else BASE_UID <= uid < BASE_UID + UID_BLOCK * UID_BLOCKS:
            out.append(task)
    return out


def _leftovers(sb):
    """Threads still owned by `sb`'s uids, and its run directories left in its scratch root."""
    procs = len(sandbox_threads(set(sb._uids or ()))) if os.geteuid() == 0 else 0
    return procs, glob.glob(os.path.join(sb.root, "ciders-sbx-*"))


@pytest.mark.parametrize("name, code, status", [
    ("passes", "print('ok')", "passed"),
    ("wrong", "assert 1 == 2", "failed"),
    ("infinite loop", "while True: pass", "timeout"),
    ("sleeps", "import time; time.sleep(60)", "timeout"),
    ("segfault", "import ctypes; ctypes.string_at(0)", "crashed"),
    ("runaway memory", "x = bytearray(3 * 1024**3)", "failed"),
    ("network", "import socket; socket.create_connection(('1.1.1.1', 80), 2)", "failed"),
    ("50 forks", "import os, time\nfor i in range(50):\n    if os.fork() == 0:\n        time.sleep(60); os._exit(0)\n"
                 "time.sleep(60)", None),
    ("escapes its process group", "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\n", "passed"),
])
def test_contained(sandbox, name, code, status):
    r = sandbox.run(Job([PY, "prog.py"], {"prog.py": code}))
    if status:
        assert r.status == status, (r.status, r.stderr[-300:])
    else:  # the fork limit stops it (BlockingIOError) or the wall clock does: never success
        assert r.status in ("failed", "timeout"), r.status
    if name == "network":
        assert "unreachable" in r.stderr or "Network" in r.stderr
    assert r.seconds < 10
    procs, dirs = _leftovers(sandbox)
    assert procs == 0 and dirs == []


def test_cpu_limit_stops_a_busy_loop_before_the_wall_clock(sandbox):
    r = sandbox.run(Job([PY, "prog.py"], {"prog.py": "while True: pass"}, limits=Limits(wall_s=20, cpu_s=1)))
    assert r.status == "timeout" and r.seconds < 5


def test_cannot_write_outside_its_directory(sandbox):
    if os.geteuid() != 0:
        pytest.skip("needs root: samples only run as an unprivileged uid when ciders runs as root")
    r = sandbox.run(Job([PY, "prog.py"], {"prog.py": "open('/etc/ciders-test', 'w')"}))
    denied = "Permission denied" in r.stderr or "Read-only file system" in r.stderr
    assert r.status == "failed" and denied and not os.path.exists("/etc/ciders-test")


@pytest.mark.full_data
@pytest.mark.parametrize("language, n", [("python", 6), ("java", 3), ("go", 3)])
def test_canonical_solutions_pass_and_wrong_ones_fail(language, n):
    shared("humaneval-x")
    toolchain(language)
    probs = he.load_problems(language)[:n]
    scratch = os.path.join(tempfile.gettempdir(), "ciders-sbx-*")
    before = set(glob.glob(scratch))  # e.g. a killed earlier run's
    good = he.score(language, [{"task_id": p["task_id"], "completion": p["canonical_solution"]} for p in probs], probs)
    assert good["pass@1"] == 1.0 and good["tasks"] == n
    wrong = {"python": "    return None\n", "java": "        return null;\n    }\n}\n", "go": "    panic(\"no\")\n}\n"}[language]
    bad = he.score(language, [{"task_id": p["task_id"], "completion": wrong} for p in probs], probs)
    assert bad["pass@1"] == 0.0 and bad["failed_tasks"] == [p["task_id"] for p in probs]
    assert sandbox_threads() == [] and set(glob.glob(scratch)) <= before


def test_pass_at_k_estimator():
    assert he.pass_at_k(10, 0, 1) == 0 and he.pass_at_k(10, 10, 5) == 1
    assert he.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert he.pass_at_k(5, 1, 2) == pytest.approx(1 - (4 * 3) / (5 * 4))


def test_truncation_at_stop_sequences():
    assert he.truncate("python", "    return x\n\ndef other():\n    pass") == "    return x\n"
    assert he.truncate("go", "    return 1\n}\n\nfunc main() {}") == "    return 1\n}\n"


@pytest.mark.full_data
@pytest.mark.slow
@pytest.mark.parametrize("language", ["python", "java", "go"])
def test_every_canonical_solution(language):
    """164/164 where the dataset's canonical solutions are correct. Go/95's canonical solution is not:
    it looks at only the first two keys of a Go map, whose iteration order is random, so it passes
    about 3 runs in 4 (22 of 30 measured)."""
    shared("humaneval-x")
    toolchain(language)
    probs = he.load_problems(language)
    r = he.score(language, [{"task_id": p["task_id"], "completion": p["canonical_solution"]} for p in probs], probs)
    assert r["tasks"] == 164
    assert set(r["failed_tasks"]) <= ({"Go/95"} if language == "go" else set()), r["failed_tasks"]
