"""The Fleet gateway: the only door to a SuperLink that SuperNodes (and their network) get.

Flower 1.42 serves its Fleet, Control and Runtime APIs from ONE HTTP listener (`flower-superlink
--host/--port`; `--fleet-api-address` and `--control-api-address` are deprecated and ignored). Without
Flower's OIDC account plugin the Control API has no accounts, so whoever reaches that listener and trusts
the CA can register a SuperNode key of their own and start a ServerApp, which is code execution on the
SuperLink host. So in our deployment the SuperLink listens on 127.0.0.1 (or a management address) only,
and this gateway listens where the SuperNodes connect: it relays exactly the Fleet routes (POST
/v1/fleet/<method>) and GET/HEAD /health to the SuperLink and answers 404 to every other request without
passing it on. SuperNode authentication stays the SuperLink's job (the signed headers travel unchanged).

Whoever reaches the Fleet port can talk to the gateway before any signature is checked, so it bounds what one
costs: a body announced larger than MAX_BODY is refused (413) before a byte of it is read, a body is read in
pieces (never trusting the announced size), at most MAX_CONNECTIONS connections are served at once (more are
closed at once), and each request must arrive whole (from the wait for it to its last body byte; the response
likewise) within REQUEST_S, or the connection is dropped: a stalled or slowly dripping peer holds one slot
for at most REQUEST_S.

  python -m ciders.transports.flower.fleet_gateway --listen HOST:PORT --upstream HOST:PORT \
      (--certfile F --keyfile F --cafile F | --insecure) [--max-body B] [--max-connections N] [--request-timeout S]
"""

from __future__ import annotations

import argparse
import re
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

# The Fleet routes of Flower 1.42 (flwr.superlink.routers.fleet.router); matched exactly, so no
# spelling of a path ("..", "%2e", "//", a query string) reaches another API.
FLEET_METHODS = ("register-node", "activate-node", "deactivate-node", "unregister-node", "send-node-heartbeat",
                 "pull-messages", "push-messages", "get-run", "get-fab", "push-object", "pull-object",
                 "confirm-message-received")
ALLOWED = frozenset({("POST", f"/v1/fleet/{m}") for m in FLEET_METHODS} | {("GET", "/health"), ("HEAD", "/health")})
HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                 "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"})
# The largest request a SuperNode sends through here. Flower 1.42 moves a Message as separate objects, one
# per push-object request, and cuts an Array into ArrayChunks of FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE (5 MiB):
# whatever the payload's size (the ciders wire bytes are one uint8 Array), the largest body is one such chunk
# (5,242,993 bytes with its request framing) or the reply's ConfigRecord (at most federation.records.MAX_RECORD
# = 1 MiB of JSON record: 1,048,734 bytes); push-messages carries only the object tree (about 70 bytes per
# chunk). 16 MiB is three times the largest; tests/transports/test_flower_deploy_addresses.py measures them.
MAX_BODY = 16 * 2**20
# A SuperNode holds at most 4 connections (Flower's 2 object pushers or pullers, its heartbeat, the main loop),
# so 64 serves 16 nodes, and bounds the buffered request bodies at 64 x MAX_BODY = 1 GiB.
MAX_CONNECTIONS = 64
# A request, from the wait for it to its last body byte, and a response must each take at most this long:
# 16 MiB at 1.1 Mbit/s, a 5 MiB chunk at 350 kbit/s (Flower's own client drops an idle connection after 5 s).
REQUEST_S = 120.0
READ_PIECE = 64 * 1024  # a body is read this much at a time


def allowed(method: str, path: str) -> bool:
    return (method, path) in ALLOWED


class Gateway(ThreadingHTTPServer):
    """A ThreadingHTTPServer that serves at most `max_connections` at once (more are closed unanswered) and
    drops a connection whose clock (`arm`) runs out before the handler stops it (`disarm`)."""

    daemon_threads = True

    def __init__(self, listen, handler, max_connections: int, request_s: float):
        super().__init__(listen, handler)
        self.max_connections, self.request_s = max_connections, request_s
        self.slots = threading.BoundedSemaphore(max_connections)
        self.clocks: dict[socket.socket, tuple[float, str]] = {}
        self.lock, self.closed = threading.Lock(), threading.Event()
        threading.Thread(target=self._watch, name="fleet-gateway-watchdog", daemon=True).start()

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            log(f"{client_address[0]} refused a connection ({self.max_connections} already open)")
            return self.shutdown_request(request)
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        self.arm(request, client_address[0])  # the TLS handshake and the first request
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.disarm(request)
            self.slots.release()

    def arm(self, sock: socket.socket, who: str) -> None:
        with self.lock:
            self.clocks[sock] = (time.monotonic() + self.request_s, who)

    def disarm(self, sock: socket.socket) -> None:
        with self.lock:
            self.clocks.pop(sock, None)

    def _watch(self) -> None:
        while not self.closed.wait(min(0.25, self.request_s / 4)):
            now = time.monotonic()
            with self.lock:
                late = [(s, who) for s, (t, who) in self.clocks.items() if t < now]
                for s, _ in late:
                    del self.clocks[s]
            for s, who in late:
                log(f"{who} dropped a connection (a request or response not done within {self.request_s:g} s)")
                try:  # the plain socket's shutdown, also under TLS: the blocked read or write returns at once
                    socket.socket.shutdown(s, socket.SHUT_RDWR)
                except OSError:
                    pass

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        log(f"{client_address[0]} connection failed: {type(exc).__name__}: {exc}")

    def server_close(self):
        self.closed.set()
        super().server_close()


def log(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Flower's httpx client expects
    timeout = REQUEST_S  # the socket's own per-read / per-write timeout, under the server's watchdog
    max_body = MAX_BODY
    upstream: httpx.Client  # set on the subclass `serve` makes
    base: str
    server: Gateway

    def setup(self):
        super().setup()
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()  # here, in this connection's thread, not in the accept loop

    def handle_one_request(self):
        self.server.arm(self.connection, self.address_string())  # the wait for this request counts
        try:
            super().handle_one_request()
        except OSError as exc:  # a timeout, a reset, a connection the watchdog shut down
            self.close_connection = True
            self.log_message("dropped (%s: %s)", type(exc).__name__, exc)

    def handle_expect_100(self):  # "Expect: 100-continue" (curl's, above 1 MiB): the refusal comes first
        n = self._check()
        if isinstance(n, tuple):
            self._refuse(*n)
            return False
        return super().handle_expect_100()

    def do_POST(self):
        self._relay()

    def do_GET(self):
        self._relay()

    def do_HEAD(self):
        self._relay()

    def _refuse(self, code: int, why: str) -> None:
        self.log_message("%s %s %s (%s)", "failed" if code == 502 else "refused", self.command, self.path, why)
        self.close_connection = True  # the body (if any) is left unread
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(why)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(why.encode())

    def _check(self) -> tuple[int, str] | int:
        """The announced body length, or (status, why) to refuse the request with, its body unread."""
        if not allowed(self.command, self.path):
            return 404, "not a Fleet API route"
        if "Transfer-Encoding" in self.headers:
            return 411, "a Content-Length is required"
        lengths = set(self.headers.get_all("Content-Length") or ["0"])
        if len(lengths) > 1 or not re.fullmatch(r"[0-9]{1,18}", n := lengths.pop()):
            return 400, "one decimal Content-Length is required"
        if int(n) > self.max_body:
            return 413, f"a body of {n} bytes, at most {self.max_body}"
        return int(n)

    def _body(self, n: int) -> bytes | None:
        """The n body bytes, read a piece at a time (a short one takes no more memory than it sent), or None
        if the peer stopped sending (the watchdog drops a stalled one)."""
        parts, left = [], n
        while left:
            part = self.rfile.read1(min(left, READ_PIECE))
            if not part:
                self.close_connection = True
                self.log_message("dropped %s %s (body ended after %d of %d bytes)", self.command, self.path,
                                 n - left, n)
                return None
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def _relay(self) -> None:
        n = self._check()
        if isinstance(n, tuple):
            return self._refuse(*n)
        if (body := self._body(n)) is None:
            return None
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP]
        self.server.disarm(self.connection)  # the SuperLink's time is not the peer's
        try:
            r = self.upstream.request(self.command, self.base + self.path, content=body, headers=headers)
        except httpx.HTTPError as exc:  # SuperLink down: 502, which Flower's SuperNode retries
            r = exc
        self.server.arm(self.connection, self.address_string())  # the response: a slow reader is dropped
        if isinstance(r, httpx.HTTPError):
            return self._refuse(502, f"SuperLink unreachable: {type(r).__name__}")
        self.send_response(r.status_code)
        for k, v in r.headers.multi_items():
            if k.lower() not in HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(r.content)

    def log_request(self, code="-", size="-"):
        if not (isinstance(code, int) and 200 <= code < 300):  # the SuperLink logs every request; here
            super().log_request(code, size)  # only what went wrong

    def log_message(self, fmt, *args):
        log(f"{self.address_string()} {fmt % args}")


def serve(listen: tuple[str, int], upstream: str, server_ctx: ssl.SSLContext | None,
          verify: ssl.SSLContext | bool, max_body: int = MAX_BODY, max_connections: int = MAX_CONNECTIONS,
          request_s: float = REQUEST_S) -> Gateway:
    """A gateway bound to `listen` relaying Fleet requests to `upstream` (scheme://host:port); call
    `serve_forever()` on it (tests run it in a thread)."""
    client = httpx.Client(verify=verify, timeout=httpx.Timeout(300.0, connect=10.0), follow_redirects=False)
    handler = type("FleetHandler", (Handler,), {"upstream": client, "base": upstream.rstrip("/"),
                                                "max_body": max_body, "timeout": request_s})
    cls = Gateway
    if ":" in listen[0]:
        cls = type("Gateway6", (Gateway,), {"address_family": socket.AF_INET6})
    server = cls(listen, handler, max_connections, request_s)
    if server_ctx is not None:
        server.socket = server_ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    return server


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fleet_gateway", description="relay only Flower's Fleet API to a SuperLink")
    p.add_argument("--listen", required=True, help="HOST:PORT the SuperNodes connect to")
    p.add_argument("--upstream", required=True, help="HOST:PORT of the SuperLink (127.0.0.1 / management)")
    p.add_argument("--certfile")
    p.add_argument("--keyfile")
    p.add_argument("--cafile", help="CA that signed the SuperLink's certificate")
    p.add_argument("--insecure", action="store_true", help="plain HTTP on both sides")
    p.add_argument("--max-body", type=int, default=MAX_BODY,
                   help=f"largest request body in bytes, refused unread above (default {MAX_BODY}: 3x Flower's)")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help=f"connections served at once, more are closed (default {MAX_CONNECTIONS}: 4 per SuperNode)")
    p.add_argument("--request-timeout", type=float, default=REQUEST_S,
                   help=f"seconds a request may take to arrive, or a response to be read (default {REQUEST_S:g})")
    a = p.parse_args(argv)
    if a.insecure:
        server_ctx, verify, scheme = None, False, "http"
    else:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(a.certfile, a.keyfile)
        verify, scheme = ssl.create_default_context(cafile=a.cafile), "https"
    server = serve(_hostport(a.listen), f"{scheme}://{a.upstream}", server_ctx, verify, a.max_body,
                   a.max_connections, a.request_timeout)
    print(f"fleet gateway on {a.listen} -> {a.upstream} (Fleet API only)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
