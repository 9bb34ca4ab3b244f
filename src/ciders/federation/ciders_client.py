"""The client side of a CIDERS round (Algorithm 2's client block, docs/method.md): the only code a client runs,
in-process (`federation.ciders_loop`) or on a SuperNode (`transports.flower`).

`client_round` decodes the broadcast (validated against the client's own references), runs `client_update`
(Eq. 4-10) on the client's saved state, writes its new state to the client's store and returns the upload bytes
and its metrics record; `client_phase` adds secure aggregation's protocol phases (`federation.secure`);
`client_report` returns the personalized messenger the server's evaluation reads. `StaticHolder` keeps what a
client receives only once (e.g. a fixed B_L) across process restarts.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ciders.algorithms import ciders as alg
from ciders.config import ExperimentConfig
from ciders.core import wire
from ciders.core.store import RoundStore
from ciders.core.tensors import device_of
from ciders.core.wire import PayloadError
from ciders.federation import codec, dp, records
from ciders import phases as timing


class StaticHolder:
    """A client's durable copy of the components it receives only once (e.g. a fixed B_L), so that a
    restarted client process can still run later rounds. In-process clients share the server's model
    and need none."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def save(self, name: str, st: dict) -> None:
        from safetensors.torch import save_file

        from ciders.fileio import atomic_path

        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.root / f"{name}.safetensors") as tmp:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in st.items()}, str(tmp))

    def load(self, name: str, ref: dict, device) -> dict:
        from safetensors.torch import load_file

        p = self.root / f"{name}.safetensors"
        if not p.is_file():
            raise PayloadError(f"this client does not hold the static component {name!r} the server sent earlier "
                               f"({p} is missing); it is sent again after this failed round")
        st = {k: v.clone() for k, v in load_file(str(p)).items()}
        wire.check(st, ref, name)
        return {k: v.to(device) for k, v in st.items()}


def client_round(cfg: ExperimentConfig, task, store: RoundStore, cid: str, msg: bytes,
                 extra_ref: dict, held: StaticHolder | None = None) -> tuple[bytes, dict]:
    """The client side of one round: decode the broadcast (validated against the client's own
    references), run `client_update` on the client's saved state, write the new state to its store and
    return (upload bytes, metrics record). `extra_ref` holds the reference shapes of the task's downlink
    extras (e.g. the student LoRA). In a private mode the record is cut down (`records.private`)."""
    up, cm = client_train(cfg, task, store, cid, msg, extra_ref, held)
    upmsg = codec.encode_upload(up)[0] if cfg.algorithm.communicate else b""
    return upmsg, records.private(cm) if dp.private_records(cfg) else cm


def client_phase(phase: str, cfg: ExperimentConfig, task, store: RoundStore, cid: str, msg: bytes,
                 extra_ref: dict, held: StaticHolder | None = None, sessions=None) -> tuple[bytes, dict]:
    """Every CIDERS client phase but "report": train (plain, or secure with the protocol phases of
    `federation.secure`, whose secrets live in `sessions`, the client's own `secure.Sessions`)."""
    if not cfg.federation.secure_aggregation:
        if phase != "train":
            raise PayloadError(f"{cid}: phase {phase!r} without federation.secure_aggregation")
        return client_round(cfg, task, store, cid, msg, extra_ref, held)
    from ciders.federation import secure

    weight = secure.own_weight(cfg, task.clients()[cid]) if phase == "train" else None  # checked, not taken
    return secure.client_phase(phase, cfg, sessions, cid, msg,
                               train=lambda inner: client_train(cfg, task, store, cid, inner, extra_ref, held),
                               weight=weight)


def client_train(cfg: ExperimentConfig, task, store: RoundStore, cid: str, msg: bytes, extra_ref: dict,
                 held: StaticHolder | None = None) -> tuple[alg.Upload, dict]:
    """`client_round` up to the upload: (the Upload, with Delta_i in `delta`, and the full metrics record)."""
    acfg = cfg.algorithm
    ref = task.initial_messenger()  # shapes / dtypes / device only
    ad = cfg.federation.adapter_dtype  # the messenger and student arrive in it; training runs in ref's dtype
    extra_ref = {k: codec.wire_dtype(v, ad) if k in codec.ADAPTERS else v for k, v in extra_ref.items()}
    b, extra = codec.decode_broadcast(msg, ref, extra_ref, device=device_of(ref),
                                      messenger_wire=codec.wire_dtype(ref, ad))
    b = replace(b, messenger={k: v.to(ref[k].dtype) for k, v in b.messenger.items()})
    if held is not None:
        for name in getattr(task, "static_extra", lambda: ())():
            if name in extra:
                held.save(name, extra[name])
            else:
                extra[name] = held.load(name, extra_ref[name], device_of(ref))
    task.begin_round(b.round, extra)
    rec = store.get(cid)
    state = _on_device(None if rec is None else codec.client_from_record(*rec), cid, ref)
    with timing.phase("client steps"):  # B_L(x) for the round's batches and the K steps
        batches = task.batches(cid, b.round, acfg.local_steps * acfg.grad_accum, cfg.seed)
        up, state, cm = alg.client_update(acfg, b, state, task.loss_fn(cid), batches,
                                          dp.client_privacy(cfg, b.round, cid))
    store.put(cid, b.round, *codec.client_record(state))
    return up, cm


def client_report(store: RoundStore, cid: str) -> bytes:
    """The client side of a "report": its personalized messenger x_K of its last participation (none if
    it never trained or keeps none) as wire bytes."""
    rec = store.get(cid)
    pers = codec.client_from_record(*rec).personalized if rec else None
    return wire.encode({"personalized": pers}, {"client_id": cid})[0]  # a None component is left out


def _on_device(s: alg.ClientState | None, cid: str, ref: dict) -> alg.ClientState:
    """A client's saved state on the messenger's device (a fresh one if it never trained)."""
    if s is None:
        return alg.init_client(cid, ref)
    dev = device_of(ref)

    def mv(st):
        return None if st is None else {k: v.to(dev) for k, v in st.items()}

    pending = None if s.pending is None else alg.Pending(mv(s.pending.dc), s.pending.base_version, s.pending.round)
    return alg.ClientState(s.client_id, mv(s.c_i), s.version, pending, mv(s.personalized))
