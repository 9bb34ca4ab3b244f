"""Losses of an LM head taken from hidden states in chunks of rows, so the [N, V] logits are never held
(docs/method.md#the-client-loss-l_i): the messenger loss's cross-entropy (`linear_nll`) and TAKD's KL + CE
(`linear_kl_ce`). Each chunk's gradient with respect to its logits is known in closed form once its softmax is, so
the gradients with respect to the hidden states (and a trainable head) are formed in the forward pass while the
chunk exists; the matmuls are the ones an unchunked forward and backward do. Not twice differentiable.
"""

from __future__ import annotations

import torch
from torch import nn

from ciders.tasks.text import IGNORE

# Rows of logits per chunk of `linear_nll`: about 2^24 fp32 logits (64 MiB) at a time, whatever the vocabulary.
CHUNK_ELEMENTS = 2**24


def chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, H] x [V, H] -> [n, V] logits of one chunk, in float32 or above (a function of its own so tests can watch
    the shapes)."""
    return (h @ weight.t()).to(torch.promote_types(h.dtype, torch.float32))


def linear_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               chunk_elements: int | None = None) -> tuple[torch.Tensor, int]:
    """`token_nll_at` without the logits tensor: h [N, H] (the final hidden states at the kept positions),
    the head's weight [V, H] (no bias), targets [N] (IGNORE skipped). The same sum and count; the logits are
    formed chunk_elements (default CHUNK_ELEMENTS) / V rows at a time, in float32 (float64 stays float64).
    It is `linear_kl_ce` with no KL term and unit CE weights."""
    valid = (targets != IGNORE).to(h.dtype)
    total, _, _ = linear_kl_ce(h, h, weight, weight, targets, torch.zeros_like(valid), valid, chunk_elements)
    return total, int(valid.sum())


class _LinearKLCE(torch.autograd.Function):
    """An LM head's KL + CE terms from hidden states, chunk by chunk, with the gradient taken in the forward pass:
    a chunk's softmax gives the gradient in its logits at once, so only the gradients in h (and a trainable W) are
    kept for backward. Per row r with student logits s = h_s W^T, teacher logits t = h_t W_t^T, q = softmax(s),
    p = softmax(t),
      KL_r = sum_v p (log p - log q),   CE_r = -log q[y_r]
    and the loss  sum_r kl_w[r] KL_r + ce_w[r] CE_r,  whose gradient in s is
      (kl_w + ce_w) q - kl_w p - ce_w onehot(y).
    Returns (loss, sum_r kl_w KL_r, sum_r ce_w CE_r); only the first is differentiable (in h_s and, when it requires
    grad, W). Four [n, V] buffers per chunk at most; the full logits are never held."""

    @staticmethod
    def forward(ctx, hs, ht, weight, t_weight, targets, kl_w, ce_w, rows):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        acc = torch.promote_types(hs.dtype, torch.float32)
        kl_total, ce_total = hs.new_zeros((), dtype=acc), hs.new_zeros((), dtype=acc)
        gh = torch.empty_like(hs) if need_h else None
        gw = torch.zeros_like(weight) if need_w else None
        use_kl = bool((kl_w != 0).any())
        for i in range(0, hs.size(0), rows):
            tc, a, b = targets[i : i + rows], kl_w[i : i + rows].to(acc), ce_w[i : i + rows].to(acc)
            s = chunk_logits(hs[i : i + rows], weight)  # [n, V]
            safe = tc.clamp_min(0)
            s.sub_(s.amax(dim=-1, keepdim=True))  # shifted student logits: log q = s - log zs
            e = s.exp()
            zs = e.sum(dim=-1)
            log_zs = zs.log()
            ce_total += (b * (log_zs - s.gather(1, safe[:, None]).squeeze(1))).sum()
            q = e.div_(zs[:, None])  # softmax(s), in the exp buffer
            p = None
            if use_kl:
                t = chunk_logits(ht[i : i + rows], t_weight)
                t.sub_(t.amax(dim=-1, keepdim=True))
                p = t.exp()
                zt = p.sum(dim=-1)
                p.div_(zt[:, None])
                # sum_v p (log p - log q) = sum_v p (t - s) - log zt + log zs   (t, s shifted; sum_v p = 1)
                cross = t.sub_(s).mul_(p).sum(dim=-1)
                kl_total += (a * (cross - zt.log() + log_zs)).sum()
            if need_h or need_w:
                g = q.mul_((a + b)[:, None])
                if p is not None:
                    g.addcmul_(p, a[:, None], value=-1.0)
                g[torch.arange(g.size(0), device=g.device), safe] -= b
                g = g.to(hs.dtype)
                if need_h:
                    gh[i : i + rows] = g @ weight
                if need_w:
                    gw += g.t() @ hs[i : i + rows]
        ctx.save_for_backward(*(t for t in (gh, gw) if t is not None))
        ctx.has = (need_h, need_w)
        kl_d, ce_d = kl_total.detach(), ce_total.detach()
        ctx.mark_non_differentiable(kl_d, ce_d)
        return kl_total + ce_total, kl_d, ce_d

    @staticmethod
    def backward(ctx, grad, _kl, _ce):
        saved = iter(ctx.saved_tensors)
        gh = next(saved) * grad if ctx.has[0] else None
        gw = next(saved) * grad if ctx.has[1] else None
        return gh, None, gw, None, None, None, None, None


def linear_kl_ce(hs: torch.Tensor, ht: torch.Tensor, weight: torch.Tensor, t_weight: torch.Tensor,
                 targets: torch.Tensor, kl_w: torch.Tensor, ce_w: torch.Tensor, chunk_elements: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum kl_w KL(p || q) + ce_w CE, the KL part, the CE part) per row of hs / ht [N, H] (student / teacher final
    hidden states; heads weight / t_weight [V, H], no bias), targets [N] (IGNORE where ce_w is 0), weights [N].
    Only the first is differentiable. See `_LinearKLCE`."""
    rows = max(1, (chunk_elements or CHUNK_ELEMENTS) // weight.size(0))
    return _LinearKLCE.apply(hs, ht.detach(), weight, t_weight.detach(), targets, kl_w, ce_w, rows)


def plain_head(model: nn.Module) -> bool:
    """Whether `model`'s logits are lm_head(h) for a bias-free nn.Linear head with no post-processing (softcapping,
    logit_scale): then `linear_nll` / `linear_kl_ce` can take the place of its logits."""
    head, c = getattr(model, "lm_head", None), model.config
    post = getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None)
    return type(head) is nn.Linear and head.bias is None and not post
