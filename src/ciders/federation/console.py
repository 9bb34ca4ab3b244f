"""What a person watching a run sees: the `ciders` logger (one line per event worth reading; the run
directory's run.log gets every line), and the progress bars of the slow steps.

Library code never prints: it logs to `LOGGER` (or calls the `log` callable it was given, by default
`info`). The command line puts a console handler on the logger (`to_console`); every run adds a file
handler for its own run.log while it holds the run directory (`run_log`). Progress bars go to stderr only,
and only where stderr is a terminal (tqdm's `disable=None`): not in tests, not in CI logs, never in
run.log; `--quiet` turns them off everywhere (`quiet`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

LOGGER = logging.getLogger("ciders")
FORMAT = "%(asctime)s %(message)s"
_bars = {"off": False}


def info(msg: str) -> None:
    """The default `log` of the library: one line to the `ciders` logger."""
    LOGGER.info(msg)


def round_label(t: int, rounds: int) -> str:
    """"round t/T-1": numbered as in metrics.jsonl (0 .. T-1; -1 is pre-alignment and the evaluation
    before the first round), the last round's number after the slash."""
    return f"round {t}/{rounds - 1}"


def rejected(t: int, phase: str, who: str, why: str) -> str:
    """The one log line of a reply the server refused, in every family and phase."""
    return f"round {t} {phase}: rejected {str(who)[:64]}: {why}"


def quiet(on: bool = True) -> None:
    """Turn every progress bar of this process off (`ciders run --quiet`), or back to automatic."""
    _bars["off"] = on


def bar(enabled: bool = True, **kw) -> tqdm:
    """A progress bar on stderr, shown only where stderr is a terminal, unless `enabled` is false or the
    process is quiet (`quiet`). Keyword arguments go to tqdm."""
    return tqdm(disable=None if enabled and not _bars["off"] else True, file=sys.stderr, **kw)


class BarSafeHandler(logging.StreamHandler):
    """A console handler that writes its lines above any progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def _ensure_level() -> None:
    if LOGGER.level == logging.NOTSET:  # otherwise the root's WARNING would drop the info lines
        LOGGER.setLevel(logging.INFO)


def to_console(level: int = logging.INFO, stream=None) -> logging.Handler:
    """Show the `ciders` logger's lines of `level` and above on `stream` (default stderr); returns the
    handler (the caller removes it with `LOGGER.removeHandler`)."""
    _ensure_level()
    h = BarSafeHandler(stream if stream is not None else sys.stderr)
    h.setLevel(level)
    h.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(h)
    return h


@contextlib.contextmanager
def run_log(root: str | Path) -> Iterator[Path]:
    """Append every line the `ciders` logger gets to ROOT/run.log while the block runs (timestamped; a
    resumed run appends to the same file). Nested blocks for the same directory share one handler."""
    _ensure_level()
    path = Path(root) / "run.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    if any(isinstance(h, logging.FileHandler) and h.baseFilename == os.path.abspath(path) for h in LOGGER.handlers):
        yield path
        return
    h = logging.FileHandler(path, encoding="utf-8")
    h.setLevel(logging.INFO)
    h.setFormatter(logging.Formatter(FORMAT))
    LOGGER.addHandler(h)
    try:
        yield path
    finally:
        LOGGER.removeHandler(h)
        h.close()
