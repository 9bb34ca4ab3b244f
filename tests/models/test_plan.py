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
