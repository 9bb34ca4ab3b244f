"""core.submodel: only kept entries travel; unpacking gives the client its dense sub-model (or the masked full
tensor of an unstructured mask) exactly and rejects bad input."""

import pytest
import torch

from ciders.core import masks as mk
from ciders.core import submodel as sm
from ciders.core.wire import PayloadError, decode, encode


def params():
    g = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(6, 3, 3, 3, generator=g), "conv.bias": torch.randn(6, generator=g),
            "head.weight": torch.randn(4, 6, generator=g), "head.bias": torch.randn(4, generator=g)}


@pytest.mark.parametrize("rule", ["importance", "static", "rolling", "full", "magnitude"])
def test_pack_then_unpack_restores_the_masked_values_and_the_mask(rule):
    p = params()
    m = mk.structured_masks(p, 0.5, rule, round_=3)
    msg, _ = encode({"x": sm.pack(p, m)}, {})
    values, mask = sm.unpack(decode(msg)[0]["x"], p)
    sub = sm.extract(p, m)
    assert all(torch.equal(values[k], sub[k]) for k in p)
    assert {k: tuple(v.shape) for k, v in values.items()} == sm.sub_shapes(m)
    sts = sm.structures(m)
    for k in p:
        if sts[k] is None:  # unstructured (any tensor): all at full shape, zero outside the mask, and the mask
            assert torch.equal(mask[k], m[k]) and torch.equal(values[k], p[k] * m[k])
        else:  # structured: the dense sub-tensor, every entry trained
            assert bool((mask[k] == 1).all()) and values[k].numel() == int(m[k].sum())
    # the uplink order: the client's sub-tensor flattened is the gather of the full-shape tensor
    assert all(torch.equal(sm.gather(values, mask)[k], sm.gather(p, m)[k]) for k in p)


UNITS = {"conv.weight": ("conv", None), "conv.bias": ("conv", None), "head.weight": (None, "conv"),
         "head.bias": (None, None)}


def test_a_coupled_plan_extracts_rows_and_columns_and_travels_as_a_dense_sub_tensor():
    p = {"a.weight": torch.randn(6, 3, 3, 3), "a.bias": torch.randn(6), "b.weight": torch.randn(8, 6, 3, 3),
         "head.weight": torch.randn(4, 8), "head.bias": torch.randn(4)}
    units = {"a.weight": ("a", None), "a.bias": ("a", None), "b.weight": ("b", "a"), "head.weight": (None, "b"),
             "head.bias": (None, None)}
    m = mk.structured_masks(p, 0.5, "importance", units=units)
    ra, rb_ = mk.kept_units(p["a.weight"], 0.5, "importance"), mk.kept_units(p["b.weight"], 0.5, "importance")
    sub = sm.extract(p, m)
    assert torch.equal(sub["b.weight"], p["b.weight"][rb_][:, ra]) and torch.equal(sub["head.weight"], p["head.weight"][:, rb_])
    assert sm.sub_shapes(m) == {"a.weight": (3, 3, 3, 3), "a.bias": (3,), "b.weight": (4, 3, 3, 3), "head.weight": (4, 4),
                                "head.bias": (4,)}
    packed = sm.pack(p, m)
    assert packed["b.weight@rows"].tolist() == rb_.tolist() and packed["b.weight@cols"].tolist() == ra.tolist()
    values, mask = sm.unpack(decode(encode({"x": packed}, {})[0])[0]["x"], p)
    assert all(torch.equal(values[k], sub[k]) for k in p)
    # the layer between two pruned ones keeps R^2 of its weights
    assert int(m["b.weight"].sum()) == p["b.weight"].numel() // 4


def test_downlink_costs_kept_entries_plus_one_index_per_kept_unit():
    p = params()
    m = mk.structured_masks(p, 0.5, "importance", units=UNITS)
    packed = sm.pack(p, m)
    # conv keeps 3 of 6 channels: 3*27 weights + 3 biases + 3 + 3 row indices (+ 3 column indices of the
    # image's channels); the head keeps its 4 class rows and the 3 columns of the kept channels
    assert packed["conv.weight"].numel() == 81 and packed["conv.weight@rows"].tolist() == packed["conv.bias@rows"].tolist()
    assert packed["head.weight"].numel() == 12 and len(packed["head.weight@rows"]) == 4
    assert packed["head.weight@cols"].tolist() == packed["conv.bias@rows"].tolist()
    un = sm.pack(p, mk.structured_masks(p, 0.5, "magnitude"))
    assert "conv.weight@idx" in un and un["conv.weight@idx"].numel() == un["conv.weight"].numel() == 81


def test_uplink_gather_scatter_under_a_known_mask():
    p = params()
    m = mk.structured_masks(p, 0.25, "rolling", round_=1)
    back = sm.scatter(sm.gather(p, m), m, p)
    assert all(torch.equal(back[k], p[k] * m[k]) for k in p)


def test_bad_payloads_are_rejected():
    p = params()
    m = mk.structured_masks(p, 0.5, "importance")
    good = sm.pack(p, m)
    with pytest.raises(PayloadError, match="expected"):
        sm.scatter({**sm.gather(p, m), "head.bias": torch.zeros(3)}, m, p)  # wrong entry count
    with pytest.raises(PayloadError, match="NaN"):
        sm.scatter({k: torch.full_like(v, float("nan")) for k, v in sm.gather(p, m).items()}, m, p)
    with pytest.raises(PayloadError, match="sorted, unique and in"):
        sm.unpack({**good, "conv.bias@rows": torch.tensor([0, 9, 2], dtype=torch.int32)}, p)
    with pytest.raises(PayloadError, match="int32"):
        sm.unpack({**good, "conv.bias@rows": good["conv.bias@rows"].long()}, p)
    with pytest.raises(PayloadError, match="sorted, unique and in"):  # a column past the architecture's width
        sm.unpack({**good, "head.weight@cols": torch.tensor([0, 1, 2, 3, 4, 9], dtype=torch.int32)}, p)
    with pytest.raises(PayloadError, match="@cols"):  # a 2-D tensor without its columns
        sm.unpack({k: v for k, v in good.items() if k != "head.weight@cols"}, p)
    with pytest.raises(PayloadError, match="entries"):  # fewer columns claimed than values sent
        sm.unpack({**good, "head.weight@cols": torch.arange(3, dtype=torch.int32)}, p)
    with pytest.raises(PayloadError, match="both"):
        sm.unpack({**{k: v for k, v in good.items() if k != "conv.bias@rows"},
                   "conv.bias@idx": good["conv.bias@rows"], "conv.bias@cols": good["conv.bias@rows"]}, p)
    with pytest.raises(PayloadError, match="differ"):
        sm.unpack({k: v for k, v in good.items() if not k.startswith("head.bias")}, p)
    with pytest.raises(PayloadError, match="expected"):
        sm.unpack({**good, "head.weight": good["head.weight"].double()}, p)
