"""`ciders flower ...`: the deployment path, one command per role (see docs/flower.md).

  credentials WORK --clients N [--host H]   CA, SuperLink certificate (SAN: the hosts), one key per SuperNode
  superlink WORK [--bind ADDR] [--port P] [--control-bind ADDR] [--control-port P]
            [--max-body B] [--max-connections N] [--request-timeout S]
        the SuperLink (TLS + SuperNode auth) on the Control address, the Fleet gateway (with these limits;
        default: the gateway's own, fleet_gateway.MAX_*) on the Fleet one
  register WORK PUBKEY... [--control HOST:PORT]   the operator admits SuperNodes (Control address only)
  supernode WORK --partition I --clients N --superlink HOST:PORT --state-dir DIR   (the Fleet address)
  launch CONFIG --out OUT --work WORK [--control HOST:PORT] [--resume] [--set K=V]   flwr run, wait, status
  loopback CONFIG --out OUT --clients N --work WORK    all of the above on 127.0.0.1, then everything stopped
The long-running roles stay in the foreground until Ctrl-C, then stop their processes. The Control
address (default 127.0.0.1:9093) must not be reachable by the SuperNodes; `deploy.check_addresses`
refuses a wildcard or the Fleet address for it.
"""

from __future__ import annotations

import argparse
import math
import signal
import time
from pathlib import Path

from ciders.errors import CidersError


def _address(s: str, what: str = "--superlink") -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise CidersError(f"{what} must be HOST:PORT, got {s!r}")
    return host.strip("[]"), int(port)


def _positive_int(s: str) -> int:
    if not s.strip().isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}")
    return int(s)


def _seconds(s: str) -> float:
    try:
        t = float(s)
    except ValueError:
        t = math.nan
    if not math.isfinite(t) or t <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {s!r}")
    return t


GATEWAY_LIMITS = ("max_body", "max_connections", "request_timeout")  # fleet_gateway's options, passed through


def deployment(a: argparse.Namespace):
    """The Deployment a role's arguments describe (the addresses each role uses, nothing started)."""
    from ciders.transports.flower.deploy import Deployment

    secure = not getattr(a, "insecure", False)
    if a.role == "superlink":  # this host: the SuperLink's own Control address, the gateway's Fleet port
        limits = {k: getattr(a, k) for k in GATEWAY_LIMITS if getattr(a, k) is not None}  # else the gateway's
        return Deployment(Path(a.work), port=a.port, control_host=a.control_bind, control_port=a.control_port,
                          secure=secure, **limits)
    if a.role == "supernode":
        host, port = _address(a.superlink)
        return Deployment(Path(a.work), port=port, host=host, secure=secure)
    host, port = _address(a.control, "--control")  # register, launch: the operator's side
    return Deployment(Path(a.work), control_host=host, control_port=port, secure=secure)


def _foreground(dep, what: str) -> int:
    print(f"{what}; Ctrl-C stops it (logs in {dep.logs})", flush=True)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while all(p.poll() is None for p in dep.procs.values()):
            time.sleep(1)
        bad = {n: p.returncode for n, p in dep.procs.items() if p.poll() is not None}
        raise CidersError(f"{', '.join(f'{n} exited ({rc})' for n, rc in bad.items())}; see {dep.logs}")
    except KeyboardInterrupt:
        return 0
    finally:
        dep.stop()


def _cmd(a: argparse.Namespace) -> int:
    from ciders.transports.flower.deploy import loopback, make_credentials

    work = Path(a.work)
    if a.role == "credentials":
        make_credentials(work, a.clients, tuple(a.host or ["127.0.0.1", "localhost"]))
        print(f"CA and SuperLink certificate in {work / 'certs'}, SuperNode keys in {work / 'keys'}")
        return 0
    if a.role == "loopback":
        status = loopback(Path(a.config), Path(a.out), a.clients, work, a.set or [],
                          secure=not a.insecure, port=a.port, control_port=a.control_port,
                          data_files=[Path(f) for f in a.data_file] if a.data_file else None)
        return 0 if status == "finished:completed" else 2
    dep = deployment(a)
    if a.role == "superlink":
        dep.start_superlink(bind=a.bind)
        return _foreground(dep, f"SuperLink: Fleet on {a.bind}:{a.port} (SuperNodes), Control on {dep.control} "
                                "(operator only); admit SuperNodes with `ciders flower register`")
    if a.role == "register":
        for key in a.keys:
            dep.register_key(Path(key), Path(key).name.removesuffix(".pub"))
        print(f"{len(a.keys)} SuperNode keys registered on {dep.control}")
        return 0
    if a.role == "supernode":
        dep.start_supernode(a.partition, a.clients, Path(a.state_dir), port=a.node_port,
                            data_file=Path(a.data_file) if a.data_file else None, warm=not a.cold)
        return _foreground(dep, f"SuperNode client{a.partition} -> {dep.fleet}")
    run_id = dep.launch(Path(a.config), Path(a.out), a.set or [], resume=a.resume)
    print(f"run {run_id} started; the ServerApp writes {a.out}", flush=True)
    status = dep.wait_run(run_id, timeout=a.timeout)
    print(f"run {run_id}: {status}")
    if status != "finished:completed":
        print(dep.run_log(run_id)[-4000:])
        return 2
    return 0


def _gateway_options(r) -> None:
    """The Fleet gateway's limits (python -m ciders.transports.flower.fleet_gateway --help); not given: the
    gateway's own defaults (not imported here: the gateway module loads httpx, too slow for every CLI start)."""
    r.add_argument("--max-body", type=_positive_int, metavar="BYTES",
                   help="largest Fleet request body the gateway accepts (default: the gateway's, 3x Flower's largest)")
    r.add_argument("--max-connections", type=_positive_int, metavar="N",
                   help="connections the gateway serves at once (default: the gateway's, for 16 SuperNodes; "
                   "a SuperNode holds up to 4: give 4 x nodes + 8 for more)")
    r.add_argument("--request-timeout", type=_seconds, metavar="S",
                   help="seconds a Fleet request may take to arrive, or its response to be read "
                   "(default: the gateway's)")


def add_parser(sub) -> None:
    p = sub.add_parser("flower", help="deploy on Flower: credentials, SuperLink, SuperNodes, launch (docs/flower.md)")
    roles = p.add_subparsers(dest="role", required=True)
    r = roles.add_parser("credentials", help="CA, SuperLink certificate and one auth key per SuperNode")
    r.add_argument("work", help="deployment directory (certs/, keys/)")
    r.add_argument("--clients", type=int, required=True, help="number of SuperNodes (one per client)")
    r.add_argument("--host", action="append", help="SuperLink host name or IP for the certificate (repeatable)")
    r = roles.add_parser("superlink", help="run a SuperLink (TLS + SuperNode auth) and its Fleet gateway")
    r.add_argument("work")
    r.add_argument("--bind", default="127.0.0.1", help="Fleet address the SuperNodes use (0.0.0.0: other hosts)")
    r.add_argument("--port", type=int, default=9092, help="Fleet port (the gateway: Fleet API only)")
    r.add_argument("--control-bind", default="127.0.0.1",
                   help="Control address: 127.0.0.1 or a management address, never the Fleet one")
    r.add_argument("--control-port", type=int, default=9093, help="Control port (the SuperLink itself)")
    r.add_argument("--insecure", action="store_true", help="no TLS, no node auth (a trusted test network only)")
    _gateway_options(r)
    r = roles.add_parser("register", help="admit SuperNodes: register their public keys (operator, Control address)")
    r.add_argument("work")
    r.add_argument("keys", nargs="+", help="public key files (supernode<i>.pub); the name is the file's stem")
    r.add_argument("--control", default="127.0.0.1:9093", help="HOST:PORT of the SuperLink's Control address")
    r = roles.add_parser("supernode", help="run the SuperNode of one client in the foreground")
    r.add_argument("work")
    r.add_argument("--partition", type=int, required=True, help="the client's partition id i (client<i>)")
    r.add_argument("--clients", type=int, required=True, help="number of clients N")
    r.add_argument("--superlink", default="127.0.0.1:9092", help="HOST:PORT of the Fleet address")
    r.add_argument("--state-dir", required=True, help="the client's durable state (survives restarts)")
    r.add_argument("--node-port", type=int, default=9094, help="local port for this node's ClientApps")
    r.add_argument("--cold", action="store_true", help="no warm worker: each Flower message pays torch's import "
                   "and the model load (docs/flower.md#warm-clients)")
    r.add_argument("--data-file", help="this client's own data file (jsonl/json/csv/parquet in a format the tasks "
                   "read); without it the client cuts its partition out of the experiment's data")
    r.add_argument("--insecure", action="store_true")
    for name, help_ in (("launch", "start a run on a running SuperLink and wait for it"),
                        ("loopback", "the whole deployment on 127.0.0.1: start, run, stop")):
        r = roles.add_parser(name, help=help_)
        r.add_argument("config", help="experiment YAML (read by the ServerApp)")
        r.add_argument("--out", required=True, help="run directory (written by the ServerApp)")
        r.add_argument("--work", required=True, help="deployment directory")
        r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
        r.add_argument("--insecure", action="store_true")
        if name == "launch":
            r.add_argument("--control", default="127.0.0.1:9093", help="HOST:PORT of the Control address")
            r.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
            r.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to wait for the run")
        else:
            r.add_argument("--clients", type=int, required=True, help="number of SuperNodes")
            r.add_argument("--port", type=int, default=9092, help="Fleet port (the gateway)")
            r.add_argument("--control-port", type=int, default=9093, help="Control port (127.0.0.1)")
            r.add_argument("--data-file", action="append", help="SuperNode i's own data file, once per node in "
                           "order (federation.partition=nodes)")
    p.set_defaults(fn=_cmd)
