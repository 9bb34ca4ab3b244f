"""RABO and RAFBO: resource-adaptive distributed bilevel optimization (the RABO paper, Algorithm 1;
docs/rabo.md#the-equations). FedMBO is the same method with every mask full.

  min_x (1/n) sum_i f_i(x (.) m_x^i, y*(x) (.) m_y^i),  y*(x) = argmin_y (1/n) sum_i g_i(x (.) m_x^i, y (.) m_y^i)

Round q, for client i with capacity R_i (masks m^i = M(x_q, R_i), M(y_q, R_i): structured, by weight
importance of the current global weights, `core.masks`; `mask_target = "y"` keeps x full):
  inner   T steps  y_{t+1} = y_t - beta * (grad_y g_i(x_q (.) m_x, y_t) (.) m_y); upload G^i = sum_t of the
          masked gradients; server  y^k_{q+1} = y^k_q - beta (1/C^k_y) sum_{i in N^k} G^{i,k}
  outer   hypergradient at (x_q (.) m_x, y_{q+1} (.) m_y), masked by m_x (RABO: implicit differentiation with
          CG or Neumann Hessian-vector products; RAFBO: every second-order product by finite differences,
          optionally the coordinate-wise Jacobian estimator; `core.hypergrad`); server
          x^s_{q+1} = x^s_q - alpha (1/C^s_x) sum_{i in N^s} grad f_i^s
Untrained coordinates keep their value; the covering numbers C_x*, C_y* of the round are reported.
Pure functions over explicit state, as `ciders.algorithms.ciders`. The state also carries the norms of the run's
initial x_0 and y_0 (`BilevelState.ref`), what the server bounds each reply's step against
(docs/security.md#aggregation): fixed at the start, never re-taken from the current state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from ciders.core import aggregate as agg
from ciders.core import hypergrad as hg
from ciders.core import masks as mk
from ciders.config.bilevel import RaboConfig  # noqa: F401 - the config lives in the config layer
from ciders.core.tensors import State, clone, lincomb, norm

BiLoss = Callable[[State, State, object], torch.Tensor]  # (x, y, batch) -> scalar


def configure(cfg: RaboConfig) -> RaboConfig:
    """RABO itself: the config's extraction rule (importance by default) and the implicit hypergradient."""
    return replace(cfg, method="rabo").validate()


@dataclass(frozen=True)
class BilevelState:
    round: int
    x: State
    y: State
    ref: dict | None = None  # `ref_norms(x_0, y_0)`: what federation.max_step_ratio bounds each reply's step
    #                          against, fixed at the run's start so no client can inflate it (None: taken from
    #                          x and y when first used, `with_ref`)


@dataclass(frozen=True)
class ClientMasks:
    x: State
    y: State
    capacity: float


def joined(x: State, y: State) -> State:
    """x and y as one state, x/<k> and y/<k> (what the local baselines' bound measures)."""
    return {**{f"x/{k}": v for k, v in x.items()}, **{f"y/{k}": v for k, v in y.items()}}


def ref_norms(x: State, y: State) -> dict:
    """{"x": ||x||, "y": ||y||, "xy": ||(x, y)||} (float64 norms): the step bound's references, one per thing
    a reply moves (y in the inner phase, x in the outer one, both in a local baseline's)."""
    return {"x": norm(x), "y": norm(y), "xy": norm(joined(x, y))}


def init_state(x: State, y: State) -> BilevelState:
    return BilevelState(0, clone(x), clone(y), ref_norms(x, y))


def with_ref(state: BilevelState) -> BilevelState:
    """The state with its step-bound references fixed: as it is, or (a state built without them) the norms of
    its x and y now, kept from then on."""
    return state if state.ref is not None else replace(state, ref=ref_norms(state.x, state.y))


def client_masks(cfg: RaboConfig, state: BilevelState, capacity: float, units: dict | None = None,
                 client: int = 0, capacities: Sequence[float] | None = None, groups: dict[str, str] | None = None
                 ) -> ClientMasks:
    """m_x = M(x_q, R_i), m_y = M(y_q, R_i) from the current global weights (recomputed every round), one
    sub-model over x and y together: `units` = {"x": plan, "y": plan} (`core.masks`; e.g. the head's columns
    follow the backbone's last layer, `models.vision.conv4_units()`); without it, output units only, with
    `groups` putting parameters into layers. `mask_target = "y"` keeps x full. `client` and `capacities`
    (this round's clients in order) are read by the coverage-aware OAP rule; `client` picks the `segment`
    rule's window (`cfg.segments`)."""
    rule = "full" if cfg.method == "fedmbo" else cfg.mask_rule
    kw = {"round_": state.round, "norm": cfg.mask_norm, "client": client, "capacities": capacities,
          "segment": cfg.segments[client % len(cfg.segments)] if cfg.segments else client}
    if rule == "magnitude":  # unstructured, tensor by tensor: no plan
        mx = mk.structured_masks(state.x, capacity, "full" if cfg.mask_target == "y" else rule,
                                 keep_full=cfg.keep_full, **kw)
        return ClientMasks(mx, mk.structured_masks(state.y, capacity, rule, keep_full=cfg.keep_full, **kw), capacity)
    parts = {"x": state.x, "y": state.y}
    if units is None:
        plan = {f"{part}/{n}": (None if r is None else f"{part}/{r}", None if c is None else f"{part}/{c}")
                for part, ps in parts.items() for n, (r, c) in mk.output_units(ps, groups).items()}
        keep_full = [f"{part}/{k}" for part in parts for k in cfg.keep_full]
    else:
        plan = {f"{part}/{n}": tuple(u) for part in parts for n, u in units[part].items()}
        keep_full = list(cfg.keep_full)
    params = {f"{part}/{n}": v for part, ps in parts.items() for n, v in ps.items()}
    full = {plan[f"x/{n}"][0] for n in state.x} if cfg.mask_target == "y" else set()
    m = mk.structured_masks(params, capacity, rule, units=plan, keep_full=keep_full, full_layers=sorted(
        x for x in full if x is not None), **kw)
    return ClientMasks({n: m[f"x/{n}"] for n in state.x}, {n: m[f"y/{n}"] for n in state.y}, capacity)


def inner_update(cfg: RaboConfig, state: BilevelState, m: ClientMasks, g: BiLoss, batches: Sequence
                 ) -> tuple[State, dict]:
    """T masked steps on y; returns G^i = sum_t G_t (only the masked coordinates are non-zero) and the
    mean inner loss over the steps (each at the y its gradient was taken at: one g evaluation per step)."""
    if len(batches) != cfg.inner_steps:
        raise ValueError(f"inner_update needs T = {cfg.inner_steps} batches, got {len(batches)}")
    x = mk.apply_mask(state.x, m.x)
    y = mk.apply_mask(state.y, m.y)
    total = {k: torch.zeros_like(v) for k, v in y.items()}
    losses = []
    for batch in batches:
        loss, gy = hg.value_and_grad_y(lambda a, b: g(a, b, batch), x, y)
        gm = mk.apply_mask(gy, m.y)
        y = lincomb([(1.0, y), (-cfg.beta, gm)])
        total = lincomb([(1.0, total), (1.0, gm)])
        losses.append(loss)
    return total, {"inner_loss": sum(losses) / len(losses)}


def episode_head(cfg: RaboConfig, x: State, y_like: State, m: ClientMasks, g: BiLoss, batches: Sequence
                 ) -> tuple[State, dict]:
    """`rabo.head: episode`: the client's own head for its episode, y_T from y_0 = 0 by the inner phase's T
    masked steps (y_T = -beta G^i; `y_like` gives y's shapes and dtypes), never aggregated: the outer hypergradient is taken at (x_q, y_T), where
    y_T ~ y*(x_q) of this episode's inner problem (docs/rabo.md#one-head-per-episode)."""
    zero = {k: torch.zeros_like(v) for k, v in y_like.items()}
    G, info = inner_update(cfg, BilevelState(-1, x, zero), m, g, batches)
    return lincomb([(-cfg.beta, G)]), info


def server_inner(cfg: RaboConfig, state: BilevelState, Gs: Sequence[State], masks: Sequence[ClientMasks]
                 ) -> tuple[BilevelState, dict]:
    y, st = agg.masked_step(state.y, Gs, [m.y for m in masks], cfg.beta)
    return replace(state, y=y), {"covering_y": st["covering"],
                                 "trained_y": st["coordinates_trained"] / st["coordinates"]}


def outer_update(cfg: RaboConfig, state: BilevelState, m: ClientMasks, f: BiLoss, g: BiLoss, batch
                 ) -> tuple[State, dict]:
    """The client's masked hypergradient at (x_q (.) m_x, y_{q+1} (.) m_y) (state.y is y_{q+1})."""
    if cfg.coordinates and cfg.method != "rafbo":  # a config made for RAFBO run as another method
        raise ValueError(f"rabo.coordinates: the coordinate-wise estimator is RAFBO's, not {cfg.method}'s")
    x = mk.apply_mask(state.x, m.x)
    y = mk.apply_mask(state.y, m.y)

    # the client's sub-model: gradients in y flow only through its coordinates
    def fm(a, b):
        return f(a, mk.apply_mask(b, m.y), batch)

    def gm(a, b):
        return g(a, mk.apply_mask(b, m.y), batch)

    second = "fd" if cfg.method == "rafbo" else "autograd"
    h, info = hg.hypergradient(fm, gm, x, y, solver=cfg.solver, iters=cfg.solver_iters, eta=cfg.neumann_eta,
                               second_order=second, delta=cfg.fd_delta, coordinates=cfg.coordinates)
    return mk.apply_mask(h, m.x), {"outer_loss": float(f(x, y, batch)), **{f"solver_{k}": v for k, v in info.items()}}


def server_outer(cfg: RaboConfig, state: BilevelState, hs: Sequence[State], masks: Sequence[ClientMasks]
                 ) -> tuple[BilevelState, dict]:
    x, st = agg.masked_step(state.x, hs, [m.x for m in masks], cfg.alpha)
    return replace(state, round=state.round + 1, x=x), {"covering_x": st["covering"],
                                                        "trained_x": st["coordinates_trained"] / st["coordinates"]}


def payload_fraction(m: ClientMasks) -> dict:
    """Fraction of the full x / y a client's masked payloads carry (only masked coordinates travel)."""
    return {"x": mk.masked_fraction(m.x), "y": mk.masked_fraction(m.y)}
