"""Ctrl-C on `--engine flower-sim`: the terminal's SIGINT reaches Ray's worker processes too, and Flower's
simulation thread then reports each message in flight as an error with a traceback. `_ctrl_c_stops` sets the run's
stop event and silences Flower's logger in the signal handler itself, before anything unwinds."""

import logging
import os
import signal
import threading

import pytest

from ciders.transports.flower.server_app import _ctrl_c_stops


def test_ctrl_c_sets_stop_and_silences_flowers_logger_until_the_process_ends(caplog):
    stop = threading.Event()
    flwr = logging.getLogger("flwr")
    before = signal.getsignal(signal.SIGINT)
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        flwr.error("before the interrupt")
        with pytest.raises(KeyboardInterrupt):
            with _ctrl_c_stops(stop):
                flwr.error("while running")
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    threading.Event().wait(5)  # the handler raises here
                finally:
                    flwr.error("unwinding")  # Flower's own cleanup, which runs before our except clause
        flwr.error("Broken pipe")  # a Ray worker's death, reported from Flower's thread after the interrupt
    msgs = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert stop.is_set()
    assert msgs == ["before the interrupt", "while running"]
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler is back
    for f in list(flwr.filters):  # leave the logger as other tests expect it
        flwr.removeFilter(f)
    for h in flwr.handlers:
        for f in list(h.filters):
            h.removeFilter(f)


def test_a_run_that_ends_normally_leaves_flowers_logger_as_it_was(caplog):
    stop = threading.Event()
    flwr = logging.getLogger("flwr")
    with _ctrl_c_stops(stop):
        pass
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        flwr.error("after a normal end")
    assert not stop.is_set() and not flwr.filters
    assert [r.getMessage() for r in caplog.records if r.name == "flwr"] == ["after a normal end"]
