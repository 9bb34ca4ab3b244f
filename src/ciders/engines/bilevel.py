"""An in-process round loop for RABO / RAFBO / FedMBO (`ciders.algorithms.rabo`) over a bilevel task.

Per round q and client i: masks M(x_q, R_i), M(y_q, R_i) -> inner phase (T masked steps, upload G^i) ->
server inner step -> outer phase (masked hypergradient) -> server outer step. Logged per round (one JSON
line each in OUT/metrics.jsonl): covering numbers C_x*, C_y*, fraction of coordinates trained, per-client
compute and bytes per direction. Compute is reported three ways, because this implementation trains a
sub-model as the full model with masked (zero) coordinates, so its wall-clock time shows no saving:
`seconds` (measured, dense), `calls` (loss evaluations, including those inside second-order products)
and `op_estimate` = calls x the kept fraction of x and y coordinates (what a physically extracted
sub-model would cost, to first order). Only the masked coordinates travel: a payload costs its kept entries x item size,
plus the index of kept units per layer (one int32 each).

A task supplies: clients() -> [capacity]; initial() -> (x, y); groups() -> layer groups for masks;
batches(i, q, T) -> inner batches; outer_batch(i, q); g(x, y, batch), f(x, y, batch);
evaluate(x, y) -> metrics.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from ciders.algorithms import rabo as rb
from ciders.core.hypergrad import grads
from ciders.fileio import append_jsonl, write_json


def payload_bytes(values: dict, mask: dict) -> int:
    """Bytes of a masked payload: kept entries plus one int32 index per kept output unit."""
    n = 0
    for k, v in values.items():
        m = mask[k]
        n += int(m.sum()) * v.element_size()
        n += 4 * int(m.reshape(m.shape[0], -1).amax(1).sum()) if m.dim() >= 1 else 0
    return n


def _kept_fraction(m: rb.ClientMasks) -> float:
    kept = sum(float(v.sum()) for v in list(m.x.values()) + list(m.y.values()))
    return kept / sum(v.numel() for v in list(m.x.values()) + list(m.y.values()))


class _Counter:
    """Counts gradient evaluations of f and g (a second-order product by autograd costs ~2, by finite
    differences 2 gradient calls; both show up here as the calls they make)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a):
        self.calls += 1
        return self.fn(*a)


def run_bilevel(cfg: rb.RaboConfig, task, rounds: int, out: str | Path, log: Callable[[str], None] = print) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    x0, y0 = task.initial()
    s = rb.init_state(x0, y0)
    caps = task.clients()
    full_x = sum(v.numel() * v.element_size() for v in x0.values())
    full_y = sum(v.numel() * v.element_size() for v in y0.values())
    ev = task.evaluate(s.x, s.y)
    append_jsonl(metrics, {"event": "eval", "round": -1, **ev})
    totals = {"seconds": 0.0, "calls": 0, "op_estimate": 0.0, "bytes_up": 0, "bytes_down": 0}
    for q in range(rounds):
        masks = [rb.client_masks(cfg, s, r, groups=task.groups()) for r in caps]
        Gs, t_in, calls = [], [], []
        for i, m in enumerate(masks):
            g = _Counter(task.g)
            t0 = time.perf_counter()
            G, _ = rb.inner_update(cfg, s, m, g, task.batches(i, q, cfg.inner_steps))
            t_in.append(time.perf_counter() - t0)
            calls.append(g.calls)
            Gs.append(G)
        mid, si = rb.server_inner(cfg, s, Gs, masks)
        hs, recs = [], []
        for i, m in enumerate(masks):
            f, g = _Counter(task.f), _Counter(task.g)
            batch = task.outer_batch(i, q)
            t0 = time.perf_counter()
            h, om = rb.outer_update(cfg, mid, m, f, g, batch)
            secs = t_in[i] + time.perf_counter() - t0
            hs.append(h)
            down = payload_bytes(s.x, m.x) + payload_bytes(s.y, m.y) + payload_bytes(mid.y, m.y)
            up = payload_bytes(Gs[i], m.y) + payload_bytes(h, m.x)
            kept = _kept_fraction(m)
            n_calls = calls[i] + f.calls + g.calls
            recs.append({"event": "client", "round": q, "client": i, "capacity": caps[i], "seconds": secs,
                         "calls": n_calls, "kept_fraction": kept, "op_estimate": n_calls * kept,
                         "bytes_up": up, "bytes_down": down, **om})
            totals["seconds"] += secs
            totals["calls"] += n_calls
            totals["op_estimate"] += n_calls * kept
            totals["bytes_up"] += up
            totals["bytes_down"] += down
        s, so = rb.server_outer(cfg, mid, hs, masks)
        for r in recs:
            append_jsonl(metrics, r)
        append_jsonl(metrics, {"event": "round", "round": q, **si, **so,
                               "full_bytes_per_client": {"down": full_x + 2 * full_y, "up": full_y + full_x}})
        ev = task.evaluate(s.x, s.y)
        append_jsonl(metrics, {"event": "eval", "round": q, **ev})
        log(f"round {q + 1}/{rounds}: C_x* {so['covering_x']} C_y* {si['covering_y']} {ev}")
    summary = {"method": cfg.method, "rounds": rounds, "clients": len(caps), "final": ev, **totals,
               "full_bytes_per_client_round": {"down": full_x + 2 * full_y, "up": full_y + full_x}}
    write_json(out / "summary.json", summary)
    return summary


class FewShotTask:
    """Few-shot hyper-representation (SPEC 2, task 1): x = Conv4 features, y = a linear head; the inner
    loss is support cross-entropy + (reg / 2)|y|^2 (strongly convex in y), the outer one query
    cross-entropy. Clients hold disjoint shards of characters; evaluation fits a fresh head on each
    held-out episode's support (`eval_steps` gradient steps) and reports query accuracy with a 95% CI."""

    def __init__(self, pool: dict, capacities: list[float], n_way: int = 5, k_shot: int = 1, q_query: int = 5,
                 width: int = 32, reg: float = 0.05, seed: int = 0, eval_pool: dict | None = None,
                 eval_episodes: int = 20, eval_steps: int = 20, eval_lr: float = 0.5):
        from ciders.tasks import omniglot as om

        self.om, self.pool, self.caps = om, pool, capacities
        self.shards = om.shard(sorted(pool), len(capacities), seed)
        self.n_way, self.k_shot, self.q_query, self.width, self.reg, self.seed = n_way, k_shot, q_query, width, reg, seed
        self.eval_pool = eval_pool or pool
        self.eval_episodes, self.eval_steps, self.eval_lr = eval_episodes, eval_steps, eval_lr
        self._episodes: dict = {}
        self._round = -1

    def clients(self) -> list[float]:
        return list(self.caps)

    def initial(self):
        from ciders.models import vision as vz

        return vz.conv4_init(width=self.width, seed=self.seed), vz.linear_init(self.n_way, self.width)

    def groups(self) -> dict:
        from ciders.models import vision as vz

        return vz.conv4_groups()

    def _episode(self, i: int, q: int):
        """Client i's episode of round q (its support is the inner data, its query the outer data)."""
        if self._round != q:
            self._episodes, self._round = {}, q
        if i not in self._episodes:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + q * 1009 + i)
            self._episodes[i] = self.om.episode(self.pool, self.shards[i], self.n_way, self.k_shot, self.q_query, gen)
        return self._episodes[i]

    def batches(self, i: int, q: int, n: int) -> list:
        return [self._episode(i, q)] * n

    def outer_batch(self, i: int, q: int):
        return self._episode(i, q)

    def g(self, x, y, ep):
        import torch.nn.functional as F

        from ciders.models import vision as vz

        return F.cross_entropy(vz.linear(y, vz.conv4_features(x, ep.support)), ep.support_labels) + \
            0.5 * self.reg * sum((v ** 2).sum() for v in y.values())

    def f(self, x, y, ep):
        import torch.nn.functional as F

        from ciders.models import vision as vz

        return F.cross_entropy(vz.linear(y, vz.conv4_features(x, ep.query)), ep.query_labels)

    def evaluate(self, x, y) -> dict:
        from ciders.models import vision as vz

        gen = torch.Generator().manual_seed(self.seed + 7)
        chars = sorted(self.eval_pool)
        accs = []
        for _ in range(self.eval_episodes):
            ep = self.om.episode(self.eval_pool, chars, self.n_way, self.k_shot, self.q_query, gen)
            with torch.no_grad():
                fs, fq = vz.conv4_features(x, ep.support), vz.conv4_features(x, ep.query)
            head = {k: torch.zeros_like(v) for k, v in vz.linear_init(self.n_way, fs.shape[1]).items()}
            for _ in range(self.eval_steps):
                _, gh = grads(lambda a, b: torch.nn.functional.cross_entropy(vz.linear(b, fs), ep.support_labels),
                              {}, head)
                head = {k: head[k] - self.eval_lr * gh[k] for k in head}
            accs.append(float((vz.linear(head, fq).argmax(1) == ep.query_labels).float().mean()))
        t = torch.tensor(accs)
        return {"accuracy": float(t.mean()), "ci95": float(1.96 * t.std() / len(accs) ** 0.5), "episodes": len(accs)}
