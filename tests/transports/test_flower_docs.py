"""docs/flower.md's deployment commands, run as written from the root of a copy of a fresh checkout.

- The role-per-host block of "Deployment on loopback" (credentials, `superlink ... &`, register, the `for i` loop of
  SuperNodes, launch, `kill %1 %2 %3 %4`) line by line, as a shell runs it: the loop expanded, the fixed ports as
  written, each `&` job started in the background and stopped by its PID where the block kills it. The run equals the
  in-process run of the same config, bit for bit, and nothing is left running.
- The "Real hosts" workflow on 127.0.0.1: its synopsis lines filled in with concrete values (a node index, a node
  count, 127.0.0.1 for the server's name, state directories, data files, a user-written experiment with
  `federation.partition: nodes`, an absolute run directory), and its concrete lines (the SuperLink on
  `--bind 0.0.0.0`, the operator's `register`) as written. Each SuperNode reads its own data file; after the run a
  node exports its personalized model from its state directory.

A background role counts as up once it prints that it is ("...; Ctrl-C stops it": what a user at a terminal waits
for before typing the next command); `launch` waits for the SuperNodes itself (flower.node_wait_s).
"""

import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ciders.fileio import read_jsonl
from doc_helpers import (ROOT, argv, bash_block, checkout_copy, ciders, documented, lines_starting, shell_env,
                         synopsis)
from flower_helpers import assert_same_run, local_run

pytestmark = pytest.mark.flower


def _expand(body: str, var: str, value: str) -> str:
    """A loop body line with $((arithmetic)) and $var substituted, as the shell does."""
    def arith(m):
        expr = re.sub(rf"\${var}\b|\b{var}\b", value, m.group(1))
        assert re.fullmatch(r"[\d\s+*-]+", expr), expr
        return str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - digits and + - * only

    return re.sub(rf"\${var}\b|\${{{var}}}", value, re.sub(r"\$\(\((.*?)\)\)", arith, body))


def shell_steps(lines: list[str]) -> list[tuple[str, object]]:
    """('run' | 'background', argv words) and ('kill', job numbers) for a block of ciders lines, `for` loops and
    `kill %n` lines; anything else in the block is an error (the test would no longer run the block as written)."""
    steps, i = [], 0
    while i < len(lines):
        line = lines[i]
        loop = re.fullmatch(r"for (\w+) in ([\w ]+); do", line)
        if loop:
            end = lines.index("done", i)
            for value in loop.group(2).split():
                steps += shell_steps([_expand(b, loop.group(1), value) for b in lines[i + 1:end]])
            i = end + 1
            continue
        words = line.split("#")[0].split()
        if words[0] == "kill":
            steps.append(("kill", [int(w[1:]) for w in words[1:] if w.startswith("%")]))
        else:
            assert words[0] == "ciders", f"unexpected line in the documented block: {line!r}"
            steps.append(("background" if words[-1] == "&" else "run", argv(line)))
        i += 1
    return steps


class Shell:
    """Runs ciders commands from `root` like an interactive shell: foreground ones to completion, `&` ones as
    numbered jobs (output in a file; up once they say so), `kill %n` by the job's PID."""

    def __init__(self, root: Path):
        self.root, self.jobs, self.outputs = root, [], []

    def run(self, words: list[str], timeout: float = 900) -> str:
        r = subprocess.run(ciders(words), cwd=self.root, env=shell_env(), capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, f"ciders {' '.join(words)}: exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
        self.outputs.append(r.stdout)
        return r.stdout

    def background(self, words: list[str], timeout: float = 120) -> subprocess.Popen:
        """Start a long-running role; it is up once it says so ("...; Ctrl-C stops it")."""
        log = self.root / f"job{len(self.jobs) + 1}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(ciders(words), cwd=self.root, env=shell_env(), stdout=f, stderr=subprocess.STDOUT)
        self.jobs.append((p, log))
        deadline = time.monotonic() + timeout
        while "Ctrl-C stops it" not in log.read_text():
            assert p.poll() is None, f"ciders {' '.join(words)}: exited {p.returncode}\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ciders {' '.join(words)}: no output after {timeout} s"
            time.sleep(0.3)
        return p

    def kill(self, jobs: list[int]) -> list[int]:
        """SIGTERM to each job, as `kill %n` sends; their exit codes."""
        procs = [self.jobs[n - 1][0] for n in jobs]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        return [p.wait(timeout=60) for p in procs]

    def stop_all(self) -> None:
        for p, _ in self.jobs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _ in self.jobs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for _, log in self.jobs)


def leftovers(root: Path, timeout: float = 30) -> list[str]:
    """Processes that still name the checkout copy, or any flower-superlink, once the roles have exited (Flower's
    own children may take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout.splitlines()
        left = [x for x in rows if not x.startswith("Z") and (str(root) in x or "flower-superlink" in x)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


ROLE_BLOCK = bash_block(ROOT / "docs" / "flower.md", "ciders flower credentials runs/fleet")


def test_documented_role_commands_deploy_and_stop_cleanly():
    """The multi-host path of docs/flower.md on one host, as written: `ciders flower credentials | superlink |
    register | supernode | launch` as separate processes (SuperNodes on the Fleet address, the operator's register
    and launch on the Control address); `kill %1 %2 %3 %4` (SIGTERM to each role) stops everything it started."""
    steps = shell_steps(ROLE_BLOCK)
    assert [k for k, _ in steps] == ["run", "background", "run", "background", "background", "background", "run",
                                     "kill"], steps
    launch = steps[-2][1]
    # a short root: a SuperNode's worker socket path (under its state directory) must fit a Unix socket's 100 bytes
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ck") as tmp:
        root = checkout_copy(Path(tmp))
        sh = Shell(root)
        try:
            for kind, what in steps:
                if kind == "run":
                    sh.run(what)
                elif kind == "background":
                    sh.background(what)
                else:
                    codes = sh.kill(what)
        finally:
            sh.stop_all()
        assert codes == [0, 0, 0, 0], sh.logs()
        assert "3 SuperNode keys registered" in sh.outputs[1] and "finished:completed" in sh.outputs[2], sh.outputs
        assert leftovers(root) == []
        out = root / launch[launch.index("--out") + 1]
        local_run(root / launch[launch.index("launch") + 1], Path(tmp) / "local")
        assert_same_run(Path(tmp) / "local", out, root / "runs" / "fleet")


EXPERIMENT = """# the user's experiment: each node brings its own data (docs/flower.md#each-node-brings-its-own-data)
family: ciders
name: my-fleet
model: {name: tiny-qwen2, dtype: float32}
decomposition: {messenger_layers: 2, drop_ratio: 0.5}
takd: {bootstrap_steps: 2, round_steps: 1, batch_size: 2}
algorithm: {weighting: uniform, local_steps: 2, batch_size: 2, lr: 0.01}
federation: {clients: 2, rounds: 2, partition: nodes}
data:
  task: custom
  public: data/gsm8k-slice/public.jsonl
  eval: data/gsm8k-slice/eval.jsonl
  clients: null
  public_limit: 12
  eval_limit: 4
  clients_limit: 12
  max_length: 128
flower: {round_timeout_s: 300, node_wait_s: 120}
"""


def fill(text: str, values: dict[str, str]) -> list[str]:
    """A synopsis line's argv with its placeholders replaced: whole words (`i`, `N`) and names inside a word
    (`server.example.org` in `server.example.org:9092`, `STATE_DIR`)."""
    words = []
    for w in argv(text):
        if w in values:
            w = values[w]
        else:
            for k, v in values.items():
                if len(k) > 1:
                    w = w.replace(k, v)
        words.append(w)
    assert not synopsis("ciders " + " ".join(words)), f"a placeholder left in {words}"
    return words


def test_real_hosts_workflow_on_loopback():
    """docs/flower.md "Real hosts", every step on 127.0.0.1: credentials for the server's names, the SuperLink with
    the Fleet address on every interface (`--bind 0.0.0.0`), the operator's register line per node, two SuperNodes
    each with its own state directory and data file (its own node port: on real hosts each has 9094 to itself),
    launch of a user-written `partition: nodes` experiment into an absolute run directory, then `ciders export` of a
    node's personalized model from its state directory, by the node alone."""
    (credentials,) = documented("ciders flower credentials fleet ")
    (superlink,) = lines_starting("ciders flower superlink fleet ")
    (register,) = lines_starting("ciders flower register fleet ")
    (supernode,) = documented("ciders flower supernode fleet ", "--data-file")
    (launch,) = documented("ciders flower launch EXPERIMENT.yaml ")
    (export,) = documented("ciders export STATE_DIR ")
    assert not synopsis(superlink) and not synopsis(register), "these two run as written"
    n = 2
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ck") as tmp:
        tmp = Path(tmp)
        root = checkout_copy(tmp / "srv")
        (root / "experiment.yaml").write_text(EXPERIMENT)
        rows = (root / "data" / "gsm8k-slice" / "clients.jsonl").read_text().splitlines()[:24]
        hosts = [tmp / f"edge{i}" for i in range(n)]
        for i, h in enumerate(hosts):
            h.mkdir()
            (h / "records.jsonl").write_text("\n".join(rows[i::n]) + "\n")
        names = {"N": str(n), "server.example.org": "127.0.0.1", "10.0.0.5": "localhost"}
        sh = Shell(root)
        try:
            sh.run(fill(credentials, names))
            sh.background(argv(superlink))
            for i in range(n):  # "one line per admitted node": the documented line for node 0, then node 1's
                sh.run([w.replace("supernode0", f"supernode{i}") for w in argv(register)])
            for i, h in enumerate(hosts):
                sh.background(fill(supernode, {**names, "i": str(i), "STATE_DIR": str(h / "state"),
                                               "RECORDS.jsonl": str(h / "records.jsonl")})
                              + ["--node-port", str(9094 + i)])
            run_dir = tmp / "srv-runs" / "my-fleet"  # absolute, on the server host
            sh.run(fill(launch, {"EXPERIMENT.yaml": "experiment.yaml", "RUN_DIR": str(run_dir)}))
            assert "finished:completed" in sh.outputs[-1], sh.outputs[-1]
            sh.run(fill(export, {"STATE_DIR": str(hosts[0] / "state"), "MODEL_DIR": str(hosts[0] / "model")}))
            codes = sh.kill([1, 2, 3])
        finally:
            sh.stop_all()
        assert codes == [0, 0, 0], sh.logs()
        assert leftovers(tmp) == []
        server = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["event"] == "server"]
        assert len(server) == 2 and all(r["accepted"] == ["client0", "client1"] for r in server), server
        assert "client0's edge model (round 1 record" in sh.outputs[-1], sh.outputs[-1]
        from ciders.models.onnx_run import EdgeSession

        assert len(EdgeSession(hosts[0] / "model").generate([1, 2, 3], 4, stop_at_eos=False)) == 4
