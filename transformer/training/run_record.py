"""What a run leaves for the people who read it: run_dir/config.yaml and provenance.json, TensorBoard events
that never stop the run, the periodic log line (and the `Window` of sums it reports), and the closing summary
of where everything is."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import resource
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf

from data.files import atomic_write
from transformer import distributed
from transformer.config import TrainJob
from transformer.checkpoint import TrainState
from transformer.training.budget import time_to_end
from transformer.evaluation.scoring import package_versions

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("train")


def write_run_record(job: TrainJob, state: TrainState, *, world_size: int, argv: list[str]) -> None:
    """run_dir/config.yaml (the resolved job) and provenance.json (where and how it was started), each
    atomically: a full disk stops the run in one line (CheckpointError) with the old records and every
    checkpoint intact."""
    run_dir = Path(job.run_dir)
    atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(job))),
                 what="run record")
    record = provenance(world_size=world_size, update_freq=state.update_freq, max_tokens=state.max_tokens,
                        argv=argv, data=job.data)
    atomic_write(run_dir / "provenance.json", json.dumps(record, indent=2) + "\n", what="run record")



class EventWriter:
    """TensorBoard's SummaryWriter, whose failures cost the events and never the run: the first OSError of a
    write, a flush or close (a full disk, a removed directory; TensorBoard writes from a thread of its own
    and raises its error at the next call) is reported in one warning line, and the run goes on without
    TensorBoard events. Checkpoints are written apart (a full disk stops the run at the next one)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # here: ~0.4 s of every start that writes no events

        self._methods = SummaryWriter
        self._writer: SummaryWriter | None = SummaryWriter(str(log_dir))
        self._log_dir = log_dir
        if threading.excepthook is not _quiet_event_thread:  # its thread's traceback: said in one line here
            _quiet_event_thread.previous = threading.excepthook
            threading.excepthook = _quiet_event_thread

    def __getattr__(self, name: str):
        if name.startswith("_"):  # own attributes (before __init__, e.g. in copy.copy): never SummaryWriter's
            raise AttributeError(name)
        method = getattr(self._methods, name)

        def guarded(*args, **kwargs):
            if self._writer is None:
                return None
            try:
                return method(self._writer, *args, **kwargs)
            except OSError as error:
                self._writer = None
                log.warning("TensorBoard events stopped: could not write to %s (%s); training goes on without "
                            "them (free some space: checkpoints stop the run when they cannot be written)",
                            self._log_dir, error.strerror or error)
                return None
        return guarded



def _quiet_event_thread(args) -> None:
    """threading.excepthook: the OSError that ends TensorBoard's writer thread is EventWriter's one line."""
    if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
        return
    _quiet_event_thread.previous(args)



def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"



def provenance(*, world_size: int, update_freq: int, max_tokens: int, argv: list[str], data=None) -> dict:
    """Where and how a run was started: command, host, commit, library versions, world size, batch, and the
    corpus (`data`, a DataConfig: the dataset with its pinned revision, or the text prefixes)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {**package_versions(), "torch": torch.__version__}
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
        "data": None if data is None else {
            "dataset": data.dataset, "subset": data.subset,
            "revision": data.revision if data.dataset else None,  # null for a hub dataset: its newest revision
            "train_prefix": data.train_prefix, "valid_prefix": data.valid_prefix, "test_prefix": data.test_prefix,
            "train_weight": data.train_weight, "extra_train": [dataclasses.asdict(c) for c in data.extra_train]},
    }



@dataclass
class Window:
    """Training sums since the last log line: loss, NLL, target tokens (this rank's share), updates, and the
    seconds spent training (validation and saving are not in the throughput)."""

    device: torch.device
    sums: torch.Tensor = None  # [loss, nll, tokens], float64, all-reduced at each report
    updates: int = 0  # every rank makes the same updates: counted, not summed over the ranks
    seconds: float = 0.0
    lr: float = 0.0  # of the latest update
    gnorm: torch.Tensor | float = 0.0  # its gradient norm (a tensor, read on the host when logged)

    def __post_init__(self) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=self.device)

    def end_update(self, losses: list[tuple[torch.Tensor, torch.Tensor]], tokens: float, seconds: float) -> None:
        """Add an update: its summed (loss, nll) of each forward pass, this rank's share of its target tokens (the
        update's divided by the world size), its time."""
        for loss, nll in losses:
            self.sums[:2] += torch.stack([loss.detach().double(), nll.detach().double()])
        self.sums[2] += tokens
        self.updates += 1
        self.seconds += seconds

    def report(self, **extra: float) -> dict[str, float]:
        """The window's per-token averages and throughput over all ranks (a collective); then empty it."""
        distributed.all_reduce_sum(self.sums)
        (loss, nll, tokens), updates = self.sums.tolist(), self.updates
        stats = {"loss": loss / tokens, "nll": nll / tokens, "ppl": math.exp(min(nll / tokens, 100)), **extra,
                 "tokens_per_s": tokens / self.seconds, "tokens_per_update": tokens / updates,
                 "seconds_per_update": self.seconds / updates}
        self.sums.zero_()
        self.updates, self.seconds = 0, 0.0
        return stats


def log_window(window: Window, *, step: int, train, spent: float, writer: EventWriter | None) -> None:
    """The periodic log line of the window's averages (a collective: every rank calls it), and rank 0's
    TensorBoard scalars. Its ETA is the first of train.max_steps and train.max_time to end the run (`spent`:
    the wall clock of train.max_time so far), named beside it."""
    stats = window.report(lr=window.lr, gnorm=float(window.gnorm))
    seconds_per_update = stats.pop("seconds_per_update")
    eta, limit = time_to_end(train, step, seconds_per_update=seconds_per_update, spent=spent)
    log.info("update %d | lr %.3g | loss %.3f | nll %.3f | ppl %.2f | gnorm %.3f | %.0f tgt tok/s | "
             "%.0f tgt tok/update | eta %s (%s)", step, stats["lr"], stats["loss"], stats["nll"], stats["ppl"],
             stats["gnorm"], stats["tokens_per_s"], stats["tokens_per_update"], format_seconds(eta), limit)
    for key, value in stats.items() if writer else ():
        writer.add_scalar(f"train/{key}", value, step)


def peak_resident_mib() -> float:
    """The most resident memory this process has held since it started (the kernel's high-water mark), in MiB."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / 2**20 if sys.platform == "darwin" else kib / 1024


def resume_command(argv: list[str], ended_by: str | None) -> str:
    """The command that trains on past the limit that ended the run (`ended_by`: train.py's stop reason), its
    earlier value of that key dropped from the command line."""
    reason = ended_by or ""
    key = ("train.max_time" if reason.startswith("max_time") else "train.max_epochs" if reason.startswith("max_epochs")
           else "train.patience" if "(patience)" in reason else "train.max_steps")
    kept = [a for a in argv if a.lstrip("+").split("=", 1)[0] != key]
    more = "<more seconds>" if key == "train.max_time" else "<more>"
    return f"python train.py {' '.join(kept)} {key}={more}    # resumes where this run stopped"


def print_summary(job, argv: list[str], ended_by: str | None = None) -> None:
    """The run's peak resident memory (the log), where everything of a finished run is, and what to try next
    (stderr; `ended_by`: the limit that ended training, which the resume command raises)."""
    log.info("peak resident memory %.0f MiB (this process)", peak_resident_mib())
    run_dir = Path(job.run_dir)
    test_prefix, d = job.data.test_prefix, job.data
    test_src, test_ref = ((f"{test_prefix}.{d.src_lang}", f"{test_prefix}.{d.tgt_lang}") if test_prefix
                          else ("src.txt", "ref.txt"))
    t = job.train
    if job.init_from or t.patience:  # a small corpus overfits; an early stop leaves the last checkpoints past the best
        model = run_dir / "checkpoints" / "best.pt"
        which = (f"best.pt (the best validation {t.best_metric}: fine-tuning overfits a small corpus and an early "
                 f"stop leaves the last checkpoints past the best) or averaged.pt (the last {t.average_last} "
                 "averaged, the paper's choice when the curve is still flat at the end)")
    else:
        model = run_dir
        which = (f"averaged.pt (the last {t.average_last} averaged, as the paper; checkpoint=<run_dir> picks it) "
                 f"or best.pt (the best validation {t.best_metric})")
    print("\n".join([
        f"run directory:  {run_dir}",
        f"  checkpoints:  {run_dir / 'checkpoints'} (averaged.pt = the average of the last {t.average_last}; "
        f"best.pt = the best validation {t.best_metric}; last.pt = the newest)",
        f"  translate with {which}",
        f"  tensorboard:  tensorboard --logdir {run_dir / 'tensorboard'}",
        f"  config:       {run_dir / 'config.yaml'}; provenance: {run_dir / 'provenance.json'}",
        "next:",
        f"  python translate.py checkpoint={model} < {test_src}",
        f"  python evaluate.py checkpoint={model} src={test_src} ref={test_ref}",
        f"  {resume_command(argv, ended_by)}",
    ]), file=sys.stderr, flush=True)
