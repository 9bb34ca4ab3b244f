import pytest
import torch

from ciders.errors import CidersError
from ciders.models.decompose import decompose
from ciders.models.load import build_tiny, load_model
from helpers import ARCHS, hand_stack, randomize_lora

FAMILIES = [*ARCHS, "tiny-gemma", "tiny-phi3"]  # two more architecture families


def tiny(name, **kw):
    return decompose(load_model(name, attn_implementation="eager"), 2, drop_ratio=0.5, **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_composites_equal_hand_run_stacks(name):
    ref = build_tiny(name, seed=0).eval()
    ref.set_attn_implementation("eager")
    d = tiny(name)  # same seed -> same weights; LoRA B = 0, so the adapters are the identity
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    s = d.split
    with torch.no_grad():
        emu = hand_stack(ref, [ref.model.layers[k] for k in s.student_indices + s.messenger_indices], ids)
        fu = hand_stack(ref, list(ref.model.layers), ids)
        torch.testing.assert_close(d.adapemu(ids).logits, emu, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.adapfu(ids).logits, fu, atol=1e-5, rtol=1e-5)
        # with trained (non-zero) LoRA, AdapEmu = B_L layers then the AdapFu messenger modules
        randomize_lora(d)
        emu2 = hand_stack(d.base, list(d.student) + list(d.messenger), ids)
        torch.testing.assert_close(d.adapemu(ids).logits, emu2, atol=1e-5, rtol=1e-5)
        assert (d.adapemu(ids).logits - emu).abs().max() > 1e-3  # the LoRA values do matter


@pytest.mark.parametrize("name", ARCHS)
def test_parts_share_storage_and_renumber(name):
    d = tiny(name)
    s = d.split
    assert len(d.backbone_full) == s.teacher_layers and len(d.messenger) == 2 and len(d.student) == s.student_layers
    for shell in (d.adapemu, d.messenger_top):
        assert shell.model.embed_tokens is d.base.model.embed_tokens
        assert shell.model.norm is d.base.model.norm and shell.lm_head is d.base.lm_head
        assert shell.model.rotary_emb is d.base.model.rotary_emb
        assert [l.self_attn.layer_idx for l in shell.model.layers] == list(range(len(shell.model.layers)))
        assert shell.config.num_hidden_layers == len(shell.model.layers)
        assert shell.config is not d.base.config
    assert d.base.config.num_hidden_layers == s.n_layers  # the original config is untouched
    # B_L layer j shares its base weights with B_F layer student_indices[j]
    for j, k in enumerate(s.student_indices):
        a = d.student[j].self_attn.q_proj.base_layer.weight
        assert a is d.backbone_full[k].self_attn.q_proj.weight
    # the messenger in AdapEmu is the same Parameters as in AdapFu
    v = d.adapemu.model.layers[s.student_layers].mlp.down_proj
    assert v.lora_A["messenger"].weight is d.messenger[0].mlp.down_proj.lora_A["messenger"].weight
    assert v is not d.messenger[0].mlp.down_proj  # but its own module (own layer_idx)
    # nothing large was copied: AdapEmu's own parameters are only the student LoRA
    base_ids = {id(p) for p in d.base.parameters()}
    own = [n for n, p in d.adapemu.named_parameters() if id(p) not in base_ids]
    assert own and all(".student." in n for n in own)


def test_qwen2_layer_types_follow_the_kept_layers():
    cfg = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
               max_window_layers=3)
    m = build_tiny(cfg)
    types = list(m.config.layer_types)
    assert len(set(types)) == 2  # a mix, so that the mapping is tested
    d = decompose(m, 2, student_layers=3)
    s = d.split
    assert d.adapemu.config.layer_types == [types[i] for i in s.student_indices + s.messenger_indices]
    assert d.messenger_top.config.layer_types == types[4:]


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_generation_equals_no_cache(name):
    d = tiny(name)
    randomize_lora(d)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # left padding on one row
    for model in (d.adapemu, d.adapfu):
        kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))
        # incremental decoding logits equal a full no-cache forward
        seq = torch.randint(0, 256, (1, 10), generator=g)
        with torch.no_grad():
            full = model(seq, use_cache=False).logits
            out = model(seq[:, :6], use_cache=True)
            steps = [out.logits]
            cache = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
            for t in range(6, 10):
                o = model(seq[:, t : t + 1], cache=cache, use_cache=True)
                steps.append(o.logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_output_hidden_states_before_decompose_does_not_leak_hooks():
    m = load_model("tiny-qwen2")
    ids = torch.randint(0, 256, (1, 7))
    m(ids, output_hidden_states=True)  # installs transformers' capture hooks on m's layers
    d = decompose(m, 2, drop_ratio=0.5)
    hs = d.adapemu(ids, output_hidden_states=True).hidden_states
    assert len(hs) == d.split.edge_layers + 1


def test_decompose_rejects_models_with_lora_and_bad_targets():
    d = tiny("tiny-qwen2")
    with pytest.raises(CidersError, match="already carries LoRA"):
        decompose(d.base, 2)
    from ciders.config import LoraConfig

    with pytest.raises(CidersError, match=r"LoRA targets \['qkv_proj'\] not found in LlamaDecoderLayer"):
        decompose(load_model("tiny-llama"), 2, messenger_lora=LoraConfig(targets=("qkv_proj",)))


def test_lora_targets_resolve_to_the_layers_own_linear_modules():
    from ciders.config import LoraConfig

    d = tiny("tiny-phi3")  # fused projections: the default targets become every linear module of the layer
    assert d.messenger_lora.targets == d.student_lora.targets
    assert set(d.messenger_lora.targets) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in d.messenger_params()}
    assert names == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    q = tiny("tiny-qwen2")  # on Llama-style layers the default is left as written (the paper's seven)
    assert q.messenger_lora.targets == LoraConfig().targets
    a = decompose(load_model("tiny-qwen2"), 2, messenger_lora=LoraConfig(targets=("all-linear",)))
    assert set(a.messenger_lora.targets) == set(LoraConfig().targets)


def test_no_lora_parts():
    d = decompose(load_model("tiny-llama"), 2, drop_ratio=0.5, messenger_lora=None, student_lora=None)
    assert d.messenger_params() == {} and d.student_params() == {}
    with pytest.raises(CidersError, match="no messenger LoRA"):
        d.save_messenger("/tmp/never")


def test_bf16_base_keeps_fp32_adapters_and_all_paths_work():
    d = decompose(load_model("tiny-llama", dtype="bfloat16"), 2, drop_ratio=0.5)
    assert d.base.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in list(d.messenger_params().values()) + list(d.student_params().values()))
    randomize_lora(d)
    ids = torch.randint(0, 256, (2, 8))
    for m in (d.adapemu, d.adapfu):
        out = m(ids, labels=ids)  # the HF loss path
        assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
        out.loss.backward()
        m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in d.messenger_params().values())
    assert all(p.grad is not None for p in d.student_params().values())
