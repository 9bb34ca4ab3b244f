"""The node's warm worker answers only its own node: the token it wrote and its own state directory; a bad frame or
a phase that raises comes back as an error reply, never as a crash of the worker."""

import socket
import struct

import pytest

from ciders.transports.flower import worker as w


def ask(header, payload=b"", phase=None, token="t" * 64, state=None, raw=None):
    a, b = socket.socketpair()
    with a, b:
        if raw is not None:
            a.sendall(raw)
        else:
            w._send(a, header, payload)
        w._answer(b, token, state, phase or (lambda f, p, cid, st, df: ({"echo": f, "cid": cid, "df": df}, p[::-1])))
        return w._recv(a)


def test_a_request_with_the_token_runs_the_phase(tmp_path):
    h, out = ask({"token": "t" * 64, "fields": {"phase": "train"}, "client_id": "client0", "state": str(tmp_path),
                  "data_file": None}, b"abc", state=tmp_path)
    assert h == {"fields": {"echo": {"phase": "train"}, "cid": "client0", "df": None}} and out == b"cba"


@pytest.mark.parametrize("change, match", [({"token": "x" * 64}, "wrong worker token"), ({"token": None}, "token"),
                                           ({"state": "/somewhere/else"}, "this worker serves")])
def test_a_request_not_for_this_node_is_refused(tmp_path, change, match):
    header = {"token": "t" * 64, "fields": {}, "client_id": "client0", "state": str(tmp_path), **change}
    h, out = ask(header, state=tmp_path, phase=lambda *a: pytest.fail("the phase ran"))
    assert match in h["error"] and out == b""


def test_bad_frames_and_failing_phases_are_error_replies(tmp_path):
    h, _ = ask(None, raw=struct.pack("<QQ", w.MAX_HEADER + 1, 0), state=tmp_path)
    assert "unreadable request" in h["error"]
    h, _ = ask(None, raw=struct.pack("<QQ", 4, 0) + b"[1] ", state=tmp_path)
    assert "not a JSON object" in h["error"]

    def boom(*a):
        raise ValueError("no such phase")

    ok = {"token": "t" * 64, "fields": {}, "client_id": "c", "state": str(tmp_path)}
    h, _ = ask(ok, state=tmp_path, phase=boom)
    assert h["error"] == "ValueError: no such phase"


def test_a_socket_path_too_long_is_a_clear_error(tmp_path):
    with pytest.raises(w.WorkerError, match="too long for a Unix socket"):
        w.socket_path(tmp_path / ("d" * 120))
