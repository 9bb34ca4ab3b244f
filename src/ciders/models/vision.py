"""Vision backbones for the bilevel tasks, written as pure functions of named parameter dicts so the
bilevel algorithms (`ciders.algorithms.rabo`) can differentiate through them and mask them.

Conv4 (Vinyals et al., 2016; the few-shot standard): 4 blocks of conv3x3(64) -> batch norm (batch
statistics, affine) -> ReLU -> maxpool 2; a 28x28 input gives a 64-d feature. Parameters are named
`block<i>.conv.weight|bias` and `block<i>.bn.weight|bias`; `conv4_groups()` puts each BN in its conv's
layer so structured masks drop whole channels consistently.

ResNet12 (the few-shot standard of Lee et al., 2019, MetaOptNet, and Tian et al., 2020, RFS; the RABO
paper's x): 4 residual blocks of widths (64, 160, 320, 640) by default. Block i maps c_in -> w:
  main      conv3x3 -> BN -> LeakyReLU(0.1) -> conv3x3 -> BN -> LeakyReLU(0.1) -> conv3x3 -> BN
  shortcut  conv1x1 -> BN
  out       LeakyReLU(0.1)(main + shortcut) -> maxpool 2
then global average pooling to a w_last-d feature (28x28 -> 14 -> 7 -> 3 -> 1; 84x84 -> 42 -> 21 -> 10 -> 5).
The convolutions have no bias (a bias before a batch-statistics BN is cancelled by its mean; the BN shift
is the bias), as in MetaOptNet / RFS; DropBlock is not implemented. BN uses batch statistics (affine).
Parameters: `block<i>.conv{1,2,3}.weight`, `block<i>.bn{1,2,3}.weight|bias`,
`block<i>.shortcut.conv.weight`, `block<i>.shortcut.bn.weight|bias`.

Masks and the residual add (`resnet12_groups()`): a structured mask keeps whole output channels per
layer, and zeroing a channel's conv weight and BN scale and shift makes that channel exactly 0 after the
BN (batch statistics of a constant channel: (0 - 0) * 0 + 0). The main branch's last conv and the
shortcut are *summed*, so masking them as independent layers could keep channel c in one branch and
drop it in the other, leaving a half-masked channel (non-zero, but with one branch's weights frozen).
So `resnet12_groups()` puts conv3, bn3, the shortcut conv and the shortcut BN of a block into ONE layer,
`block<i>.residual` (all have dim 0 = the block width): one mask covers both branches, and a dropped
block channel is exactly 0 after the add, the LeakyReLU and the pool. Its importance score (the layer's
lead, the first >= 2-D parameter in order) is conv3's weight. conv1 + bn1 (`block<i>.conv1`) and
conv2 + bn2 (`block<i>.conv2`) are layers of their own (the interior channels of the main branch).
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


def conv4_units() -> dict[str, tuple]:
    """The sub-model plan (`core.masks`): block i's conv, bias and BN are rows of layer `block<i>.conv`; its
    conv's input channels (dim 1) are block i-1's (the image's channels for block 0: never pruned)."""
    out: dict[str, tuple] = {}
    for i in range(4):
        layer, prev = f"block{i}.conv", (f"block{i - 1}.conv" if i else None)
        out[f"block{i}.conv.weight"] = (layer, prev)
        for n in ("conv.bias", "bn.weight", "bn.bias"):
            out[f"block{i}.{n}"] = (layer, None)
    return out


def conv4_features(p: State, images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, width * (H / 16) * (W / 16)] (64 for 28x28)."""
    h = images
    for i in range(4):
        h = F.conv2d(h, p[f"block{i}.conv.weight"], p[f"block{i}.conv.bias"], padding=1)
        h = F.batch_norm(h, None, None, p[f"block{i}.bn.weight"], p[f"block{i}.bn.bias"], training=True)
        h = F.max_pool2d(F.relu(h), 2)
    return h.flatten(1)


RESNET12_WIDTHS = (64, 160, 320, 640)
_LEAK = 0.1


def _conv_weight(c_out: int, c_in: int, k: int, g: torch.Generator, dtype) -> torch.Tensor:
    return torch.randn(c_out, c_in, k, k, generator=g, dtype=dtype) * math.sqrt(2.0 / (c_in * k * k))


def resnet12_init(in_channels: int = 1, widths: tuple[int, ...] = RESNET12_WIDTHS, seed: int = 0,
                  dtype=torch.float32) -> State:
    if len(widths) != 4 or any(int(w) < 1 for w in widths):
        raise ValueError(f"resnet12 needs 4 positive block widths, got {tuple(widths)}")
    g = torch.Generator().manual_seed(seed)
    p: State = {}
    c_in = in_channels
    for i, w in enumerate(int(w) for w in widths):
        b = f"block{i}"
        for j, c in ((1, c_in), (2, w), (3, w)):
            p[f"{b}.conv{j}.weight"] = _conv_weight(w, c, 3, g, dtype)
            p[f"{b}.bn{j}.weight"] = torch.ones(w, dtype=dtype)
            p[f"{b}.bn{j}.bias"] = torch.zeros(w, dtype=dtype)
        p[f"{b}.shortcut.conv.weight"] = _conv_weight(w, c_in, 1, g, dtype)
        p[f"{b}.shortcut.bn.weight"] = torch.ones(w, dtype=dtype)
        p[f"{b}.shortcut.bn.bias"] = torch.zeros(w, dtype=dtype)
        c_in = w
    return p


def resnet12_groups() -> dict[str, str]:
    """Layer of each parameter for structured masks: bn1 with conv1, bn2 with conv2, and conv3 + bn3 +
    the shortcut conv + BN as one layer `block<i>.residual` (the two summed branches share one mask)."""
    out: dict[str, str] = {}
    for i in range(4):
        b = f"block{i}"
        for j in (1, 2):
            out[f"{b}.bn{j}.weight"] = out[f"{b}.bn{j}.bias"] = f"{b}.conv{j}"
        for n in ("conv3.weight", "bn3.weight", "bn3.bias", "shortcut.conv.weight", "shortcut.bn.weight",
                  "shortcut.bn.bias"):
            out[f"{b}.{n}"] = f"{b}.residual"
    return out


def resnet12_units() -> dict[str, tuple]:
    """The sub-model plan (`core.masks`) on `resnet12_groups()`'s layers: conv1 reads the previous block's
    output channels (`block<i-1>.residual`; the image's for block 0), conv2 reads conv1's, conv3 conv2's,
    and the shortcut the previous block's output, so one kept set of block channels covers both summed
    branches and the next block's inputs."""
    out: dict[str, tuple] = {}
    groups = resnet12_groups()
    for i in range(4):
        b, prev = f"block{i}", (f"block{i - 1}.residual" if i else None)
        out[f"{b}.conv1.weight"] = (f"{b}.conv1", prev)
        out[f"{b}.conv2.weight"] = (f"{b}.conv2", f"{b}.conv1")
        out[f"{b}.conv3.weight"] = (f"{b}.residual", f"{b}.conv2")
        out[f"{b}.shortcut.conv.weight"] = (f"{b}.residual", prev)
        for n, layer in groups.items():
            if n.startswith(b + ".") and n.endswith(("bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias", "bn3.weight",
                                                      "bn3.bias", "shortcut.bn.weight", "shortcut.bn.bias")):
                out[n] = (layer, None)
    return out


def linear_units(feature_layer: str | None) -> dict[str, tuple]:
    """The head's plan: its rows are the classes (never pruned), its columns the features of
    `feature_layer` (the backbone's last layer: the head keeps the columns of the channels the client's
    backbone computes, "the same model capacity" as x)."""
    return {"head.weight": (None, feature_layer), "head.bias": (None, None)}


def _bn(p: State, name: str, h: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(h, None, None, p[f"{name}.weight"], p[f"{name}.bias"], training=True)


def resnet12_block(p: State, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block i on h: (main branch after bn3, shortcut after its BN, block output after the add,
    LeakyReLU and the pool)."""
    b = f"block{i}"
    m = F.leaky_relu(_bn(p, f"{b}.bn1", F.conv2d(h, p[f"{b}.conv1.weight"], padding=1)), _LEAK)
    m = F.leaky_relu(_bn(p, f"{b}.bn2", F.conv2d(m, p[f"{b}.conv2.weight"], padding=1)), _LEAK)
    m = _bn(p, f"{b}.bn3", F.conv2d(m, p[f"{b}.conv3.weight"], padding=1))
    s = _bn(p, f"{b}.shortcut.bn", F.conv2d(h, p[f"{b}.shortcut.conv.weight"]))
    return m, s, F.max_pool2d(F.leaky_relu(m + s, _LEAK), 2)


def resnet12_features(p: State, images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, widths[-1]] (global average pool after the 4 blocks; H, W >= 16)."""
    h = images
    for i in range(4):
        h = resnet12_block(p, i, h)[2]
    return h.mean((2, 3))


def linear_init(n_out: int, n_in: int, dtype=torch.float32) -> State:
    return {"head.weight": torch.zeros(n_out, n_in, dtype=dtype), "head.bias": torch.zeros(n_out, dtype=dtype)}


def linear(p: State, feats: torch.Tensor) -> torch.Tensor:
    return F.linear(feats, p["head.weight"], p["head.bias"])


def conv_flops(shape: tuple, hw: int) -> int:
    """Forward FLOPs (2 per multiply-add) of a stride-1 'same' conv of weight shape [o, i, kh, kw] on an
    hw x hw input, per example."""
    o, i, kh, kw = shape
    return 2 * o * i * kh * kw * hw * hw


def backbone_flops(backbone: str, shapes: dict, hw: int = 28) -> int:
    """Forward FLOPs per example of a Conv4 / ResNet12 whose parameters have these `shapes` (a client's
    extracted sub-model, or the full model): the convolutions, which dominate (batch norm, activations and
    pooling add O(activations), not counted). Block i sees an (hw // 2^i)^2 input."""
    total = 0
    for i in range(4):
        side = hw // 2 ** i
        names = ["conv.weight"] if backbone == "conv4" else ["conv1.weight", "conv2.weight", "conv3.weight",
                                                            "shortcut.conv.weight"]
        total += sum(conv_flops(tuple(shapes[f"block{i}.{n}"]), side) for n in names)
    return total


def linear_flops(shape: tuple) -> int:
    """Forward FLOPs of a Linear of weight shape [o, i], per example."""
    return 2 * shape[0] * shape[1]

