"""A model-free task for the engine: clients with their own quadratic losses over a vector messenger,
stochastic through seeded per-batch noise. Fast enough for thousands of clients in tests."""

from __future__ import annotations

import torch

from ciders.algorithms import ciders as alg
from ciders.algorithms.ciders import ServerState
from ciders.config import CidersConfig
from ciders.runtime import derive_seed


class VectorTask:
    def __init__(self, n_clients: int, dim: int = 8, seed: int = 0, noise: float = 0.1):
        self.ids = [f"c{i:04d}" for i in range(n_clients)]
        self.dim, self.seed, self.noise = dim, seed, noise
        self._params: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _client(self, cid: str):
        # built on demand from (seed, client): no per-client memory until used
        if cid not in self._params:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "synthetic-client", self.ids.index(cid)))
            m = torch.randn(self.dim, self.dim, generator=g, dtype=torch.float64)
            h = m @ m.T / self.dim + 0.5 * torch.eye(self.dim, dtype=torch.float64)
            self._params[cid] = (h, torch.randn(self.dim, generator=g, dtype=torch.float64))
            if len(self._params) > 64:
                self._params.pop(next(iter(self._params)))
        return self._params[cid]

    def clients(self) -> dict[str, int]:
        return {cid: 10 + i % 5 for i, cid in enumerate(self.ids)}

    def initial_messenger(self) -> dict:
        return {"x": torch.zeros(self.dim, dtype=torch.float64)}

    def initial_extra(self):
        return {}, {}, {}

    def extra_from_record(self, tensors, meta):
        return None

    def extra_record(self, extra):
        return {}, {}

    def downlink_extra(self, extra) -> dict:
        return {}

    def begin_round(self, t, downlink_extra) -> None:
        pass

    def loss(self, cid: str, x: torch.Tensor) -> torch.Tensor:
        h, b = self._client(cid)
        return 0.5 * (x - b) @ h @ (x - b)

    def loss_fn(self, cid: str):
        return lambda p, batch: self.loss(cid, p["x"]) + batch @ p["x"]

    def batches(self, cid: str, t: int, n: int, seed: int) -> list:
        g = torch.Generator().manual_seed(derive_seed(seed, "synthetic-batch", t, self.ids.index(cid)))
        return [torch.randn(self.dim, generator=g, dtype=torch.float64) * self.noise for _ in range(n)]

    def after_server(self, t, server, extra):
        return extra, {}

    def finalize(self, out, server, extra) -> None:
        pass

    def evaluate(self, t: int, server: ServerState, personalized: dict) -> dict:
        x = server.messenger["x"]
        out = {"global_loss": float(sum(self.loss(c, x) for c in self.ids) / len(self.ids))}
        if personalized:
            out["personalized_loss"] = float(sum(self.loss(c, p["x"]) for c, p in personalized.items()) / len(personalized))
        return out


# ------------------------------------------------------------------ CIDERS update fixtures (pure functions)


def cfg(**kw):
    base = dict(local_steps=3, optimizer="sgd", lr=0.05, weight_decay=0.0, max_grad_norm=0.0, schedule="constant",
                eta_in=0.02, gamma=0.3, alpha=0.2, tau=0.5, eps_prox=0.1)
    base.update(kw)
    c = CidersConfig(**base)
    c.validate()
    return c


def quad_clients(n=4, dim=6, seed=0):
    """Quadratics with different Hessians: curvature makes every path nontrivial."""
    g = torch.Generator().manual_seed(seed)
    fns = []
    for _ in range(n):
        m = torch.randn(dim, dim, generator=g, dtype=torch.float64)
        h = m @ m.T / dim + 0.5 * torch.eye(dim, dtype=torch.float64)
        b = torch.randn(dim, generator=g, dtype=torch.float64)
        fns.append(lambda p, batch, h=h, b=b: 0.5 * (p["x"] - b) @ h @ (p["x"] - b) + (batch or 0.0) * p["x"].sum())
    return fns


def setup(n=4, dim=6, rounds=20, sizes=None):
    w0 = {"x": torch.zeros(6, dtype=torch.float64)}
    ids = [f"c{i}" for i in range(n)]
    sizes = sizes or [1] * n
    SIZES.clear()
    SIZES.update(zip(ids, sizes))  # the registered |D_i| the server weighs by
    return (alg.init_server(w0, rounds), {i: alg.init_copy(w0) for i in ids},
            {i: alg.init_client(i, w0) for i in ids}, ids)


SIZES: dict[str, int] = {}


# ------------------------------------------------------------------ one CIDERS round as messages (federation.rounds)

VEC = ["federation.clients=3", "federation.rounds=2", "algorithm.local_steps=2", "algorithm.optimizer=sgd",
       "algorithm.lr=0.05", "algorithm.gamma=0.3"]


def one_round(tmp_path):
    """The first round's uploads of 3 of 4 VectorTask clients: (cfg, task, ref, the InFlight round, {cid:
    (upload bytes, record)})."""
    from ciders.algorithms import configure
    from ciders.config import load_config
    from ciders.core.store import RoundStore
    from ciders.federation.rounds import InFlight, RunState, broadcast_message
    from ciders.federation.ciders_client import client_round

    cfg, task = configure(load_config(None, VEC)), VectorTask(4)
    ref = task.initial_messenger()
    state = RunState(-1, alg.init_server(ref, cfg.federation.rounds), None, frozenset())
    sampled = tuple(task.ids[:3])
    rnd = InFlight(0, sampled, {}, next=state)
    store = RoundStore(tmp_path, -1)
    ups = {}
    for cid in sampled:
        msg, _, _ = broadcast_message(cfg.algorithm, state, alg.init_copy(ref), cid, {}, set())
        ups[cid] = client_round(cfg, task, store, cid, msg, {})
    return cfg, task, ref, rnd, ups


def checked_uploads(cfg, ref, known, rnd, replies):
    """`check_uploads` of a train phase's deliveries as the round loop hands them over (`exchange.admit`)."""
    from ciders.federation.exchange import admit
    from ciders.federation.rounds import check_uploads

    return check_uploads(cfg.algorithm, ref, known, rnd.t, rnd.sampled, admit(replies, rnd.sampled, "train", rnd.t), {})


def client_uploads(c, server, copies, states, ids, fns):
    """The uploads of clients `ids` (each runs `client_update` on its broadcast; `states` updated in place)."""
    from ciders.algorithms import ciders as alg

    ups = []
    for i in ids:
        b = alg.make_broadcast(c, server, copies[i])
        up, states[i], _ = alg.client_update(c, b, states[i], fns[int(i[1:])], [None] * c.local_steps)
        ups.append(up)
    return ups


def largest_accepted(ok, iters=60):
    """The largest s >= 0 with ok(s), for ok monotone (true up to a threshold): doubling, then bisection."""
    lo, hi = 0.0, 1.0
    while ok(hi) and hi < 1e15:
        lo, hi = hi, 2 * hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
