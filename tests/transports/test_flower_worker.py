"""The node's warm worker answers only a peer that proves its key, refuses bad frames unread, and survives every
peer: a wrong key, a silent or stalled connection, a deeply nested header, a too-large frame, a peer that leaves
before its reply. When the worker is gone, the ClientApp runs the phase itself (docs/security.md)."""

import json
import os
import socket
import threading
import time
from multiprocessing.connection import AuthenticationError, Client

import pytest

from ciders.transports.flower import worker as w


def echo(f, p, cid, st, df):
    return {"echo": f, "cid": cid, "df": df}, p[::-1]


@pytest.fixture
def live(tmp_path, monkeypatch):
    """A worker serving tmp_path/node in a thread with a test phase; yields (state_dir, log lines, calls)."""
    monkeypatch.setattr(w, "HANDSHAKE_S", 0.5)
    state, lines, calls, stop = tmp_path / "node", [], [], threading.Event()

    def phase(*a):
        calls.append(a[2])
        if a[0].get("sleep"):
            time.sleep(a[0]["sleep"])
        return echo(*a)

    t = threading.Thread(target=w.serve, args=(state, 600, os.getppid()),
                         kwargs={"phase": phase, "log": lines.append, "stop": stop}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not (state / w.KEY).exists():
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.02)
    yield state.resolve(), lines, calls
    stop.set()
    t.join(10)


def ask(state, fields=None, payload=b"abc", cid="client0"):
    return w.call(state / w.SOCK, fields or {"phase": "train"}, payload, cid, state, None)


def logged(lines, text, within=5.0):
    """Whether the worker logged `text` within `within` s (it logs from its own thread, after the peer has seen the
    refusal, so a loaded machine can deliver the log line later than the error)."""
    deadline = time.monotonic() + within
    while not any(text in s for s in lines):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def key(state):
    return bytes.fromhex((state / w.KEY).read_text().strip())


def test_a_request_with_the_key_runs_the_phase_and_files_are_private(live):
    state, _, calls = live
    fields, out = ask(state)
    assert fields == {"echo": {"phase": "train"}, "cid": "client0", "df": None} and out == b"cba"
    assert calls == ["client0"]
    assert (state / w.KEY).stat().st_mode & 0o777 == 0o600 and (state / w.SOCK).stat().st_mode & 0o077 == 0


def test_a_peer_without_the_key_is_refused_before_its_request_is_read_and_the_worker_goes_on(live):
    state, lines, calls = live
    with pytest.raises((AuthenticationError, EOFError, OSError)):
        with Client(str(state / w.SOCK), family="AF_UNIX", authkey=b"x" * 32) as c:
            c.send_bytes(json.dumps({"fields": {}, "client_id": "c", "state": str(state)}).encode())
            c.send_bytes(b"")
            c.recv_bytes()
    assert calls == [] and logged(lines, "handshake failed"), lines
    assert ask(state)[1] == b"cba"


def test_a_silent_connection_blocks_nobody_and_is_dropped(live, monkeypatch):
    state, lines, _ = live
    monkeypatch.setattr(w, "HANDSHAKE_S", 3.0)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(state / w.SOCK))
    time.sleep(0.2)  # accepted first
    t0 = time.monotonic()
    assert ask(state)[1] == b"cba"  # served while the silent peer holds its own thread, not after its timeout
    assert time.monotonic() - t0 < 2
    silent.settimeout(5)
    assert silent.recv(1 << 16)  # the challenge; then, unanswered, the handshake times out and the peer is closed
    assert logged(lines, "handshake failed", within=8), lines
    silent.close()


def test_a_peer_that_leaves_before_its_reply_costs_only_its_own_request(live):
    state, lines, calls = live
    c = Client(str(state / w.SOCK), family="AF_UNIX", authkey=key(state))
    c.send_bytes(json.dumps({"fields": {"sleep": 0.3}, "client_id": "gone", "state": str(state)}).encode())
    c.send_bytes(b"x" * 2**20)
    c.close()  # a ClientApp killed mid-round
    deadline = time.monotonic() + 5
    while "gone" not in calls:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ask(state, cid="client1")[1] == b"cba"
    assert logged(lines, "went away"), lines


@pytest.mark.parametrize("header, match", [(b"[" * 200_000, "not JSON"), (b"[1]", "not a JSON object"),
                                           (b"\xff\xfe", "not JSON")])
def test_malformed_headers_are_error_replies(live, header, match):
    state, _, calls = live
    with Client(str(state / w.SOCK), family="AF_UNIX", authkey=key(state)) as c:
        c.send_bytes(header)
        try:  # the worker replies and closes without reading the payload frame: the send may race its close
            c.send_bytes(b"")
        except BrokenPipeError:
            pass
        reply = json.loads(c.recv_bytes())
    assert match in reply["error"] and calls == []
    assert ask(state)[1] == b"cba"


def test_a_request_for_another_node_or_a_failing_phase_is_an_error_reply(live, tmp_path):
    state, _, _ = live
    with pytest.raises(w.WorkerError, match="this worker serves"):
        w.call(state / w.SOCK, {}, b"", "client0", tmp_path / "elsewhere", None)
    with pytest.raises(w.WorkerError, match="TypeError"):  # fields that are not an object reach the phase as dict()
        with Client(str(state / w.SOCK), family="AF_UNIX", authkey=key(state)) as c:
            c.send_bytes(json.dumps({"fields": 3, "client_id": "c", "state": str(state)}).encode())
            c.send_bytes(b"")
            raise w.WorkerError(json.loads(c.recv_bytes())["error"])
    assert ask(state)[1] == b"cba"


def test_a_frame_beyond_the_bound_is_refused_unread(live, monkeypatch):
    """The worker refuses a too-large payload without reading it and closes: the ClientApp's send breaks, and it
    still reports the worker's reason, not a bare broken pipe."""
    state, _, calls = live
    monkeypatch.setattr(w, "MAX_PAYLOAD", 1024)
    with pytest.raises(w.WorkerError, match="request payload larger than 1024 bytes"):
        ask(state, payload=b"x" * 2**25)
    assert calls == []
    monkeypatch.setattr(w, "MAX_PAYLOAD", 4 * 2**30)
    assert ask(state)[1] == b"cba"


def test_no_worker_at_all_or_a_dead_one_is_worker_gone_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(w, "LAUNCH_S", 0.2)
    t0 = time.monotonic()
    with pytest.raises(w.WorkerGone, match="not running"):  # never started: no pid, no socket
        ask(tmp_path)
    (tmp_path / w.PID).write_text(f"{os.getpid()}\n")  # a pid that is not a worker (this pytest process)
    with pytest.raises(w.WorkerGone, match="not running"):
        ask(tmp_path)
    assert time.monotonic() - t0 < 5
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a killed worker's socket and key, nobody listening
    stale.bind(str(tmp_path / w.SOCK))
    stale.close()
    (tmp_path / w.KEY).write_text("00" * 32)
    with pytest.raises(w.WorkerGone, match="did not answer"):
        ask(tmp_path)


def test_the_client_app_runs_the_phase_cold_when_the_worker_is_gone(tmp_path, monkeypatch, capsys):
    from ciders.transports.flower.client_app import run_phase

    monkeypatch.setattr(w, "LAUNCH_S", 0.1)
    f, out, warm = run_phase(str(tmp_path / w.SOCK), {"phase": "train"}, b"ab", "client0", tmp_path, None, phase=echo)
    assert (f["cid"], out, warm) == ("client0", b"ba", False)
    assert "running this message cold" in capsys.readouterr().err


def test_the_client_app_uses_a_live_worker_and_does_not_fall_back_on_its_errors(live):
    from ciders.transports.flower.client_app import run_phase

    state, _, calls = live
    f, out, warm = run_phase(str(state / w.SOCK), {"phase": "train"}, b"ab", "client0", state, None,
                             phase=lambda *a: pytest.fail("ran cold"))
    assert (out, warm, calls) == (b"ba", True, ["client0"])
    with pytest.raises(w.WorkerError, match="this worker serves"):  # a refusal is an error, never a silent cold rerun
        run_phase(str(state / w.SOCK), {}, b"", "client0", state / "other", None, phase=lambda *a: pytest.fail("cold"))


def test_a_socket_path_too_long_is_a_clear_error(tmp_path):
    with pytest.raises(w.WorkerError, match="too long for a Unix socket"):
        w.socket_path(tmp_path / ("d" * 120))
