import json

import pytest

from ciders.cli import main
from ciders.errors import CidersError
from ciders.models.adapters import count_params
from ciders.models.decompose import decompose
from ciders.models.load import load_model
from ciders.models.plan import make_plan
from conftest import FIXTURES

QWEN25_3B = str(FIXTURES / "configs" / "qwen2.5-3b" / "config.json")
QWEN2_15B = str(FIXTURES / "configs" / "qwen2-1.5b")  # a directory works too


@pytest.mark.parametrize(
    "model, layers, student, msg_params, stu_params, mib, per_direction",
    [
        # Table II; Table VI per-direction messenger + consensus MiB
        # (docs/method.md#algorithm-1-model-decomposition-modelprep)
        (QWEN25_3B, (36, 30), 24, 1_247_232, 4_988_928, 4.76, 9.516),
        (QWEN2_15B, (28, 22), 18, 989_184, 2_967_552, 3.77, 7.547),
    ],
)
def test_table_ii_figures(model, layers, student, msg_params, stu_params, mib, per_direction):
    p = make_plan(model, 6, drop_ratio=0.2, upload_personalized_messenger=True)
    assert (p.n_layers, p.teacher_layers) == layers
    assert p.student_layers == student and len(p.student_indices) == student
    assert p.messenger_lora_params == msg_params and p.messenger_lora_tensors == 84
    assert p.student_lora_params == stu_params
    assert round(p.consensus_mib, 2) == mib
    assert round(p.downlink_mib["messenger"] + p.downlink_mib["consensus"], 3) == per_direction
    assert round(p.uplink_mib["total"], 3) == per_direction
    assert p.edge_base_dtype == "bfloat16"


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_plan_counts_equal_the_injected_adapters(name):
    p = make_plan(name, 2, drop_ratio=0.5)
    d = decompose(load_model(name), 2, drop_ratio=0.5)
    assert p.messenger_lora_params == count_params(d.messenger_state())
    assert p.messenger_lora_tensors == len(d.messenger_state())
    assert p.student_lora_params == count_params(d.student_state())
    assert p.student_indices == list(d.split.student_indices)
    lora = {id(q) for q in list(d.student_params().values()) + list(d.messenger_params().values())}
    own = {id(q) for q in d.adapemu.parameters()} - lora
    assert p.edge_base_params == sum(q.numel() for q in d.adapemu.parameters() if id(q) in own)
    # the bfloat16 first download (federation.emulator_dtype) is what the server would send
    sent = sum(v.numel() * 2 for v in d.emulator_base_state().values()) / 2**20
    assert p.edge_base_mib_16 == pytest.approx(sent, rel=1e-12) and p.edge_base_mib == pytest.approx(2 * sent)
    # and the int8 one (federation.emulator_quantize): the bytes models.edge_quant sends, exactly
    from ciders.models import edge_quant

    plain = {k.replace(".base_layer.", "."): v for k, v in d.emulator_base_state().items()}
    q = edge_quant.quantize_state(d.adapemu.config.to_dict(), plain, "int8")
    assert p.edge_base_mib_int8 == pytest.approx(sum(v.numel() * v.element_size() for v in q.values()) / 2**20,
                                                 rel=1e-12)


def test_cli_plan_json_and_text(capsys):
    assert main(["plan", QWEN25_3B, "--messenger-layers", "6", "--drop-ratio", "0.2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("n_layers", "teacher_layers", "student_layers", "student_indices", "messenger_lora_params",
                "messenger_lora_tensors", "student_lora_params", "consensus_mib", "downlink_mib", "uplink_mib"):
        assert key in out
    assert out["messenger_lora_params"] == 1_247_232
    assert main(["plan", QWEN25_3B, "-a", "6", "--drop-ratio", "0.2"]) == 0
    text = capsys.readouterr().out
    assert "1,247,232 params" in text and "84 tensors" in text and "4.76 MiB" in text


def test_plan_rejects_bad_input(tmp_path, capsys):
    assert main(["plan", QWEN25_3B, "-a", "36"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ciders: error: messenger_layers") and "\n" not in err
    assert main(["plan", QWEN25_3B, "-a", "6", "--beta", "1.5"]) == 2
    assert "beta: must be in (0, 1]" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(CidersError, match="not a JSON model config"):
        make_plan(str(bad), 2)
    with pytest.raises(CidersError, match="LoRA targets"):
        from ciders.config import LoraConfig

        make_plan("tiny-llama", 2, messenger_lora=LoraConfig(targets=("nope",)))


# ---- peak training memory (`ciders plan`'s memory model; README "Sizing machines")

def _bytes(tensors) -> int:
    """Bytes of distinct storages: a tensor that shares another's storage counts once."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_memory_terms_are_the_sizes_of_the_tensors_each_machine_holds():
    from ciders.core import optim
    from ciders.models.distill import TeacherCache
    from ciders.models.plan import Workload

    w = Workload(dtype="float32", batch_size=2, seq_len=32, takd_batch_size=2, public_examples=3, public_len=32)
    mem = make_plan("tiny-qwen2", 2, drop_ratio=0.5, workload=w).memory
    d = decompose(load_model("tiny-qwen2"), 2, drop_ratio=0.5)
    lora = list(d.messenger_state().values()) + list(d.student_state().values())
    lora_ids = {id(p) for p in list(d.messenger_params().values()) + list(d.student_params().values())}
    server_base = [p for m in (d.base, d.adapemu) for p in m.parameters() if id(p) not in lora_ids]
    mib = 2**20
    # B_L's layers are B_F's Parameters: the server holds M* once (a double count would add B_L's layers)
    assert mem["server"]["weights"] * mib == _bytes(server_base) == _bytes(d.base.parameters()) - _bytes(
        [p for p in d.base.parameters() if id(p) in lora_ids])
    assert mem["client"]["fo"]["weights"] * mib == _bytes(d.emulator_base_state().values())
    assert mem["client"]["fo"]["lora"] * mib == mem["server"]["lora"] * mib == _bytes(lora)
    # AdamW's m and v: the messenger's on the client, the student's in TAKD
    assert mem["client"]["fo"]["optimizer"] * mib == _bytes(optim.adamw_init(d.messenger_state()).m.values()) * 2
    assert mem["server"]["optimizer"] * mib == _bytes(optim.adamw_init(d.student_state()).v.values()) * 2
    feats = [{"input_ids": list(range(1, 33)), "labels": list(range(1, 33))}] * 3
    cache = TeacherCache.build(d, feats, pad_id=0, mode="memory")
    assert mem["server"]["teacher_cache"] * mib == _bytes([cache.gather([k], d.device) for k in range(3)])
    for part in (mem["client"]["fo"], mem["client"]["fd"], mem["server"]):
        assert part["total"] == pytest.approx(sum(v for k, v in part.items() if k != "total"))
    assert mem["client"]["fd"]["activations"] > mem["client"]["fo"]["activations"] > 0


def test_memory_teacher_cache_spills_to_disk_above_its_limit():
    from ciders.models.plan import Workload

    small = make_plan(QWEN2_15B, 6, workload=Workload(public_examples=10, cache_memory_mib=2048)).memory
    large = make_plan(QWEN2_15B, 6, workload=Workload(public_examples=10**5, cache_memory_mib=2048)).memory
    assert small["server"]["teacher_cache"] == pytest.approx(10 * 512 * 1536 * 2 / 2**20)  # bfloat16 checkpoint
    assert large["server"]["teacher_cache"] == 0.0


@pytest.mark.parametrize("step, dtype", [("fo", "float32"), ("fd", "float32"), ("takd", "float32"),
                                         ("fo", "bfloat16"), ("takd", "bfloat16")])
def test_predicted_activations_are_within_25_percent_of_the_tensors_a_step_holds(step, dtype):
    """The activation term against the tensor storage one real step allocates and holds at once (counted op by op,
    so allocator caching does not blur it), on a small random Qwen2 where activations dominate that storage."""
    import sys
    from dataclasses import replace

    import torch

    from ciders.models.load import config_from_dict
    from ciders.models.plan import Workload, _Shapes, _client_activations, _takd_activations
    from ciders.models.split import split_layers
    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import peak_tensor_mib

    from ciders.config import TAKDConfig, CidersConfig, LoraConfig
    from ciders.models.distill import TeacherCache, distill, init_state

    cfg = config_from_dict(dict(model_type="qwen2", vocab_size=2048, hidden_size=128, intermediate_size=384,
                                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=512, tie_word_embeddings=True))
    dt = getattr(torch, dtype)
    split = split_layers(6, 2, drop_ratio=0.5)
    B, T = 2, 128
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dt).eval()
    d = decompose(model, 2, drop_ratio=0.5, messenger_lora=LoraConfig(), student_lora=LoraConfig())
    g = torch.Generator().manual_seed(0)
    feats = [{"input_ids": (ids := torch.randint(1, 2048, (T,), generator=g).tolist()),
              "labels": [-100] * (T // 2) + ids[T // 2:]} for _ in range(B)]
    w = Workload(batch_size=B, seq_len=T, takd_batch_size=B)
    s = _Shapes.of(cfg)
    b = torch.empty((), dtype=dt).element_size()
    if step == "takd":
        cache = TeacherCache.build(d, feats, 0, batch_size=B, mode="memory")
        st, msg = init_state(d), d.messenger_state()
        fn = lambda: distill(d, st, msg, feats, TAKDConfig(batch_size=B), 1, pad_id=0, cache=cache)  # noqa: E731
        predicted = _takd_activations(s, split, b, w)
    else:
        from ciders.algorithms import ciders as alg
        from ciders.models.messenger_loss import MessengerLoss
        from ciders.tasks.text import collate

        ccfg = replace(CidersConfig(), local_steps=1, metagrad=step, hvp="exact", gamma=0.01)
        msg = d.messenger_state()
        bc = alg.make_broadcast(ccfg, alg.init_server(msg, 10), alg.init_copy(msg))
        batch = collate(feats, 0)
        loss = MessengerLoss(d)
        d.messenger_top.train()

        def fn():
            h = d.backbone_hidden(batch["input_ids"], batch["attention_mask"])
            alg.client_update(ccfg, bc, alg.init_client("c", msg), loss, [dict(batch, hidden=h, seed=0)])
        predicted = _client_activations(s, split, b, w, step)
    fn()  # warm-up: first-call allocations are not the step's
    measured = peak_tensor_mib(fn) * 2**20
    assert 0.75 <= measured / predicted <= 1.25, (measured / 2**20, predicted / 2**20)
