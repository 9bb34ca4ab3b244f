"""Fast checks (default suite, no Flower processes) that our Flower deployment keeps the Control API off
the network the SuperNodes use: the generated commands and configs, the documented commands, the
address checks, and the Fleet gateway's route filter attacked with raw HTTP."""

import http.client
import re
import shlex
import threading
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


@pytest.fixture
def gateway():
    up = ThreadingHTTPServer(("127.0.0.1", 0), type("Up", (Upstream,), {"seen": []}))
    gate = gw.serve(("127.0.0.1", 0), f"http://127.0.0.1:{up.server_port}", None, False)
    for s in (up, gate):
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    yield gate.server_port, up
    for s in (up, gate):
        s.shutdown()
        s.server_close()


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
