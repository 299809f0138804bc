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


def label_smoothed_nll(
    logits: torch.Tensor, target: torch.Tensor, *, epsilon: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed loss and summed NLL over the tokens whose target is not `ignore_index`.

    logits: [B, T, V] or [N, V], any float dtype (the loss is computed in float32 even under autocast).
    target: [B, T] or [N] int64.
    Returns (loss_sum, nll_sum), float32 scalars. `loss_sum` equals
    `F.cross_entropy(logits, target, label_smoothing=epsilon, ignore_index=ignore_index, reduction="sum")`;
    `nll_sum` is the same without smoothing, detached (it is for logging: perplexity = exp(nll / tokens)).
    Divide by the global count of non-pad target tokens outside (see train.py).
    """
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {epsilon}")
    vocab = logits.size(-1)
    # F.cross_entropy(label_smoothing=ε) is log_softmax + nll_loss + a mean over V inside; calling it and
    # then cross_entropy again for the NLL would run log_softmax twice over [N, V] (V = 37000). We run the
    # same composite once and keep both terms; a test checks it equals F.cross_entropy(label_smoothing=ε).
    lprobs = F.log_softmax(logits.reshape(-1, vocab).float(), dim=-1)  # [N, V]
    target = target.reshape(-1)  # [N]
    nll = F.nll_loss(lprobs, target, ignore_index=ignore_index, reduction="sum")
    if epsilon == 0.0:
        return nll, nll.detach()
    real = target != ignore_index  # [N]
    smooth = -lprobs.sum(dim=-1).masked_fill(~real, 0.0).sum() / vocab  # Σ_tokens -(1/V) Σ_v log p(v)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss, nll.detach()
