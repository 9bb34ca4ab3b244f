"""Where records come from: a local data file or a Hugging Face hub dataset, both read by `datasets.load_dataset`.

A source is a string (docs/data.md#sources):
- a file path, by suffix: `.jsonl` / `.json` (optionally `.gz`) -> the json builder, `.csv` / `.tsv` -> csv,
  `.parquet` -> parquet; `${CIDERS_DATA}` expands to the datasets directory (tasks.paths);
- a hub dataset `ID[:CONFIG][@SPLIT]`, e.g. `openai/gsm8k:main@test` (split default `train`). A value with no
  data-file suffix that is not an existing path is read as a hub id; `hub:` in front forces it.

JSON Lines that the json builder refuses as a whole (one malformed line, mixed types) are read line by line
instead, so that the bad lines are counted by reason in the DataReport and the good ones kept, never
silently dropped (tasks.text.read_records).
"""

from __future__ import annotations

import errno
import gzip
import os
from dataclasses import dataclass
from pathlib import Path

from ciders.errors import CidersError
from ciders.tasks.paths import expand
from ciders.tasks.text import (
    MAX_RECORD_BYTES, UNREADABLE, DataReport, Example, Records, detect_format, read_records, unreadable, validate,
)

BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "csv",
            ".parquet": "parquet"}


@dataclass(frozen=True)
class Source:
    kind: str  # "file" | "hub"
    where: str  # the file path, or the hub dataset id
    config: str | None = None
    split: str = "train"

    def __str__(self) -> str:
        if self.kind == "file":
            return self.where
        return f"hub:{self.where}" + (f":{self.config}" if self.config else "") + f"@{self.split}"


def _suffix(path: str) -> str:
    """The data suffix, looking through `.gz`: data.jsonl.gz -> .jsonl."""
    p = Path(path.lower())
    return Path(p.stem).suffix if p.suffix == ".gz" else p.suffix


def parse(value: str) -> Source:
    """A source string -> Source (no I/O beyond checking whether a path exists)."""
    if not isinstance(value, str) or not value.strip():
        raise CidersError(f"data source must be a non-empty string, got {value!r}")
    if value.startswith("hub:"):
        return _hub(value[4:], value)
    path = expand(value)
    if _suffix(value) in BUILDERS or path.exists() or value.startswith((".", "/", "~", "$")):
        return Source("file", str(path))
    return _hub(value, value)


def _hub(spec: str, original: str) -> Source:
    ident, _, split = spec.partition("@")
    ident, _, config = ident.partition(":")
    if not ident or ident.count("/") > 1 or any(c.isspace() for c in ident):
        raise CidersError(f"data source {original!r}: neither an existing file nor a hub dataset id "
                          "(ID[:CONFIG][@SPLIT], e.g. openai/gsm8k:main@test); check the path")
    return Source("hub", ident, config or None, split or "train")


def check(value: str) -> Source:
    """Parse and, for a file, check it exists: run before any model is loaded, so that a mistyped path fails
    in a second, not after minutes of loading."""
    src = parse(value)
    if src.kind == "file":
        p = Path(src.where)
        if _is_loop(p):
            raise CidersError(f"data file {value}: its symbolic links form a loop ({p}); point it at a real file")
        if not p.is_file():
            hint = " (set CIDERS_DATA to the datasets directory)" if "CIDERS_DATA" in value else ""
            near = _near(p)
            raise CidersError(f"data file not found: {value} -> {os.path.realpath(p)}{hint}"
                              + (f"; did you mean {near}?" if near else ""))
        if _suffix(src.where) not in BUILDERS:
            raise CidersError(f"data file {value}: unknown suffix {''.join(p.suffixes)!r} (use "
                              f"{', '.join(sorted(BUILDERS))}, optionally .gz)")
        _check_gzip(p, value)
    return src


def _is_loop(p: Path) -> bool:
    try:
        p.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _check_gzip(p: Path, value: str) -> None:
    """A `.gz` name on a file that is not gzip: one line now, not a decoder's traceback later."""
    if p.suffix.lower() != ".gz":
        return
    with open(p, "rb") as f:
        magic = f.read(2)
    if magic != b"\x1f\x8b":
        raise CidersError(f"data file {value} is named .gz but is not gzip-compressed (it starts with {magic!r}); "
                          "compress it, or drop .gz from its name")


def _has_long_line(path: str, limit: int = MAX_RECORD_BYTES) -> bool:
    """Whether a JSON Lines file holds a line longer than `limit` bytes, found by streaming it in 1 MiB chunks
    (never holding a line): such a file is read line by line (read_records), which skips those lines, so that no
    reader ever holds one whole. A JSON array document (first byte `[`) is one record set, not lines: False."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    run, first = 0, b""
    try:
        with opener(path, "rb") as f:
            while chunk := f.read(2**20):
                first = first or chunk.lstrip()[:1]
                if first == b"[":
                    return False
                parts = chunk.split(b"\n")
                if run + len(parts[0]) > limit or any(len(x) > limit for x in parts[1:]):
                    return True
                run = run + len(parts[0]) if len(parts) == 1 else len(parts[-1])
    except UNREADABLE as exc:
        raise unreadable(path, exc) from exc
    return False


def _near(p: Path) -> str | None:
    import difflib

    if not p.parent.is_dir():
        return None
    names = [c.name for c in p.parent.iterdir()]
    hit = difflib.get_close_matches(p.name, names, n=1, cutoff=0.75)
    return str(p.parent / hit[0]) if hit else None


def read(value: str) -> tuple[list[dict], DataReport]:
    """All records of a source, as dicts, with a DataReport of what was read."""
    src = check(value)
    return _read_hub(src) if src.kind == "hub" else _read_file(src)


def _read_file(src: Source) -> tuple[list[dict], DataReport]:
    import datasets

    builder = BUILDERS[_suffix(src.where)]
    kw = {"delimiter": "\t"} if _suffix(src.where) == ".tsv" else {}
    if builder == "json" and _has_long_line(src.where):
        rep = DataReport(src.where)
        return read_records(src.where, rep), rep
    try:
        ds = datasets.load_dataset(builder, data_files=src.where, split="train", **kw)
    except Exception as exc:  # noqa: BLE001 - the builders raise many types for one bad file
        if builder != "json":
            raise CidersError(f"cannot read {src.where} as {builder}: {_first_line(exc)}") from exc
        rep = DataReport(src.where)  # a malformed line or mixed types: count the bad lines instead
        return read_records(src.where, rep), rep
    return [dict(r) for r in ds], DataReport(src.where, records=len(ds))


def _read_hub(src: Source) -> tuple[list[dict], DataReport]:
    import datasets

    offline = any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    try:
        ds = datasets.load_dataset(src.where, src.config, split=src.split)
    except Exception as exc:  # noqa: BLE001 - offline, gated, renamed, no such split...
        why = "offline (HF_HUB_OFFLINE is set)" if offline else _first_line(exc)
        raise CidersError(f"cannot load {src} from the Hugging Face hub: {why}; use a local data file, "
                          "or check the id, config and split") from exc
    return [dict(r) for r in ds], DataReport(str(src), records=len(ds))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def load_records(value: str, fmt: str = "auto", limit: int | None = None, *, template: str = "plain",
                 keys: tuple[str | None, str | None] = (None, None), label: str | None = None) -> Records:
    """A source's records validated into Examples (+ labels from column `label`). fmt auto: told from the first
    record's fields (prompt_completion when only `keys` are given)."""
    rows, report = read(value)
    if not rows:
        raise CidersError(f"{value}: no usable records ({report.summary()})")
    if fmt == "auto":
        fmt = "prompt_completion" if keys != (None, None) and not _known(rows[0]) else detect_format(rows[0])
    recs = validate(rows, fmt, label, report, limit, template, keys)
    if not recs.examples:
        raise CidersError(f"{value}: no usable records as format {fmt} ({report.summary()})")
    return recs


def _known(rec: dict) -> bool:
    try:
        detect_format(rec)
    except CidersError:
        return False
    return True


def load_examples(value: str | Path, fmt: str = "auto", limit: int | None = None, **kw) -> tuple[list[Example], DataReport]:
    recs = load_records(str(value), fmt, limit, **kw)
    return recs.examples, recs.report


def data_kw(dc) -> dict:
    """The record-reading options of a DataConfig, for load_records / load_examples."""
    return {"template": dc.template, "keys": (dc.prompt_key, dc.response_key)}
