"""The metrics records clients send with their replies, checked before the server writes them.

A record is a client's claim: it is never trusted for anything the server can know itself (ids, rounds,
bytes, masks), and only what the schema below names gets through. The server writes its own fields
after the client's, so a client cannot set `event`, `round`, `client` or the byte counts. Every value
must have the type its key says, a list at most MAX_STEPS entries: a record that does not fit rejects
the whole reply (docs/security.md#client-records), so nothing a client sends can break `summarize`,
resume or the report later.
"""

from __future__ import annotations

from typing import Mapping

from ciders.core.wire import MAX_INT, MAX_NAME, PayloadError, loads_json

MAX_STEPS = 4096  # entries of a per-step list (K local steps)
MAX_RECORD = 1 << 20  # bytes of a record's JSON text on the wire

# kinds: "number" (int or float, NaN allowed: a diverged loss is a fact to record, not an attack),
# "count" (int in [0, 2**53]), "bool", "str" (at most MAX_NAME characters)
_STEP = {"step": "count", "loss": "number", "g_norm": "number", "g_traj_norm": "number", "lr": "number",
         "r_fd": "number"}
CIDERS = {"client": "str", "round": "count", "resync_request": "bool", "gamma": "number", "eta_bar": "number",
          "loss": "number", "c_norm": "number", "c_i_norm": "number", "dc_norm": "number", "delta_norm": "number",
          "corr_norm": "number", "g_mean_norm": "number", "step_mean_norm": "number",
          "e_rae": "number", "s_dr": "number", "s_ppr": "number", "r_fd_small": "count", "r_fd_moderate": "count",
          "r_fd_large": "count", "steps": _STEP, "clipped": "bool",
          # an edge client's own resources (Flower): its process's peak resident memory, its state's bytes on disk
          "peak_rss_mib": "number", "disk_mib": "number",
          # and its timings: in client_round, in the whole message handler, from its process's start; warm worker
          "compute_s": "number", "handle_s": "number", "startup_s": "number", "warm": "bool"}
# What a client sends under secure aggregation or local DP: its loss, schedule and resources, nothing computed
# from its update (no norms, no readouts of Delta_i or c_i; docs/privacy.md#what-the-server-sees).
_PRIVATE_STEP = {"step": "count", "loss": "number", "lr": "number"}
CIDERS_PRIVATE = {"client": "str", "round": "count", "gamma": "number", "eta_bar": "number", "loss": "number",
                  "steps": _PRIVATE_STEP, "peak_rss_mib": "number", "disk_mib": "number", "compute_s": "number",
                  "handle_s": "number", "startup_s": "number", "warm": "bool"}
BILEVEL = {"calls": "count", "seconds": "number", "inner_loss": "number", "outer_loss": "number",
           "solver_iters": "count", "solver_residual": "number", "solver_breakdown": "bool", "loss": "number",
           "support_loss": "number", "train_accuracy": "number", "steps": "count"}


def private(rec: dict) -> dict:
    """A client's own record cut down to CIDERS_PRIVATE (what it sends in a private mode)."""
    out = {k: v for k, v in rec.items() if k in CIDERS_PRIVATE and k != "steps"}
    if "steps" in rec:
        out["steps"] = [{k: v for k, v in s.items() if k in _PRIVATE_STEP} for s in rec["steps"]]
    return out


def parse(text: str) -> dict:
    """A record sent as JSON text (the Flower engine): bounded size and nesting, an object."""
    rec = loads_json(text, "client record", max_bytes=MAX_RECORD, allow_nonfinite=True)
    if not isinstance(rec, dict):
        raise PayloadError("client record must be a JSON object")
    return rec


def check(rec, schema: Mapping[str, object], what: str = "client record") -> dict:
    """`rec` restricted to `schema` and type-checked, or PayloadError naming the first bad key. A schema
    value is a kind (see above) or, for a list of per-step records, the schema of one entry."""
    if not isinstance(rec, dict):
        raise PayloadError(f"{what} must be an object, got {type(rec).__name__}")
    out = {}
    for k, v in rec.items():
        kind = schema.get(k) if isinstance(k, str) else None
        if kind is None:
            raise PayloadError(f"{what}: unknown key {str(k)[:40]!r}")
        if isinstance(kind, Mapping):
            if not isinstance(v, list) or len(v) > MAX_STEPS:
                raise PayloadError(f"{what}: {k!r} must be a list of at most {MAX_STEPS} entries")
            out[k] = [check(e, kind, f"{what} {k}[{j}]") for j, e in enumerate(v)]
        elif _fits(v, kind):
            out[k] = v
        else:
            raise PayloadError(f"{what}: {k!r} must be {kind}, got {type(v).__name__} {str(v)[:40]}")
    return out


def _fits(v, kind: str) -> bool:
    if kind == "bool":
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if kind == "number":
        return isinstance(v, (int, float)) and (not isinstance(v, int) or abs(v) <= MAX_INT)
    if kind == "count":
        return isinstance(v, int) and 0 <= v <= MAX_INT
    return kind == "str" and isinstance(v, str) and len(v) <= MAX_NAME
