"""Structured sub-model masks and per-coordinate aggregation (RABO / RAFBO and its baselines;
docs/rabo.md#sub-model-masks).

A mask is a sub-model: it keeps whole units (output channels of a conv, neurons of a Linear) of every
layer, and each parameter keeps the entries whose units all survive. A `units` plan says, per parameter,
which layer's units index its dim 0 and which its dim 1:

  units[name] = (rows, cols)   rows / cols: a layer id, or None (that dim is never pruned)

so keeping output channel j of layer l keeps input channel j of layer l + 1 (its `cols` are layer l) and
the matching entries of l's bias and normalisation scale / shift (their `rows` are l), as width-scaled
federated learning extracts sub-models (HeteroFL, Diao et al., ICLR 2021; FedRolex; FIARSE). A conv
weight [out, in, kh, kw] keeps rows x cols x kh x kw, so a layer between two pruned ones costs about R^2
of its parameters and FLOPs, and no kept coordinate is one whose input the client never computes (its
gradient would be structurally zero). Without a plan (`groups`, or nothing) each parameter's rows are its
layer (module prefix, or the `groups` map, e.g. a BatchNorm following its conv) and its cols are never
pruned: output units only. A layer's units are counted and scored on its lead: its first >= 2-D
parameter; a layer without one is never pruned. A layer keeps k = max(1, round(R * units)) units.
Extraction rules:
  importance  the k units with the largest L1 (or L2) norm of the current global weights (RABO); with
              norm `bn_scale`, the largest |scale| of the layer's normalisation (ties: L1), which tracks
              training under batch-statistics BN where the weights' norm does not (docs/rabo.md)
  static      the first k units: a fixed leading sub-model (HeteroFL, Diao et al., ICLR 2021)
  rolling     a window of k units starting at unit (round mod out), wrapping (FedRolex, Alam et al.,
              NeurIPS 2022)
  segment     a fixed window of k units starting at unit segment * k (mod units): client-chosen segments
              of the model, to set the covering numbers by hand (the RABO paper's C_x* ablation, Fig. 4)
  full        everything (FedMBO = every mask full)
  magnitude   unstructured: the R fraction of each tensor's entries with the largest |w| (the
              importance-aware extraction of FIARSE, Wu et al., NeurIPS 2024; its threshold-controlled
              biased update is the client step's, `algorithms.dist_protonet.threshold_controlled`)
  oap         coverage-first importance extraction, the joint mask design advocated by OAP (Zhou, Lan,
              Venkataramani, Ding, "Every parameter matters: ensuring the convergence of federated learning
              with dynamic heterogeneous models reduction", NeurIPS 2023, arXiv 2310.08670): convergence is
              set by the minimum coverage index (every unit trained by >= 1 client each round) together with
              the model-reduction noise. Units are ranked by the norm of the current global weights (as
              `importance`); the clients' k_j, in the order client (round + j) mod N, take consecutive windows
              of a tape that repeats the ranking, so unit of rank p is kept by floor(L/n) + [p < L mod n] of
              them (L = sum_j k_j): the largest possible minimum coverage (every unit is covered whenever
              L >= n), the surplus going to the highest-norm units, and the top-k window rotating over the
              clients round by round. Needs the client index and every client's capacity (`client`,
              `capacities`; `n_clients` alone assumes they all have this ratio; one client reduces it to
              `importance`). Zhou et al. prove convergence for arbitrary per-round masks with coverage >= 1
              and advocate designing masks for both factors, but prescribe no construction: this tape is our
              deterministic instance of that advice, not the masks of their experiments.
Layers named in `keep_full` (e.g. a classifier whose outputs are the classes) are never pruned.

Aggregation (`ciders.core.aggregate.masked_step`): coordinate k of the server state moves by the mean over
the clients that trained it, `s^k - lr (1/C^k) sum_{i in N^k} G^{i,k}`; a coordinate nobody trained keeps
its value. The covering number C* = min_k C^k.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ciders.core.tensors import State

RULES = ("importance", "static", "rolling", "full", "magnitude", "oap", "segment")


def layer_groups(params: Mapping[str, torch.Tensor], groups: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """{layer: [param names]} in parameter order; `groups` overrides a parameter's layer."""
    out: dict[str, list[str]] = {}
    for name in params:
        layer = (groups or {}).get(name, name.rsplit(".", 1)[0] if "." in name else name)
        out.setdefault(layer, []).append(name)
    return out


NORMS = ("l1", "l2", "bn_scale")


def kept_units(weight: torch.Tensor, ratio: float, rule: str, round_: int = 0, norm: str = "l1", *,
               client: int = 0, n_clients: int = 1, capacities: Sequence[float] | None = None,
               segment: int = 0, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the output units (dim 0) a layer keeps. `client`, `n_clients`, `capacities` (every
    client's ratio, `capacities[client] == ratio`) are read by the `oap` rule only, `segment` by `segment`.
    `scale` ([units], norm `bn_scale`): the layer's normalisation scale magnitudes, ranked first, ties
    (e.g. every scale 1 at initialisation) broken by the L1 norm of `weight`."""
    if norm not in NORMS:
        raise ValueError(f"mask norm must be one of {', '.join(NORMS)}, got {norm!r}")
    if rule not in RULES:
        raise ValueError(f"mask rule must be one of {', '.join(RULES)}, got {rule!r}")
    if not 0 < ratio <= 1:
        raise ValueError(f"capacity ratio must be in (0, 1], got {ratio}")
    n = weight.shape[0]
    k = max(1, round(ratio * n))
    if rule == "full" or k >= n:
        return torch.arange(n)
    if rule == "static":
        return torch.arange(k)
    if rule == "rolling":
        return torch.sort((torch.arange(k) + round_) % n).values
    if rule == "segment":
        if isinstance(segment, bool) or not isinstance(segment, int) or segment < 0:
            raise ValueError(f"segment must be an integer >= 0, got {segment!r}")
        return torch.sort((torch.arange(k) + segment * k) % n).values
    order = _ranking(weight, norm, scale)
    if rule == "oap":
        return torch.sort(order[_oap_positions(n, ratio, round_, client, n_clients, capacities)]).values
    return torch.sort(order[:k]).values


def _ranking(weight: torch.Tensor, norm: str, scale: torch.Tensor | None) -> torch.Tensor:
    """Units by decreasing score. Stable sorts: ties go to the lower index, so every party computes the same
    mask. `bn_scale`: by |scale| first (a batch-statistics BN makes a unit's output independent of its weights'
    norm, so only its scale says how much it contributes), the weights' L1 norm breaking ties."""
    n = weight.shape[0]
    w = weight.detach().reshape(n, -1).float()
    order = torch.argsort(-(w.pow(2).sum(1) if norm == "l2" else w.abs().sum(1)), stable=True)
    if norm == "bn_scale" and scale is not None:
        order = order[torch.argsort(-scale.detach().float().abs()[order], stable=True)]
    return order


def _oap_positions(n: int, ratio: float, round_: int, client: int, n_clients: int,
                   capacities: Sequence[float] | None) -> torch.Tensor:
    """Ranks (0 = largest norm) client `client` keeps: its window on the tape of the clients' k_j laid end to
    end, in the order (round_ + j) mod N, over the ranking repeated."""
    caps = [ratio] * n_clients if capacities is None else [float(c) for c in capacities]
    if not caps:
        raise ValueError("oap needs at least one client")
    if any(not 0 < c <= 1 for c in caps):
        raise ValueError(f"capacity ratios must be in (0, 1], got {caps}")
    if not 0 <= client < len(caps):
        raise ValueError(f"client must be in [0, {len(caps)}), got {client}")
    if abs(caps[client] - ratio) > 1e-12:
        raise ValueError(f"capacities[{client}] = {caps[client]}, but this client's ratio is {ratio}")
    ks = [max(1, round(c * n)) for c in caps]
    start = 0
    for j in range(len(caps)):
        c = (round_ + j) % len(caps)
        if c == client:
            break
        start += ks[c]
    return (start + torch.arange(ks[client])) % n


Units = Mapping[str, tuple]  # param name -> (layer of its dim-0 units | None, layer of its dim-1 units | None)


def output_units(params: Mapping[str, torch.Tensor], groups: Mapping[str, str] | None = None) -> dict:
    """The plan that prunes output units only: rows = the parameter's layer (`layer_groups`), cols never."""
    return {n: (layer, None) for layer, names in layer_groups(params, groups).items() for n in names}


def layer_sizes(params: Mapping[str, torch.Tensor], units: Units) -> dict[str, tuple[str | None, int]]:
    """{layer: (lead parameter or None, number of units)} of a plan, checked against the shapes: every
    parameter's rows / cols have its layer's unit count, and every cols layer is some parameter's rows."""
    if set(units) != set(params):
        diff = sorted(set(units) ^ set(params))
        raise ValueError(f"the units plan and the parameters differ (e.g. {diff[0]!r})")
    sizes: dict[str, tuple[str | None, int]] = {}
    for n, p in params.items():
        rows = units[n][0]
        if rows is None or p.dim() == 0:
            continue
        if sizes.get(rows, (None,))[0] is None and p.dim() >= 2:  # the first >= 2-D parameter leads
            sizes[rows] = (n, p.shape[0])
        elif rows not in sizes:
            sizes[rows] = (None, p.shape[0])
    for n, p in params.items():
        for d, layer in enumerate(units[n][:2]):
            if layer is None:
                continue
            if layer not in sizes:
                raise ValueError(f"{n}: dim {d} follows layer {layer!r}, which no parameter's rows are")
            if p.dim() <= d or p.shape[d] != sizes[layer][1]:
                raise ValueError(f"{n}: dim {d} has {tuple(p.shape)[d] if p.dim() > d else 'no'} entries, but its "
                                 f"layer {layer!r} has {sizes[layer][1]} units")
    return sizes


def structured_masks(params: Mapping[str, torch.Tensor], ratio: float, rule: str = "importance", *,
                     round_: int = 0, norm: str = "l1", groups: Mapping[str, str] | None = None,
                     units: Units | None = None, keep_full: Sequence[str] = (), full_layers: Sequence[str] = (),
                     client: int = 0, n_clients: int = 1, capacities: Sequence[float] | None = None,
                     segment: int = 0) -> State:
    """0/1 masks (the parameters' dtype and shape) of the sub-model keeping fraction `ratio` of every layer's
    units: parameter p keeps entry [r, c, ...] iff unit r of its rows layer and unit c of its cols layer are
    kept (`units`: see the module docstring; default `output_units(params, groups)`). Layers in `keep_full`
    or `full_layers` keep every unit. `client`, `n_clients`, `capacities`, `segment`: see `kept_units`."""
    if rule == "magnitude":
        return {n: _magnitude_mask(p, ratio) if not any(n.startswith(k + ".") or n == k for k in keep_full)
                else torch.ones_like(p) for n, p in params.items()}
    units = output_units(params, groups) if units is None else units
    keep: dict[str, torch.Tensor] = {}
    for layer, (lead, size) in layer_sizes(params, units).items():
        if lead is None or layer in keep_full or layer in full_layers or rule == "full":
            keep[layer] = torch.arange(size)
        else:
            scale = layer_scale(params, units, layer, size) if norm == "bn_scale" else None
            keep[layer] = kept_units(params[lead], ratio, rule, round_, norm, client=client, n_clients=n_clients,
                                     capacities=capacities, segment=segment, scale=scale)
    masks: State = {}
    for n, p in params.items():
        m = torch.ones_like(p)
        for d, layer in enumerate(units[n][:2]):
            if layer is not None and p.dim() > d:
                on = torch.zeros(p.shape[d], dtype=torch.bool, device=p.device)
                on[keep[layer].to(p.device)] = True
                shape = [1] * p.dim()
                shape[d] = p.shape[d]
                m = m * on.view(shape).to(p.dtype)
        masks[n] = m
    return masks


def layer_scale(params: Mapping[str, torch.Tensor], units: Units, layer: str, size: int) -> torch.Tensor | None:
    """|scale| per unit of a layer: the sum over its 1-D `*.weight` parameters (its normalisation scales; a
    residual layer of `resnet12_groups` has two, its BN and its shortcut's), or None when it has none (the
    layer is then ranked by its weights' L1 norm, as `importance`)."""
    scales = [p.detach().float().abs() for n, p in params.items()
              if units[n][0] == layer and p.dim() == 1 and n.endswith("weight") and p.shape[0] == size]
    return torch.stack(scales).sum(0) if scales else None


def _magnitude_mask(p: torch.Tensor, ratio: float) -> torch.Tensor:
    if not 0 < ratio <= 1:
        raise ValueError(f"capacity ratio must be in (0, 1], got {ratio}")
    flat = p.detach().reshape(-1).abs().float()
    k = max(1, round(ratio * flat.numel()))
    keep = torch.argsort(-flat, stable=True)[:k]  # ties to the lower index, as kept_units
    m = torch.zeros(flat.numel(), dtype=p.dtype, device=p.device)
    m[keep] = 1
    return m.view_as(p)


def apply_mask(state: State, mask: State) -> State:
    return {k: v * mask[k] for k, v in state.items()}


def masked_fraction(mask: State) -> float:
    """Fraction of coordinates kept (what a masked payload costs relative to the full one)."""
    kept = sum(float(m.sum()) for m in mask.values())
    return kept / max(sum(m.numel() for m in mask.values()), 1)
