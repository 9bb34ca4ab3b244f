"""The edge client's task (a Flower ClientApp; docs/edge.md): AdapEmu built from what the server sent
(`models.edge`: the edge spec at first contact, the emulator weights in the first broadcast), the client's
own data, the messenger loss. It never loads `model.name`: an edge device holds no full model.

State directory layout (the node's `state-dir`):
  edge/      the edge spec and, after the first round, model.safetensors: AdapEmu's base as an HF model; also
             the experiment's config (experiment.yaml) and the last student LoRA received (student.safetensors),
             so that the node can export its personalized model by itself (`node_model`, `ciders export NODE`)
  store/     the client's round records (c_i, version, pending increment, personalized messenger)
  static/    components sent once besides the emulator (the student LoRA under FedOT / LocalOT)

Data: `data_file` (the node's `data-file`) is the client's own file, in any format the tasks read, split
into a training part and a held-out head (`federation.holdout`); without it the client cuts its partition
out of the experiment's data as the in-process engine does (simulation and benchmarks).
"""

from __future__ import annotations

import json
from pathlib import Path

from ciders.config import ExperimentConfig
from ciders.core.wire import PayloadError
from ciders.errors import CidersError
from ciders.models import edge as me
from ciders.models import edge_spec as es
from ciders.models.edge_guard import bound_chat_template
from ciders.models.messenger_loss import MessengerLoss, step_compute_dtype
from ciders.models.split import split_layers
from ciders.federation.ciders_client import StaticHolder
from ciders.fileio import write_text
from ciders.runtime import DTYPES, resolve_device, resolve_dtype
from ciders.workloads.client_side import ClientSide

NODE_CONFIG, NODE_STUDENT = "experiment.yaml", "student.safetensors"  # in edge/


def _edge_model(cfg: ExperimentConfig, edge: Path, meta: dict, plain: bool = False):
    """AdapEmu from the node's edge directory (models.edge), with the experiment's LoRA: (decomposition,
    tokenizer with a pad token, whether the emulator weights are real). `plain`: an int8 emulator dequantized
    before the LoRA goes on (for an export: merging LoRA into torchao weights is not supported)."""
    from transformers import AutoTokenizer

    dev = resolve_device(cfg.model.device)
    quantize = quantize_of(cfg, meta)
    model, loaded = me.load_edge(edge, dev, resolve_dtype(cfg.model.dtype, dev), cfg.model.attn_implementation,
                                 quantize=quantize)
    if plain and quantize != "none":
        from ciders.models.edge_quant import dequantize_

        dequantize_(model)
    d = me.edge_decompose(model, es.split_of(meta), cfg.lora.messenger, cfg.lora.student, cfg.seed, meta.get("model"))
    # the chat template is the server's code: every render is bounded (a hostile loop is an error, not a hang)
    tok = bound_chat_template(AutoTokenizer.from_pretrained(str(edge)))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return d, tok, loaded


def quantize_of(cfg: ExperimentConfig, meta: dict) -> str:
    """The emulator's quantization: the experiment's, which the spec must state too (a spec from another
    setting would make the client check its download against the wrong layout)."""
    mode = cfg.federation.emulator_quantize
    if meta.get("quantize", "none") != mode:
        raise PayloadError(f"the edge spec says the emulator is quantized as {str(meta.get('quantize'))[:16]!r}, the "
                           f"experiment's federation.emulator_quantize is {mode!r}")
    return mode


def node_model(state: str | Path):
    """What a node needs to export its personalized model by itself (`ciders export NODE_STATE_DIR`), with no
    full model and no server: (EdgeDecomposition with the last student LoRA received loaded, tokenizer,
    the experiment config, the personalized messenger, client id, the round of its record)."""
    from safetensors.torch import load_file

    from ciders.federation import codec
    from ciders.config import loads_config
    from ciders.core.store import RoundStore

    state = Path(state)
    edge = state / "edge"
    for need, what in ((edge / es.WEIGHTS, "emulator weights"), (edge / NODE_CONFIG, "experiment config"),
                       (edge / NODE_STUDENT, "student LoRA")):
        if not need.is_file():
            raise CidersError(f"{state}: this node holds no {what} yet ({need} is missing): it exports after "
                              "its first trained round")
    cfg = loads_config((edge / NODE_CONFIG).read_text(encoding="utf-8"), str(edge / NODE_CONFIG))
    keys = sorted(p.name for p in (state / "store").iterdir() if p.is_dir()) if (state / "store").is_dir() else []
    if len(keys) != 1:
        raise CidersError(f"{state}/store: expected one client's records, found {keys or 'none'}")
    cid = keys[0]
    store = RoundStore(state / "store")
    rounds = store.rounds(cid)
    store = RoundStore(state / "store", rounds[-1] if rounds else -1)  # its newest record, committed or not
    rec = store.get(cid)
    st = codec.client_from_record(*rec) if rec else None
    if st is None or st.personalized is None:
        raise CidersError(f"{state}: {cid} keeps no personalized messenger (algorithm {cfg.algorithm.name})")
    d, tok, _ = _edge_model(cfg, edge, json.loads((edge / es.META).read_text(encoding="utf-8")), plain=True)
    d.load_student(load_file(str(edge / NODE_STUDENT)))
    return d, tok, cfg, st.personalized, cid, rounds[-1]


class EdgeTask(ClientSide):
    def __init__(self, cfg: ExperimentConfig, state: str | Path, cid: str, data_file: str | Path | None = None,
                 log=print):
        from ciders.config import dump_yaml

        self.cfg, self.cid, self.log = cfg, cid, log
        self.edge_dir = Path(state) / "edge"
        if not es.held_digest(self.edge_dir):
            raise PayloadError(f"{cid} holds no edge spec ({self.edge_dir}); the server sends it at first contact")
        text = dump_yaml(cfg)
        held = self.edge_dir / NODE_CONFIG
        if not held.is_file() or held.read_text(encoding="utf-8") != text:
            write_text(held, text)
        meta = json.loads((self.edge_dir / es.META).read_text(encoding="utf-8"))
        self.wire_dtype = DTYPES.get(str(meta.get("emulator_dtype")))  # the emulator's download dtype
        self.quantize = quantize_of(cfg, meta)
        self._quant_ref = None  # (reference tensors, torchao metadata) of a quantized download
        split = es.split_of(meta)
        mine = split_layers(split.n_layers, cfg.decomposition.messenger_layers, **cfg.decomposition.split_kwargs())
        if mine != split:
            raise CidersError(f"the edge spec's split {split} is not the experiment's {mine}")
        self.d, self.tok, self.loaded = _edge_model(cfg, self.edge_dir, meta)
        self.pad = self.tok.pad_token_id
        nodes = cfg.federation.partition == "nodes"
        if nodes != bool(data_file):
            raise CidersError(f"{cid}: this node has {'a' if data_file else 'no'} data-file and the experiment's "
                              f"federation.partition is {cfg.federation.partition}; a node brings its own data "
                              "(--data-file) exactly when federation.partition=nodes")
        self.train = {cid: self._data(Path(data_file)) if data_file else self._partition()}
        a = cfg.algorithm
        self.loss = MessengerLoss(self.d, compute_dtype=step_compute_dtype(a.metagrad, a.hvp, self.d.base.dtype))
        self._hidden: dict = {}

    def _partition(self) -> list[dict]:
        from ciders.tasks import federated

        data = federated.build(self.cfg, self.tok)
        if self.cid not in data.train:
            raise CidersError(f"this node hosts {self.cid}, but the run has clients {', '.join(sorted(data.train))}; "
                              "check its partition-id")
        return data.train[self.cid]

    def _data(self, path: Path) -> list[dict]:
        from ciders.tasks.federated import tokenize_clients
        from ciders.tasks.sources import data_kw, load_examples

        dc = self.cfg.data
        ex, _ = load_examples(str(path), dc.format, dc.clients_limit, **data_kw(dc))
        fed = self.cfg.federation
        train, *_ = tokenize_clients([ex], [], self.tok, dc.max_length, fed.holdout, fed.validation)
        return train["client0"]  # its held-out head and validation part are left out of training

    def downlink_reference(self) -> dict:
        """As `ClientSide`'s, with the emulator in the dtype the spec says it travels in."""
        ref = super().downlink_reference()
        if self.quantize != "none":
            ref["emulator"] = self._quantized_reference()[0]
        elif self.wire_dtype is not None:
            ref["emulator"] = {k: v.to(self.wire_dtype) for k, v in ref["emulator"].items()}
        return ref

    def _quantized_reference(self) -> tuple[dict, dict]:
        if self._quant_ref is None:  # from the spec's config.json alone (models.edge_quant.reference)
            from ciders.models import edge_quant as eq

            config = json.loads((self.edge_dir / "config.json").read_text(encoding="utf-8"))
            self._quant_ref = eq.reference(config, self.quantize, self.d.base.dtype)
        return self._quant_ref

    def static_extra(self) -> set[str]:
        """The once-sent components the client round keeps in `static/`: the student LoRA when it is fixed
        (no per-round TAKD). The emulator is this task's own: it becomes edge/model.safetensors."""
        return {"student"} if self.cfg.takd.round_steps == 0 else set()

    def begin_round(self, t: int, downlink_extra: dict) -> None:
        if "emulator" in downlink_extra and self.quantize != "none":  # first contact, quantized: as received
            from ciders.models import edge_quant as eq

            _, metadata = self._quantized_reference()
            eq.load_into(me.plain_names(self.d.emulator_base_params()), downlink_extra["emulator"], metadata)
            self.loss.reset_head()
            eq.save_quantized(self.edge_dir / es.WEIGHTS, downlink_extra["emulator"], metadata)
            self.loaded = True
        elif "emulator" in downlink_extra:  # first contact: load, then keep as the edge model's weights
            self.d.load_emulator_base(downlink_extra["emulator"])
            me.save_edge_weights(self.d, self.edge_dir, self.wire_dtype)
            self.loaded = True
        elif not self.loaded:
            raise PayloadError(f"{self.cid} does not hold the emulator weights ({self.edge_dir / es.WEIGHTS} is "
                               "missing); they are sent again after this failed round")
        if "student" in downlink_extra:
            self.d.load_student(downlink_extra["student"])
            StaticHolder(self.edge_dir).save("student", self.d.student_state())  # NODE_STUDENT, for an export
        self._hidden.clear()  # B_L may have changed
        self.d.messenger_top.train()  # LoRA dropout during client steps
