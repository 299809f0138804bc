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


# Logits per chunk. CPU: 2^20 (4 MiB of float32), so that a chunk's passes run in cache (faster than one
# pass over the whole [N, V]); CUDA and others: 2^24 (64 MiB), few kernel launches (55 chunks at 25k × 37k).
CHUNK_ELEMENTS = {"cpu": 2**20, "other": 2**24}


def _chunks(tokens: int, vocab: int, device: torch.device) -> list[slice]:
    """The rows of each chunk of tokens: CHUNK_ELEMENTS // vocab tokens each (at least one)."""
    size = max(1, CHUNK_ELEMENTS["cpu" if device.type == "cpu" else "other"] // vocab)
    return [slice(i, i + size) for i in range(0, tokens, size)]


class _LabelSmoothedNLL(torch.autograd.Function):
    """The loss and its gradient over [N, V] logits, a chunk of tokens at a time: no float32 [N, V] tensor.

    Forward, per chunk of tokens: log p = log_softmax(logits) in float32, the chunk's -log p(y) and
    -(1/V) Σ_v log p(v) summed; nothing of [N, V] is kept but the logits themselves. Backward, per chunk:
    dL/dlogits = p - (1 - ε)·onehot(y) - ε/V per counted token (0 for ignored ones), with p =
    exp(log_softmax(logits)) recomputed in float32 (the forward's p: one more pass over the chunk, no saved
    [N, V]; torch's logsumexp would save it but is slower on CPU) and written into the gradient, [N, V] in
    the logits' dtype (float32 logits: computed in place there).

    Building the whole float32 log p instead (torch's composite, or one float32 copy) adds a tensor of
    N·V·4 bytes, twice the logits when they are bf16, and the last projection's [N, V] is already the
    largest tensor of a step (25k tokens × 37k pieces). The sums are those over the whole [N, V] up to the
    float32 rounding of their order (tests/core/test_loss.py compares with F.cross_entropy); the peak memory is
    measured by benchmarks/loss_memory.py.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int):
        tokens, vocab = logits.shape
        real = target != ignore_index  # [N]
        target = target.masked_fill(~real, 0)  # ignored tokens point at column 0 and are zeroed below
        nll = torch.zeros((), dtype=torch.float32, device=logits.device)
        smooth = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in _chunks(tokens, vocab, logits.device):
            lprobs = torch.log_softmax(logits[rows], dim=-1, dtype=torch.float32)  # [n, V]
            picked = lprobs.gather(1, target[rows, None]).squeeze(1)  # log p(y)  [n]
            nll -= (picked * real[rows]).sum()
            if epsilon:
                smooth -= (lprobs.sum(dim=-1) * real[rows]).sum()
        loss = nll.clone()  # its own tensor: nll alone is marked non-differentiable
        if epsilon:
            loss = (1.0 - epsilon) * nll + epsilon * (smooth / vocab)  # Σ_tokens -(1/V) Σ_v log p(v)
        ctx.save_for_backward(logits, target, real)
        ctx.epsilon = epsilon
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_nll: torch.Tensor):
        logits, target, real = ctx.saved_tensors
        epsilon, (tokens, vocab) = ctx.epsilon, logits.shape
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)  # [N, V], the logits' dtype
        scale = real * grad_loss  # [N]; ignored tokens: 0
        for rows in _chunks(tokens, vocab, logits.device):
            # [n, V] in float32: float32 logits' gradient is computed where it is returned, others' in a chunk
            probs = grad[rows] if grad.dtype == torch.float32 else torch.empty_like(grad[rows], dtype=torch.float32)
            torch.log_softmax(logits[rows], dim=-1, dtype=torch.float32, out=probs).exp_()  # p
            if epsilon:
                probs.sub_(epsilon / vocab)
            probs.mul_(scale[rows, None])
            # - (1 - ε) at each token's target, scaled
            probs.scatter_add_(1, target[rows, None], (-(1.0 - epsilon) * scale[rows])[:, None])
            if grad.dtype != torch.float32:
                grad[rows] = probs  # rounded once, to the logits' dtype
        return grad, None, None, None


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
