import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ciders.models.decompose import decompose
from ciders.models.export import export_edge_model
from ciders.models.load import load_model
from helpers import ARCHS, randomize_lora


@pytest.mark.parametrize("name", ARCHS)
def test_export_roundtrip(name, tmp_path):
    d = decompose(load_model(name), 2, drop_ratio=0.5)
    randomize_lora(d)
    teacher_w = d.backbone_full[0].self_attn.q_proj.weight.clone()
    export_edge_model(d, tmp_path / "edge")
    info = json.loads((tmp_path / "edge" / "ciders_export.json").read_text())
    assert info["student_indices"] == list(d.split.student_indices)
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "edge")).eval()
    assert type(m) is type(d.base) and m.config.num_hidden_layers == d.split.edge_layers
    assert not any("lora" in n for n, _ in m.named_parameters())
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, d.adapemu(ids).logits, atol=1e-4, rtol=1e-4)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(ids, **kw), d.adapemu.generate(ids, **kw))
    # merging happened on a copy: the shared teacher weights are untouched
    assert torch.equal(d.backbone_full[0].self_attn.q_proj.weight, teacher_w)
