"""The Fleet gateway: the only door to a SuperLink that SuperNodes (and their network) get.

Flower 1.42 serves its Fleet, Control and Runtime APIs from ONE HTTP listener (`flower-superlink
--host/--port`; `--fleet-api-address` and `--control-api-address` are deprecated and ignored). Without
Flower's OIDC account plugin the Control API has no accounts, so whoever reaches that listener and trusts
the CA can register a SuperNode key of their own and start a ServerApp, which is code execution on the
SuperLink host. So in our deployment the SuperLink listens on 127.0.0.1 (or a management address) only,
and this gateway listens where the SuperNodes connect: it relays exactly the Fleet routes (POST
/v1/fleet/<method>) and GET/HEAD /health to the SuperLink and answers 404 to every other request without
passing it on. SuperNode authentication stays the SuperLink's job (the signed headers travel unchanged).

  python -m ciders.transports.flower.fleet_gateway --listen HOST:PORT --upstream HOST:PORT \
      (--certfile F --keyfile F --cafile F | --insecure)
"""

from __future__ import annotations

import argparse
import socket
import ssl
import sys
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
IDLE_S = 300  # an idle SuperNode connection is closed after this (Flower reconnects)


def allowed(method: str, path: str) -> bool:
    return (method, path) in ALLOWED


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Flower's httpx client expects
    timeout = IDLE_S
    upstream: httpx.Client  # set on the subclass `serve` makes
    base: str

    def setup(self):
        super().setup()
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()  # here, in this connection's thread, not in the accept loop

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

    def _relay(self) -> None:
        if not allowed(self.command, self.path):
            return self._refuse(404, "not a Fleet API route")
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._refuse(411, "a Content-Length is required")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP]
        try:
            r = self.upstream.request(self.command, self.base + self.path, content=body, headers=headers)
        except httpx.HTTPError as exc:  # SuperLink down: 502, which Flower's SuperNode retries
            return self._refuse(502, f"SuperLink unreachable: {type(exc).__name__}")
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
        sys.stdout.write(f"{self.address_string()} {fmt % args}\n")
        sys.stdout.flush()


def serve(listen: tuple[str, int], upstream: str, server_ctx: ssl.SSLContext | None,
          verify: ssl.SSLContext | bool) -> ThreadingHTTPServer:
    """A gateway bound to `listen` relaying Fleet requests to `upstream` (scheme://host:port); call
    `serve_forever()` on it (tests run it in a thread)."""
    client = httpx.Client(verify=verify, timeout=httpx.Timeout(300.0, connect=10.0), follow_redirects=False)
    handler = type("FleetHandler", (Handler,), {"upstream": client, "base": upstream.rstrip("/")})
    cls = ThreadingHTTPServer
    if ":" in listen[0]:
        cls = type("Server6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
    server = cls(listen, handler)
    server.daemon_threads = True
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
    a = p.parse_args(argv)
    if a.insecure:
        server_ctx, verify, scheme = None, False, "http"
    else:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(a.certfile, a.keyfile)
        verify, scheme = ssl.create_default_context(cafile=a.cafile), "https"
    server = serve(_hostport(a.listen), f"{scheme}://{a.upstream}", server_ctx, verify)
    print(f"fleet gateway on {a.listen} -> {a.upstream} (Fleet API only)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
