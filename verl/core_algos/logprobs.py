"""Log-probs of the sampled tokens and the entropy, from logits, computed in chunks of rows."""
from __future__ import annotations

import torch


def logprobs_and_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = False, entropy_grad: bool = True,
                         chunk_elements: int = 1 << 27) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[label] and, optionally, the entropy of that softmax.

    logits_NV may have any leading shape (…, V); labels match it without V. Both results are fp32
    (fp64 for fp64 logits): bf16 log-probs are too coarse for PPO's ratio. With `entropy_grad=False`
    the entropy is returned detached (for metrics).

    Memory: with a 150k-token vocabulary the logits are the largest tensor of an update (7,000 response
    tokens × 151,936 × 4 bytes = 4.3 GB per fp32 copy), and the plain composition (upcast, divide,
    log-softmax, softmax for the entropy) keeps several such copies alive. Here rows are processed in
    chunks of about `chunk_elements` values: only the logits as given (usually bf16) are kept for
    backward, which recomputes each chunk's softmax and writes the gradient chunk by chunk.
    """
    V = logits_NV.shape[-1]
    flat_NV, flat_N = logits_NV.reshape(-1, V), labels_N.reshape(-1)
    chunk_rows = max(1, chunk_elements // V)
    logprobs_N, entropy_N = _ChunkedLogprobs.apply(flat_NV, flat_N, float(temperature), chunk_rows, with_entropy)
    logprobs = logprobs_N.view(labels_N.shape)
    if not with_entropy:
        return logprobs, None
    entropy = entropy_N.view(labels_N.shape)
    return logprobs, entropy if entropy_grad else entropy.detach()


class _ChunkedLogprobs(torch.autograd.Function):
    """See `logprobs_and_entropy`. With z = logits / T, log p = z - logsumexp(z) and H = -Σ p log p:
    d logp_label / dz = onehot(label) - p,   dH / dz = -p ⊙ (log p + H).
    The entropy is summed over log p (finite even where p underflows to 0), not as lse - Σ p z,
    whose two terms grow with |z| and cancel."""

    @staticmethod
    def forward(ctx, logits_NV, labels_N, temperature, chunk_rows, with_entropy):
        dtype = torch.promote_types(logits_NV.dtype, torch.float32)
        N = logits_NV.shape[0]
        lse_N = torch.empty(N, dtype=dtype, device=logits_NV.device)
        logprobs_N = torch.empty_like(lse_N)
        entropy_N = torch.empty_like(lse_N) if with_entropy else None
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            z_cV = logits_NV[s:e].to(dtype, copy=True).div_(temperature)
            lse_N[s:e] = torch.logsumexp(z_cV, dim=-1)
            logp_cV = z_cV.sub_(lse_N[s:e, None])
            logprobs_N[s:e] = logp_cV.gather(-1, labels_N[s:e, None]).squeeze(-1)
            if with_entropy:
                entropy_N[s:e] = -(logp_cV.exp() * logp_cV).sum(-1)
        ctx.save_for_backward(logits_NV, labels_N, lse_N, entropy_N)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.set_materialize_grads(False)  # an unused output (e.g. a detached entropy) sends None
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, g_logprobs_N, g_entropy_N):
        logits_NV, labels_N, lse_N, entropy_N = ctx.saved_tensors
        T, N = ctx.temperature, logits_NV.shape[0]
        if g_logprobs_N is None and g_entropy_N is None:
            return torch.zeros_like(logits_NV), None, None, None, None
        grad_NV = torch.empty_like(logits_NV)
        for s in range(0, N, ctx.chunk_rows):
            e = min(N, s + ctx.chunk_rows)
            logp_cV = logits_NV[s:e].to(lse_N.dtype, copy=True).div_(T).sub_(lse_N[s:e, None])
            p_cV = logp_cV.exp()
            grad_cV = None
            if g_entropy_N is not None:  # in logp's memory
                grad_cV = logp_cV.add_(entropy_N[s:e, None]).mul_(p_cV).mul_(-g_entropy_N[s:e, None])
            if g_logprobs_N is not None:
                g_c1 = g_logprobs_N[s:e, None]
                minus_p_cV = p_cV.mul_(-g_c1)
                grad_cV = minus_p_cV if grad_cV is None else grad_cV.add_(minus_p_cV)
                grad_cV.scatter_add_(-1, labels_N[s:e, None], g_c1)
            grad_NV[s:e] = grad_cV.div_(T)
        return grad_NV, None, None, None, None
