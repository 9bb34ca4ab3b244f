"""Fast checks (default suite, no Flower processes) that our Flower deployment keeps the Control API off
the network the SuperNodes use: the generated commands and configs, the documented commands, the
address checks, and the Fleet gateway's route filter and its bounds (body size, connections, time) attacked
with raw HTTP."""

import contextlib
import http.client
import random
import re
import select
import shlex
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ciders.errors import CidersError
from ciders.transports.flower import fleet_gateway as gw
from ciders.transports.flower.deploy import Deployment, check_addresses
from conftest import ROOT


def arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("fleet,control", [("127.0.0.1", "127.0.0.1"), ("10.0.0.5", "10.1.0.5"),
                                           ("10.0.0.5", "127.0.0.1")])
def test_deploy_commands_bind_control_to_its_own_address_never_the_fleet_one(tmp_path, fleet, control):
    dep = Deployment(tmp_path, port=9092, host=fleet, control_port=9093, control_host=control)
    link = dep.superlink_cmd()
    assert (arg(link, "--host"), arg(link, "--port")) == (control, "9093")  # the SuperLink's only listener
    assert "9092" not in link and "--enable-supernode-auth" in link
    gate = dep.gateway_cmd("0.0.0.0")
    assert (arg(gate, "--listen"), arg(gate, "--upstream")) == ("0.0.0.0:9092", f"{control}:9093")
    assert arg(dep.supernode_cmd(0, 3, tmp_path / "s"), "--superlink") == f"{fleet}:9092"
    assert re.findall(r'address = "([^"]+)"', dep.config_toml()) == [f"{control}:9093"]  # what `flwr` is given


@pytest.mark.parametrize("fleet,control", [("0.0.0.0", "0.0.0.0"), ("10.0.0.5", "10.0.0.5"), ("10.0.0.5", "::"),
                                           ("10.0.0.5", ""), ("fd00::5", "[fd00::5]")])
def test_deploy_control_on_the_fleet_network_is_refused(tmp_path, fleet, control):
    with pytest.raises(CidersError, match="Control API must not"):
        check_addresses(fleet, control)
    with pytest.raises(CidersError, match="Control API must not"):
        Deployment(tmp_path, host=fleet, control_host=control)


def test_deploy_superlink_refuses_a_fleet_bind_on_the_control_address_before_starting(tmp_path, capsys):
    """Also through the CLI: nothing starts."""
    from ciders.cli import main

    dep = Deployment(tmp_path, control_host="10.1.0.5")
    with pytest.raises(CidersError, match="must not share the Fleet address"):
        dep.start_superlink(bind="10.1.0.5")
    assert dep.procs == {}
    assert main(["flower", "superlink", str(tmp_path), "--bind", "0.0.0.0", "--control-bind", "0.0.0.0"]) == 2
    assert "Control API must not listen on every interface" in capsys.readouterr().err


def documented(role: str) -> list[list[str]]:
    """Every `ciders flower ROLE ...` command in docs/flower.md, continuation lines joined."""
    text = (ROOT / "docs" / "flower.md").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        m = re.match(rf"\s*ciders flower {role} (.*)", line)
        if m:  # the docs' placeholders (i, N, shell loop variables) become numbers
            words = shlex.split(m.group(1).split("#")[0].replace("$((9094 + i))", "9094").replace("$i", "0"))
            out.append(["flower", role, *[{"i": "0", "N": "3"}.get(w, w) for w in words if w != "&"]])
    return out


def test_deploy_documented_commands_keep_control_off_the_fleet_address(tmp_path, monkeypatch):
    from ciders.cli import parser
    from ciders.transports.flower.commands import deployment

    monkeypatch.chdir(tmp_path)  # the docs' WORK directories are relative
    links = documented("superlink")
    assert len(links) >= 2
    controls = set()
    for argv in links:
        a = parser().parse_args(argv)
        dep = deployment(a)
        check_addresses(a.bind, dep.control_host)
        assert dep.control_host == "127.0.0.1" and a.port != dep.control_port
        assert arg(dep.superlink_cmd(), "--host") == "127.0.0.1"
        controls.add(dep.control)
    operator = [a for r in ("register", "launch") for a in documented(r)]
    assert len(operator) >= 4
    for argv in operator:  # the operator's register / launch go to the Control address
        assert deployment(parser().parse_args(argv)).control in controls, argv
    for argv in documented("supernode"):  # the SuperNodes are given the Fleet port, never the Control one
        a = parser().parse_args(argv)
        assert int(a.superlink.rpartition(":")[2]) not in {int(c.rpartition(":")[2]) for c in controls}, argv


def gateway_limits(cmd: list[str]) -> tuple[int, int, float]:
    """The limits a generated gateway command gives, as the gateway's own `main` parses them into `serve`."""
    got = {}

    def serve(listen, upstream, server_ctx, verify, *limits):
        got["limits"] = limits
        raise KeyboardInterrupt  # stop main before it listens

    module = cmd.index("ciders.transports.flower.fleet_gateway")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gw, "serve", serve)
        with pytest.raises(KeyboardInterrupt):
            gw.main(cmd[module + 1:])
    return got["limits"]


def test_deploy_gateway_cmd_carries_the_gateway_limits_and_its_defaults(tmp_path):
    """`gateway_cmd` passes the limits through (the gateway's own defaults when not given), and the gateway's
    own parser reads them back."""
    plain = Deployment(tmp_path, secure=False)
    assert gateway_limits(plain.gateway_cmd()) == (gw.MAX_BODY, gw.MAX_CONNECTIONS, gw.REQUEST_S)
    assert arg(plain.gateway_cmd(), "--max-connections") == str(gw.MAX_CONNECTIONS)  # explicit, not implied
    set_ = Deployment(tmp_path, secure=False, max_body=32 * 2**20, max_connections=200, request_timeout=30.5)
    assert gateway_limits(set_.gateway_cmd("0.0.0.0")) == (32 * 2**20, 200, 30.5)
    secure = Deployment(tmp_path, max_connections=300).gateway_cmd()
    assert arg(secure, "--max-connections") == "300" and "--certfile" in secure


def test_deploy_superlink_cli_passes_the_gateway_limits_through(tmp_path):
    from ciders.cli import parser
    from ciders.transports.flower.commands import deployment

    base = ["flower", "superlink", str(tmp_path), "--bind", "0.0.0.0"]
    given = deployment(parser().parse_args([*base, "--max-body", "1000000", "--max-connections", "408",
                                            "--request-timeout", "300"]))
    cmd = given.gateway_cmd("0.0.0.0")
    assert (arg(cmd, "--max-body"), arg(cmd, "--max-connections")) == ("1000000", "408")
    assert float(arg(cmd, "--request-timeout")) == 300
    assert (given.control_host, given.port) == ("127.0.0.1", 9092)  # the limits leave the addresses alone
    default = deployment(parser().parse_args([*base, "--max-connections", "100"])).gateway_cmd("0.0.0.0")
    assert (arg(default, "--max-body"), arg(default, "--max-connections")) == (str(gw.MAX_BODY), "100")
    assert float(arg(default, "--request-timeout")) == gw.REQUEST_S


@pytest.mark.parametrize("flag,value,message", [
    ("--max-connections", "0", "must be a positive integer, got '0'"),
    ("--max-connections", "-3", "must be a positive integer, got '-3'"),
    ("--max-connections", "many", "must be a positive integer, got 'many'"),
    ("--max-body", "1.5", "must be a positive integer, got '1.5'"),
    ("--max-body", "0", "must be a positive integer, got '0'"),
    ("--request-timeout", "0", "must be a positive number of seconds, got '0'"),
    ("--request-timeout", "-1", "must be a positive number of seconds, got '-1'"),
    ("--request-timeout", "inf", "must be a positive number of seconds, got 'inf'"),
    ("--request-timeout", "nan", "must be a positive number of seconds, got 'nan'"),
    ("--request-timeout", "soon", "must be a positive number of seconds, got 'soon'")])
def test_deploy_superlink_cli_refuses_bad_gateway_limits_in_one_line(tmp_path, capsys, flag, value, message):
    from ciders.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["flower", "superlink", str(tmp_path), f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"error: argument {flag}: {message}\n" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # refused before any Deployment (nothing started)


@pytest.mark.parametrize("limits,message", [
    ({"max_connections": 0}, "--max-connections must be a positive integer, got 0"),
    ({"max_body": -1}, "--max-body must be a positive integer, got -1"),
    ({"max_body": 2.0}, "--max-body must be a positive integer, got 2.0"),
    ({"max_connections": True}, "--max-connections must be a positive integer, got True"),
    ({"request_timeout": 0}, "--request-timeout must be a positive number of seconds, got 0"),
    ({"request_timeout": float("nan")}, "--request-timeout must be a positive number of seconds, got nan"),
    ({"request_timeout": "120"}, "--request-timeout must be a positive number of seconds, got '120'")])
def test_deploy_refuses_bad_gateway_limits(tmp_path, limits, message):
    with pytest.raises(CidersError, match=re.escape(message)):
        Deployment(tmp_path, **limits)


def test_deploy_loopback_sizes_the_gateway_for_its_supernodes(tmp_path, monkeypatch):
    from ciders.transports.flower import deploy

    assert [deploy.gateway_connections(n) for n in (1, 14, 15, 16, 100)] == [gw.MAX_CONNECTIONS, 64, 68, 72, 408]
    seen = []

    def start_superlink(self, *a, **kw):
        seen.append(self.gateway_cmd())
        raise CidersError("stopped before starting anything")

    monkeypatch.setattr(deploy.Deployment, "start_superlink", start_superlink)
    for n in (3, 40):
        with pytest.raises(CidersError, match="stopped before"):
            deploy.loopback(tmp_path / "c.yaml", tmp_path / "out", n, tmp_path / f"w{n}", secure=False, log=lambda m: 0)
    assert [arg(c, "--max-connections") for c in seen] == [str(gw.MAX_CONNECTIONS), str(4 * 40 + 8)]
    assert [arg(c, "--max-body") for c in seen] == [str(gw.MAX_BODY)] * 2


# ------------------------------------------------------------------------------------------ the gateway


def test_gateway_routes_are_exactly_flowers_fleet_routes():
    from flwr.superlink.routers.fleet.router import router

    served = {(m, r.path) for r in router.routes for m in r.methods}
    assert {x for x in gw.ALLOWED if x[1] != "/health"} == served


class Upstream(BaseHTTPRequestHandler):
    """A stand-in SuperLink serving every path (Control included): records what reaches it."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.command, self.path, body, dict(self.headers)))
        reply = b"reply:" + body
        self.send_response(200)
        self.send_header("Content-Type", "application/protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_PUT = do_DELETE = do_POST

    def log_message(self, *a):
        pass


@contextlib.contextmanager
def running(**limits):
    """A gateway (with `limits`: max_body, max_connections, request_s) in front of a stand-in SuperLink."""
    up = ThreadingHTTPServer(("127.0.0.1", 0), type("Up", (Upstream,), {"seen": []}))
    gate = gw.serve(("127.0.0.1", 0), f"http://127.0.0.1:{up.server_port}", None, False, **limits)
    for s in (up, gate):
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield gate, up
    finally:
        for s in (up, gate):
            s.shutdown()
            s.server_close()


@pytest.fixture
def gateway():
    with running() as (gate, up):
        yield gate.server_port, up


def send(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.putrequest(method, path, skip_accept_encoding=True)  # the path goes out byte for byte
    for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
        c.putheader(k, v)
    c.endheaders(body)
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out


ATTACKS = [("POST", "/v1/control/start-run"), ("POST", "/v1/control/register-node"), ("POST", "/v1/control/list-runs"),
           ("POST", "/v1/runtime/pull-app-inputs"), ("POST", "/v1/fleet/../control/start-run"),
           ("POST", "/v1/fleet/%2e%2e/control/start-run"), ("POST", "//v1/control/start-run"),
           ("POST", "/v1/fleet/pull-messages/../../control/start-run"), ("POST", "/v1/fleet/pull-messages?x=1"),
           ("POST", "/V1/CONTROL/START-RUN"), ("GET", "/v1/fleet/pull-messages"), ("GET", "/docs"),
           ("GET", "/openapi.json"), ("PUT", "/v1/fleet/push-messages"), ("DELETE", "/health"),
           ("POST", "http://127.0.0.1/v1/control/start-run")]


@pytest.mark.parametrize("method,path", ATTACKS)
def test_gateway_refuses_everything_but_the_fleet_api(gateway, method, path):
    port, up = gateway
    status, _ = send(port, method, path, b"\x08\x01")
    assert status in (404, 501), (method, path, status)
    assert up.RequestHandlerClass.seen == []  # nothing reached the SuperLink


def test_gateway_relays_fleet_calls_byte_for_byte(gateway):
    port, up = gateway
    body = bytes(range(256)) * 64
    auth = {"Content-Type": "application/protobuf", "flwr-public-key": "cGs=", "flwr-signature": "c2ln",
            "flwr-timestamp": "2026-01-01T00:00:00+00:00"}
    assert send(port, "POST", "/v1/fleet/push-object", body, auth) == (200, b"reply:" + body)
    assert send(port, "GET", "/health")[0] == 200
    (m, path, got, headers), _ = up.RequestHandlerClass.seen
    assert (m, path, got) == ("POST", "/v1/fleet/push-object", body)
    assert {k.lower(): v for k, v in headers.items()}.items() >= {k.lower(): v for k, v in auth.items()}.items()


def test_gateway_answers_502_while_the_superlink_is_down():
    gate = gw.serve(("127.0.0.1", 0), "http://127.0.0.1:9", None, False)  # port 9: nothing listens
    threading.Thread(target=gate.serve_forever, args=(0.05,), daemon=True).start()
    try:
        assert send(gate.server_port, "POST", "/v1/fleet/pull-messages", b"x")[0] == 502  # Flower retries 502
    finally:
        gate.shutdown()
        gate.server_close()


# ------------------------------------------------------------------------------------------ the gateway's bounds


def head(length: int, path: str = "/v1/fleet/push-object") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def connect(port: int, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


def until_closed(s: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def rss() -> int:
    with open("/proc/self/status") as f:  # the gateway runs in this process
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_gateway_refuses_a_huge_announced_body_before_reading_it(gateway):
    """2 GiB announced, 10 bytes sent: 413 at once, not a thread waiting for the other 2 GiB."""
    port, up = gateway
    t0 = time.monotonic()
    with connect(port, head(2**31) + b"x" * 10) as s:
        reply = until_closed(s)
    assert reply.startswith(b"HTTP/1.1 413") and f"at most {gw.MAX_BODY}".encode() in reply, reply
    assert time.monotonic() - t0 < 5 and up.RequestHandlerClass.seen == []


def test_gateway_does_not_buffer_a_streamed_body_over_the_bound(gateway):
    """2 GiB announced and 128 MiB actually streamed (the attack that cost +128 MiB of RSS): the gateway answers
    413 after the headers and closes, so the sender is cut off after what the kernel buffers hold, and the
    gateway's process does not grow."""
    port, up = gateway
    before, sent, piece = rss(), 0, b"\0" * 2**16
    s = connect(port, head(2**31))
    with s, contextlib.suppress(ConnectionError):  # cut off: EPIPE / ECONNRESET (a timeout fails the test)
        while sent < 128 * 2**20:
            s.sendall(piece)
            sent += len(piece)
    assert sent < 32 * 2**20, f"the gateway took {sent} bytes of an over-sized body"
    assert rss() - before < 32 * 2**20 and up.RequestHandlerClass.seen == []


@pytest.mark.parametrize("length,status", [(2**20, 200), (2**20 + 1, 413)])
def test_gateway_body_bound_is_an_option_and_inclusive(length, status):
    with running(max_body=2**20) as (gate, up):
        with connect(gate.server_port, head(length)) as s:  # the headers only: a refusal needs no body byte
            if status == 200:
                s.sendall(b"x" * length)
                assert s.recv(12) == b"HTTP/1.1 200"
            else:
                assert until_closed(s).startswith(b"HTTP/1.1 413")
        assert len(up.RequestHandlerClass.seen) == (status == 200)


@pytest.mark.parametrize("lengths", [["-1"], ["abc"], ["1e3"], ["5", "6"], ["99999999999999999999"]])
def test_gateway_refuses_a_content_length_that_is_not_one_decimal_number(gateway, lengths):
    port, up = gateway
    head_ = b"POST /v1/fleet/push-object HTTP/1.1\r\nHost: x\r\n"
    head_ += b"".join(f"Content-Length: {n}\r\n".encode() for n in lengths) + b"\r\nxxxxxx"
    with connect(port, head_) as s:
        assert until_closed(s).startswith(b"HTTP/1.1 400")
    assert up.RequestHandlerClass.seen == []


def test_gateway_refuses_an_over_sized_body_before_100_continue(gateway):
    port, up = gateway
    with connect(port, head(2**31).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")) as s:
        assert until_closed(s).startswith(b"HTTP/1.1 413")  # no "100 Continue" first


def test_gateway_serves_at_most_max_connections_at_once():
    """Over the cap a connection is closed unanswered; the ones held are served, and once they close an honest
    request goes through again."""
    with running(max_connections=3) as (gate, up):
        port = gate.server_port
        held = [connect(port) for _ in range(3)]  # accepted in order: these take the 3 slots
        with connect(port) as extra:
            t0 = time.monotonic()
            assert until_closed(extra) == b"" and time.monotonic() - t0 < 5
        held[0].sendall(head(2) + b"hi")
        assert held[0].recv(12) == b"HTTP/1.1 200"
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while True:  # the slots come back as the handlers see their connections close
            try:
                assert send(port, "POST", "/v1/fleet/pull-messages", b"x") == (200, b"reply:x")
                break
            except (ConnectionError, http.client.HTTPException):
                assert time.monotonic() < deadline, "the slots were not given back"
                time.sleep(0.1)


def seconds_until_dropped(s: socket.socket, drip: bytes = b"", every: float = 0.1, limit: float = 6.0) -> float:
    """Send `drip` one byte every `every` s (nothing if empty) until the gateway closes the connection."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if select.select([s], [], [], every)[0]:
            assert until_closed(s) == b"", "the gateway answered a request that never arrived whole"
            return time.monotonic() - t0
        if drip:
            s.sendall(drip[:1])
            drip = drip[1:]
    raise AssertionError(f"connection still open after {limit} s")


@pytest.mark.parametrize("kind", ["stalled body", "stalled headers", "idle", "dripping headers"])
def test_gateway_drops_a_stalled_or_dripping_connection(kind):
    """With --request-timeout 1: a peer that sends part of a request and stops, opens and says nothing, or sends
    its headers one byte per 0.1 s (each read well within the socket timeout) loses the connection after about
    1 s; an honest request is served meanwhile."""
    with running(request_s=1.0) as (gate, up):
        port = gate.server_port
        first = {"stalled body": head(100) + b"x" * 10, "stalled headers": head(100)[:20]}.get(kind, b"")
        with connect(port, first) as s:
            assert send(port, "POST", "/v1/fleet/pull-messages", b"x") == (200, b"reply:x")
            took = seconds_until_dropped(s, head(100) if kind == "dripping headers" else b"")
        assert 0.5 < took < 3, took
        assert [p for _, p, _, _ in up.RequestHandlerClass.seen] == ["/v1/fleet/pull-messages"]


def test_gateway_body_bound_covers_the_largest_request_a_supernode_sends():
    """What a SuperNode sends for a reply carrying a 2- or 4-chunk payload and a record of the largest size the server
    accepts, built with Flower's own serializers: every push-object body (one object each) and the push-messages
    body stay under a third of MAX_BODY, and the largest is one full ArrayChunk whatever the payload's size."""
    from flwr.app import Metadata
    from flwr.app.message import make_message, remove_content_from_message
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE as CHUNK
    from flwr.common.serde import message_to_proto
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    from ciders.federation.records import MAX_RECORD
    from ciders.transports.flower import messages as fm

    big, node = 2**63 - 1, Node(node_id=2**63 - 1)

    def bodies(payload: bytes) -> tuple[int, int]:
        md = Metadata(run_id=big, message_id="f" * 64, src_node_id=big, dst_node_id=1, reply_to_message_id="e" * 64,
                      group_id="round 150", created_at=1.7e9, ttl=43200.0, message_type="train")
        msg = make_message(md, fm.pack({"client_id": "client4", "record": "x" * MAX_RECORD}, payload))
        objects = [len(PushObjectRequest(node=node, run_id=big, object_id=i, object_content=o.deflate())
                       .SerializeToString()) for i, o in get_all_nested_objects(msg).items()]
        tree = PushMessagesRequest(node=node, messages_list=[message_to_proto(remove_content_from_message(msg))],
                                   message_object_trees=[get_object_tree(msg)], clientapp_runtime_list=[1.0])
        return max(objects), len(tree.SerializeToString())

    rng = random.Random(0)  # no two chunks alike (Flower sends a repeated chunk once)
    two, tree2 = bodies(rng.randbytes(CHUNK + 1000))  # 2 chunks
    four, tree4 = bodies(rng.randbytes(3 * CHUNK + 1000))  # 4 chunks
    assert CHUNK <= four == two < CHUNK + 1024 and 3 * four <= gw.MAX_BODY
    per_chunk = (tree4 - tree2) / 2  # the tree grows this much per chunk: a 4 GiB payload's still fits
    assert tree4 < gw.MAX_BODY / 3 and tree2 + per_chunk * (4 * 2**30 / CHUNK) < gw.MAX_BODY / 3
