"""The edge spec (docs/edge.md): the files besides the weights that an edge client needs to build AdapEmu,
as the server sends them at first contact and the client stores them. Checked on arrival (file names,
sizes, the split) and written atomically. No torch import: the ClientApp answers `hello` with the
digest of the spec it holds before it loads anything.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ciders.fileio import atomic_dir
from ciders.models.split import Split

META = "ciders_edge.json"
WEIGHTS = "model.safetensors"
# what a spec may hold: the model config, ciders' meta and the files tokenizers save (nothing executable)
SPEC_FILES = frozenset({"config.json", "generation_config.json", META, "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                        "chat_template.jinja", "chat_template.json", "tokenizer.model"})
MAX_SPEC_BYTES = 64 * 2**20  # a real spec is a few MiB (the tokenizer); bounds what a client writes
MAX_JSON_BYTES = 2 * 2**20  # config.json / ciders_edge.json


def spec_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "little") + files[name])
    return h.hexdigest()


def check_spec(files: dict) -> dict:
    """A spec as received: known file names only, bounded sizes, config.json and ciders_edge.json present and
    readable, the meta's split consistent. Returns the parsed meta; a PayloadError names the problem."""
    from ciders.core.wire import PayloadError, loads_json

    if not isinstance(files, dict) or not files:
        raise PayloadError("edge spec: no files")
    bad = [n for n in files if not isinstance(n, str) or n not in SPEC_FILES]
    if bad:
        raise PayloadError(f"edge spec: unexpected file {str(bad[0])[:64]!r} (allowed: {', '.join(sorted(SPEC_FILES))})")
    if any(not isinstance(b, bytes) for b in files.values()):
        raise PayloadError("edge spec: every file must be bytes")
    total = sum(len(b) for b in files.values())
    if total > MAX_SPEC_BYTES:
        raise PayloadError(f"edge spec: {total} bytes, at most {MAX_SPEC_BYTES}")
    for need in ("config.json", META):
        if need not in files:
            raise PayloadError(f"edge spec: {need} missing")
    cfg = loads_json(files["config.json"], "edge spec config.json", max_bytes=MAX_JSON_BYTES)
    meta = loads_json(files[META], f"edge spec {META}", max_bytes=MAX_JSON_BYTES)
    if not isinstance(cfg, dict) or not isinstance(meta, dict):
        raise PayloadError("edge spec: config.json and ciders_edge.json must be JSON objects")
    try:
        n, a, idx = int(meta["n_layers"]), int(meta["messenger_layers"]), [int(i) for i in meta["student_indices"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PayloadError(f"edge spec: {META} lacks a valid split ({exc})") from exc
    if not (0 < a < n and idx and all(0 <= i < n - a for i in idx) and idx == sorted(set(idx))):
        raise PayloadError(f"edge spec: inconsistent split (n_layers {n}, messenger {a}, student {idx[:8]})")
    if cfg.get("num_hidden_layers") != len(idx) + a:
        raise PayloadError(f"edge spec: config.json has {cfg.get('num_hidden_layers')} layers, the split gives "
                           f"{len(idx) + a} (B_L + messenger)")
    return meta


def write_spec(directory: str | Path, files: dict[str, bytes]) -> str:
    """Store a checked spec as the client's edge directory (atomically; replaces an earlier spec and its
    weights, which belong to it). Returns its digest."""
    check_spec(files)
    digest = spec_digest(files)
    with atomic_dir(directory) as tmp:
        for name, b in files.items():
            (tmp / name).write_bytes(b)
        (tmp / "spec.sha256").write_text(digest + "\n", encoding="utf-8")
    return digest


def held_digest(directory: str | Path) -> str:
    """The digest of the spec stored in `directory` ("" if none)."""
    f = Path(directory) / "spec.sha256"
    return f.read_text(encoding="utf-8").strip() if f.is_file() else ""


def split_of(meta: dict) -> Split:
    return Split(int(meta["n_layers"]), int(meta["messenger_layers"]), tuple(int(i) for i in meta["student_indices"]))
