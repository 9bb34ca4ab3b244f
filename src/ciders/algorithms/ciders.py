"""CIDERS client and server updates (paper Sec. IV-B/C, Algorithm 2; docs/method.md#algorithm-2-one-round).

Model-agnostic: parameters are a named tensor dict and `loss_fn(params, batch) -> scalar` (autograd
gives gradients), so the same functions run an LLM messenger and a plain vector (`ciders theory`).

Client i, round t, from w = w_PM^(t), K optimizer updates:
  g_k     = meta-gradient at x_k (FO or FD, Eqs. 5-7; `ciders.core.metagrad`)
  g_traj  = g_k + gamma (c - c_i) + eps_prox (x_k - w)                     (Eq. 4)
  x_{k+1} = OPTIM(x_k, clip(g_traj))                                        (SGD or AdamW)
then Delta_i (Eq. 8, eta_bar = mean of the round's K learning rates), c_i' (Eq. 9), upload dc_i (Eq. 10).
Server: Eq. 11 reconstruction from its copy of c_i, Eq. 12 aggregation, whose step on the messenger can go
through a server optimizer (FedAvgM / FedAdam / FedYogi, `ciders.core.server_opt`; c keeps Eq. 12's rule). TAKD
(Eq. 13) is the LLM layer's job, after `server_update`.

Consensus bookkeeping survives faults (lost, duplicated or late uploads, client restores, server
restarts): every copy of c_i carries a version. The client does not change its committed c_i when it
uploads; it keeps the increment as *pending*. The server applies an upload only if it is for the current
round and was computed from the server's current version, and remembers which one it applied (its round
and a digest of dc_i). The next broadcast to that client carries the server's version, that
acknowledgement and a digest of the server's copy of c_i: the client commits the pending increment only
if the acknowledgement names exactly that increment, drops it if the version did not move, and then
compares digests; any mismatch (e.g. a client restored from an old snapshot whose pending increment
is not the one the server applied) makes it ask for a resync, and its next broadcast carries the
server's copy. Both copies stay bit-identical (docs/method.md#consensus-copies-under-faults).

The server weighs client i by the size of its data as the server registered it (p_i, Eq. 12), never by
anything the upload claims, and rejects an upload whose implied step is not finite or too large
(`core.aggregate.step_check`, relative to ||w_0||, the messenger's norm at the run's start, which the server
state carries: `ServerState.ref_norm`) or whose round's aggregate is not finite (docs/security.md#aggregation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from ciders.config import CidersConfig
from ciders.core import aggregate as agg
from ciders.core import consensus as cs
from ciders.core import optim
from ciders.core import server_opt as so
from ciders.core.diagnostics import RoundStats
from ciders.core.metagrad import exact_grad_hvp, fd_class, metagrad
from ciders.core.schedules import gamma_at, lr_at
from ciders.core.tensors import State, clone, digest, lincomb, norm, scale, zeros_like

LossFn = Callable[[State, Any], torch.Tensor]


# ------------------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class Broadcast:
    """What client i receives at the start of round t (per client: version / resync differ)."""

    round: int
    messenger: State
    c: State | None  # None when gamma_t = 0 in every round (baselines): the client uses zeros
    gamma: float
    lrs: tuple[float, ...]  # learning rate of each of the K optimizer updates
    eta_ins: tuple[float, ...]  # look-ahead step of each update (same schedule)
    version: int = 0  # server's committed version of this client's c_i
    resync: State | None = None  # the server's copy of c_i, sent only after a mismatch
    applied: tuple[int, str] | None = None  # (round, digest of dc_i) of the upload that made `version`
    c_i_digest: str | None = None  # digest of the server's copy of c_i (None: not checked)
    secure: bool = False  # secure aggregation: the server holds no copy of c_i (`reconcile_secure`)


@dataclass(frozen=True)
class Upload:
    client_id: str
    round: int
    base_version: int
    dc: State | None = None  # Eq. 10; None for a resync request
    resync_request: bool = False
    personalized: State | None = None  # x_K, only with upload_personalized_messenger
    delta: State | None = None  # Delta_i as it entered Eq. 9 (clipped / noised under DP); never encoded:
    #                             secure aggregation masks n_i * delta instead of sending dc_i


@dataclass(frozen=True)
class Privacy:
    """What client-level DP asks of one round's update rules (built from federation.dp by the round code;
    docs/privacy.md#differential-privacy). The default asks nothing: the plain run, bit for bit."""

    clip: float | None = None  # C: Delta_i is scaled to norm <= C before Eq. 9
    local_std: float = 0.0  # client: N(0, local_std^2) added to its clipped Delta_i (local mode, z C)
    central_sigma: float = 0.0  # server: N(0, (central_sigma / m)^2) added to the mean of m updates (z C)
    seed: int | None = None  # the noise generator's seed (None: the operating system's random source)


@dataclass(frozen=True)
class Pending:
    """An uploaded increment the server has not acknowledged yet."""

    dc: State
    base_version: int
    round: int


@dataclass(frozen=True)
class ClientState:
    client_id: str
    c_i: State  # committed local consensus variate
    version: int = 0
    pending: Pending | None = None
    personalized: State | None = None  # x_K of the last participation (the personalized messenger)


@dataclass(frozen=True)
class ServerCopy:
    """The server's copy of one client's c_i."""

    c_i: State
    version: int = 0
    needs_resync: bool = False
    applied: tuple[int, str] | None = None  # (round, digest of dc_i) of the last upload applied


@dataclass(frozen=True)
class ServerState:
    round: int
    total_rounds: int
    messenger: State
    c: State
    opt: so.ServerOptState | None = None  # server optimizer moments (algorithm.server_optimizer); None: no step yet
    ref_norm: float | None = None  # ||w_0||: what max_step_ratio bounds each step against, fixed at the run's
    #                                start so no client can inflate it (None: the messenger's norm when first used)


def init_client(client_id: str, messenger: State) -> ClientState:
    return ClientState(client_id, zeros_like(messenger))


def init_server(messenger: State, total_rounds: int) -> ServerState:
    return ServerState(0, total_rounds, clone(messenger), zeros_like(messenger), ref_norm=norm(messenger))


def with_ref(state: ServerState) -> ServerState:
    """The state with its step-bound reference fixed: as it is, or (a state built without one) its messenger's
    norm now, kept from then on."""
    return state if state.ref_norm is not None else replace(state, ref_norm=norm(state.messenger))


def init_copy(messenger: State) -> ServerCopy:
    return ServerCopy(zeros_like(messenger))


# ------------------------------------------------------------------------------------------ schedules


def round_schedule(cfg: CidersConfig, t: int, total_rounds: int) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(lrs, eta_ins, gamma_t) of round t: the K learning rates over global client steps t*K + k,
    the look-ahead steps scaled by the same schedule, and the consensus coefficient."""
    k_steps = cfg.local_steps
    total = max(total_rounds * k_steps, 1)
    lrs = tuple(lr_at(t * k_steps + k, cfg.schedule, total, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
                for k in range(k_steps))
    eta0 = cfg.lr if cfg.eta_in is None else cfg.eta_in
    eta_ins = tuple(eta0 * lr / cfg.lr for lr in lrs)
    return lrs, eta_ins, gamma_at(t, cfg.gamma_schedule, cfg.gamma)


def make_broadcast(cfg: CidersConfig, state: ServerState, copy: ServerCopy, secure: bool = False) -> Broadcast:
    """Client i's broadcast; `secure`: the server keeps only the version of c_i (`reconcile_secure`)."""
    lrs, eta_ins, gamma = round_schedule(cfg, state.round, state.total_rounds)
    c = state.c if cfg.uses_consensus() else None  # not sent when no client can use it
    if secure:
        return Broadcast(state.round, state.messenger, c, gamma, lrs, eta_ins, copy.version, applied=copy.applied,
                         secure=True)
    return Broadcast(state.round, state.messenger, c, gamma, lrs, eta_ins, copy.version,
                     resync=copy.c_i if copy.needs_resync else None, applied=copy.applied,
                     c_i_digest=digest(copy.c_i))


# ------------------------------------------------------------------------------------------ client


SECAGG_ACK = "secagg"  # `applied` of a secure round: the server saw only the sum, so it names no digest


def reconcile_secure(state: ClientState, b: Broadcast) -> ClientState:
    """Secure aggregation keeps c_i on the client alone (the server never reconstructs Delta_i, so no copy
    must match): the pending increment is committed iff the server says the upload of its round entered the
    sum, and the client takes the server's version number."""
    p = state.pending
    if p is not None and b.applied == (p.round, SECAGG_ACK) and b.version == state.version + 1:
        return replace(state, c_i=_commit(state.c_i, p.dc), version=b.version, pending=None)
    return replace(state, version=b.version, pending=None)


def reconcile(state: ClientState, b: Broadcast) -> ClientState | None:
    """Bring the client's committed c_i to the server's version, or None if only a resync can: the
    pending increment is committed only if the server acknowledges exactly it (its round and digest),
    and whatever the client ends with must match the digest of the server's copy."""
    if b.secure:
        return reconcile_secure(state, b)
    if b.resync is not None:
        return replace(state, c_i=clone(b.resync), version=b.version, pending=None)
    p, st = state.pending, None
    if (p is not None and p.base_version == state.version and b.version == state.version + 1
            and b.applied == (p.round, digest(p.dc))):
        st = replace(state, c_i=_commit(state.c_i, p.dc), version=b.version, pending=None)
    elif b.version == state.version:
        st = replace(state, pending=None)  # the pending increment was never applied
    if st is None or (b.c_i_digest is not None and digest(st.c_i) != b.c_i_digest):
        return None
    return st


def _commit(c_i: State, dc: State) -> State:
    # exactly the server's operation (c_i + dc), so both copies stay bit-identical
    return {k: c_i[k] + dc[k] for k in c_i}


def grad_of(loss_fn: LossFn, params: State, batch: Any) -> tuple[torch.Tensor, State]:
    p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = loss_fn(p, batch)
    grads = torch.autograd.grad(loss, list(p.values()))
    return loss.detach(), {k: g for k, g in zip(p, grads)}


def client_update(cfg: CidersConfig, b: Broadcast, state: ClientState, loss_fn: LossFn,
                  batches: Sequence[Any], priv: Privacy = Privacy()) -> tuple[Upload, ClientState, dict]:
    """K consensus-corrected meta-gradient steps (Eq. 4) on `batches` (K * grad_accum of them). Under DP
    (`priv`), Delta_i is clipped (and, in local mode, noised) before Eq. 9, so the uploaded dc_i, the client's
    c_i and the server's copy all follow the privatized Delta_i."""
    st = reconcile(state, b)
    if st is None:  # versions disagree in a way no pending increment explains
        up = Upload(state.client_id, b.round, state.version, resync_request=True)
        return up, replace(state, pending=None), {"client": state.client_id, "round": b.round, "resync_request": True}
    k_steps, accum = cfg.local_steps, cfg.grad_accum
    if len(batches) != k_steps * accum:
        raise ValueError(f"client_update needs K * grad_accum = {k_steps * accum} batches, got {len(batches)}")
    w, c_i, gamma = b.messenger, st.c_i, b.gamma
    c = b.c if b.c is not None else zeros_like(w)
    corr = lincomb([(gamma, c), (-gamma, c_i)])  # gamma (c - c_i): fixed within the round
    start = st.personalized if cfg.client_start == "personalized" and st.personalized is not None else w
    x = clone(start)
    opt_state = optim.adamw_init(x) if cfg.optimizer == "adamw" else None
    stats = RoundStats(c, c_i, gamma)
    steps, sums = [], _Sums()
    for k in range(k_steps):
        g, rec = _meta_step(cfg, loss_fn, x, b.eta_ins[k], batches[k * accum:(k + 1) * accum])
        x, u, d, opt_state, traj_norm = _local_step(cfg, x, w, g, corr, b.lrs[k], opt_state)
        if cfg.consensus_space == "update":  # the optimizer's own direction: c lives in its units
            u = lincomb([(1.0, u), (-1.0, corr)])
        stats.add(u if cfg.consensus_space == "update" else g)  # what c is compared with (same units)
        sums.add(g, u, d, b.lrs[k])
        steps.append({"step": k, **rec, "g_norm": norm(g), "g_traj_norm": traj_norm, "lr": b.lrs[k]})
    # our decision (docs/method.md#eq-8-the-displacement-delta_i): eta_bar is the mean of the K per-step learning rates
    eta_bar = sum(b.lrs) / k_steps
    if cfg.consensus_space == "gradient":  # the eta-weighted mean of the corrected gradients fed to OPTIM
        delta = {n: v / sum(b.lrs) for n, v in sums.fed.items()}
    else:
        delta = cs.displacement(w, x, k_steps, eta_bar)  # Eq. 8
    delta, raw_norm = privatize(delta, priv)
    c_i_new = cs.client_consensus(c_i, delta, c, cfg.alpha, gamma)  # Eq. 9
    dc = cs.increment(c_i_new, c_i)  # Eq. 10
    new_state = replace(st, pending=Pending(dc, st.version, b.round), personalized=x)
    up = Upload(st.client_id, b.round, st.version, dc=dc,
                personalized=x if cfg.upload_personalized_messenger else None, delta=delta)
    summary = {"client": st.client_id, "round": b.round, "gamma": gamma, "eta_bar": eta_bar,
               "loss": sum(s["loss"] for s in steps) / k_steps, "c_norm": norm(c), "c_i_norm": norm(c_i),
               "dc_norm": norm(dc), "delta_norm": norm(delta), "corr_norm": norm(corr),
               "g_mean_norm": norm(sums.mean("g", k_steps)), "step_mean_norm": norm(sums.mean("u", k_steps)),
               **stats.result()}
    if priv.clip is not None:
        summary["clipped"] = raw_norm > priv.clip
    if cfg.metagrad == "fd":
        classes = [fd_class(s["r_fd"]) for s in steps]
        summary.update({f"r_fd_{k}": classes.count(k) for k in ("small", "moderate", "large")})
    return up, new_state, {**summary, "steps": steps}


def privatize(delta: State, priv: Privacy) -> tuple[State, float]:
    """(Delta_i clipped to norm priv.clip and, in local mode, plus N(0, local_std^2); its norm before). With no
    clipping and no noise, `delta` itself (the plain run's tensors, bit for bit)."""
    from ciders.core import privacy as dp

    out, raw = dp.clip_to_norm(delta, priv.clip)
    if priv.local_std > 0:
        out = dp.add_noise(out, priv.local_std, dp.noise_generator(priv.seed, "cpu"))
    return out, raw


class _Sums:
    """Running sums over a round's K steps: raw meta-gradients g, the optimizer's directions u (update units,
    without a correction added after it) and,
    for consensus_space gradient, eta_k d_k (the clipped corrected gradients fed to OPTIM, Delta_i's numerator)."""

    def __init__(self):
        self.g: State | None = None
        self.u: State | None = None
        self.fed: State | None = None

    def add(self, g: State, u: State, fed: State, lr: float) -> None:
        self.g = dict(g) if self.g is None else lincomb([(1.0, self.g), (1.0, g)])
        self.u = dict(u) if self.u is None else lincomb([(1.0, self.u), (1.0, u)])
        self.fed = scale(fed, lr) if self.fed is None else lincomb([(1.0, self.fed), (lr, fed)])

    def mean(self, which: str, k: int) -> State:
        return {n: v / k for n, v in getattr(self, which).items()}


def _hvp_kw(cfg: CidersConfig, loss_fn: LossFn, batch: Any) -> dict:
    """algorithm.hvp: exact gives metagrad the double-backward product on this micro-batch, sharing the
    forward at x_k with the step's first gradient (`exact_grad_hvp`)."""
    if cfg.metagrad == "fd" and cfg.hvp == "exact":
        return {"grad_hvp_fn": lambda x: exact_grad_hvp(loss_fn, x, batch)}
    return {}


def _meta_step(cfg: CidersConfig, loss_fn: LossFn, x: State, eta_in: float, batches: Sequence[Any]
               ) -> tuple[State, dict]:
    """g_k: the meta-gradient (Eqs. 5-7) at x averaged over the step's micro-batches, and the step's
    loss and (FD) r_FD = ||mean eta_HVP Hv|| / (||mean v|| + 1e-12), the ratio of the step's update, not of
    one micro-batch."""
    g = v_sum = corr_sum = None
    losses = []
    for batch in batches:
        gm, info = metagrad(lambda p: grad_of(loss_fn, p, batch), x, eta_in, cfg.metagrad, cfg.eps_fd, cfg.fd_eta,
                            **_hvp_kw(cfg, loss_fn, batch))
        g = gm if g is None else lincomb([(1.0, g), (1.0, gm)])
        losses.append(info["loss"])
        if cfg.metagrad == "fd":
            v_sum = info["v"] if v_sum is None else lincomb([(1.0, v_sum), (1.0, info["v"])])
            corr_sum = info["corr"] if corr_sum is None else lincomb([(1.0, corr_sum), (1.0, info["corr"])])
    n = len(batches)
    if n > 1:
        g = {k: v / n for k, v in g.items()}
    rec = {"loss": sum(losses) / n}
    if cfg.metagrad == "fd":
        rec["r_fd"] = norm(corr_sum) / (norm(v_sum) + 1e-12 * n)  # the 1/n of both means cancels
    return g, rec


def _local_step(cfg: CidersConfig, x: State, w: State, g: State, corr: State, lr: float, opt_state):
    """x_{k+1} and the step's direction u = (x_k - x_{k+1}) / lr, in the configured consensus space:
      paper / gradient: d = clip(g + gamma (c - c_i) + eps_prox (x - w)),  x' = OPTIM(x, d)       (Eq. 4)
      update:           d = clip(g + eps_prox (x - w)),  x' = OPTIM(x, d) - lr gamma (c - c_i)
    (docs/method.md#the-consensus-space). Returns (x', u, d, the optimizer's new state, ||d|| before clipping)."""
    space = cfg.consensus_space
    terms = [(1.0, g), (cfg.eps_prox, x), (-cfg.eps_prox, w)] + ([] if space == "update" else [(1.0, corr)])
    d, traj_norm = optim.clip_by_global_norm(lincomb(terms), cfg.max_grad_norm)
    if opt_state is None:
        new = optim.sgd_step(x, d, lr, cfg.weight_decay)
    else:
        new, opt_state = optim.adamw_step(x, d, opt_state, lr, weight_decay=cfg.weight_decay)
    if space == "update":
        new = lincomb([(1.0, new), (-lr, corr)])
    u = {n: (x[n] - new[n]) / lr for n in x}
    return new, u, d, opt_state, traj_norm


# ------------------------------------------------------------------------------------------ server

REF = "||w_0||"  # how a rejection names the bound's reference (the messenger's norm at the run's start)


def check_upload(up: Upload, state: ServerState, copy: ServerCopy) -> str | None:
    """Why the server must not apply this upload, or None. Shapes/finiteness are the wire layer's job
    too, but the server checks again: a bad upload never touches global state."""
    if up.round != state.round:
        return f"late: computed in round {up.round}, the server is in round {state.round}"
    if up.resync_request:
        return "resync requested"
    if up.base_version != copy.version:
        return f"stale: computed from c_i version {up.base_version}, the server holds version {copy.version}"
    if up.dc is None:
        return "no consensus increment"
    if up.dc.keys() != state.messenger.keys():
        return "consensus increment keys do not match the messenger"
    for k, v in up.dc.items():
        ref = state.messenger[k]
        if v.shape != ref.shape or v.dtype != ref.dtype:
            return f"consensus increment {k!r} is {tuple(v.shape)} {v.dtype}, expected {tuple(ref.shape)} {ref.dtype}"
        if not torch.isfinite(v).all():
            return f"consensus increment {k!r} is not finite"
    return None


def server_update(cfg: CidersConfig, state: ServerState, uploads: Sequence[Upload],
                  copies: dict[str, ServerCopy], sizes: Mapping[str, int], max_step_ratio: float | None = None,
                  priv: Privacy = Privacy()) -> tuple[ServerState, dict[str, ServerCopy], dict]:
    """Eq. 11 per accepted upload, then Eq. 12 (or SCAFFOLD's rule for c over the N = len(sizes)
    registered clients). `copies` holds the server's ServerCopy of every client with an upload (the
    engine loads them from its store); returns the updated ones. `sizes` are the registered |D_i| (the
    weights p_i; a client not in it is rejected). An upload whose implied local step K eta_bar Delta_i
    fails `core.aggregate.step_check` is rejected; if the aggregate is not finite, the whole round is
    rejected: messenger, c and every copy stay as they were (the clients drop their pending increments).
    With algorithm.server_optimizer set, Eq. 12's messenger step goes through that optimizer (`_server_step`); its
    state advances only in a round whose aggregate is applied. algorithm.aggregator median / trimmed_mean puts
    that unweighted robust centre of the Delta_i in place of sum_i p_i Delta_i, for the messenger and for c
    (`_aggregate`); Eq. 11 and the copies of c_i do not change. Central DP (`priv.central_sigma`) adds
    N(0, (sigma / m)^2) to the mean of the m accepted updates (`central_noise`). The step bound is
    max_step_ratio x max(||w_0||, 1), with ||w_0|| = state.ref_norm (`with_ref`), never the current ||w||."""
    state = with_ref(state)
    lrs, _, gamma = round_schedule(cfg, state.round, state.total_rounds)
    eta_bar = sum(lrs) / cfg.local_steps
    new_copies = dict(copies)
    accepted: list[tuple[Upload, State]] = []
    rejected: dict[str, str] = {}
    for up in uploads:
        cp = new_copies.get(up.client_id)  # the caller loads a copy for every registered uploader
        why = _reject_reason(up, state, cp, sizes, accepted)
        delta = None
        if why is None:
            delta = cs.reconstruct(up.dc, cp.c_i, state.c, cfg.alpha, gamma)  # Eq. 11
            why = clip_check(delta, priv) or agg.step_check(
                {k: v * (cfg.local_steps * eta_bar) for k, v in delta.items()}, state.ref_norm, max_step_ratio, REF)
        if why is not None:
            rejected[up.client_id] = why
            if cp is not None and up.resync_request and up.round == state.round:
                new_copies[up.client_id] = replace(cp, needs_resync=True)
            continue
        new_copies[up.client_id] = ServerCopy(_commit(cp.c_i, up.dc), cp.version + 1, needs_resync=False,
                                              applied=(up.round, digest(up.dc)))
        accepted.append((up, delta))
    metrics = {"round": state.round, "gamma": gamma, "accepted": [u.client_id for u, _ in accepted],
               "rejected": rejected}
    if cfg.aggregator != "mean":  # recorded only when set, so a mean run's records stay as they were
        metrics["aggregator"] = cfg.aggregator
    if not accepted:
        return replace(state, round=state.round + 1), new_copies, {**metrics, "delta_bar_norm": 0.0,
                                                                    "c_norm": norm(state.c)}
    ids = [u.client_id for u, _ in accepted]
    p = agg.client_weights([sizes[i] for i in ids], uniform=cfg.weighting == "uniform")
    delta_bar = _aggregate(cfg, [d for _, d in accepted], p)  # sum_i p_i Delta_i, or a robust centre
    delta_bar = central_noise(delta_bar, priv, len(accepted))
    new, why = _checked_step(cfg, state, delta_bar, eta_bar, [u.dc for u, _ in accepted], len(sizes),
                             [new_copies[i].c_i for i in ids])
    if new is None:
        metrics.update({"accepted": [], "rejected": {**rejected, **{i: why for i in ids}}, "aggregate_rejected": ids})
        kept = {i: copies[i] for i in ids}
        return replace(state, round=state.round + 1), {**new_copies, **kept}, {**metrics, "delta_bar_norm": 0.0,
                                                                               "c_norm": norm(state.c)}
    metrics.update({"p": dict(zip(ids, p)), "delta_bar_norm": norm(delta_bar), "c_norm": norm(new.c)})
    return new, new_copies, metrics


def _aggregate(cfg: CidersConfig, deltas: Sequence[State], p: Sequence[float]) -> State:
    """Delta-bar of Eq. 12 from the accepted Delta_i: mean = sum_i p_i Delta_i (weighted); median and
    trimmed_mean are per coordinate and unweighted (`core.aggregate.coordinate_median` / `trimmed_mean`,
    docs/method.md#robust-aggregation)."""
    if cfg.aggregator == "median":
        return agg.coordinate_median(deltas)
    if cfg.aggregator == "trimmed_mean":
        return agg.trimmed_mean(deltas, cfg.trim_fraction)
    return agg.weighted_sum(deltas, p)


CLIP_TOL = 1e-3  # relative slack on ||Delta_i|| <= C: Eq. 11 recovers Delta_i up to float rounding, not exactly


def clip_check(delta: State, priv: Privacy, what: str = "Delta_i") -> str | None:
    """Central DP's noise is scaled to the clipping norm C, so an update above C (a client that skipped
    clipping) would enter the mean unprotected and outweigh the rest: why it must be rejected, or None. The
    server sees the reconstructed Delta_i (Eq. 11), so it checks the client's clip instead of trusting it. A
    weighted mean of clipped updates is within C too (`secure_server_update` checks the sum's)."""
    if priv.clip is None or priv.local_std > 0:  # local mode: the client's own noise makes the norm exceed C
        return None
    n = norm(delta)
    if not n <= priv.clip * (1 + CLIP_TOL):
        return (f"{what} has norm {n:.4g}, above the clipping norm C = {priv.clip:.4g} (federation.dp.clip): "
                "the client did not clip its update")
    return None


def central_noise(delta_bar: State, priv: Privacy, m: int) -> State:
    """Central DP: Delta-bar + N(0, (sigma / m)^2) for the uniform mean of m clipped updates (the sum's noise
    is N(0, sigma^2) with sigma = z C); `delta_bar` itself without noise."""
    if priv.central_sigma <= 0:
        return delta_bar
    from ciders.core import privacy as dp

    return dp.add_noise(delta_bar, priv.central_sigma / m, dp.noise_generator(priv.seed, "cpu"))


NOT_FINITE = "the round's aggregate is not finite: the round is rejected, the state stays as it was"


def _checked_step(cfg: CidersConfig, state: ServerState, delta_bar: State, eta_bar: float, dcs: Sequence[State],
                  n_registered: int, also: Sequence[State] = ()) -> tuple[ServerState | None, str | None]:
    """Eq. 12 from Delta-bar, the one checked core of both server rules (`server_update`, `secure_server_update`):
    the new messenger (through the server optimizer, if any) and c (or SCAFFOLD's c + (1/N) sum_i dc_i over the N
    registered clients), as the next round's state; or (None, why) when any of it, the optimizer state or the
    states in `also` (the clients' new c_i copies) is not finite, and the round must leave the state as it was."""
    messenger, opt = _server_step(cfg, state, delta_bar, eta_bar)  # Eq. 12 (then the server optimizer, if any)
    if cfg.consensus_update == "scaffold":
        c = cs.scaffold_consensus(state.c, dcs, n_registered)
    else:
        c = cs.server_consensus(state.c, delta_bar, cfg.alpha)  # Eq. 12
    opt_tensors = [] if opt is None or opt is state.opt else opt.tensors()
    if not agg.all_finite(messenger, c, *opt_tensors, *also):
        return None, NOT_FINITE
    return ServerState(state.round + 1, state.total_rounds, messenger, c, opt, state.ref_norm), None


def secure_server_update(cfg: CidersConfig, state: ServerState, delta_sum: State | None, weight_sum: float,
                         included: Sequence[str], copies: dict[str, ServerCopy], n_registered: int,
                         dc_sum: State | None = None, max_step_ratio: float | None = None, priv: Privacy = Privacy(),
                         why_not: str | None = None) -> tuple[ServerState, dict[str, ServerCopy], dict]:
    """Eq. 12 from what secure aggregation gives the server: delta_sum = sum_{i in U} n_i Delta_i over the
    clients U whose masked uploads entered the sum (n_i the integer weights the server sent and each client
    checked: 1 or |D_i|), weight_sum = sum_{i in U} n_i, so Delta-bar = delta_sum / weight_sum = sum_i p_i
    Delta_i with p_i = n_i / sum_U n_j, as in
    `server_update`; dc_sum = sum_U dc_i for SCAFFOLD's rule. No Delta_i is seen, so no per-client check runs:
    the implied step K eta_bar Delta-bar must pass `core.aggregate.step_check` (a convex combination of steps
    that all pass does) and be finite, else the round is rejected and the state stays. `copies` holds each
    client's version only (no c_i); an included client's version moves and names the round (`SECAGG_ACK`).
    `why_not`: the sum could not be formed (too few clients, a secret not rebuilt): no update. The bound is
    relative to ||w_0|| (state.ref_norm), as in `server_update`."""
    state = with_ref(state)
    lrs, _, gamma = round_schedule(cfg, state.round, state.total_rounds)
    eta_bar = sum(lrs) / cfg.local_steps
    metrics = {"round": state.round, "gamma": gamma, "secure": True}
    skip = replace(state, round=state.round + 1)
    if why_not is None and (not included or delta_sum is None):
        why_not = "no masked upload entered the sum"
    if why_not is None:
        mean = {k: v / weight_sum for k, v in delta_sum.items()}
        why_not = clip_check(mean, priv, "the unmasked mean of the updates")
    if why_not is None:
        delta_bar = central_noise(mean, priv, len(included))
        why_not = agg.step_check({k: v * (cfg.local_steps * eta_bar) for k, v in delta_bar.items()}, state.ref_norm,
                                 max_step_ratio, REF)
    if why_not is None:
        new, why_not = _checked_step(cfg, state, delta_bar, eta_bar, [] if dc_sum is None else [dc_sum], n_registered)
    if why_not is not None:
        return skip, dict(copies), {**metrics, "accepted": [], "rejected": {"sum": why_not}, "delta_bar_norm": 0.0,
                                    "c_norm": norm(state.c)}
    new_copies = dict(copies)
    for cid in included:
        cp = copies[cid]
        new_copies[cid] = ServerCopy(cp.c_i, cp.version + 1, needs_resync=False, applied=(state.round, SECAGG_ACK))
    metrics.update({"accepted": sorted(included), "rejected": {}, "delta_bar_norm": norm(delta_bar),
                    "c_norm": norm(new.c)})
    return new, new_copies, metrics


def _server_step(cfg: CidersConfig, state: ServerState, delta_bar: State, eta_bar: float
                 ) -> tuple[State, so.ServerOptState | None]:
    """The new messenger and server-optimizer state. server_optimizer none: Eq. 12 as it is, and the state (if a
    checkpoint holds one) carried unchanged. Otherwise Eq. 12's step d = -tau K eta_bar sum_i p_i Delta_i (the
    term `server_messenger` adds to w, computed the same way, so w + d is bit for bit its result) goes through
    `core.server_opt.update` (docs/method.md#server-optimizers)."""
    opt = so.from_config(cfg)
    if opt is None:
        return cs.server_messenger(state.messenger, delta_bar, cfg.tau, cfg.local_steps, eta_bar), state.opt
    d = {k: v * (-cfg.tau * cfg.local_steps * eta_bar) for k, v in delta_bar.items()}
    return so.update(opt, state.messenger, d, state.opt)


def _reject_reason(up: Upload, state: ServerState, cp: ServerCopy | None, sizes: Mapping[str, int],
                   accepted: list) -> str | None:
    if up.client_id not in sizes or cp is None:
        return "not a registered client"
    if any(u.client_id == up.client_id for u, _ in accepted):
        return "duplicate: already applied this round"
    return check_upload(up, state, cp)
