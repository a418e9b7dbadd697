"""Token log-probabilities through the LM head, a block of rows at a time: the GRPO loss's
log pi(token) without a (rows, vocabulary) logits tensor.

Written plainly (`grpo.token_logprobs` on `Transformer.logits`), log softmax(h W^T / T)[target] makes
float32 logits of rows x vocabulary (100 MB for 4 responses of 128 tokens of the default model), then
tensors of that size for the logsumexp and, in the backward, for the softmax and the gather's gradient:
memory-bound passes that cost more than the head's products on a CPU. Here each block of rows is reduced
to its logsumexp and picked logit and dropped; the backward makes it again and turns it into its share
of the gradients of h and W. The same maths as the plain form (float64 reference test); `keep_logits`
also returns the logits where something else reads them (the drafter's online loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_BYTES = 32 << 20  # float32 logits per block (170 rows of the default model's): products large
# enough to run near full speed (32 rows per block run 1.7x slower), blocks small enough for the allocator
# to reuse rather than map afresh (256 rows are no faster)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, scale: float, rows: int, keep_logits: bool):
        N = hidden.shape[0]
        logp = torch.empty(N, device=hidden.device)
        lse = torch.empty(N, device=hidden.device)
        logits = torch.empty(N, weight.shape[0], device=hidden.device) if keep_logits else None
        for s in range(0, N, rows):
            z = F.linear(hidden[s : s + rows], weight).float()
            if logits is not None:
                logits[s : s + rows] = z
            if scale != 1.0:
                z.mul_(scale)
            lse[s : s + rows] = torch.logsumexp(z, -1)
            logp[s : s + rows] = z.gather(1, targets[s : s + rows, None])[:, 0] - lse[s : s + rows]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.scale, ctx.rows = scale, rows
        if logits is None:
            return logp, torch.empty(0, device=hidden.device)
        ctx.mark_non_differentiable(logits)
        return logp, logits

    @staticmethod
    def backward(ctx, grad, _):
        # d logp / d z = onehot(target) - softmax(z), z = scale * h W^T
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device) if need_w else None
        weight32 = weight.float()  # (the weight itself when it is float32)
        for s in range(0, hidden.shape[0], ctx.rows):
            h = hidden[s : s + ctx.rows]
            z = F.linear(h, weight).float()
            if ctx.scale != 1.0:
                z.mul_(ctx.scale)
            g = grad[s : s + ctx.rows, None] * ctx.scale
            gz = z.sub_(lse[s : s + ctx.rows, None]).exp_().mul_(-g)  # -g * softmax, in place of z
            gz.scatter_add_(1, targets[s : s + ctx.rows, None], g)
            if need_h:
                grad_h[s : s + ctx.rows] = (gz @ weight32).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(gz.t(), h.float())
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    keep_logits: bool = False,
    rows: int | None = None,
):
    """log softmax(hidden W^T / T)[targets] in float32: hidden (..., d), weight (V, d), targets (...) ->
    (...), differentiable in hidden and weight. The logits are F.linear(hidden, weight) rounded up to
    float32, as `Transformer.logits` makes them; T <= 0 (greedy) scores at T 1, as `grpo.token_logprobs`.
    keep_logits: also return those logits (..., V) (unscaled, without a gradient), else None.
    rows: rows per block (default: float32 logits of `BLOCK_BYTES`)."""
    V, d = weight.shape
    rows = rows or max(1, BLOCK_BYTES // (4 * V))
    scale = 1.0 / temperature if temperature > 0 else 1.0
    logp, logits = _HeadLogprobs.apply(hidden.reshape(-1, d), weight, targets.reshape(-1), scale, rows, keep_logits)
    return logp.view(targets.shape), (logits.view(*targets.shape, V) if keep_logits else None)
