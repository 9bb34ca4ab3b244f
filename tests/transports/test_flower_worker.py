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


def test_an_empty_payload_is_not_sent_after_the_header():
    """A report carries no payload: a zero-byte send after the header races the worker's reply-and-close and
    fails with EPIPE (seen in the deployment tests), so the header frame is the only write."""
    class Conn:
        def __init__(self):
            self.writes = []

        def sendall(self, b):
            self.writes.append(bytes(b))

    c = Conn()
    w._send(c, {"a": 1})
    assert len(c.writes) == 1 and struct.unpack("<QQ", c.writes[0][:16]) == (len(c.writes[0]) - 16, 0)
    w._send(c, {"a": 1}, b"xyz")
    assert c.writes[-1] == b"xyz"


def test_the_client_reads_why_the_worker_refused_a_frame_it_did_not_read(tmp_path, monkeypatch):
    """The worker refuses a too-large payload without reading it and closes: the ClientApp's send breaks, and
    it still reports the worker's reason, not a bare broken pipe."""
    import threading

    monkeypatch.setattr(w, "MAX_PAYLOAD", 1024)
    sock = tmp_path / w.SOCK
    (tmp_path / w.TOKEN).write_text("t" * 64)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(sock))
        srv.listen(1)

        def serve_one():
            conn, _ = srv.accept()
            with conn:
                w._answer(conn, "t" * 64, tmp_path, lambda *a: pytest.fail("the phase ran"))

        t = threading.Thread(target=serve_one)
        t.start()
        with pytest.raises(w.WorkerError, match=r"frame of \d+ \+ 33554432 bytes"):
            w.call(sock, {}, b"x" * 2**25, "client0", tmp_path, None)
        t.join(10)
