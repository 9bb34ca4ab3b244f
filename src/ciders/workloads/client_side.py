"""What a CIDERS client round reads from its task (`federation.ciders_client.client_round`): the client's data as
micro-batches of cached backbone outputs, the messenger loss, and the reference shapes of what the server
sends. Shared by the server-side `LLMTask` (in-process clients share the server's model) and the edge
client's `EdgeTask` (a Flower client holding AdapEmu only), so both engines run the same client code.

A subclass sets: cfg, d (a Decomposition), train (client id -> features), pad, loss (MessengerLoss) and
_hidden (a dict, cleared when B_L changes).
"""

from __future__ import annotations

import torch

from ciders.runtime import derive_seed
from ciders.tasks.text import collate


class ClientSide:
    def clients(self) -> dict[str, int]:
        return {cid: len(f) for cid, f in self.train.items()}

    def initial_messenger(self) -> dict:
        return self.d.messenger_state()

    def downlink_reference(self) -> dict:
        """What a client checks the downlink extras against (keys, shapes, dtypes)."""
        return {"student": self.d.student_state(), "emulator": self.d.emulator_base_state()}

    def loss_fn(self, cid: str):
        return self.loss

    def batches(self, cid: str, t: int, n: int, seed: int) -> list:
        """n micro-batches of the client's data: epochs of seeded permutations; B_L(x) is computed once
        per example per round (no grad) and reused by every gradient evaluation and repeated batch."""
        feats = self.train[cid]
        bs = self.cfg.algorithm.batch_size
        ci = int(cid[len("client"):])
        out = []
        for j in range(n):
            idx = []
            for g in range(j * bs, (j + 1) * bs):
                epoch, k = divmod(g, len(feats))
                perm = torch.randperm(len(feats), generator=torch.Generator().manual_seed(derive_seed(seed, "client-batches", t, ci, epoch)))
                idx.append(int(perm[k]))
            out.append(self._batch(cid, idx, derive_seed(seed, "client-dropout", t, ci, j) % (2**62)))
        return out

    def _batch(self, cid: str, idx: list[int], seed: int) -> dict:
        feats = self.train[cid]
        missing = sorted({i for i in idx if (cid, i) not in self._hidden})
        if missing:
            b = collate([feats[i] for i in missing], self.pad, self.d.device)
            h = self.d.backbone_hidden(b["input_ids"], b["attention_mask"])
            for r, i in enumerate(missing):
                self._hidden[(cid, i)] = h[r, : len(feats[i]["input_ids"])]
        b = collate([feats[i] for i in idx], self.pad, self.d.device)
        hid = torch.zeros((len(idx), b["input_ids"].size(1), self.d.base.config.hidden_size),
                          dtype=self.d.base.dtype, device=self.d.device)
        for r, i in enumerate(idx):
            h = self._hidden[(cid, i)]
            hid[r, : h.size(0)] = h
        return {"hidden": hid, "attention_mask": b["attention_mask"], "labels": b["labels"], "seed": seed}

