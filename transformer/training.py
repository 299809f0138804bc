"""What train.py's procedure works with: where a run starts (`resume_or_initialise`), the objects of a
run (`Run`) and its checkpoints, stop signals, dropout seeds, the throughput window and its log line, the
provenance record and the closing summary."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import logging
import math
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from data.batching import BatchStream
from data.pipeline import Prepared
from data.vocab import Vocab
from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.checkpoint import TrainState
from transformer.config import ARCH_KEYS, ConfigError, TrainJob
from transformer.model import Transformer

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


# ------------------------------------------------------------------------------------------ starting

# Keys of data.* whose change makes a saved run a different run (the architecture's are config.ARCH_KEYS).
DATA_KEYS = ("src_lang", "tgt_lang", "vocab_size", "spm_model", "dataset", "subset", "train_prefix",
             "max_len", "max_len_ratio", "dedup")

# ---------------------------------------------------------------------------------- where the run starts


def differences(saved: dict, current: dict, section: str, keys) -> list[str]:
    return [f"{section}.{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


@dataclass
class Start:
    """What a run starts from: its own checkpoint (resume), another run's weights (init_from), or nothing;
    and the vocabulary it must keep (None: prepare one from the corpus or data.spm_model)."""

    resume: dict | None = None
    resume_path: Path | None = None
    init: dict | None = None
    vocab: Vocab | None = None


def resume_or_initialise(job: TrainJob, run_dir: Path) -> Start:
    """Resume the run in `run_dir` if it has a checkpoint (then init_from is ignored); else initialise from
    `init_from` if set; and decide the vocabulary: the resumed run's, or init_from's with data.vocab=keep."""
    config = dataclasses.asdict(job)
    resume_path = ckpt.latest_resumable(run_dir)
    if resume_path is not None:
        state = ckpt.load(resume_path)
        saved = state["config"]
        diffs = (differences(saved["model"], config["model"], "model", ARCH_KEYS)
                 + differences(saved["data"], config["data"], "data", DATA_KEYS)
                 + differences(saved, config, "", ("seed",))
                 + differences({"freeze": [], "train_top_layers": None, **saved["train"]}, config["train"], "train",
                               ("max_tokens", "freeze", "train_top_layers")))  # the saved Adam state's parameters
        if diffs:
            raise ConfigError("run_dir holds a different run (" + "; ".join(d.lstrip(".") for d in diffs)
                              + "): use another run_dir or the saved values")
        if job.init_from:
            log.warning("init_from=%s is ignored: resuming the run in %s", job.init_from, run_dir)
        log.info("resuming from %s (update %d)", resume_path, state["step"])
        return Start(resume=state, resume_path=resume_path, vocab=Vocab.from_bytes(ckpt.spm_bytes(state)))
    if not job.init_from:
        if job.train.freeze or job.train.train_top_layers is not None:
            log.warning("freezing without init_from: the frozen weights stay at their random initialisation")
        return Start()
    init = ckpt.load(ckpt.resolve(job.init_from))
    diffs = differences(init["model_config"], config["model"], "model", ARCH_KEYS)
    if diffs:
        raise ConfigError(f"init_from={job.init_from} has another architecture ({'; '.join(diffs)}): "
                          "set model.* to the checkpoint's values")
    start = Start(init=init)
    if job.data.vocab == "keep":
        start.vocab = Vocab.from_bytes(ckpt.spm_bytes(init))
        if job.data.spm_model and Vocab.load(job.data.spm_model).sha256 != start.vocab.sha256:
            raise ConfigError(f"data.spm_model={job.data.spm_model} is not the vocabulary of init_from="
                              f"{job.init_from}: set data.vocab=transfer to use it (shared pieces keep their "
                              "embeddings) or data.spm_model=null to keep the checkpoint's")
    return start



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
    model: Transformer
    train_model: torch.nn.Module  # the model, under DDP and torch.compile when they are on
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    autocast: contextlib.AbstractContextManager
    state: TrainState
    writer: SummaryWriter | None = None

    def save(self, path: Path, kind: str = "train") -> None:
        """A training checkpoint of the run as it is now (rank 0 writes; the others skip)."""
        if self.dist.is_main:
            ckpt.save(ckpt.training_checkpoint(
                state=self.state, model=self.model, model_config=dataclasses.asdict(self.model.config),
                spm_model=self.data.vocab.model_proto, config=dataclasses.asdict(self.job),
                optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                data_state=self.stream.state_dict(), kind=kind), path)

    def save_numbered(self) -> None:
        """step-<N>.pt, then last.pt as the same file, then the oldest beyond train.keep_last removed."""
        if self.dist.is_main:
            path = ckpt.numbered_path(self.run_dir, self.state.step)
            self.save(path)
            ckpt.crash_point("before-last")  # test-only (see transformer/checkpoint.py)
            ckpt.link_or_copy(path, ckpt.last_path(self.run_dir))
            ckpt.prune(self.run_dir, self.job.train.keep_last)


@dataclass
class Window:
    """Training sums since the last log line: loss, NLL, target tokens (per rank), updates, and the seconds
    spent training (validation and saving are not in the throughput)."""

    device: torch.device
    sums: torch.Tensor = None  # [loss, nll, tokens, updates], float64, all-reduced at each report
    seconds: float = 0.0
    lr: float = 0.0  # of the latest update
    gnorm: torch.Tensor | float = 0.0  # its gradient norm (a tensor: read only when logged, no host sync per step)

    def __post_init__(self) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def add(self, loss: torch.Tensor, nll: torch.Tensor) -> None:
        self.sums[:2] += torch.stack([loss.detach().double(), nll.detach().double()])

    def end_update(self, tokens: float, seconds: float) -> None:
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


def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def provenance(*, world_size: int, update_freq: int, max_tokens: int, argv: list[str]) -> dict:
    """Where and how a run was started: command, host, commit, library versions, world size, batch."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("datasets", "sentencepiece", "sacrebleu"):
        versions[package] = importlib.metadata.version(package)
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": [sys.executable, sys.argv[0], *argv],
        "host": socket.gethostname(),
        "git_commit": commit,
        "versions": versions,
        "world_size": world_size,
        "update_freq": update_freq,
        "max_tokens_per_update": max_tokens * world_size * update_freq,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def log_window(run: Run, window: Window) -> None:
    stats = window.report(lr=window.lr, gnorm=float(window.gnorm))
    t, step = run.job.train, run.state.step
    eta = (t.max_steps - step) * stats.pop("seconds_per_update") if t.max_steps else float("nan")
    log.info("update %d | lr %.3g | loss %.3f | nll %.3f | ppl %.2f | gnorm %.3f | %.0f tgt tok/s | "
             "%.0f tgt tok/update | eta %s", step, stats["lr"], stats["loss"], stats["nll"], stats["ppl"],
             stats["gnorm"], stats["tokens_per_s"], stats["tokens_per_update"], format_seconds(eta))
    for key, value in stats.items() if run.writer else ():
        run.writer.add_scalar(f"train/{key}", value, step)



def print_summary(job, argv: list[str]) -> None:
    """Where everything of a finished run is, and what to try next (stderr)."""
    run_dir = Path(job.run_dir)
    test_prefix, d = job.data.test_prefix, job.data
    test_src, test_ref = (f"{test_prefix}.{d.src_lang}", f"{test_prefix}.{d.tgt_lang}") if test_prefix else ("src.txt", "ref.txt")
    print("\n".join([
        f"run directory:  {run_dir}",
        f"  checkpoints:  {run_dir / 'checkpoints'} (averaged.pt = the average of the last {job.train.average_last})",
        f"  tensorboard:  tensorboard --logdir {run_dir / 'tensorboard'}",
        f"  config:       {run_dir / 'config.yaml'}; provenance: {run_dir / 'provenance.json'}",
        "next:",
        f"  python translate.py checkpoint={run_dir} < {test_src}",
        f"  python evaluate.py checkpoint={run_dir} src={test_src} ref={test_ref}",
        f"  python train.py {' '.join(argv)} train.max_steps=<more>    # resumes where this run stopped",
    ]), file=sys.stderr, flush=True)
