"""core.submodel: only kept entries travel; unpacking restores values and masks exactly and rejects bad input."""

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
    assert all(torch.equal(mask[k], m[k]) and torch.equal(values[k], p[k] * m[k]) for k in p)


def test_downlink_costs_kept_entries_plus_one_index_per_kept_unit():
    p = params()
    m = mk.structured_masks(p, 0.5, "importance")
    packed = sm.pack(p, m)
    # conv keeps 3 of 6 channels: 3*27 weights + 3 biases + 3 + 3 row indices; head 2 of 4 rows
    assert packed["conv.weight"].numel() == 81 and packed["conv.weight@rows"].tolist() == packed["conv.bias@rows"].tolist()
    assert packed["head.weight"].numel() == 12 and len(packed["head.weight@rows"]) == 2
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
    with pytest.raises(PayloadError, match="differ"):
        sm.unpack({k: v for k, v in good.items() if not k.startswith("head.bias")}, p)
    with pytest.raises(PayloadError, match="expected"):
        sm.unpack({**good, "head.weight": good["head.weight"].double()}, p)
