"""A node's warm worker (docs/flower.md#warm-clients): one long-lived process per SuperNode that keeps torch, the
edge model, the client's data and its batches' cache loaded across rounds, and runs the CIDERS train and report
phases (`client_app.ciders_phase`) for the short-lived ClientApp processes Flower 1.42 starts per message.

Node-local only: it listens on a Unix socket in the node's state directory (mode 0600) and answers only requests
that carry the token it wrote beside it (`worker.token`, mode 0600) and name its own state directory. It exits when
the process that started it (the SuperNode launcher) is gone, or after `--idle-s` without a request.

Frames: 16 bytes (header length, payload length; little-endian u64) + a JSON header + the payload bytes. A request
header is {token, fields, client_id, state, data_file}; a reply header is {fields} or {error}.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import socket
import struct
import time
from pathlib import Path

SOCK = "worker.sock"
TOKEN = "worker.token"
MAX_HEADER = 16 * 2**20  # the experiment config travels in the fields
MAX_PAYLOAD = 4 * 2**30  # a first-contact broadcast carries the emulator's weights


class WorkerError(RuntimeError):
    """The worker refused a request or its phase raised (the ClientApp turns it into a Flower error reply)."""


def _send(conn: socket.socket, header: dict, payload: bytes = b"") -> None:
    h = json.dumps(header).encode()
    conn.sendall(struct.pack("<QQ", len(h), len(payload)) + h)
    if payload:  # no zero-byte send: the peer may already have answered and closed (EPIPE)
        conn.sendall(payload)


def _exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise WorkerError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv(conn: socket.socket) -> tuple[dict, bytes]:
    hlen, plen = struct.unpack("<QQ", _exactly(conn, 16))
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise WorkerError(f"frame of {hlen} + {plen} bytes (at most {MAX_HEADER} + {MAX_PAYLOAD})")
    header = json.loads(_exactly(conn, hlen))
    if not isinstance(header, dict):
        raise WorkerError("frame header is not a JSON object")
    return header, _exactly(conn, plen)


def socket_path(state_dir: str | Path) -> Path:
    p = Path(state_dir).resolve() / SOCK
    if len(str(p).encode()) > 100:  # sockaddr_un holds 108 bytes
        raise WorkerError(f"{p} is too long for a Unix socket ({len(str(p))} characters, at most 100); use a "
                          "shorter --state-dir or a cold node (--cold)")
    return p


def call(sock: Path, fields: dict, payload: bytes, cid: str, state: Path, data_file: str | None) -> tuple[dict, bytes]:
    """Run one CIDERS phase in the node's worker: (reply fields, reply bytes), or WorkerError."""
    token_file = sock.parent / TOKEN
    deadline = time.monotonic() + 120  # the worker may still be importing torch at the first message
    while not (sock.exists() and token_file.exists()):
        if time.monotonic() > deadline:
            raise WorkerError(f"no warm worker at {sock} after 120 s; see the SuperNode's log")
        time.sleep(0.2)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(sock))
            try:
                _send(conn, {"token": token_file.read_text().strip(), "fields": fields, "client_id": cid,
                             "state": str(Path(state).resolve()), "data_file": data_file}, payload)
            except BrokenPipeError:  # the worker refused the frame before reading all of it: read why
                pass
            header, out = _recv(conn)
    except (OSError, WorkerError) as exc:  # a worker that died, or one restarting (a stale socket)
        raise WorkerError(f"{cid}: the warm worker at {sock} did not answer ({exc})") from exc
    if "error" in header:
        raise WorkerError(f"{cid}: {header['error']}")
    return header["fields"], out


def serve(state_dir: Path, idle_s: float, parent: int) -> None:
    from ciders.transports.flower.edge_phase import ciders_phase

    import torch  # noqa: F401  (the import is the point: it is paid once, here)

    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    path = socket_path(state_dir)
    token = secrets.token_hex(32)
    path.unlink(missing_ok=True)
    (state_dir / TOKEN).unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        old = os.umask(0o177)  # the socket is created 0600
        try:
            srv.bind(str(path))
        finally:
            os.umask(old)
        srv.listen(4)
        srv.settimeout(2.0)
        fd = os.open(state_dir / TOKEN, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        last = time.monotonic()
        while os.getppid() == parent and time.monotonic() - last < idle_s:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            last = time.monotonic()
            with conn:
                conn.settimeout(None)
                _answer(conn, token, state_dir, ciders_phase)
    path.unlink(missing_ok=True)


def _answer(conn: socket.socket, token: str, state_dir: Path, phase) -> None:
    try:
        header, payload = _recv(conn)
    except (WorkerError, ValueError, struct.error) as exc:
        _send(conn, {"error": f"unreadable request: {exc}"})
        return
    if not hmac.compare_digest(str(header.get("token", "")), token):
        _send(conn, {"error": "wrong worker token"})
        return
    if header.get("state") != str(state_dir):
        _send(conn, {"error": f"this worker serves {state_dir}, not {str(header.get('state'))[:200]}"})
        return
    try:
        fields, out = phase(dict(header["fields"]), payload, str(header["client_id"]), state_dir, header.get("data_file"))
    except Exception as exc:  # the ClientApp reports it as its own error, as without a worker
        _send(conn, {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"})
        return
    _send(conn, {"fields": fields}, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a SuperNode's warm ciders worker (started by `ciders flower supernode`)")
    ap.add_argument("state_dir", type=Path)
    ap.add_argument("--idle-s", type=float, default=6 * 3600, help="exit after this long without a request")
    a = ap.parse_args(argv)
    serve(a.state_dir, a.idle_s, os.getppid())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
