"""A quantized emulator (federation.emulator_quantize: int8; models.edge_quant): the server sends int8 weights with
a scale per row, the edge client checks them against its own skeleton, holds them quantized (never the emulator in
the model's dtype), stores them with its own torchao metadata and loads them memory-mapped in a new process; its
losses stay close to the unquantized client's, and the client trains the messenger's LoRA on top."""

import copy
from types import SimpleNamespace

import pytest
import torch

from ciders.config import load_config
from ciders.core import wire
from ciders.core.wire import PayloadError
from ciders.errors import ConfigError
from ciders.models import edge_quant as eq
from ciders.models.edge_spec import WEIGHTS, write_spec
from ciders.workloads.edge import EdgeTask
from ciders.workloads.llm import LLMTask
from helpers import edge_task_args

SLICE, BASE = edge_task_args()
Q = BASE + ["federation.emulator_quantize=int8"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = load_config(None, Q)
    s = LLMTask(cfg, tmp_path_factory.mktemp("server"), log=lambda s: None, edge_quantize="int8")
    return cfg, s, s.downlink_extra(SimpleNamespace(student=s.d.student_state()))


def _node(server, tmp_path):
    cfg, s, extra = server
    write_spec(tmp_path / "node" / "edge", s.edge_spec())
    return EdgeTask(cfg, tmp_path / "node", "client1")


def _is_quantized(p) -> bool:
    return type(p).__name__ in ("Int8Tensor", "IntxUnpackedToInt8Tensor")


def test_the_download_is_int8_with_a_scale_per_row_and_a_quarter_of_fp32(server):
    cfg, s, extra = server
    emu, full = extra["emulator"], s.d.emulator_base_state()
    q = {k: v for k, v in emu.items() if k.endswith("_weight_qdata")}
    assert q and all(v.dtype == torch.int8 for v in q.values())
    two_d = [k for k, v in full.items() if v.dim() == 2]
    assert len(q) == len(two_d)  # every matrix (embedding included), no norm
    w = full["model.layers.0.self_attn.q_proj.base_layer.weight"]
    qd, sc = emu["model.layers.0.self_attn.q_proj._weight_qdata"], emu["model.layers.0.self_attn.q_proj._weight_scale"]
    assert sc.shape == (w.shape[0], 1)
    assert torch.allclose(qd.float() * sc, w, atol=float(sc.max()) * 0.51)  # round to nearest, per row
    assert qd.abs().amax() == 127 and not torch.equal(qd.float() * sc, w)  # symmetric, and lossy
    nbytes = sum(v.numel() * v.element_size() for v in emu.values())
    assert nbytes < 0.3 * sum(v.numel() * 4 for v in full.values())


def test_the_client_holds_int8_checks_the_download_and_matches_the_unquantized_loss(server, tmp_path):
    cfg, s, extra = server
    task = _node(server, tmp_path)
    assert not task.loaded
    base = task.d.emulator_base_params()
    assert all(_is_quantized(p) for k, p in base.items() if p.dim() == 2)  # the placeholder is int8 already
    msg = {k: torch.randn_like(v) * 0.1 for k, v in s.initial_messenger().items()}
    task.loss(msg, task.batches("client1", 0, 2, cfg.seed)[0])  # on the placeholder: its dequantized head cached
    wire.check(extra["emulator"], task.downlink_reference()["emulator"], "emulator")
    with pytest.raises(PayloadError):  # the plain weights are not what a quantized client accepts
        wire.check(s.d.emulator_base_state(), task.downlink_reference()["emulator"], "emulator")
    task.begin_round(0, {"emulator": extra["emulator"], "student": extra["student"]})
    s.begin_round(0, {"student": extra["student"]})
    assert task.loaded and (tmp_path / "node" / "edge" / WEIGHTS).is_file()
    a, b = s.batches("client1", 0, 2, cfg.seed)[0], task.batches("client1", 0, 2, cfg.seed)[0]
    la, lb = float(s.loss(msg, a)), float(task.loss(msg, b))
    assert la != lb and abs(la - lb) < 0.02 * abs(la)  # int8 per row: close, not equal
    again = EdgeTask(cfg, tmp_path / "node", "client1")  # a new process: the stored int8 file, memory-mapped
    assert again.loaded and all(_is_quantized(p) for p in again.d.emulator_base_params().values() if p.dim() == 2)
    again.begin_round(1, {"student": extra["student"]})
    assert torch.equal(again.loss(msg, again.batches("client1", 0, 2, cfg.seed)[0]), task.loss(msg, b))


def test_the_messenger_lora_trains_on_the_int8_base(server, tmp_path):
    cfg, s, extra = server
    task = _node(server, tmp_path)
    task.begin_round(0, {"emulator": extra["emulator"], "student": extra["student"]})
    params = {k: v.clone().requires_grad_(True) for k, v in task.initial_messenger().items()}
    batch = task.batches("client1", 0, 1, cfg.seed)[0]
    grads = torch.autograd.grad(task.loss(params, batch), list(params.values()))
    assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_a_stored_file_unlike_the_skeleton_is_refused(server, tmp_path):
    cfg, s, extra = server
    task = _node(server, tmp_path)
    bad = dict(extra["emulator"])
    k = next(k for k in bad if k.endswith("_weight_scale"))
    bad[k] = bad[k][:-1]  # a row short
    _, metadata = eq.reference(s.d.adapemu.config.to_dict(), "int8", torch.float32)
    eq.save_quantized(tmp_path / "node" / "edge" / WEIGHTS, bad, metadata)
    with pytest.raises(PayloadError, match="does not hold the quantized emulator"):
        EdgeTask(cfg, tmp_path / "node", "client1")
    del task


def test_the_spec_and_the_experiment_must_agree_and_dtypes_are_checked(server, tmp_path):
    cfg, s, extra = server
    plain = load_config(None, BASE)
    write_spec(tmp_path / "node" / "edge", s.edge_spec())
    with pytest.raises(PayloadError, match="emulator_quantize"):
        EdgeTask(plain, tmp_path / "node", "client1")
    with pytest.raises(ConfigError, match="emulator_dtype: model"):
        load_config(None, Q + ["federation.emulator_dtype=bfloat16"])


def test_the_quantization_is_torchaos_own(server):
    """quantize_state equals torchao's quantize_ on the plain model (the same tensors), so a model transformers
    quantizes with ao_config loads what we send."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from torchao.quantization import quantize_

    cfg, s, extra = server
    conf = s.d.adapemu.config
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(copy.deepcopy(conf))
    m.load_state_dict({k.replace(".base_layer.", "."): v for k, v in s.d.emulator_base_state().items()}, strict=False)
    fqn = eq.ao_config("int8").quant_type.fqn_to_config
    quantize_(m, fqn["re:.+"], filter_fn=lambda mod, name: isinstance(mod, torch.nn.Linear) and name != "lm_head")
    quantize_(m, fqn["model.embed_tokens"], filter_fn=lambda mod, name: name == "model.embed_tokens")
    names = [n for n, _ in m.named_parameters() if n != "lm_head.weight" or not conf.tie_word_embeddings]
    flat, _ = flatten_tensor_state_dict({n: p.data for n, p in m.named_parameters() if n in names})
    sent = extra["emulator"]
    assert flat.keys() == sent.keys() and all(torch.equal(flat[k], sent[k]) for k in flat)


def test_an_int8_node_exports_its_personalized_model_by_itself(server, tmp_path, capsys):
    """`ciders export NODE_STATE_DIR` on a node holding the int8 emulator: the export is the model the node runs,
    its int8 weights dequantized (LoRA merged), i.e. the server-side export of the same adapters on the
    dequantized emulator, and it is a plain model (no torchao tensor in the file)."""
    from safetensors.torch import load_file

    from ciders.algorithms import ciders as alg
    from ciders.cli import main
    from ciders.core.store import RoundStore
    from ciders.federation import codec
    from ciders.models.export import export_edge_model

    cfg, s, extra = server
    task = _node(server, tmp_path)
    task.begin_round(0, {"emulator": extra["emulator"], "student": extra["student"]})
    torch.manual_seed(1)
    mine = {k: torch.randn_like(v) * 0.1 for k, v in s.initial_messenger().items()}
    c0 = {k: torch.zeros_like(v) for k, v in mine.items()}
    RoundStore(tmp_path / "node" / "store").put("client1", 0,
                                                *codec.client_record(alg.ClientState("client1", c0, 0, None, mine)))
    assert main(["export", str(tmp_path / "node"), "--out", str(tmp_path / "out-node")]) == 0
    ref = copy.deepcopy(s.d)
    eq.dequantize_(task.d.adapemu)  # the node's weights, dequantized, onto the server's decomposition
    node = {k.replace(".base_layer.", "."): v for k, v in task.d.emulator_base_state().items()}
    ref.load_emulator_base({k: node[k.replace(".base_layer.", ".")] for k in ref.emulator_base_state()})
    export_edge_model(ref, tmp_path / "server", messenger=mine, student=extra["student"])
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("out-node", "server"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())
    assert "quantization_config" not in (tmp_path / "out-node" / "config.json").read_text()


def test_a_bfloat16_int8_client_with_fd_steps_computes_in_float32_close_to_the_server(tmp_path):
    """bfloat16 model, FD meta-gradient with FD Hessian-vector products: the messenger's evaluations run on float32
    copies of the base (`MessengerLoss.compute_dtype`), the int8 head's included, after the first download too."""
    args = [a for a in Q if a != "model.dtype=float32"] + ["model.dtype=bfloat16", "algorithm.metagrad=fd",
                                                           "algorithm.hvp=fd"]
    cfg = load_config(None, args)
    s = LLMTask(cfg, tmp_path / "server", log=lambda s: None, edge_quantize="int8")
    extra = s.downlink_extra(SimpleNamespace(student=s.d.student_state()))
    write_spec(tmp_path / "node" / "edge", s.edge_spec())
    task = EdgeTask(cfg, tmp_path / "node", "client1")
    assert task.loss.compute_dtype == torch.float32
    msg = {k: (torch.randn_like(v.float()) * 0.1).to(v.dtype) for k, v in s.initial_messenger().items()}
    task.loss(msg, task.batches("client1", 0, 2, cfg.seed)[0])  # on the placeholder: its float32 copies made
    task.begin_round(0, {"emulator": extra["emulator"], "student": extra["student"]})
    s.begin_round(0, {"student": extra["student"]})
    la = float(s.loss(msg, s.batches("client1", 0, 2, cfg.seed)[0]))
    lb = float(task.loss(msg, task.batches("client1", 0, 2, cfg.seed)[0]))
    assert la != lb and abs(la - lb) < 0.02 * abs(la)
