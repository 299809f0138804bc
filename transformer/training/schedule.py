"""Adam and the learning-rate schedule of §5.3 of the paper.

    lr(n) = lr_scale · d_model^-0.5 · min(n^-0.5, n · warmup^-1.5)      (n = 1, 2, ... the update number)

Linear warm-up for `warmup` updates, then decay with the inverse square root of the update number; the
peak is at n = warmup. Adam(β1 = 0.9, β2 = 0.98, ε = 1e-9).

Usage: the optimizer's base lr is 1.0 and `LambdaLR` multiplies it by `noam_lambda(...)`;
call `scheduler.step()` after each `optimizer.step()`:

    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer, d_model=512, warmup_steps=4000, lr_scale=1.0)
"""

from collections.abc import Callable, Iterable

import torch


def noam_lambda(*, d_model: int, warmup_steps: int, lr_scale: float) -> Callable[[int], float]:
    """The multiplier `LambdaLR` applies to a base lr of 1.0, as a function of its 0-based step index.

    LambdaLR evaluates it at index 0 when built (the lr of update 1) and at index i after its i-th
    `step()` (the lr of update i + 1), so update n = i + 1 gets lr(n) of the module docstring.
    """
    if d_model <= 0:
        raise ValueError(f"d_model must be positive, got {d_model}")
    if warmup_steps <= 0:
        raise ValueError(f"train.warmup_steps must be a positive number of updates, got {warmup_steps}")
    scale = lr_scale * d_model**-0.5

    def lr_at(index: int) -> float:
        n = index + 1
        return scale * min(n**-0.5, n * warmup_steps**-1.5)

    return lr_at


def make_optimizer(params: Iterable[torch.nn.Parameter], *, fused: bool = True,
                   weight_decay: float = 0.0) -> torch.optim.Adam:
    """Adam(0.9, 0.98, eps=1e-9) with base lr 1.0 (the schedule supplies the lr).

    weight_decay (`train.weight_decay`; 0 = the paper): decoupled, as AdamW and fairseq's Adam: each update
    also moves every parameter by -lr · weight_decay · parameter.

    fused=True: torch's single-kernel Adam, on CUDA and (torch >= 2.4) on CPU, where it is several times
    faster than the multi-tensor one (docs/BENCHMARKS.md, 'Notes on the CPU figures'); the multi-tensor
    (foreach) implementation where fused is unsupported, or with fused=False.
    """
    params = list(params)
    settings = dict(lr=1.0, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay, decoupled_weight_decay=True)
    if fused:
        try:
            return torch.optim.Adam(params, **settings, fused=True)
        except RuntimeError:  # an older torch on CPU: "fused=True requires ... supported devices"
            pass
    return torch.optim.Adam(params, **settings, foreach=True)


def set_weight_decay(optimizer: torch.optim.Optimizer, weight_decay: float) -> None:
    """The run's train.weight_decay on every parameter group, after a checkpoint's optimizer state was loaded
    (load_state_dict restores the saved groups' settings: a resumed run takes the command line's)."""
    for group in optimizer.param_groups:
        group["weight_decay"], group["decoupled_weight_decay"] = weight_decay, True


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, d_model: int, warmup_steps: int, lr_scale: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """`LambdaLR` over `noam_lambda`; its state_dict holds only the step count (the lambda is rebuilt)."""
    lr_lambda = noam_lambda(d_model=d_model, warmup_steps=warmup_steps, lr_scale=lr_scale)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
