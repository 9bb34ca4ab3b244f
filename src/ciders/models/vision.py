"""Vision backbones for the bilevel tasks, written as pure functions of named parameter dicts so the
bilevel algorithms (`ciders.algorithms.rabo`) can differentiate through them and mask them.

Conv4 (Vinyals et al., 2016; the few-shot standard): 4 blocks of conv3x3(64) -> batch norm (batch
statistics, affine) -> ReLU -> maxpool 2; a 28x28 input gives a 64-d feature. Parameters are named
`block<i>.conv.weight|bias` and `block<i>.bn.weight|bias`; `conv4_groups()` puts each BN in its conv's
layer so structured masks drop whole channels consistently.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ciders.core.tensors import State


def conv4_init(in_channels: int = 1, width: int = 64, seed: int = 0, dtype=torch.float32) -> State:
    g = torch.Generator().manual_seed(seed)
    p: State = {}
    c_in = in_channels
    for i in range(4):
        fan_in = c_in * 9
        p[f"block{i}.conv.weight"] = torch.randn(width, c_in, 3, 3, generator=g, dtype=dtype) * math.sqrt(2.0 / fan_in)
        p[f"block{i}.conv.bias"] = torch.zeros(width, dtype=dtype)
        p[f"block{i}.bn.weight"] = torch.ones(width, dtype=dtype)
        p[f"block{i}.bn.bias"] = torch.zeros(width, dtype=dtype)
        c_in = width
    return p


def conv4_groups() -> dict[str, str]:
    return {f"block{i}.bn.{k}": f"block{i}.conv" for i in range(4) for k in ("weight", "bias")}


def conv4_features(p: State, images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, width * (H / 16) * (W / 16)] (64 for 28x28)."""
    h = images
    for i in range(4):
        h = F.conv2d(h, p[f"block{i}.conv.weight"], p[f"block{i}.conv.bias"], padding=1)
        h = F.batch_norm(h, None, None, p[f"block{i}.bn.weight"], p[f"block{i}.bn.bias"], training=True)
        h = F.max_pool2d(F.relu(h), 2)
    return h.flatten(1)


def linear_init(n_out: int, n_in: int, dtype=torch.float32) -> State:
    return {"head.weight": torch.zeros(n_out, n_in, dtype=dtype), "head.bias": torch.zeros(n_out, dtype=dtype)}


def linear(p: State, feats: torch.Tensor) -> torch.Tensor:
    return F.linear(feats, p["head.weight"], p["head.bias"])
