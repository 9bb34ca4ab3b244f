"""Attacks on a loopback deployment (TLS + SuperNode auth) from the SuperNodes' side of the network:
someone holding the public CA certificate and a key pair of their own, aiming Flower's own CLI (and raw
Control API calls) at the Fleet address. The Fleet gateway must refuse every Control call there, so the
intruder can neither register its key nor start a ServerApp; its SuperNode is refused by the SuperLink.
The operator's Control address on 127.0.0.1 keeps working."""

import json
import socket
import ssl
import subprocess

import httpx
import pytest

pytestmark = pytest.mark.flower


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def intruder_home(dep, tmp_path):
    """A Flower CLI home whose connection is the Fleet address, trusting the CA: all an outsider has."""
    home = tmp_path / "intruder"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "x"\n\n[superlink.x]\naddress = "{dep.fleet}"\n'
                                      f'root-certificates = "{dep.work / "certs" / "ca.crt"}"\n')
    return home


def intruder_flwr(dep, home, *args):
    from ciders.transports.flower.deploy import flower_env

    return subprocess.run(["flwr", *args], env=flower_env(home), cwd=dep.work, capture_output=True, text=True,
                          timeout=120)


def control_call(hostport: str, ca, path: str) -> int:
    from flwr.proto.control_pb2 import ListRunsRequest

    r = httpx.post(f"https://{hostport}/v1/control/{path}", content=ListRunsRequest().SerializeToString(),
                   headers={"content-type": "application/protobuf", "accept": "application/protobuf"},
                   verify=ssl.create_default_context(cafile=str(ca)), timeout=30)
    return r.status_code


def test_deploy_fleet_address_refuses_control_and_unregistered_supernodes(tmp_path):
    from ciders.transports.flower.deploy import CONN, Deployment, make_credentials

    work = tmp_path / "dep"
    make_credentials(work, 2)  # supernode1's key pair plays the intruder's own key
    dep = Deployment(work, port=free_port(), control_port=free_port(), node_port=free_port())
    home = intruder_home(dep, tmp_path)
    try:
        dep.start_superlink()
        ca = work / "certs" / "ca.crt"
        # the same Control request: accepted on the operator's address, refused on the Fleet address
        assert control_call(dep.control, ca, "list-runs") == 200
        assert control_call(dep.fleet, ca, "list-runs") == 404
        # the intruder's Flower CLI against the Fleet address: no key registered, no run started
        reg = intruder_flwr(dep, home, "supernode", "register", str(work / "keys" / "supernode1.pub"), "x")
        assert reg.returncode != 0, reg.stdout + reg.stderr
        run = intruder_flwr(dep, home, "run", str(dep.app_dir()), "x")
        assert run.returncode != 0, run.stdout + run.stderr
        assert intruder_flwr(dep, home, "ls", "x").returncode != 0
        assert json.loads(dep.flwr("ls", CONN, "--format", "json")).get("runs") == []
        # only the operator admits SuperNodes: supernode0 registered on Control, supernode1 not
        dep.register(0)
        dep.start_supernode(0, 2, work / "nodes" / "client0")
        intruder = dep.start_supernode(1, 2, work / "nodes" / "client1")
        assert intruder.wait(timeout=120) != 0  # refused, gives up, never got a node id
        dep.wait_online(1)
        assert dep.online() == 1
    finally:
        dep.stop()
    link = (work / "logs" / "superlink.log").read_text()
    assert "ApiError:2004" in link and "No SuperNode found with the given public key" in link, link[-3000:]
    assert "/v1/control/register-node" in link and link.count("POST /v1/control/register-node") == 1  # operator's
    assert "POST /v1/control/start-run" not in link  # no intruder request ever reached the SuperLink
    gw = (work / "logs" / "fleet-gateway.log").read_text()
    assert "refused POST /v1/control/register-node" in gw and "refused POST /v1/control/start-run" in gw, gw
    assert dep.leftovers() == []
