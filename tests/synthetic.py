"""A model-free task for the engine: clients with their own quadratic losses over a vector messenger,
stochastic through seeded per-batch noise. Fast enough for thousands of clients in tests."""

from __future__ import annotations

import torch

from ciders.algorithms.ciders import ServerState
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
