"""The live objects of a training run (`Run`, made by `build_run`) and its checkpoints, the rule that ends it
(`stop_reason`), stop signals, precision and compilation. Where a run starts is transformer/training/start.py,
one update transformer/training/update.py, the ranks' agreement agreement.py, the records a run leaves
run_record.py."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data.batching import BatchStream, Prefetcher
from data.files import crash_point, link_or_copy
from data.pipeline import Prepared
from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.checkpoint import TrainState
from transformer.config import ConfigError, TrainJob
from transformer.kernels import warn_if_emulated
from transformer.model import Transformer, TransformerConfig
from transformer.training import finetune
from transformer.training.agreement import Clock, start_fingerprint
from transformer.training.budget import Budget, out_of_time
from transformer.training.run_record import EventWriter
from transformer.training.schedule import make_optimizer, make_scheduler, set_weight_decay
from transformer.training.start import Start, plan_update

log = logging.getLogger("train")


class StopRequest:
    """SIGTERM/SIGINT (preemption, Ctrl-C) ask the loop to save and stop at the next update boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    # A scheduler that signals every process of a job (SLURM) and torchrun, which forwards the signal it got,
    # deliver the same request twice within milliseconds: only a signal this much later means "stop now".
    REPEAT_WINDOW_S = 2.0

    def __enter__(self) -> StopRequest:
        self.requested = False
        self.first_at = 0.0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if time.monotonic() - self.first_at < self.REPEAT_WINDOW_S:
                return  # the same request, delivered twice
            raise KeyboardInterrupt  # a second signal: stop now
        self.requested, self.first_at = True, time.monotonic()
        log.warning("%s received: saving a checkpoint at the end of this update, then stopping",
                    signal.Signals(signum).name)


# --------------------------------------------------------------------------------------------- the run


@dataclass
class Run:
    """Everything a training run holds while it trains."""

    job: TrainJob
    dist: distributed.DistInfo
    device: torch.device
    run_dir: Path
    data: Prepared
    stream: BatchStream
    batches: Prefetcher  # collates the stream's next update ahead
    model: Transformer
    train_model: torch.nn.Module  # the model, under DDP and torch.compile when they are on
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    autocast: contextlib.AbstractContextManager
    state: TrainState
    writer: EventWriter | None = None  # rank 0's TensorBoard events
    budget: Budget | None = None  # the wall clock and measured costs (train.max_time); set at init
    clock: Clock | None = None  # rank 0's clocks as every rank last received them (`settle`); set at init
    last_save: float = 0.0  # time.monotonic() of the last checkpoint (rank 0's is the one that counts)

    def __post_init__(self) -> None:
        self.budget = self.budget or Budget.resumed(self.state, started=time.monotonic())
        # Before the first update every rank decides from the checkpoint's figures, the same on every rank.
        self.clock = self.clock or Clock(
            train_seconds=self.state.train_seconds, wall_seconds=self.state.wall_seconds,
            costs=Budget.resumed(self.state, started=time.monotonic()).costs(
                average_last=self.job.train.average_last, test_lines=self.test_lines))
        self.last_save = self.last_save or time.monotonic()

    @property
    def test_lines(self) -> int:
        """Lines of the test split that the end of the run translates (train.test_at_end), for its cost."""
        if not self.job.train.test_at_end:
            return 0  # the test split is not prepared then
        return len(self.data.test.dataset) if self.data.test is not None else 0

    def clock_reading(self) -> Clock:
        """This process's clocks and measured costs now: what rank 0 hands every rank at each update (`agree`)."""
        return Clock(train_seconds=self.state.train_seconds, since_save=time.monotonic() - self.last_save,
                     wall_seconds=self.budget.spent(),
                     costs=self.budget.costs(average_last=self.job.train.average_last, test_lines=self.test_lines))

    def close(self) -> None:
        """The end of training on every rank: TensorBoard's events flushed, the process group left.

        DDP's reducer holds the process group; left to a later garbage collection (the function's return), the
        group's destructor ran there with the GIL held and joined gloo's worker thread while that thread waited
        for the GIL to free the last collective's tensors: a finished run that never exits (seen once, two
        ranks with train.compile). The wrappers go first, torch.compile's caches with them, so that the group
        ends in destroy_process_group."""
        if self.writer:
            self.writer.close()
        if self.train_model is not self.model:
            self.train_model = self.model
            if self.job.train.compile:
                torch._dynamo.reset()  # its guards and cached frames hold the compiled DDP module
            gc.collect()
        distributed.barrier()
        distributed.cleanup()

    def save(self, path: Path, kind: str = "train") -> None:
        """A training checkpoint of the run as it is now (rank 0 writes; the others skip)."""
        if self.dist.is_main:
            self.budget.record(self.state)
            ckpt.save(ckpt.training_checkpoint(
                state=self.state, model=self.model, model_config=dataclasses.asdict(self.model.config),
                spm_model=self.data.vocab.model_proto, config=dataclasses.asdict(self.job),
                optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                data_state=self.stream.state_dict(), kind=kind), path)

    def save_numbered(self) -> None:
        """step-<N>.pt, then last.pt as the same file, then the oldest beyond train.keep_last removed."""
        with self.budget.timing("save"):
            if self.dist.is_main:
                path = ckpt.numbered_path(self.run_dir, self.state.step)
                self.save(path)
                crash_point("before-last")  # test-only (see data/files.py)
                link_or_copy(path, ckpt.last_path(self.run_dir))
                ckpt.prune(self.run_dir, self.job.train.keep_last)
        self.last_save = time.monotonic()

    def save_last(self) -> None:
        with self.budget.timing("save"):
            self.save(ckpt.last_path(self.run_dir))
        self.last_save = time.monotonic()


def user_error(error: BaseException) -> Exception | None:
    """The one-line error for a failure the user can fix (out of memory; a rank that died, under torchrun),
    or None for a bug of this process, whose traceback stays."""
    if isinstance(error, torch.OutOfMemoryError):
        rank = os.environ.get("RANK")
        detail = " ".join(str(error).split())[:160]
        return ConfigError(f"out of memory{f' on rank {rank}' if rank else ''} ({detail}): lower train.max_tokens "
                           "(more passes per update keep its size) and start in a new run_dir: a run resumes only "
                           "with the max_tokens it started with")
    return distributed.peer_failure(error)


def resolve_precision(precision: str, device: torch.device) -> str:
    """train.precision=auto as what it means on `device`: bf16 on a CUDA GPU with native bf16 matmuls
    (compute capability 8.0 and later: A100, H100, ...), fp32 elsewhere (CPUs, older GPUs)."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return "bf16"
    return "fp32"


def set_tf32(precision: str, device: torch.device) -> None:
    """On a GPU, train.precision=fp32 is float32 matmuls, as the paper's: the TF32 matmuls every entry point
    turns on (for what runs outside autocast in the mixed modes, and for decoding) are off for this training."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision != "fp32"


def mixed_precision(precision: str, device: torch.device):
    """(autocast context, GradScaler) for train.precision = fp32 | bf16 | fp16 (the scaler is on for fp16 only)."""
    warn_if_emulated(precision, device.type)
    set_tf32(precision, device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
                if precision != "fp32" else contextlib.nullcontext())
    return autocast, torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def compile_for_batches(module: torch.nn.Module, *, backend: str = "inductor") -> torch.nn.Module:
    """torch.compile for batches whose (B, S, T) change every pass: one graph for them all, one more for B = 1.

    Why dynamic=True: by default dynamo compiles the first batch's sizes as constants and makes them symbolic
    only when the next shape arrives, a whole inductor compile (forward and backward) spent on one shape; with
    constant sizes (dynamic=False) it compiles per shape until torch._dynamo.config.recompile_limit (8), then
    runs eagerly. Dynamo still specialises sizes of 1: a one-sentence batch gets its own graph, and so would
    a batch of empty sentences (S or T = 1). Padding lengths to multiples of 8 in `collate` instead would
    change the eager batches and train.max_tokens' count. tests/training/test_compile.py counts the graphs.
    """
    return torch.compile(module, dynamic=True, backend=backend)


def build_run(job: TrainJob, *, dist: distributed.DistInfo, device: torch.device, run_dir: Path, start: Start,
          data: Prepared, started: float) -> Run:
    """The model (initialised, from init_from, or resumed), its optimizer, schedule, precision and data order;
    the run's wall clock counts from `started` (time.monotonic()) plus what the resumed checkpoint spent."""
    t, saved = job.train, TrainState.read(start.resume) if start.resume is not None else None
    plan, warning = plan_update(tokens_per_update=t.tokens_per_update, world_size=dist.world_size,
                                max_tokens=t.max_tokens, update_freq=t.update_freq, saved=saved)
    if warning:
        log.warning("%s", warning)
    stream = BatchStream(data.train.src_lengths, data.train.tgt_lengths, max_tokens=plan.max_tokens, seed=job.seed,
                         multiple=t.pad_to_multiple,
                         world_size=dist.world_size, rank=dist.rank, update_freq=plan.update_freq,
                         data=data.train.cache_entry.name, epoch_rows=data.train.epoch_rows)
    if stream.skipped:
        log.warning("%d training pairs are longer than a pass's budget (%d tokens; train.max_tokens=%d) and are "
                    "skipped", stream.skipped, plan.max_tokens, t.max_tokens)
    torch.manual_seed(job.seed)
    model = Transformer(TransformerConfig(**data.vocab.token_config(), **dataclasses.asdict(job.model))).to(device)
    optimizer = make_optimizer(finetune.set_up(
        model, start.init, init_from=job.init_from, vocab_mode=job.data.vocab, vocab=data.vocab,
        freeze_parts=t.freeze, train_top_layers=t.train_top_layers), weight_decay=t.weight_decay)
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
        set_weight_decay(optimizer, t.weight_decay)
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
    log.info("the run ends at the first of %s; the progress line's eta names the one that will",
             ", ".join(run_limits(t)) or "none: set train.max_steps, max_epochs or max_time")
    model.train()
    return Run(job=job, dist=dist, device=device, run_dir=run_dir, data=data, stream=stream,
               batches=Prefetcher(data.train.tokens, device, multiple=t.pad_to_multiple, pad_id=model.config.pad_id,
                                  bos_id=model.config.bos_id, eos_id=model.config.eos_id), model=model,
               train_model=train_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, autocast=autocast,
               state=state, writer=EventWriter(run_dir / "tensorboard") if dist.is_main else None,
               budget=Budget.resumed(state, started=started))


def run_limits(t) -> list[str]:
    """The stopping rules a run's `train.*` sets, as the log names them."""
    return [limit for limit, on in ((f"max_steps={t.max_steps}", t.max_steps), (f"max_epochs={t.max_epochs}", t.max_epochs),
                                    (f"max_time={t.max_time:g}s (wall clock, all restarts)" if t.max_time else "",
                                     t.max_time), (f"patience={t.patience} validations", t.patience)) if on]


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
