"""Faster float32 linear maps on CPU: the same y = x W^T + b as `nn.Linear`, computed by oneDNN.

Kept apart from model.py so that the model reads as the paper; model.py uses `Linear` where it would use
`nn.Linear` (same parameters, same state_dict keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _onednn_linear_op():
    """oneDNN's dense linear kernel, or None where this torch build has none."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


_ONEDNN_LINEAR = _onednn_linear_op()


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., I] @ weight[O, I]^T (+ bias [O]) -> [..., O]; strided (transposed) operands are read in place."""
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with all three matmuls of training in oneDNN: dX = dY W, dW = dY^T X, db = Σ dY."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)  # [..., O] @ [O, I] -> [..., I]
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [N, O]
        if ctx.needs_input_grad[1]:
            grad_w = _onednn(grad_2d.t(), x.reshape(-1, x.shape[-1]).t(), None)  # [O, N] @ [N, I] -> [O, I]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(dim=0)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), with float32 on CPU computed by oneDNN instead of the BLAS behind F.linear.

    Why: torch's CPU builds send float32 F.linear to MKL, whose sgemm runs its AVX2 code on AMD CPUs;
    oneDNN uses AVX-512 there and measured 2x faster on a 2-core AMD EPYC in all three matmuls of a
    training step (docs/BENCHMARKS.md). Same maths; only the rounding of the sums may differ (~1e-6
    relative), as between thread counts. Everything else (GPU, autocast, bf16/fp16 weights, torch.compile,
    a torch without the kernel) goes to F.linear.
    """
    if (_ONEDNN_LINEAR is None or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
            or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)
    return _onednn(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state_dict keys) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


