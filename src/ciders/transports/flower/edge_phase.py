"""The CIDERS client phases on plain values (`ciders_phase`): what a ClientApp runs, or, on a warm node, what
its worker runs (`transports.flower.worker`), so both give the same numbers. Also the first-contact `setup`
(storing the edge spec). The client task is an `EdgeTask` (docs/edge.md), built once per process and experiment.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

_TASKS: dict[tuple[str, str], object] = {}  # a cache (rebuilt on demand), not state: Ray reuses processes


def _task(cfg_text: str, state: Path, cid: str, data_file: str | None):
    """The client's EdgeTask (built once per process and experiment: Ray reuses processes)."""
    from ciders.models.edge_spec import held_digest

    key = (hashlib.sha256(cfg_text.encode()).hexdigest(), str(state), held_digest(state / "edge"), data_file or "")
    if key not in _TASKS:
        from ciders.algorithms import configure
        from ciders.config import loads_config
        from ciders.workloads.edge import EdgeTask

        cfg = configure(loads_config(cfg_text, "the config the server sent"))  # the method's effective knobs
        _TASKS.clear()  # one experiment per process at a time
        _TASKS[key] = (cfg, EdgeTask(cfg, state, cid, data_file, log=lambda s: None))
    return _TASKS[key]


def setup(f: dict, cid: str, state: Path) -> dict:
    """First contact: store the edge spec the server sent (checked: names, sizes, the split, and the size of the
    model its config.json implies, computed without allocating it) in state/edge."""
    from ciders.core.wire import PayloadError, loads_json
    from ciders.models.edge_guard import check_config
    from ciders.models.edge_spec import MAX_JSON_BYTES, MAX_SPEC_BYTES, check_spec, spec_digest, write_spec

    names = f.get("names")
    if not isinstance(names, list) or not 0 < len(names) <= 32 or not all(isinstance(n, str) for n in names):
        raise PayloadError(f"{cid}: setup message without a valid list of file names")
    files = {n: f.get(f"file{i}") for i, n in enumerate(names)}
    if sum(len(b) for b in files.values() if isinstance(b, bytes)) > MAX_SPEC_BYTES:
        raise PayloadError(f"{cid}: edge spec larger than {MAX_SPEC_BYTES} bytes")
    check_spec(files)
    if spec_digest(files) != f.get("sha"):
        raise PayloadError(f"{cid}: the edge spec's digest does not match the one the server sent")
    # refused here, before it is stored, rather than when the client builds its placeholder model from it
    check_config(loads_json(files["config.json"], "edge spec config.json", max_bytes=MAX_JSON_BYTES))
    return {"client_id": cid, "edge": write_spec(state / "edge", files)}


def _store(state: Path, committed: int, keep_current: bool):
    """The client's record store, with records of rounds the server did not commit removed (train) or
    kept up to the current round (report, which comes before the server commits it)."""
    from ciders.core.store import RoundStore

    if keep_current:
        return RoundStore(state / "store", committed, cache_size=2)
    store = RoundStore(state / "store", -1, cache_size=2)
    store.recover(committed)
    store.commit(committed)
    return store


def _resources(state: Path) -> dict:
    """This client's own footprint: the process's peak resident memory and its state's bytes on disk (MiB)."""
    import resource

    disk = sum(p.stat().st_size for p in state.rglob("*") if p.is_file())
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "disk_mib": disk / 2**20}


def _fault(cid: str, kind: str, t: int, state: Path) -> None:
    """Test hook: CIDERS_FLOWER_FAULT="<client>:<round>:sleep:<seconds>" delays this reply (a late or
    killed client in the deployment tests). Never set in normal use."""
    spec = os.environ.get("CIDERS_FLOWER_FAULT", "")
    for item in filter(None, spec.split(",")):
        c, r, what, arg = item.split(":")
        if c == cid and int(r) == t and kind == "train" and what == "sleep":
            (state / f"FAULT_SLEEPING_r{t}").write_text(str(os.getpid()))
            time.sleep(float(arg))


def ciders_phase(f: dict, payload: bytes, cid: str, state: Path, data_file: str | None) -> tuple[dict, bytes]:
    """A CIDERS train or report phase on plain values: (reply fields, reply bytes). The ClientApp runs it, or
    the node's warm worker does (the same function, so the same numbers)."""
    t, committed, phase = int(f["round"]), int(f["committed"]), f.get("phase")
    if phase == "train":
        from ciders.federation.ciders_client import StaticHolder, client_phase
        from ciders.federation.secure import Sessions

        cfg, task = _task(str(f["config"]), state, cid, data_file)
        store = _store(state, committed, keep_current=False)
        t0 = time.perf_counter()
        up, rec = client_phase(phase, cfg, task, store, cid, payload, task.downlink_reference(),
                               held=StaticHolder(state / "static"), sessions=Sessions(state / "secagg"))
        compute = time.perf_counter() - t0
        _fault(cid, "train", t, state)
        return {"client_id": cid, "record": json.dumps({**rec, **_resources(state), "compute_s": compute})}, up
    if phase in ("secagg_keys", "secagg_shares", "secagg_unmask"):  # secure aggregation's protocol phases
        from ciders.federation.secure import Sessions, client_phase

        cfg, _ = _task(str(f["config"]), state, cid, data_file)
        out, rec = client_phase(phase, cfg, Sessions(state / "secagg"), cid, payload)
        return {"client_id": cid, "record": json.dumps(rec)}, out
    if phase != "report":
        raise ValueError(f"{cid}: CIDERS has no phase {phase!r}")
    # report: the personalized messenger of this round (not yet committed by the server)
    from ciders.federation.ciders_client import client_report

    return {"client_id": cid}, client_report(_store(state, committed, keep_current=True), cid)
