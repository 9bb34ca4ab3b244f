"""eval.chunked: the head losses from hidden states in chunks against PyTorch's own on the full logits."""

import torch
import torch.nn.functional as F

from ciders.eval.chunked import linear_kl_ce, linear_nll


def test_the_chunked_nll_equals_cross_entropy_with_its_gradients_in_every_dtype():
    """eval.chunked.linear_nll against F.cross_entropy on the full logits: the sum, d/dh and d/dW (a trainable
    head), with ignored targets and a last chunk shorter than the rest; bfloat16 inputs give bfloat16 grads."""
    from ciders.eval.chunked import linear_nll

    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h = torch.randn(11, 8, generator=g).to(dtype).requires_grad_(True)
        w = (0.5 * torch.randn(37, 8, generator=g)).to(dtype).requires_grad_(True)
        t = torch.randint(0, 37, (11,), generator=g)
        t[[2, 7]] = -100
        got, n = linear_nll(h, w, t, chunk_elements=3 * 37)
        gh, gw = torch.autograd.grad(2.0 * got, [h, w])
        ref = torch.nn.functional.cross_entropy((h @ w.t()).to(torch.promote_types(dtype, torch.float32)), t, ignore_index=-100, reduction="sum")
        rh, rw = torch.autograd.grad(2.0 * ref, [h, w])
        assert n == 9 and gh.dtype == dtype and gw.dtype == dtype
        assert abs(float(got.detach()) - float(ref.detach())) <= tol * abs(float(ref.detach()))
        for a, b in ((gh, rh), (gw, rw)):
            assert float((a.double() - b.double()).norm()) <= tol * float(b.double().norm())
    # a frozen head: no weight gradient is formed
    h = torch.randn(5, 8, generator=g, requires_grad=True)
    (gh,) = torch.autograd.grad(linear_nll(h, torch.randn(37, 8, generator=g), torch.zeros(5, dtype=torch.long))[0], [h])
    assert gh.shape == h.shape


def test_the_chunked_kl_and_ce_equal_pytorchs_with_their_gradients():
    """linear_kl_ce against F.kl_div + F.cross_entropy on the full logits, per-row weights (one row without KL, two
    ignored targets), 4-row chunks: the loss, each part and d/dh, d/dW (W trains through the student only)."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        hs = torch.randn(13, 8, generator=g).to(dtype).requires_grad_(True)
        ht = torch.randn(13, 8, generator=g).to(dtype)
        w = (0.7 * torch.randn(37, 8, generator=g)).to(dtype).requires_grad_(True)
        y = torch.randint(0, 37, (13,), generator=g)
        y[[1, 5]] = -100
        klw = torch.rand(13, generator=g, dtype=dtype)
        klw[3] = 0
        cew = (y != -100).to(dtype) * 0.3
        loss, kl, ce = linear_kl_ce(hs, ht, w, w, y, klw, cew, chunk_elements=4 * 37)
        acc = torch.promote_types(dtype, torch.float32)
        s, t = (hs @ w.t()).to(acc), (ht @ w.detach().t()).to(acc)
        per = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
        rkl = (per * klw).sum()
        rce = (F.cross_entropy(s, y, ignore_index=-100, reduction="none") * cew).sum()
        for a, b in ((loss, rkl + rce), (kl, rkl), (ce, rce)):
            assert abs(float(a.detach()) - float(b.detach())) <= tol * abs(float(b.detach()))
        assert not kl.requires_grad and not ce.requires_grad
        got = torch.autograd.grad(3 * loss, [hs, w])
        want = torch.autograd.grad(3 * (rkl + rce), [hs, w])
        for a, b in zip(got, want):
            assert float((a - b).norm()) <= tol * float(b.norm())
