"""What secure aggregation costs per round (docs/privacy.md#cost), through the real message functions of
`federation.secure` (the client's `client_phase`, the server's absorbers and `core.secagg.unmask`), with random
updates of a messenger's size in place of training:

  bytes per client per round, each direction, against the plain round's float32 upload of dc_i
  client seconds (keys, shares, masking) and server seconds (every absorb and the unmasking), with no dropout
  and with one client lost after its shares (its pair masks are then rebuilt and removed by the server)

Sizes: SmolLM2-135M's 2-layer messenger LoRA (r 4 on 7 projections: 81,920 parameters in 28 tensors) and
Qwen2.5-3B's 6-layer one (1,247,232 in 84 tensors, SPEC Table II); n clients per round, every client a
neighbour (SecAgg) or a ring of k (SecAgg+).

--smoke: the first setting alone (SMOKE).

--json keys: up_ratio_range, down_kib_range, client_s_range, server_s_range, max_abs_error, rows.*.up_ratio,
rows.*.kib_up_per_client, rows.*.kib_down_per_client_secagg, rows.*.client_s_mean, rows.*.server_s,
rows.*.max_abs_error  (a range is [min, max] over the rows; down_kib: the protocol's own downlink messages per
client, the broadcast not counted)

    python benchmarks/secagg_cost.py [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import load_config
from ciders.federation import secure
from ciders.federation.exchange import Reply
from common import add_output_flags, emit

MESSENGERS = {"smollm2-a2": (81_920, 28), "qwen2.5-3b-a6": (1_247_232, 84)}
SETTINGS = [("smollm2-a2", 5, None), ("smollm2-a2", 20, None), ("smollm2-a2", 50, 8),
            ("qwen2.5-3b-a6", 5, None), ("qwen2.5-3b-a6", 20, 8)]
SMOKE = SETTINGS[:1]


def messenger(params: int, tensors: int) -> dict:
    per = params // tensors
    return {f"t{i:03d}": torch.zeros(per + (params - per * tensors if i == 0 else 0)) for i in range(tensors)}


def one_round(name: str, n: int, k: int | None, drop: str | None, root: Path) -> dict:
    ref = messenger(*MESSENGERS[name])
    sets = [f"federation.clients={n}", "federation.secure_aggregation=true"]
    if k is not None:
        sets.append(f"federation.secagg.neighbours={k}")
    cfg = load_config(None, sets)
    ids = [f"client{i}" for i in range(n)]
    sr = secure.start(cfg, 0, tuple(ids), {c: 1 for c in ids})
    sessions = secure.Sessions(root / name / f"{n}-{k}-{drop}")
    g = torch.Generator().manual_seed(0)
    deltas = {c: {key: torch.randn(v.shape, generator=g) for key, v in ref.items()} for c in ids}
    down, up, client_s, server_s = {c: 0 for c in ids}, {c: 0 for c in ids}, {c: 0.0 for c in ids}, 0.0

    def phase(name_, msgs, absorb, lost=()):
        nonlocal server_s
        replies = []
        for c, m in msgs.items():
            down[c] += len(m)
            t0 = time.perf_counter()
            out, rec = secure.client_phase(name_, cfg, sessions, c, m,
                                           train=lambda inner, c=c: (alg.Upload(c, 0, 0, delta=deltas[c]), {"loss": 1.0}),
                                           weight=secure.own_weight(cfg, 1))
            client_s[c] += time.perf_counter() - t0
            up[c] += len(out)
            if c not in lost:
                replies.append(Reply(c, out, rec))
        t0 = time.perf_counter()
        res = absorb(replies)
        server_s += time.perf_counter() - t0
        return res

    sr, _ = phase("secagg_keys", secure.keys_messages(sr), lambda r: secure.absorb_keys(sr, r))
    sr, _ = phase("secagg_shares", secure.shares_messages(sr), lambda r: secure.absorb_shares(sr, r))
    train = {c: secure.train_message(sr, c, b"") for c in sr.u2}  # the broadcast itself is the plain round's
    sr = phase("train", train, lambda r: secure.absorb_masked(sr, r, ref, False), lost=(drop,) if drop else ())[0]
    total, _, why, _, cheats = phase("secagg_unmask", secure.unmask_messages(sr), lambda r: secure.absorb_unmask(sr, r, ref, False))
    assert why is None and not cheats, (why, cheats)
    alive = [c for c in ids if c != drop]
    exact = {key: sum(deltas[c][key].double() * sr.weights[c] for c in alive) for key in ref}
    err = max((total[key].double() - exact[key]).abs().max().item() for key in ref)
    plain_up = len(codec.encode_upload(alg.Upload("client0", 0, 0, dc=ref))[0])
    return {"messenger": name, "clients": n, "neighbours": k if k is not None else "all", "dropout": bool(drop),
            "params": sum(v.numel() for v in ref.values()),
            "kib_up_per_client": sum(up.values()) / n / 1024, "kib_down_per_client_secagg": sum(down.values()) / n / 1024,
            "plain_upload_kib": plain_up / 1024, "up_ratio": sum(up.values()) / n / plain_up,
            "client_s_mean": sum(client_s.values()) / n, "server_s": server_s, "max_abs_error": err}


def main() -> None:
    args = add_output_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0])).parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, n, k in SMOKE if args.smoke else SETTINGS:
            for drop in (None, "client1"):
                rows.append(one_round(name, n, k, drop, Path(tmp)))
    emit(summarise(rows), args.json, lambda: report(rows))


def summarise(rows: list[dict]) -> dict:
    """The rows, and the ranges over them that the README quotes."""
    def span(f):
        vals = [f(r) for r in rows]
        return [min(vals), max(vals)]

    return {"up_ratio_range": span(lambda r: r["up_ratio"]),
            "down_kib_range": span(lambda r: r["kib_down_per_client_secagg"]),
            "client_s_range": span(lambda r: r["client_s_mean"]), "server_s_range": span(lambda r: r["server_s"]),
            "max_abs_error": max(r["max_abs_error"] for r in rows), "rows": rows}


def report(rows: list[dict]) -> None:
    print(f"{'messenger':14s} {'n':>3s} {'nbrs':>4s} {'drop':>4s} {'KiB up':>9s} {'x plain':>7s} "
          f"{'KiB down*':>9s} {'client s':>8s} {'server s':>8s} {'max err':>9s}")
    for r in rows:
        print(f"{r['messenger']:14s} {r['clients']:3d} {str(r['neighbours']):>4s} {str(r['dropout'])[0]:>4s} "
              f"{r['kib_up_per_client']:9.1f} {r['up_ratio']:7.2f} {r['kib_down_per_client_secagg']:9.1f} "
              f"{r['client_s_mean']:8.3f} {r['server_s']:8.3f} {r['max_abs_error']:9.2e}")
    print("KiB down*: the protocol's own messages only (the broadcast is the plain round's). x plain: the masked "
          "round's uplink over the plain float32 dc_i upload. Seconds on this machine, one thread.")


if __name__ == "__main__":
    main()
