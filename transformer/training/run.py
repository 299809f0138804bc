"""What train.py's procedure works with: where a run starts (`resume_or_initialise`), the update plan, the
objects of a run (`Run`) and its checkpoints, stop signals, dropout seeds, precision, the throughput window.
The ranks' agreement is transformer/agreement.py; the records a run leaves, transformer/run_record.py."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from data.batching import BatchStream, Prefetcher
from data.files import crash_point, link_or_copy
from data.pipeline import Prepared
from data.vocab import MarianVocab, Vocab, load_vocab
from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.budget import Budget
from transformer.agreement import Clock
from transformer.checkpoint import TrainState
from transformer.config import ARCH_KEYS, DATA_KEYS, ConfigError, TrainJob, model_config_with_defaults
from transformer.kernels import warn_if_emulated
from transformer.model import Transformer
from transformer.run_record import EventWriter

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


def dropout_seed(seed: int, update: int, slot: int) -> int:
    """The RNG seed of one forward pass: a function of (seed, update, batch index within the update) only,
    so the dropout masks do not depend on the world size and a resumed run draws the same ones."""
    digest = hashlib.blake2b(f"{seed}/{update}/{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------------------------- where the run starts


def resolve_run_dir(job: TrainJob, cfg: DictConfig) -> Path:
    """`run_dir`, or runs/<experiment or model>-<corpus>-<src>-<tgt> (`default_run_name`); a multirun job gets
    `<that>/<job number>`."""
    choices = cfg.get("choices", {})
    base = Path(job.run_dir) if job.run_dir else Path("runs") / default_run_name(
        choices.get("experiment") or choices.get("model") or "base", job.data)
    return base / str(cfg.job_num) if cfg.get("job_num") is not None else base


def default_run_name(recipe: str, data) -> str:
    """`<recipe>-<corpus>-<src>-<tgt>`: the corpus is the dataset's name (its last path part: wmt/wmt14 →
    wmt14) or the train_prefix's folder and file (corpus/train → corpus_train), so that two runs on different
    data or language pairs never share, and resume, one directory."""
    if data.dataset:
        corpus = Path(str(data.dataset).rstrip("/")).name
    else:
        prefix = Path(str(data.train_prefix))
        corpus = f"{prefix.parent.name}_{prefix.name}" if prefix.parent.name else prefix.name
    name = f"{recipe}-{corpus}-{data.src_lang}-{data.tgt_lang}"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def differences(saved: dict, current: dict, section: str, keys) -> list[str]:
    return [f"{section}.{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def run_differences(saved: dict, config: dict) -> list[str]:
    """The keys of a saved run's config (a checkpoint's, or run_dir/config.yaml) that make `config` another run:
    the architecture, the data and its splits, the seed, and what the saved Adam state depends on."""
    train_saved = {"freeze": [], "train_top_layers": None, **saved.get("train", {})}
    diffs = (differences(model_config_with_defaults(saved.get("model", {})), config["model"], "model", ARCH_KEYS)
             + differences(saved.get("data", {}), config["data"], "data", DATA_KEYS)
             + differences(saved, config, "", ("seed",))
             + differences(train_saved, config["train"], "train", ("max_tokens", "freeze", "train_top_layers")))
    return [d.lstrip(".") for d in diffs]


@dataclass
class Start:
    """What a run starts from: its own checkpoint (resume), another run's weights (init_from), or nothing;
    and the vocabulary it must keep (None: prepare one from the corpus or data.spm_model)."""

    resume: dict | None = None
    resume_path: Path | None = None
    init: dict | None = None
    vocab: Vocab | MarianVocab | None = None


def resume_or_initialise(job: TrainJob, run_dir: Path) -> Start:
    """Resume the run in `run_dir` if it has a checkpoint (then init_from is ignored); else initialise from
    `init_from` if set; and decide the vocabulary: the resumed run's, or init_from's with data.vocab=keep."""
    config = dataclasses.asdict(job)
    resume_path = ckpt.latest_resumable(run_dir)
    if resume_path is not None:
        state = ckpt.load(resume_path)
        diffs = run_differences(state["config"], config)
        if diffs:
            raise ConfigError("run_dir holds a different run (" + "; ".join(diffs)
                              + "): use another run_dir or the saved values")
        if job.init_from:
            log.warning("init_from=%s is ignored: resuming the run in %s", job.init_from, run_dir)
        log.info("resuming from %s (update %d)", resume_path, state["step"])
        return Start(resume=state, resume_path=resume_path, vocab=load_vocab(ckpt.spm_bytes(state)))
    record = run_dir / "config.yaml"  # written before the first update: a run that has not saved a checkpoint yet
    if record.is_file():
        diffs = run_differences(OmegaConf.to_container(OmegaConf.load(record)), config)
        if diffs:
            raise ConfigError(f"run_dir holds another run that has no checkpoint yet ({'; '.join(diffs)}; see "
                              f"{record}): use another run_dir, or delete {run_dir} to start it again")
    if not job.init_from:
        if job.train.freeze or job.train.train_top_layers is not None:
            log.warning("freezing without init_from: the frozen weights stay at their random initialisation")
        return Start()
    init = ckpt.load(ckpt.resolve(job.init_from))
    diffs = differences(model_config_with_defaults(init["model_config"]), config["model"], "model", ARCH_KEYS)
    if diffs:
        raise ConfigError(f"init_from={job.init_from} has another architecture ({'; '.join(diffs)}): "
                          "drop those model.* overrides (the checkpoint's architecture is used without them)")
    start = Start(init=init)
    if job.data.vocab == "keep":
        start.vocab = load_vocab(ckpt.spm_bytes(init))
        if job.data.spm_model and load_vocab(job.data.spm_model).sha256 != start.vocab.sha256:
            raise ConfigError(f"data.spm_model={job.data.spm_model} is not the vocabulary of init_from="
                              f"{job.init_from}: set data.vocab=transfer to use it (shared pieces keep their "
                              "embeddings) or data.spm_model=null to keep the checkpoint's")
    return start


# ------------------------------------------------------------------------------------- the update size

MIN_TOKENS = 256  # the floor on a rank's tokens per forward pass that plan_update derives


@dataclass(frozen=True)
class UpdatePlan:
    """How one update is made: `world_size` ranks × `update_freq` forward passes × `max_tokens` each."""

    world_size: int
    update_freq: int
    max_tokens: int  # per rank and forward pass: the budget BatchStream fills (padded max(src, tgt) tokens)

    @property
    def tokens(self) -> int:
        return self.world_size * self.update_freq * self.max_tokens


def plan_update(*, tokens_per_update: int, world_size: int, max_tokens: int, update_freq: int | None = None,
                saved: TrainState | None = None) -> tuple[UpdatePlan, str | None]:
    """The update plan for `world_size` ranks, and a warning when it cannot be what was asked for.

    Derived (`update_freq` None): the fewest forward passes that keep each rank within `max_tokens`,
    `ceil(T / (W × max_tokens))`, each of `T / (W × update_freq)` tokens, so that the update holds T tokens
    at any world size; never below min(max_tokens, MIN_TOKENS) per pass. Above T / MIN_TOKENS ranks (97 for
    the paper's 25k) the floor holds and the update grows past T; more than 10 % past it (from 108 ranks) is
    the warning. Given `update_freq`: `max_tokens` as it is.
    Resumed (`saved`): the saved run's per-pass budget, so that its batches and data position stay valid,
    with the passes that keep its update size at this world size.
    """
    if saved is not None:
        total = saved.world_size * saved.update_freq
        # The saved passes per update, spread over this world size; a train.update_freq other than the saved
        # one is the user's own choice.
        freq = update_freq if update_freq and update_freq != saved.update_freq else max(1, round(total / world_size))
        plan = UpdatePlan(world_size, freq, saved.max_tokens or max_tokens)  # older checkpoints: max_tokens
        if world_size * freq != total:
            return plan, (f"world_size × update_freq changed ({saved.world_size}×{saved.update_freq} → "
                          f"{world_size}×{freq}): the update holds {plan.tokens} tokens instead of "
                          f"{total * plan.max_tokens}, and the batch sequence "
                          "differs from the original run's")
        return plan, None
    if update_freq is not None:
        return UpdatePlan(world_size, update_freq, max_tokens), None
    freq = max(1, math.ceil(tokens_per_update / (world_size * max_tokens)))
    plan = UpdatePlan(world_size, freq, max(min(max_tokens, MIN_TOKENS), tokens_per_update // (world_size * freq)))
    if plan.tokens > 1.1 * tokens_per_update:
        return plan, (f"{world_size} ranks × at least {plan.max_tokens} tokens per pass make an update of "
                      f"{plan.tokens} tokens, {plan.tokens / tokens_per_update:.1f}× train.tokens_per_update="
                      f"{tokens_per_update}, with the schedule unchanged: set train.tokens_per_update={plan.tokens} "
                      "and scale the learning rate with train.lr_scale as large-batch recipes do (e.g. × the "
                      "square root of the ratio, with a longer warmup), or train on fewer ranks")
    return plan, None


# ------------------------------------------------------------------------- decisions every rank shares


class StepOutcome(enum.Enum):
    """What `train.train_step` did."""

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


def keep_best(run: Run, metrics: dict[str, float]) -> None:
    """After a validation: best and stale of train.best_metric, best.pt when it improved, and rank 0's best
    and stale given to every rank (only rank 0 computes BLEU), so that train.patience stops all ranks at the
    same update."""
    t, state = run.job.train, run.state
    if t.best_metric in metrics:
        value = metrics[t.best_metric]
        if state.best is None or (value > state.best if t.best_metric == "bleu" else value < state.best):
            state.best, state.stale = value, 0
            run.save(ckpt.best_path(run.run_dir))
        else:
            state.stale += 1
    best, stale = distributed.broadcast_from_main(
        [math.nan if state.best is None else state.best, float(state.stale)], device=run.device)
    state.best, state.stale = (None if math.isnan(best) else best), int(stale)


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
        t = self.job.train
        test_lines = len(self.data.test.dataset) if t.test_at_end and self.data.test is not None else 0
        self.clock = self.clock or Clock(
            train_seconds=self.state.train_seconds, wall_seconds=self.state.wall_seconds,
            costs=Budget.resumed(self.state, started=time.monotonic()).costs(average_last=t.average_last,
                                                                             test_lines=test_lines))
        self.last_save = self.last_save or time.monotonic()

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


@dataclass
class Window:
    """Training sums since the last log line: loss, NLL, target tokens (per rank), updates, and the seconds
    spent training (validation and saving are not in the throughput)."""

    device: torch.device
    sums: torch.Tensor = None  # [loss, nll, tokens, updates], float64, all-reduced at each report
    seconds: float = 0.0
    lr: float = 0.0  # of the latest update
    gnorm: torch.Tensor | float = 0.0  # its gradient norm (a tensor, read on the host when logged)

    def __post_init__(self) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def end_update(self, losses: list[tuple[torch.Tensor, torch.Tensor]], tokens: float, seconds: float) -> None:
        """Add an update: its summed (loss, nll) of each forward pass, its target tokens (per rank), its time."""
        for loss, nll in losses:
            self.sums[:2] += torch.stack([loss.detach().double(), nll.detach().double()])
        self.sums[2] += tokens
        self.sums[3] += 1
        self.seconds += seconds

    def report(self, **extra: float) -> dict[str, float]:
        """The window's per-token averages and throughput over all ranks (a collective); then empty it."""
        distributed.all_reduce_sum(self.sums)
        loss, nll, tokens, updates = self.sums.tolist()
        stats = {"loss": loss / tokens, "nll": nll / tokens, "ppl": math.exp(min(nll / tokens, 100)), **extra,
                 "tokens_per_s": tokens / self.seconds, "tokens_per_update": tokens / updates,
                 "seconds_per_update": self.seconds / updates}
        self.sums.zero_()
        self.seconds = 0.0
        return stats


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


def mixed_precision(precision: str, device: torch.device):
    """(autocast context, GradScaler) for train.precision = fp32 | bf16 | fp16 (the scaler is on for fp16 only)."""
    warn_if_emulated(precision, device.type)
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
    change the eager batches and train.max_tokens' count. tests/test_compile.py counts the graphs.
    """
    return torch.compile(module, dynamic=True, backend=backend)
