"""transformer/loss.py: the label-smoothed loss (§5.4) against the explicit smoothed distribution and torch."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from transformer import loss as loss_module
from transformer.loss import label_smoothed_nll

PAD = 0
EPS = 0.1


def _smoothed_loss_by_hand(logits, target, epsilon, pad):
    """Cross-entropy against the explicit smoothed distribution q, in float64, summed over non-pad."""
    logits, vocab = logits.double().reshape(-1, logits.size(-1)), logits.size(-1)
    target = target.reshape(-1)
    log_p = logits - logits.exp().sum(-1, keepdim=True).log()
    loss = nll = 0.0
    for row, y in zip(log_p, target.tolist()):
        if y == pad:
            continue
        q = torch.full((vocab,), epsilon / vocab, dtype=torch.float64)
        q[y] += 1.0 - epsilon
        loss += float(-(q * row).sum())
        nll += float(-row[y])
    return loss, nll


def test_loss_matches_explicit_smoothed_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = PAD
    target[2, 1:] = PAD
    loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    want_loss, want_nll = _smoothed_loss_by_hand(logits, target, EPS, PAD)
    assert loss.dtype == nll.dtype == torch.float32
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    assert nll.item() == pytest.approx(want_nll, rel=1e-5)


def test_loss_equals_torch_cross_entropy_with_label_smoothing():
    torch.manual_seed(1)
    logits = torch.randn(17, 23, requires_grad=True)
    target = torch.randint(0, 23, (17,))
    target[::4] = PAD
    loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    reference = F.cross_entropy(logits, target, label_smoothing=EPS, ignore_index=PAD, reduction="sum")
    plain = F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, plain.detach())
    (grad,) = torch.autograd.grad(loss, logits)
    (grad_reference,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, grad_reference)
    assert not nll.requires_grad


def test_no_smoothing_gives_the_plain_nll():
    torch.manual_seed(2)
    logits, target = torch.randn(6, 9, requires_grad=True), torch.randint(1, 9, (6,))
    loss, nll = label_smoothed_nll(logits, target, epsilon=0.0, ignore_index=PAD)
    reference = F.cross_entropy(logits, target, reduction="sum")
    torch.testing.assert_close(loss, nll)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(reference, logits)[0])


def test_bf16_logits_get_a_bf16_gradient_of_the_float32_loss():
    torch.manual_seed(6)
    logits = torch.randn(5, 4, 31).bfloat16().requires_grad_()
    target = torch.randint(0, 31, (5, 4))
    loss, _ = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    (grad,) = torch.autograd.grad(2.0 * loss, logits)  # an upstream factor, as the token normalisation
    wide = logits.detach().float().requires_grad_()
    reference = F.cross_entropy(wide.view(-1, 31), target.view(-1), label_smoothing=EPS, ignore_index=PAD,
                                reduction="sum")
    (grad_reference,) = torch.autograd.grad(2.0 * reference, wide)
    assert grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference)
    assert (grad.float() - grad_reference).abs().max() <= 0.01


def test_padding_does_not_change_loss():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 13)
    target = torch.randint(1, 13, (2, 4))
    padded_logits = torch.cat([logits, torch.randn(2, 3, 13) * 10], dim=1).requires_grad_()  # [2, 7, 13]
    padded_target = torch.cat([target, torch.full((2, 3), PAD)], dim=1)
    loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    padded_loss, padded_nll = label_smoothed_nll(padded_logits, padded_target, epsilon=EPS, ignore_index=PAD)
    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(padded_nll, nll)
    (grad,) = torch.autograd.grad(padded_loss, padded_logits)
    assert torch.all(grad[:, 4:] == 0)


def test_smoothed_loss_minimum_is_the_entropy_of_the_smoothed_target():
    vocab, y = 7, 4
    q = torch.full((vocab,), EPS / vocab, dtype=torch.float64)
    q[y] += 1 - EPS
    entropy = float(-(q * q.log()).sum())
    assert entropy > 0  # the smoothed loss can never reach zero
    best_logits = q.log().float().unsqueeze(0).requires_grad_()  # predicts q exactly
    loss, nll = label_smoothed_nll(best_logits, torch.tensor([y]), epsilon=EPS, ignore_index=PAD)
    assert loss.item() == pytest.approx(entropy, rel=1e-5)
    assert nll.item() == pytest.approx(-math.log(1 - EPS + EPS / vocab), rel=1e-5)
    (grad,) = torch.autograd.grad(loss, best_logits)
    assert grad.abs().max().item() < 1e-6  # a stationary point: the minimum of a convex function
    torch.manual_seed(4)
    for _ in range(5):
        other = best_logits.detach() + torch.randn(1, vocab)
        assert label_smoothed_nll(other, torch.tensor([y]), epsilon=EPS, ignore_index=PAD)[0].item() > entropy
    confident = torch.full((1, vocab), -30.0)
    confident[0, y] = 30.0  # the unsmoothed optimum is penalised
    assert label_smoothed_nll(confident, torch.tensor([y]), epsilon=EPS, ignore_index=PAD)[0].item() > entropy


def test_loss_is_float32_under_autocast():
    torch.manual_seed(5)
    logits = torch.randn(4, 3, 29).bfloat16()
    target = torch.randint(1, 29, (4, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    assert loss.dtype == nll.dtype == torch.float32
    want_loss, _ = _smoothed_loss_by_hand(logits.float(), target, EPS, PAD)
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)


# ------------------------------------------------------------------------------- chunks and their memory


class Allocations(TorchDispatchMode):
    """Every new tensor an aten op returns (views and in-place results, which share an input's storage,
    left out): (op, dtype, number of elements)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.made += [(str(func), t.dtype, t.numel()) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_torch_cross_entropy_value_and_gradient(dtype, monkeypatch):
    """Several chunks, the last one short, padding in and across them: the value and the gradient of
    F.cross_entropy(label_smoothing=) over the same (float32) logits; the gradient in the logits' dtype."""
    monkeypatch.setitem(loss_module.CHUNK_ELEMENTS, "cpu", 5 * 37)  # 5 tokens a chunk: 29 tokens = 6 chunks
    torch.manual_seed(7)
    logits = (torch.randn(29, 37) * 4).to(dtype).requires_grad_()
    target = torch.randint(1, 37, (29,))
    target[[0, 4, 5, 6, 7, 8, 9, 28]] = PAD  # a whole chunk of padding, and the last token
    loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    (grad,) = torch.autograd.grad(3.0 * loss, logits)
    wide = logits.detach().float().requires_grad_()
    reference = F.cross_entropy(wide, target, label_smoothing=EPS, ignore_index=PAD, reduction="sum")
    (grad_reference,) = torch.autograd.grad(3.0 * reference, wide)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, F.cross_entropy(wide, target, ignore_index=PAD, reduction="sum").detach())
    assert grad.dtype == dtype and torch.all(grad[target == PAD] == 0)
    torch.testing.assert_close(grad, grad_reference.to(dtype))  # float32's gradient, rounded once
    if dtype == torch.bfloat16:  # and torch's own bf16 cross-entropy agrees to bf16 rounding
        direct = F.cross_entropy(logits, target, label_smoothing=EPS, ignore_index=PAD, reduction="sum")
        torch.testing.assert_close(loss, direct.float(), rtol=1e-2, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_float32_copy_of_the_logits_is_made(dtype, monkeypatch):
    """Forward: no tensor larger than a chunk of float32 logits. Backward: one [N, V] tensor, the gradient,
    in the logits' dtype. (Before: a float32 [N, V] log p in the forward, kept for the backward, and for bf16
    logits a bf16 copy of it as the gradient.)"""
    monkeypatch.setitem(loss_module.CHUNK_ELEMENTS, "cpu", 8 * 50)
    tokens, vocab = 64, 50
    logits = torch.randn(tokens, vocab).to(dtype).requires_grad_()
    target = torch.randint(1, vocab, (tokens,))
    with Allocations() as forward:
        loss, _ = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    with Allocations() as backward:
        (grad,) = torch.autograd.grad(loss, logits)
    assert forward.made and max(numel for _, _, numel in forward.made) <= 8 * vocab, forward.made
    large = [(op, kind) for op, kind, numel in backward.made if numel > 8 * vocab]
    assert large == [("aten.empty_like.default", dtype)], large
    assert grad.dtype == dtype
