"""A Flower deployment of ciders: certificates and keys, SuperLink, Fleet gateway, SuperNodes, runs.

What `ciders flower ...` and the loopback tests use. Flower 1.42 facts this relies on (measured; see
docs/flower.md):
  - the SuperLink serves Fleet, Control and Runtime APIs from ONE HTTP listener (`--host/--port`;
    `--fleet-api-address` / `--control-api-address` are deprecated and ignored), and the Control API has
    no accounts: whoever reaches it and trusts the CA can register SuperNode keys and start ServerApps.
    So the SuperLink listens on the CONTROL address only (127.0.0.1 or a management address, never a
    wildcard, never the Fleet address), and `fleet_gateway` listens on the FLEET address the SuperNodes
    use, relaying only the Fleet routes to it (`check_addresses` refuses any other layout);
  - every SuperNode has its own local port for its ClientApps (`--port`, here 9094 + i);
  - TLS: a CA plus a server certificate whose SAN covers the Fleet host, the Control host and 127.0.0.1
    (the SuperLink's own helper connects to https://<control host>:<port>); SuperNode authentication: one
    EC key pair (NIST curve, OpenSSH format) per node, its public key registered by the operator on the
    Control address (`flwr supernode register`) BEFORE the node connects (an unregistered node is
    refused with Flower error 2004, exits and does not retry);
  - SuperLink and SuperNode start their helpers (`flower-superexec`, `flwr-serverapp`,
    `flwr-clientapp`) by name: the environment's bin directory must be on PATH;
  - `flwr run` would `uv sync` the app's dependencies (pulling a CUDA torch): disabled with
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1; telemetry and update checks are turned off too;
  - `flwr run --stream` exits 0 even when the run fails: the run's status comes from `flwr ls`;
  - `flwr run` starts a background SuperLink only for the special address ":local:"; this module always
    names its SuperLink, and still stops every process it started by process group.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ciders.errors import CidersError
from ciders.transports.flower.fleet_gateway import MAX_BODY, MAX_CONNECTIONS, REQUEST_S

CONN = "ciders"  # the connection name in $FLWR_HOME/config.toml

APP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "ciders-flower-app"
version = "1.0.0"
description = "ciders on Flower: the ServerApp and ClientApp of ciders.transports.flower"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "ciders"

[tool.flwr.app.components]
serverapp = "ciders.transports.flower.server_app:app"
clientapp = "ciders.transports.flower.client_app:app"

[tool.flwr.app.config]
config = ""
set = ""
out = ""
resume = false
"""


def flower_env(home: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.update({"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise CidersError(f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}")
    return r


def make_credentials(work: Path, n_nodes: int, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> None:
    """A CA, a SuperLink certificate for `hosts` plus 127.0.0.1 and localhost (SAN: the gateway and the
    loopback Control address), and one auth key pair per SuperNode (reused if present). Needs openssl
    and ssh-keygen."""
    hosts = tuple(dict.fromkeys([*hosts, "127.0.0.1", "localhost"]))
    certs, keys = work / "certs", work / "keys"
    certs.mkdir(parents=True, exist_ok=True)
    keys.mkdir(parents=True, exist_ok=True)
    if not (certs / "server.pem").is_file():
        san = ",".join(f"IP:{h}" if re.fullmatch(r"[\d.]+|[0-9a-fA-F:]+:[0-9a-fA-F:]*", h) else f"DNS:{h}"
                       for h in hosts)
        _sh(["openssl", "genrsa", "-out", str(certs / "ca.key"), "4096"])
        _sh(["openssl", "req", "-x509", "-new", "-nodes", "-key", str(certs / "ca.key"), "-sha256", "-days", "365",
             "-subj", "/CN=ciders Flower CA", "-out", str(certs / "ca.crt")])
        _sh(["openssl", "genrsa", "-out", str(certs / "server.key"), "4096"])
        _sh(["openssl", "req", "-new", "-key", str(certs / "server.key"), "-subj", f"/CN={hosts[0]}",
             "-out", str(certs / "server.csr")])
        (certs / "server.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                                          f"extendedKeyUsage=serverAuth\nsubjectAltName={san}\n")
        _sh(["openssl", "x509", "-req", "-in", str(certs / "server.csr"), "-CA", str(certs / "ca.crt"),
             "-CAkey", str(certs / "ca.key"), "-CAcreateserial", "-out", str(certs / "server.pem"), "-days", "365",
             "-sha256", "-extfile", str(certs / "server.ext")])
    for i in range(n_nodes):
        k = keys / f"supernode{i}"
        if not k.is_file():
            _sh(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-C", f"supernode{i}", "-f", str(k)])


WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")


def _loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_addresses(fleet_bind: str, control_host: str) -> None:
    """Refuse a layout that puts the Control API on the network the SuperNodes use: it must listen on a
    loopback or management address of its own, never on every interface and never on the Fleet address."""
    if control_host.strip() in WILDCARDS:
        raise CidersError(f"the Control API must not listen on every interface ({control_host!r}): "
                          "bind it to 127.0.0.1 or a management address")
    if not _loopback(control_host) and control_host.strip("[]") == fleet_bind.strip("[]"):
        raise CidersError(f"the Control API must not share the Fleet address {fleet_bind}: bind it to 127.0.0.1 "
                          "or a management address the SuperNodes cannot reach")


CONNECTIONS_PER_NODE = 4  # a SuperNode's connections to the gateway at most (fleet_gateway.MAX_CONNECTIONS)


def gateway_connections(nodes: int) -> int:
    """The Fleet gateway's connection limit for `nodes` SuperNodes: 4 each and 8 spare (a restarted node's
    old connections until they close), never below the gateway's own default."""
    return max(MAX_CONNECTIONS, CONNECTIONS_PER_NODE * nodes + 8)


def check_gateway_limits(max_body: int, max_connections: int, request_timeout: float) -> None:
    """Refuse limits the Fleet gateway cannot serve with: counts must be positive integers, the timeout a
    positive finite number of seconds."""
    for flag, v in (("--max-body", max_body), ("--max-connections", max_connections)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CidersError(f"{flag} must be a positive integer, got {v!r}")
    t = request_timeout
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise CidersError(f"--request-timeout must be a positive number of seconds, got {t!r}")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass
class Deployment:
    """SuperLink (Control address) + Fleet gateway (Fleet address) + SuperNodes started by this
    process, all stopped by `stop()` (process groups)."""

    work: Path
    port: int = 9092  # the Fleet address's port: the gateway, what SuperNodes connect to
    host: str = "127.0.0.1"  # the Fleet host as this process and the SuperNodes reach it
    secure: bool = True  # TLS + SuperNode authentication
    node_port: int = 9094  # SuperNode i serves its ClientApps on node_port + i (127.0.0.1)
    control_port: int = 9093  # the SuperLink itself (Control, Runtime and Fleet APIs): operator only
    control_host: str = "127.0.0.1"  # 127.0.0.1 or a management address, never the Fleet address
    max_body: int = MAX_BODY  # the Fleet gateway's limits (fleet_gateway's options and defaults)
    max_connections: int = MAX_CONNECTIONS  # 4 per SuperNode: gateway_connections(nodes) above 16 nodes
    request_timeout: float = REQUEST_S
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    groups: set[int] = field(default_factory=set)  # every process group started (for `leftovers`)

    def __post_init__(self):
        check_addresses(self.host, self.control_host)
        check_gateway_limits(self.max_body, self.max_connections, self.request_timeout)
        self.work = Path(self.work).resolve()
        self.home = self.work / "flwr_home"
        self.logs = self.work / "logs"
        for d in (self.home, self.logs):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def control(self) -> str:
        return f"{_url_host(self.control_host)}:{self.control_port}"

    @property
    def fleet(self) -> str:
        return f"{_url_host(self.host)}:{self.port}"

    def config_toml(self) -> str:
        """The `flwr` CLI's connection: the Control address, never the Fleet one."""
        tls = f'root-certificates = "{self.work / "certs" / "ca.crt"}"\n' if self.secure else "insecure = true\n"
        return f'[superlink]\ndefault = "{CONN}"\n\n[superlink.{CONN}]\naddress = "{self.control}"\n{tls}'

    def superlink_cmd(self) -> list[str]:
        # in-memory SuperLink state: nothing in it is needed to resume (the run directory is), and a
        # persisted one would keep crashed nodes "online" and refuse them for up to a minute after restart
        c = self.work / "certs"
        cmd = ["flower-superlink", "--host", self.control_host.strip("[]"), "--port", str(self.control_port)]
        return cmd + (["--ssl-ca-certfile", str(c / "ca.crt"), "--ssl-certfile", str(c / "server.pem"),
                       "--ssl-keyfile", str(c / "server.key"), "--enable-supernode-auth"]
                      if self.secure else ["--insecure"])

    def gateway_cmd(self, bind: str | None = None) -> list[str]:
        c = self.work / "certs"
        cmd = [sys.executable, "-m", "ciders.transports.flower.fleet_gateway",
               "--listen", f"{_url_host(bind or self.host)}:{self.port}", "--upstream", self.control,
               "--max-body", str(self.max_body), "--max-connections", str(self.max_connections),
               "--request-timeout", str(self.request_timeout)]
        return cmd + (["--certfile", str(c / "server.pem"), "--keyfile", str(c / "server.key"),
                       "--cafile", str(c / "ca.crt")] if self.secure else ["--insecure"])

    def supernode_cmd(self, i: int, n: int, state_dir: Path, port: int | None = None,
                      data_file: Path | None = None, warm: bool = True) -> list[str]:
        """`data_file`: the node's own data (the ClientApp reads it instead of cutting partition i out of the
        experiment's data; docs/flower.md#each-node-brings-its-own-data). `warm`: the SuperNode starts beside a
        warm worker (`transports.flower.worker`) that its ClientApps hand the CIDERS phases to."""
        state_dir = Path(state_dir).resolve()
        node_cfg = f'partition-id={i} num-partitions={n} state-dir="{state_dir}"'
        if data_file is not None:
            node_cfg += f' data-file="{Path(data_file).resolve()}"'
        if warm:
            from ciders.transports.flower.worker import socket_path

            node_cfg += f' worker="{socket_path(state_dir)}"'
        cmd = ["flower-supernode", "--superlink", self.fleet, "--node-config", node_cfg,
               "--host", "127.0.0.1", "--port", str(port or self.node_port + i)]
        cmd += (["--root-certificates", str(self.work / "certs" / "ca.crt"), "--auth-supernode-private-key",
                 str(self.work / "keys" / f"supernode{i}")] if self.secure else ["--insecure"])
        if warm:  # the worker's parent is the shell that becomes the SuperNode: one process group, one lifetime
            state_dir.mkdir(parents=True, exist_ok=True)
            launch = f'"{sys.executable}" -m ciders.transports.flower.worker "$0" >> "$0/worker.log" 2>&1 & exec "$@"'
            cmd = ["sh", "-c", launch, str(state_dir), *cmd]
        return cmd

    # ------------------------------------------------------------------ processes
    def _start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=flower_env(self.home, env),
                             cwd=self.work, start_new_session=True)  # own process group: stop() takes children too
        self.procs[name] = p
        self.groups.add(p.pid)
        return p

    def _healthy(self, name: str, hostport: str, timeout: float) -> None:
        p = self.procs[name]
        ctx = ssl.create_default_context(cafile=str(self.work / "certs" / "ca.crt")) if self.secure else None
        url = f"{'https' if self.secure else 'http'}://{hostport}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise CidersError(f"{name} exited ({p.returncode}); see {self.logs / (name + '.log')}")
            try:
                urllib.request.urlopen(url, context=ctx, timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        raise CidersError(f"{name} not healthy after {timeout:.0f} s; see {self.logs / (name + '.log')}")

    def start_superlink(self, timeout: float = 60, bind: str | None = None) -> None:
        """Start the SuperLink on the Control address and the Fleet gateway on `bind` (default: the Fleet
        host) unless it is still running, and wait until both are healthy."""
        bind = bind or self.host
        check_addresses(bind, self.control_host)
        self._start("superlink", self.superlink_cmd())
        self._healthy("superlink", self.control, timeout)
        gw = self.procs.get("fleet-gateway")
        if gw is None or gw.poll() is not None:
            self._start("fleet-gateway", self.gateway_cmd(bind))
        here = self.fleet if bind.strip() in WILDCARDS else f"{_url_host(bind)}:{self.port}"
        self._healthy("fleet-gateway", here, timeout)

    def flwr(self, *args: str, timeout: float = 120) -> str:
        # written here, not at construction: every role of a deployment shares WORK, and a SuperNode
        # role (which never runs `flwr`) must not overwrite the operator's Control address
        cfg, text = self.home / "config.toml", self.config_toml()
        if not cfg.is_file() or cfg.read_text() != text:
            tmp = cfg.with_name(f"config.toml.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, cfg)  # a concurrent `flwr` never reads half a file
        return _sh(["flwr", *args], env=flower_env(self.home), cwd=self.work, timeout=timeout).stdout

    def register_key(self, key: Path, name: str) -> None:
        """The operator's act of admitting one SuperNode: register its public key on the Control address
        (idempotent: an already registered key is fine)."""
        try:
            self.flwr("supernode", "register", str(Path(key).resolve()), CONN, "--name", name)
        except CidersError as exc:
            if "already" not in str(exc).lower():
                raise

    def register(self, i: int) -> None:
        """Register SuperNode i's public key (WORK/keys/supernode<i>.pub)."""
        if self.secure:
            self.register_key(self.work / "keys" / f"supernode{i}.pub", f"supernode{i}")

    def start_supernode(self, i: int, n: int, state_dir: Path, env: dict | None = None,
                        port: int | None = None, data_file: Path | None = None,
                        wrap: list[str] | None = None, warm: bool = True) -> subprocess.Popen:
        """`wrap`: a command prefix the SuperNode runs under (tests: a mount namespace hiding the model files)."""
        cmd = self.supernode_cmd(i, n, state_dir, port, data_file, warm)
        return self._start(f"supernode{i}", [*(wrap or []), *cmd], env)

    def rejoin(self, i: int, n: int, state_dir: Path, timeout: float = 180, env: dict | None = None) -> None:
        """Restart SuperNode i after a crash. The SuperLink keeps a SIGKILLed node "online" until its
        heartbeat lapses (Flower 1.42: 2 x 30 s) and refuses the same key until then (exit code 305), so
        retry until the node stays up."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.start_supernode(i, n, state_dir, env)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                return  # activated and running
            if time.monotonic() > deadline:
                raise CidersError(f"supernode{i} could not rejoin within {timeout:.0f} s; see its log")
            time.sleep(3)

    def online(self) -> int:
        try:
            nodes = json.loads(self.flwr("supernode", "ls", CONN, "--format", "json")).get("nodes", [])
        except (CidersError, ValueError):
            return 0
        return sum(str(n.get("status", "")).lower() == "online" for n in nodes)

    def wait_online(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.online() < n:
            for name, p in self.procs.items():
                if name.startswith("supernode") and p.poll() is not None:
                    raise CidersError(f"{name} exited ({p.returncode}); see {self.logs / (name + '.log')}")
            if time.monotonic() > deadline:
                raise CidersError(f"only {self.online()} of {n} SuperNodes online after {timeout:.0f} s")
            time.sleep(0.5)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name, None)
        if p is None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every role, then SIGKILL whatever of ours is still running after `grace` seconds: any
        process in a group we started, or one started for this deployment in a group of its own (Flower's
        ServerApp / ClientApp processes name our certificates or state directories)."""
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self._ours() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid, pgid in self._ours():
            for kill, target in ((os.killpg, pgid), (os.kill, pid)):
                try:
                    kill(target, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _processes(self) -> list[tuple[int, int, str]]:
        """(pid, pgid, args) of every live process but this one (zombies have exited, only not reaped)."""
        r = subprocess.run(["ps", "-eo", "pid=,pgid=,stat=,args="], capture_output=True, text=True)
        out = []
        for line in r.stdout.splitlines():
            parts = line.split(None, 3)
            if len(parts) == 4 and not parts[2].startswith("Z") and int(parts[0]) != os.getpid():
                out.append((int(parts[0]), int(parts[1]), parts[3]))
        return out

    def _ours(self) -> list[tuple[int, int]]:
        out = []
        for pid, pgid, args in self._processes():
            flower = "flwr-" in args or "flower-" in args  # not other `ciders flower` roles
            if pgid in self.groups or (flower and str(self.work) in args):
                out.append((pid, pgid))
        return out

    def leftovers(self) -> list[str]:
        """Processes still running from any group this deployment started, plus any flower-superlink
        at all (such as the background one `flwr run` starts for ":local:"). Empty after stop()."""
        return [f"{pid} {args}" for pid, pgid, args in self._processes()
                if pgid in self.groups or str(self.work) in args or "flower-superlink" in args]

    # ------------------------------------------------------------------ runs
    def app_dir(self) -> Path:
        d = self.work / "app"
        d.mkdir(exist_ok=True)
        (d / "pyproject.toml").write_text(APP_PYPROJECT)
        return d

    def launch(self, config: Path, out: Path, overrides: list[str] = (), resume: bool = False) -> int:
        """`flwr run` the ciders app; returns the run id (the run goes on in the ServerApp)."""
        for o in overrides:
            if ";" in o or '"' in o:
                raise CidersError(f"override {o!r}: ';' and '\"' cannot travel in a Flower run config")
        rc = (f'config="{Path(config).resolve()}" out="{Path(out).resolve()}" set="{";".join(overrides)}" '
              f"resume={'true' if resume else 'false'}")
        text = self.flwr("run", str(self.app_dir()), CONN, "--run-config", rc)
        m = re.search(r"run (\d+)", text)
        if not m:
            raise CidersError(f"flwr run did not report a run id:\n{text[-800:]}")
        return int(m.group(1))

    def status(self, run_id: int) -> str:
        runs = json.loads(self.flwr("ls", CONN, "--run-id", str(run_id), "--format", "json")).get("runs", [])
        return str(runs[0]["status"]) if runs else "unknown"

    def wait_run(self, run_id: int, timeout: float = 1800) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status(run_id)
            if s.startswith("finished"):
                return s
            time.sleep(1.0)
        raise CidersError(f"run {run_id} not finished after {timeout:.0f} s")

    def run_log(self, run_id: int) -> str:
        try:
            return self.flwr("log", str(run_id), CONN, "--show")
        except CidersError as exc:
            return str(exc)


def loopback(config: Path, out: Path, n_clients: int, work: Path, overrides: list[str] = (), secure: bool = True,
             port: int = 9092, node_port: int = 9094, log=print, control_port: int = 9093,
             data_files: list[Path] | None = None) -> str:
    """The whole deployment on 127.0.0.1: credentials, SuperLink (Control on `control_port`), the Fleet
    gateway (`port`, its connections sized for N nodes: `gateway_connections`), N SuperNodes (state in
    WORK/nodes/client<i>; `data_files[i]`: node i's own data, for federation.partition=nodes), one run, then
    every process stopped. Returns the run's final status."""
    work = Path(work)
    if data_files and len(data_files) != n_clients:
        raise CidersError(f"--data-file: give one per SuperNode ({n_clients}), got {len(data_files)}")
    if secure:
        make_credentials(work, n_clients)
    dep = Deployment(work, port=port, node_port=node_port, secure=secure, control_port=control_port,
                     max_connections=gateway_connections(n_clients))
    try:
        dep.start_superlink()
        log(f"SuperLink: Fleet on {dep.fleet}, Control on {dep.control} "
            f"({'TLS + SuperNode auth' if secure else 'insecure'})")
        for i in range(n_clients):
            dep.register(i)
        for i in range(n_clients):
            dep.start_supernode(i, n_clients, work / "nodes" / f"client{i}",
                                data_file=Path(data_files[i]) if data_files else None)
        dep.wait_online(n_clients)
        log(f"{n_clients} SuperNodes online")
        run_id = dep.launch(config, out, overrides)
        log(f"run {run_id} started; the ServerApp writes {out}")
        status = dep.wait_run(run_id)
        log(f"run {run_id}: {status}")
        if status != "finished:completed":
            log(dep.run_log(run_id)[-3000:])
        return status
    finally:
        dep.stop()
        left = dep.leftovers()
        if left:
            log("still running after stop: " + "; ".join(left))
