"""Train the Transformer: `python train.py [key=value ...]`, or under `torchrun` for DDP.

Reads top to bottom: the live objects of a run (`build`), one update, validation, then `train()`: set up →
start or resume → loop → finish. The config schema is transformer/config.py; the pieces are in transformer/.

    python train.py                                   # the paper's base model on WMT14 EN-DE
    python train.py experiment=quickstart             # a small model on the generated corpus, on a CPU
    torchrun --nproc_per_node=8 train.py experiment=paper_big_en_de
    python train.py ... prepare_only=true             # vocabulary + encoded data only (e.g. on a CPU box)
    python train.py --help | --cfg job | -m key=a,b   # Hydra: the groups, the resolved config, a sweep
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from data.batching import BatchStream, Prefetcher
from data.lock import releasing_locks
from data.paths import check_job_paths
from data.pipeline import Prepared, prepare
from data.quickstart_corpus import write_corpus
from transformer import checkpoint as ckpt
from transformer import distributed, finetune
from transformer.budget import Budget, out_of_time, process_age
from transformer.checkpoint import TrainState
from transformer.cli import ConfigError, compose_config, hydra_app, setup_logging, to_job
from transformer.config import TrainJob
from transformer.kernels import keep_freed_memory
from transformer.loss import label_smoothed_nll
from transformer.model import Transformer, TransformerConfig
from transformer.schedule import make_optimizer, make_scheduler
from transformer.agreement import agree, settle, start_fingerprint
from transformer.run_lock import hold_run_dir
from transformer.run_record import EventWriter, log_window, print_summary, write_run_record
from transformer.training import (Run, Start, StepOutcome, StopRequest, Window, compile_for_batches, dropout_seed,
                                  keep_best, mixed_precision, plan_update, resolve_precision, resolve_run_dir,
                                  resume_or_initialise, step_if_finite, user_error)
from transformer.validation import run_metrics, score_test_split

log = logging.getLogger("train")

# ---------------------------------------------------------------------------------------------- set-up


def build(job: TrainJob, *, dist: distributed.DistInfo, device: torch.device, run_dir: Path, start: Start,
          data: Prepared, started: float) -> Run:
    """The model (initialised, from init_from, or resumed), its optimizer, schedule, precision and data order;
    the run's wall clock counts from `started` (time.monotonic()) plus what the resumed checkpoint spent."""
    t, saved = job.train, TrainState.read(start.resume) if start.resume is not None else None
    plan, warning = plan_update(tokens_per_update=t.tokens_per_update, world_size=dist.world_size,
                                max_tokens=t.max_tokens, update_freq=t.update_freq, saved=saved)
    if warning:
        log.warning("%s", warning)
    stream = BatchStream(data.train.src_lengths, data.train.tgt_lengths, max_tokens=plan.max_tokens, seed=job.seed,
                         world_size=dist.world_size, rank=dist.rank, update_freq=plan.update_freq,
                         data=data.train.cache_entry.name)
    if stream.skipped:
        log.warning("%d training pairs are longer than a pass's budget (%d tokens; train.max_tokens=%d) and are "
                    "skipped", stream.skipped, plan.max_tokens, t.max_tokens)
    torch.manual_seed(job.seed)
    model = Transformer(TransformerConfig(**data.vocab.token_config(), **dataclasses.asdict(job.model))).to(device)
    optimizer = make_optimizer(finetune.set_up(
        model, start.init, init_from=job.init_from, vocab_mode=job.data.vocab, vocab=data.vocab,
        freeze_parts=t.freeze, train_top_layers=t.train_top_layers))
    scheduler = make_scheduler(optimizer, d_model=job.model.d_model, warmup_steps=t.warmup_steps, lr_scale=t.lr_scale)
    precision = resolve_precision(t.precision, device)
    autocast, scaler = mixed_precision(precision, device)
    state = TrainState(world_size=dist.world_size, update_freq=plan.update_freq, max_tokens=plan.max_tokens,
                       device=device.type)
    if start.resume is not None:
        saved = ckpt.load_training(start.resume, start.resume_path, model=model, optimizer=optimizer,
                                   scheduler=scheduler, scaler=scaler, stream=stream)
        state = dataclasses.replace(saved, world_size=dist.world_size, update_freq=plan.update_freq,
                                    max_tokens=plan.max_tokens, device=device.type)
    distributed.check_same_start(start_fingerprint(job, model, optimizer, scaler, state, stream, data.vocab),
                                 device=device)
    train_model = model
    if dist.world_size > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False)  # the only buffer is the fixed sinusoid table
    if t.compile:
        train_model = compile_for_batches(train_model)
    log.info("model: %s, %.1fM parameters; update: %d rank(s) × update_freq %d × max_tokens %d = %d tokens "
             "(train.tokens_per_update=%d); device %s, %s", model.config,
             sum(p.numel() for p in model.parameters()) / 1e6, dist.world_size, plan.update_freq, plan.max_tokens,
             plan.tokens, t.tokens_per_update, device, f"{precision}{' (auto)' if t.precision == 'auto' else ''}")
    return Run(job=job, dist=dist, device=device, run_dir=run_dir, data=data, stream=stream,
               batches=Prefetcher(data.train.tokens, device, pad_id=model.config.pad_id,
                                  bos_id=model.config.bos_id, eos_id=model.config.eos_id), model=model,
               train_model=train_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, autocast=autocast,
               state=state, writer=EventWriter(run_dir / "tensorboard") if dist.is_main else None,
               budget=Budget.resumed(state, started=started))


# ------------------------------------------------------------------------------------------------ an update

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
    agreement = agree(run, sum(b.tgt_tokens for _, b in batches), stop.requested)
    state, world, step, losses = run.state, run.dist.world_size, run.state.step + 1, []
    # DDP averages gradients over ranks; × world_size / global tokens turns that into the per-token mean.
    per_token = (world / agreement.tokens).float()
    for i, (slot, batch) in enumerate(batches):
        torch.manual_seed(dropout_seed(run.job.seed, step, slot))
        last = i == len(batches) - 1
        with run.train_model.no_sync() if world > 1 and not last else contextlib.nullcontext():  # one all-reduce
            with run.autocast:
                logits = run.train_model(batch.src, batch.tgt_in)
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
    settled = settle(run, agreement, finite)
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
    window.lr = run.scheduler.get_last_lr()[0]  # this update's lr; after step() it is the next update's
    run.scheduler.step()
    seconds = time.monotonic() - started
    state.train_seconds += seconds
    run.budget.add_update(seconds)
    window.end_update(losses, settled.tokens / world, seconds)
    return StepOutcome.STOP if settled.stop else StepOutcome.UPDATE


# ------------------------------------------------------------------------------------ logging, validation


def validate(run: Run) -> dict[str, float]:
    """Loss, NLL and perplexity of the validation split (all ranks), and BLEU of its first
    `train.valid_bleu_lines` lines (rank 0); updates best and stale on every rank, and best.pt."""
    with run.budget.timing("validation"):
        metrics = run_metrics(run)
    keep_best(run, metrics)
    return metrics


def stop_reason(run: Run) -> str | None:
    """Which of max_steps, max_epochs, max_time and patience ends training now, or None: the same answer on
    every rank (the update, the data position and rank 0's validation and clock are shared)."""
    t, state = run.job.train, run.state
    if t.max_steps and state.step >= t.max_steps:
        return f"max_steps={t.max_steps}"
    if t.max_epochs and run.stream.epoch >= t.max_epochs:
        return f"max_epochs={t.max_epochs}"
    if t.max_time and (reason := out_of_time(t, state.step, run.clock)):
        return reason
    if t.patience and state.stale >= t.patience:
        return f"no better {t.best_metric} in {state.stale} validations (patience)"
    return None


# ----------------------------------------------------------------------------------------------- training


def train(cfg: DictConfig, argv: list[str], stop: StopRequest, started: float) -> int:
    # 1. Set up: the config, the processes, the device, the run directory.
    job: TrainJob = to_job(cfg)
    setup_logging()
    check_job_paths(dataclasses.replace(job, run_dir=str(resolve_run_dir(job, cfg))))  # data/paths.py
    job = finetune.adopt_architecture(job, argv)
    run_dir = resolve_run_dir(job, cfg)
    job = dataclasses.replace(job, run_dir=str(run_dir))
    dist = distributed.init_from_env("cuda" if job.device != "cpu" and torch.cuda.is_available() else "cpu")
    if not dist.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    device = distributed.pick_device(job.device, dist.local_rank, training=True)
    hold_run_dir(run_dir, dist, device)  # one training per run_dir, before anything in it is touched
    ckpt.make_run_dir(run_dir, clean=dist.is_main)

    # 2. Start or resume: the checkpoint, the vocabulary, the data.
    start = resume_or_initialise(job, run_dir)
    if job.data.generate == "synthetic" and dist.is_main:
        write_corpus(Path(job.data.train_prefix).parent, seed=job.seed)
    distributed.barrier()
    # Every rank calls prepare: a file lock lets the first build the vocabulary and cache, the others read them.
    splits = ("train", "valid", "test") if job.train.test_at_end else ("train", "valid")
    data = prepare(job.data, run_dir, seed=job.seed, splits=splits, vocab=start.vocab)
    if start.init is not None and job.data.vocab == "keep" and dist.is_main:
        sample = data.train.dataset.select(range(min(20000, len(data.train.dataset))))
        finetune.warn_if_poorly_covered(data.vocab, {"source": sample["src_ids"], "target": sample["tgt_ids"]},
                                        init_from=job.init_from)
    if job.prepare_only:
        log.info("data prepared in %s; train with the same command without prepare_only=true", run_dir)
        distributed.cleanup()
        return 0
    run = build(job, dist=dist, device=device, run_dir=run_dir, start=start, data=data, started=started)
    del start  # the checkpoint read at start (weights and Adam moments) is in the live objects now
    if dist.is_main:
        write_run_record(run, argv)

    # 3. The loop: train; log; validate and save. A finished run started again trains no further update.
    t, window = job.train, Window(device)
    reason = stop_reason(run)
    run.model.train()
    while reason is None:
        outcome = train_step(run, window, stop)
        if outcome is StepOutcome.STOP:
            reason = "a stop signal"
            break
        step = run.state.step
        if outcome is StepOutcome.OVERFLOW:
            continue
        if step % t.log_every_steps == 0:
            log_window(run, window)
        reason = stop_reason(run)
        if step % t.valid_every_steps == 0 or reason is not None:
            validate(run)
            reason = reason or stop_reason(run)
        if step % t.save_every_steps == 0 or reason is not None:
            run.save_numbered()
        elif t.save_every_minutes and run.clock.since_save >= 60 * t.save_every_minutes:
            run.save_last()

    # 4. Finish: the averaged checkpoint, the test translation, where everything is. The ranks leave the
    # process group first: rank 0's lone work would otherwise hold the others in a collective that times out.
    if reason == "a stop signal":
        run.save_last()
        log.info("stopped by a signal at update %d; run the same command to resume", run.state.step)
    else:
        log.info("training stopped at update %d: %s", run.state.step, reason)
    if run.writer:
        run.writer.close()
    distributed.barrier()
    distributed.cleanup()
    if reason != "a stop signal" and dist.is_main:
        finish(run, argv)
    return 0


def finish(run: Run, argv: list[str]) -> None:
    """Average the last `train.average_last` numbered checkpoints; with train.test_at_end, score the averaged
    model on the test split (`score_test_split`); say where everything is."""
    run_dir, job = run.run_dir, run.job
    steps = [s for s, _ in ckpt.list_numbered(run_dir)][-job.train.average_last:]
    if not steps:
        log.warning("no checkpoint to average or test: the run stopped before its first update")
        print_summary(job, argv)
        return
    averaged = ckpt.average([ckpt.numbered_path(run_dir, s) for s in steps])
    ckpt.save(averaged, ckpt.averaged_path(run_dir))
    log.info("averaged the checkpoints of updates %s into %s", steps, ckpt.averaged_path(run_dir))
    if job.train.test_at_end:
        run.model.load_state_dict(averaged["model"])
        score_test_split(run)
    print_summary(job, argv)


@releasing_locks  # the run_dir's lock (hold_run_dir) ends with the run, also for in-process callers
def run_training(cfg: DictConfig, argv: list[str] | None = None, started: float | None = None) -> int:
    """`train` with the stop-signal handlers installed and its failures as one-line errors. The run's wall
    clock (train.max_time) counts from `started` (time.monotonic()), by default this process's start."""
    started = time.monotonic() - process_age() if started is None else started
    with StopRequest() as stop:
        try:
            return train(cfg, sys.argv[1:] if argv is None else argv, stop, started)
        except Exception as error:
            failure = user_error(error)
            if failure is None:
                raise
            raise failure from None


def main(argv: list[str]) -> int:
    """In-process entry (tests, notebooks): `main(["experiment=quickstart", ...])`; its wall clock starts now."""
    return run_training(compose_config(argv), argv, started=time.monotonic())


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    hydra_app("config", run_training)
