import pytest

from ciders.eval.generate import generate
from ciders.eval.nll_matrix import cross_gap, nll_matrix
from ciders.models.decompose import decompose
from ciders.models.load import byte_tokenizer, load_model
from ciders.tasks.text import Example, tokenize
from helpers import randomize_lora


def test_batched_left_padded_generation_equals_one_by_one():
    d = decompose(load_model("tiny-llama"), 2, drop_ratio=0.5)
    randomize_lora(d)
    tok = byte_tokenizer()
    prompts = ["Question: 1+1?\nAnswer:", "Hi", "A much longer prompt, to force left padding in the batch"]
    batched = generate(d.adapemu, tok, prompts, max_new_tokens=12, batch_size=3)
    single = [generate(d.adapemu, tok, [p], max_new_tokens=12, batch_size=1)[0] for p in prompts]
    assert batched == single and all(isinstance(s, str) for s in batched)
    assert tok.padding_side == "right"  # restored
    cut = generate(d.adapemu, tok, prompts, max_new_tokens=12, batch_size=2, stops=[batched[0][2:4]])
    assert len(cut[0]) <= 2 + 0 or batched[0][2:4] not in cut[0]


def test_cross_gap_by_hand():
    cells = {"a": {"a": {"nll": 1.0}, "b": {"nll": 2.0}}, "b": {"a": {"nll": 3.0}, "b": {"nll": 1.5}}}
    g = cross_gap(cells)
    assert g["diag_mean"] == 1.25 and g["off_mean"] == 2.5 and g["delta_cross"] == 1.25


def test_nll_matrix_cells_are_each_messengers_perplexity():
    from ciders.eval.metrics import perplexity
    from ciders.tasks.text import batches

    d = decompose(load_model("tiny-qwen2"), 2, drop_ratio=0.5)
    tok = byte_tokenizer()
    targets = {"x": tokenize([Example("p: ", "alpha beta")] * 2, tok, 64), "y": tokenize([Example("q: ", "gamma")], tok, 64)}
    randomize_lora(d, seed=1)
    m1 = d.messenger_state()
    randomize_lora(d, seed=2)
    m2 = d.messenger_state()
    out = nll_matrix(d.adapemu, d.load_messenger, {"x": m1, "y": m2}, targets, tok.pad_token_id, 2)
    d.load_messenger(m2)
    want = perplexity(d.adapemu, batches(targets["x"], 2, tok.pad_token_id))["nll"]
    assert out["cells"]["y"]["x"]["nll"] == pytest.approx(want)
    assert out["cells"]["x"]["x"]["examples"] == 2 and out["cells"]["x"]["y"]["tokens"] > 0
    assert out["delta_cross"] == pytest.approx(cross_gap(out["cells"])["delta_cross"])


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_perplexity_runs_the_head_only_where_a_target_follows_and_is_unchanged(name):
    import torch

    from ciders.eval.metrics import perplexity, target_positions, token_nll
    from ciders.tasks.text import collate
    from helpers import random_features

    d = decompose(load_model(name), 2, drop_ratio=0.5)
    randomize_lora(d)
    b = collate(random_features(n=4, seed=3), 257)
    rows = []
    hook = d.adapemu.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1]))
    try:
        got = perplexity(d.adapemu, [b])
    finally:
        hook.remove()
    assert rows == [len(target_positions(b["labels"]))]
    one = {k: v[:1] for k, v in b.items()}
    assert 0 < len(target_positions(one["labels"])) < one["input_ids"].shape[1] - 1  # its prompt is left out
    with torch.no_grad():
        nll, n = token_nll(d.adapemu(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    assert got["tokens"] == n and abs(got["nll"] - float(nll) / n) < 1e-6 * abs(float(nll) / n)

    class Plain(torch.nn.Module):  # a forward without logits_to_keep: every position, as before
        def __init__(self):
            super().__init__()
            self.m = d.adapemu

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask)

    assert abs(perplexity(Plain(), [b])["nll"] - got["nll"]) < 1e-6 * got["nll"]
