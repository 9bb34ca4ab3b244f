"""A node's warm worker (docs/flower.md#warm-clients): one long-lived process per SuperNode that keeps torch, the
edge model, the client's data and its batches' cache loaded across rounds, and runs the CIDERS train and report
phases (`edge_phase.ciders_phase`) for the short-lived ClientApp processes Flower 1.42 starts per message.

Node-local only: it listens on a Unix socket in the node's state directory (mode 0600). The transport is the
standard library's `multiprocessing.connection`: a peer proves it holds the key the worker wrote beside the socket
(`worker.key`, mode 0600) by HMAC challenge and response, in both directions, before a byte of its request is
read; then the request is two length-prefixed messages (a JSON header {fields, client_id, state, data_file}, the
payload bytes), each refused unread beyond its bound, and the reply is a header {fields} or {error} and a payload.

It survives its peers (docs/security.md#the-nodes-warm-worker): every connection is served in its own thread with
read and write timeouts, so a silent or stalled peer holds only its own thread; the phases run one at a time under
a lock; a peer that fails the handshake, sends a bad frame or leaves before its reply costs nothing but its own
request. It exits when the process that started it (the SuperNode launcher) is gone, or after `--idle-s` without a
request. If it is gone anyway, `call` raises `WorkerGone` at once and the ClientApp runs the phase itself (cold).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path

SOCK = "worker.sock"
KEY = "worker.key"
PID = "worker.pid"
MAX_HEADER = 16 * 2**20  # the experiment config travels in the fields
MAX_PAYLOAD = 4 * 2**30  # a first-contact broadcast carries the emulator's weights
HANDSHAKE_S = 10.0  # a peer that has not proved its key by then is dropped
IO_S = 120.0  # the longest a read or a write may stall once authenticated
MAX_PEERS = 8  # connections served at once; more are closed unanswered
STARTUP_S = 120.0  # how long a ClientApp waits for a worker that is alive but still importing torch
LAUNCH_S = 5.0  # how long it waits for a worker that has not even written its pid (the SuperNode's launch race)


class WorkerError(RuntimeError):
    """The worker refused a request or its phase raised (the ClientApp turns it into a Flower error reply)."""


class WorkerGone(WorkerError):
    """No worker to hand the request to (never started, exited or killed): nothing of the request was run, so the
    ClientApp may run the phase itself."""


def socket_path(state_dir: str | Path) -> Path:
    p = Path(state_dir).resolve() / SOCK
    if len(str(p).encode()) > 100:  # sockaddr_un holds 108 bytes
        raise WorkerError(f"{p} is too long for a Unix socket ({len(str(p))} characters, at most 100); use a "
                          "shorter --state-dir or a cold node (--cold)")
    return p


def _timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-level timeouts on a blocking socket (a Connection reads its fd directly, so socket.settimeout would
    not apply): a stalled read or write fails with EAGAIN instead of blocking forever."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _recv(conn: Connection, limit: int, what: str) -> bytes:
    try:
        return conn.recv_bytes(limit)
    except OSError as exc:
        if "bad message length" in str(exc):  # the length prefix exceeded `limit`: the body is left unread
            raise WorkerError(f"{what} larger than {limit} bytes") from exc
        raise


def _reply(conn: Connection, header: dict, payload: bytes = b"") -> None:
    conn.send_bytes(json.dumps(header).encode())
    conn.send_bytes(payload)


def _alive(state_dir: Path) -> bool:
    """Whether the worker named by state_dir/worker.pid still runs (a recycled pid must be a worker too)."""
    try:
        pid = int((state_dir / PID).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"ciders.transports.flower.worker" in cmdline


def call(sock: Path, fields: dict, payload: bytes, cid: str, state: Path, data_file: str | None) -> tuple[dict, bytes]:
    """Run one CIDERS phase in the node's worker: (reply fields, reply bytes); WorkerGone if there is no worker to
    ask (nothing ran), WorkerError if it refused the request or its phase failed."""
    sock = Path(sock)
    key_file, start = sock.parent / KEY, time.monotonic()
    while not (sock.exists() and key_file.exists()):  # a live worker may still be importing torch
        waited = time.monotonic() - start
        if waited > LAUNCH_S and not _alive(sock.parent):
            raise WorkerGone(f"{cid}: no warm worker at {sock} (not running; see worker.log beside it)")
        if waited > STARTUP_S:
            raise WorkerGone(f"{cid}: no warm worker at {sock} after {STARTUP_S:.0f} s; see worker.log beside it")
        time.sleep(0.2)
    try:
        conn = Client(str(sock), family="AF_UNIX", authkey=bytes.fromhex(key_file.read_text().strip()))
    except (OSError, EOFError, ValueError, AuthenticationError) as exc:  # a stale socket, or a worker restarting
        raise WorkerGone(f"{cid}: the warm worker at {sock} did not answer ({type(exc).__name__}: {exc})") from exc
    with conn:
        try:
            try:
                conn.send_bytes(json.dumps({"fields": fields, "client_id": cid, "state": str(Path(state).resolve()),
                                            "data_file": data_file}).encode())
                conn.send_bytes(payload)
            except BrokenPipeError:  # the worker refused the request before reading all of it: read why
                pass
            header = json.loads(_recv(conn, MAX_HEADER, "reply header"))
            out = _recv(conn, MAX_PAYLOAD, "reply payload")
        except (OSError, EOFError, ValueError, WorkerError) as exc:  # it died or stalled while serving us
            raise WorkerError(f"{cid}: the warm worker at {sock} did not answer ({type(exc).__name__}: {exc})") from exc
    if not isinstance(header, dict) or not ("error" in header or isinstance(header.get("fields"), dict)):
        raise WorkerError(f"{cid}: the warm worker's reply is malformed")
    if "error" in header:
        raise WorkerError(f"{cid}: {header['error']}")
    return header["fields"], out


def _read_request(conn: Connection) -> tuple[dict, bytes]:
    try:
        header = json.loads(_recv(conn, MAX_HEADER, "request header"))
    except (ValueError, RecursionError) as exc:
        raise WorkerError(f"request header is not JSON ({type(exc).__name__})") from exc
    if not isinstance(header, dict):
        raise WorkerError("request header is not a JSON object")
    return header, _recv(conn, MAX_PAYLOAD, "request payload")


def _answer(conn: Connection, key: bytes, state_dir: Path, phase, lock: threading.Lock, log,
            authenticated=lambda: None) -> None:
    """One peer, start to end; every failure ends here, logged, and never reaches the accept loop.
    `authenticated()` runs after the handshake (the worker lengthens the socket's timeouts there)."""
    try:
        deliver_challenge(conn, key)  # the peer proves the key before anything of its request is read
        answer_challenge(conn, key)
    except (AuthenticationError, OSError, EOFError) as exc:
        log(f"refused a peer: handshake failed ({type(exc).__name__}: {exc})")
        return
    authenticated()
    try:
        try:
            header, payload = _read_request(conn)
        except WorkerError as exc:
            _reply(conn, {"error": f"unreadable request: {exc}"})
            return
        if header.get("state") != str(state_dir):
            _reply(conn, {"error": f"this worker serves {state_dir}, not {str(header.get('state'))[:200]}"})
            return
        try:
            with lock:  # one model, one phase at a time
                fields, out = phase(dict(header["fields"]), payload, str(header["client_id"]), state_dir,
                                    header.get("data_file"))
        except Exception as exc:  # noqa: BLE001 - the ClientApp reports it as its own error, as without a worker
            _reply(conn, {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"})
            return
        _reply(conn, {"fields": fields}, out)
    except (OSError, EOFError) as exc:  # the peer left or stalled: only its own request is lost
        log(f"a peer went away mid-request ({type(exc).__name__}: {exc})")


def serve(state_dir: Path, idle_s: float, parent: int, phase=None, log=None, stop: threading.Event | None = None) -> None:
    """Serve until the parent is gone, `idle_s` passes without a request or `stop` is set. `phase` defaults to
    `edge_phase.ciders_phase` (tests pass their own)."""
    if phase is None:
        from ciders.transports.flower.edge_phase import ciders_phase as phase

        import torch  # noqa: F401  (the import is the point: it is paid once, here)
    log = log or (lambda s: print(f"[worker {os.getpid()}] {s}", file=sys.stderr, flush=True))
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    path, key = socket_path(state_dir), secrets.token_bytes(32)
    path.unlink(missing_ok=True)
    (state_dir / KEY).unlink(missing_ok=True)
    lock, peers, last = threading.Lock(), threading.BoundedSemaphore(MAX_PEERS), [time.monotonic()]

    def one(raw: socket.socket) -> None:
        try:
            with raw, Connection(os.dup(raw.fileno())) as conn:  # one socket: options set on raw apply to conn
                _timeouts(raw, HANDSHAKE_S)
                _answer(conn, key, state_dir, phase, lock, log, lambda: _timeouts(raw, IO_S))
        except Exception as exc:  # noqa: BLE001 - whatever a peer does, the worker goes on serving
            log(f"a request failed: {type(exc).__name__}: {exc}")
        finally:
            last[0] = time.monotonic()
            peers.release()

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        old = os.umask(0o177)  # the socket is created 0600
        try:
            srv.bind(str(path))
        finally:
            os.umask(old)
        srv.listen(MAX_PEERS)
        srv.settimeout(2.0)
        fd = os.open(state_dir / KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key.hex() + "\n")
        try:
            while os.getppid() == parent and time.monotonic() - last[0] < idle_s and not (stop and stop.is_set()):
                try:
                    raw, _ = srv.accept()
                except (socket.timeout, OSError):
                    continue
                last[0] = time.monotonic()
                raw.settimeout(None)
                if not peers.acquire(blocking=False):
                    log(f"refused a peer: {MAX_PEERS} connections already open")
                    raw.close()
                    continue
                threading.Thread(target=one, args=(raw,), daemon=True).start()
        finally:
            path.unlink(missing_ok=True)
            (state_dir / KEY).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a SuperNode's warm ciders worker (started by `ciders flower supernode`)")
    ap.add_argument("state_dir", type=Path)
    ap.add_argument("--idle-s", type=float, default=6 * 3600, help="exit after this long without a request")
    a = ap.parse_args(argv)
    a.state_dir.mkdir(parents=True, exist_ok=True)
    pid_file = a.state_dir / PID
    pid_file.write_text(f"{os.getpid()}\n")  # before torch's import: a ClientApp can tell "starting" from "gone"
    try:
        serve(a.state_dir, a.idle_s, os.getppid())
    finally:
        pid_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
