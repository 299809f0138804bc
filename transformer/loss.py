"""The training loss: label-smoothed cross-entropy (§5.4 of the paper, ε_ls = 0.1).

Label smoothing (Szegedy et al. 2016) trains against the target distribution

    q(v) = (1 - ε) · 1[v = y] + ε / V          (ε/V to every class, the true one included)

so, with p = softmax(logits), the per-token loss is

    L = -Σ_v q(v) log p(v) = (1 - ε) · (-log p(y)) + ε · (-(1/V) Σ_v log p(v)),

exactly what `F.cross_entropy(label_smoothing=ε)` computes. Its minimum is the entropy H(q) > 0, reached
at p = q, so the smoothed loss never reaches zero; the plain NLL -log p(y) is returned beside it for
perplexity.
"""

import torch
import torch.nn.functional as F


class _LabelSmoothedNLL(torch.autograd.Function):
    """The loss and its gradient over [N, V] logits with one float32 [N, V] buffer.

    Forward: log p = log_softmax(logits) in float32 (for reduced-precision logits, computed in place in
    their float32 copy). Backward: dL/dlogits = p - (1 - ε)·onehot(y) - ε/V per counted token, 0 for
    ignored ones, written over the saved log p. Autograd's composite (log_softmax, nll_loss, a masked sum)
    holds and sweeps several [N, V] tensors instead: the last projection's [N, V] is the largest tensor
    of a step (25k tokens x 37k pieces = 3.7 GB in float32).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int):
        if logits.dtype == torch.float32:
            lprobs = F.log_softmax(logits, dim=-1)  # the caller's logits stay as they are
        else:
            lprobs = logits.float()
            torch.log_softmax(lprobs, dim=-1, out=lprobs)  # [N, V], in our own float32 copy
        real = target != ignore_index  # [N]
        target = target.masked_fill(~real, 0)  # ignored tokens point at column 0 and are zeroed below
        picked = lprobs.gather(1, target[:, None]).squeeze(1)  # log p(y)  [N]
        nll = -(picked * real).sum()
        loss = nll.clone()  # its own tensor: nll alone is marked non-differentiable
        if epsilon:
            smooth = -(lprobs.sum(dim=-1) * real).sum() / lprobs.size(1)  # Σ_tokens -(1/V) Σ_v log p(v)
            loss = (1.0 - epsilon) * nll + epsilon * smooth
        ctx.save_for_backward(lprobs, target, real)
        ctx.epsilon, ctx.logits_dtype = epsilon, logits.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_nll: torch.Tensor):
        lprobs, target, real = ctx.saved_tensors
        epsilon, vocab = ctx.epsilon, lprobs.size(1)
        grad = lprobs.exp_()  # p, over the saved log p: nothing else reads it
        if epsilon:
            grad.sub_(epsilon / vocab)
        onehot = torch.full((target.size(0), 1), -(1.0 - epsilon), device=grad.device)
        grad.scatter_add_(1, target[:, None], onehot)  # - (1 - ε) at each token's target
        grad.mul_((real * grad_loss)[:, None])  # ignored tokens: 0
        return grad.to(ctx.logits_dtype), None, None, None


def label_smoothed_nll(
    logits: torch.Tensor, target: torch.Tensor, *, epsilon: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss and summed NLL over the tokens whose target is not `ignore_index`.

    logits: [B, T, V] or [N, V], any float dtype (the loss is computed in float32 even under autocast).
    target: [B, T] or [N] int64.
    Returns (loss_sum, nll_sum), float32 scalars. `loss_sum` equals
    `F.cross_entropy(logits, target, label_smoothing=epsilon, ignore_index=ignore_index, reduction="sum")`
    (a test checks the value and the gradient); `nll_sum` is the same without smoothing, detached (it is
    for logging: perplexity = exp(nll / tokens)). Divide by the global count of non-pad target tokens
    outside (see train.py).
    """
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {epsilon}")
    with torch.autocast(logits.device.type, enabled=False):
        return _LabelSmoothedNLL.apply(logits.reshape(-1, logits.size(-1)), target.reshape(-1), epsilon,
                                       ignore_index)
