"""One update of a training run (`train_step`): `update_freq` forward/backward passes per rank, one optimizer
step, the ranks' one agreement; with the seed of each pass's dropout (`dropout_seed`) and the rule that skips a
step with non-finite gradients (`step_if_finite`)."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import math
import time

import torch

from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.config import ConfigError
from transformer.loss import label_smoothed_nll
from transformer.training.agreement import agree, settle
from transformer.training.run import Run, StopRequest
from transformer.training.run_record import Window

log = logging.getLogger("train")


def dropout_seed(seed: int, update: int, slot: int) -> int:
    """The RNG seed of one forward pass: a function of (seed, update, batch index within the update) only,
    so the dropout masks do not depend on the world size and a resumed run draws the same ones."""
    digest = hashlib.blake2b(f"{seed}/{update}/{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class StepOutcome(enum.Enum):
    """What `train_step` did."""

    UPDATE = "update"  # one more update made
    OVERFLOW = "overflow"  # fp16: the loss scale was lowered and the update is to be made again
    STOP = "stop"  # a stop signal: the run saves and ends after this update


def step_if_finite(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """optimizer.step() unless `finite` (a device bool) is False. Optimizers that take GradScaler's
    `found_inf` (fused Adam) skip on the device, parameters and step counts alike, without waiting for the
    host; others read `finite` on the host."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale, optimizer.found_inf = None, (~finite).float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif bool(finite):
        optimizer.step()


MIN_LOSS_SCALE = 1e-4  # fp16: below this GradScaler scale, an overflow is divergence, not calibration (fairseq's)


def train_step(run: Run, window: Window, stop: StopRequest) -> StepOutcome:
    """One update: `update_freq` forward/backward passes per rank, then one optimizer step; UPDATE, or STOP
    when any rank has received a stop signal (every rank stops after the same update).

    The host waits for the device once, at the end (`settle`): the token count, the stop signals and the
    finiteness of the gradient norm are read together, after the next update's batches are collated.
    A non-finite gradient norm skips the optimizer step (on the device). In fp16 that is GradScaler
    calibrating its loss scale (it halves it): OVERFLOW, and the update is made again from the same
    batches at the lower scale (the update number, the lr schedule and the data do not move), until the
    scale falls below MIN_LOSS_SCALE. Otherwise it counts towards train.max_nonfinite.
    """
    started, position = time.monotonic(), run.stream.state_dict()
    batches = run.batches.next_update(run.stream)
    agreement = agree(sum(b.tgt_tokens for _, b in batches), stop.requested,
                      run.clock_reading() if run.dist.is_main else None, device=run.device)
    state, world, step, losses = run.state, run.dist.world_size, run.state.step + 1, []
    # DDP averages gradients over ranks; × world_size / global tokens turns that into the per-token mean.
    per_token = (world / agreement.tokens).float()
    for i, (slot, batch) in enumerate(batches):
        torch.manual_seed(dropout_seed(run.job.seed, step, slot))
        last = i == len(batches) - 1
        with run.train_model.no_sync() if world > 1 and not last else contextlib.nullcontext():  # one all-reduce
            with run.autocast:
                # a batch without padding attends with no mask (the kernel chooses), told without a host sync
                logits = run.train_model(batch.src, batch.tgt_in, src_padded=batch.src_tokens < batch.src.numel())
            loss, nll = label_smoothed_nll(logits, batch.tgt_out, epsilon=run.job.train.label_smoothing,
                                           ignore_index=run.model.config.pad_id)
            run.scaler.scale(loss * per_token).backward()
        losses.append((loss, nll))
    run.scaler.unscale_(run.optimizer)
    clip = run.job.train.clip_norm if run.job.train.clip_norm > 0 else math.inf
    window.gnorm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    finite = torch.isfinite(window.gnorm)
    if run.scaler.is_enabled():
        run.scaler.step(run.optimizer)  # skips a step with non-finite gradients itself
    else:
        step_if_finite(run.optimizer, finite)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.batches.prepare(run.stream)  # the next update's batches, while the device computes this one
    settled = settle(agreement, finite)
    run.clock = settled.clock
    if not settled.finite and run.scaler.is_enabled():
        scale = run.scaler.get_scale() / run.scaler.get_backoff_factor()  # the scale this update had
        if scale >= MIN_LOSS_SCALE:
            log.info("update %d: fp16 overflow, loss scale %g → %g; the update is made again", step, scale,
                     run.scaler.get_scale())
            run.stream.load_state_dict(position)
            state.train_seconds += time.monotonic() - started
            return StepOutcome.STOP if settled.stop else StepOutcome.OVERFLOW
    state.step, state.train_tokens = step, state.train_tokens + int(settled.tokens)
    state.nonfinite = 0 if settled.finite else state.nonfinite + 1
    if not settled.finite:
        log.warning("update %d: non-finite gradient norm, skipped (%d in a row)", step, state.nonfinite)
        if state.nonfinite >= run.job.train.max_nonfinite:
            run.save(ckpt.checkpoint_dir(run.run_dir) / f"diagnostic-{step:08d}.pt", kind="diagnostic")
            distributed.barrier()  # every rank stops here: none may exit (and have torchrun kill rank 0) mid-write
            raise ConfigError(f"{state.nonfinite} updates in a row had non-finite gradients (last: update {step}); "
                              "a diagnostic checkpoint is in run_dir/checkpoints: lower the learning rate "
                              "(train.lr_scale), use train.precision=fp32 or set train.clip_norm")
    window.lr = run.optimizer.param_groups[0]["lr"]  # this update's lr; after step() it is the next update's
    run.scheduler.step()
    seconds = time.monotonic() - started
    state.train_seconds += seconds
    run.budget.add_update(seconds)
    window.end_update(losses, settled.tokens / world, seconds)
    return StepOutcome.STOP if settled.stop else StepOutcome.UPDATE
