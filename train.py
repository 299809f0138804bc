"""Train the Transformer: `python train.py [key=value ...]`, or under `torchrun` for DDP.

`train()` reads as the procedure it is: set up → start or resume → loop → finish. The steps it calls live in
transformer/training/ (start.py, run.py, update.py, validation.py, run_record.py); the config schema is
transformer/config.py.

    python train.py                                   # the paper's base model on WMT14 EN-DE
    python train.py experiment=quickstart             # a small model on the generated corpus, on a CPU
    torchrun --nproc_per_node=8 train.py experiment=paper_big_en_de
    python train.py ... prepare_only=true             # vocabulary + encoded data only (e.g. on a CPU box)
    python train.py --help | --cfg job | -m key=a,b   # Hydra: the groups, the resolved config, a sweep
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from data.lock import releasing_locks
from transformer.cli import compose_config, hydra_app, setup_logging, to_job
from transformer.config import TrainJob
from transformer.kernels import keep_freed_memory
from transformer.training.budget import run_clock_start
from transformer.training.distill import with_distilled_data
from transformer.training.run import Run, StopRequest, build_run, stop_reason, user_error
from transformer.training.run_record import Window, log_window, write_run_record
from transformer.training.start import prepare_data, prepared_only, resume_or_initialise, start_processes
from transformer.training.update import StepOutcome, train_step
from transformer.training.validation import finish, validate

log = logging.getLogger("train")


def train(cfg: DictConfig, argv: list[str], stop: StopRequest, started: float) -> int:
    # 1. Set up: the config, the processes, the device, the run directory.
    job: TrainJob = to_job(cfg)
    setup_logging()
    job, dist, device = start_processes(job, cfg, argv)
    run_dir = Path(job.run_dir)
    # With distill.teacher: the teacher's translations of the training sources become the corpus (resumable).
    # That is the pipeline's step before the student's training: train.max_time counts from its end.
    translating = time.monotonic()
    job = with_distilled_data(job, run_dir, rank=dist.rank, world_size=dist.world_size, device=device)
    if job.distill.teacher is not None:
        started += time.monotonic() - translating

    # 2. Start or resume: the checkpoint, the vocabulary, the data; then the live objects of the run.
    start = resume_or_initialise(job, run_dir)
    data = prepare_data(job, run_dir, start, is_main=dist.is_main)
    if job.prepare_only:  # the vocabulary and the encoded data only
        return prepared_only(run_dir)
    run = build_run(job, dist=dist, device=device, run_dir=run_dir, start=start, data=data, started=started)
    del start  # the checkpoint read at start (weights and Adam moments) is in the live objects now
    if dist.is_main:
        write_run_record(job, run.state, world_size=dist.world_size, argv=argv)

    # 3. The loop: train; log; validate and save. A finished run started again trains no further update; a run
    # stopped by a signal right after an update first does what that update's end would have (`after_update`).
    t, window = job.train, Window(device)
    reason = after_update(run) if run.state.unfinished_update else stop_reason(run)
    while reason is None:
        before = run.state.step
        outcome = train_step(run, window, stop)
        if outcome is StepOutcome.STOP:
            reason = "a stop signal"
            run.state.unfinished_update = run.state.step != before  # not an fp16 overflow's redo
            break
        if outcome is StepOutcome.OVERFLOW:
            continue
        if run.state.step % t.log_every_steps == 0:
            log_window(window, step=run.state.step, train=t, spent=run.budget.spent(), writer=run.writer)
        reason = after_update(run)

    # 4. Finish: the averaged checkpoint, the test translation, where everything is. The ranks leave the
    # process group first: rank 0's lone work would otherwise hold the others in a collective that times out.
    if reason == "a stop signal":
        run.save_last()
        log.info("stopped by a signal at update %d; run the same command to resume", run.state.step)
    else:
        log.info("training stopped at update %d: %s", run.state.step, reason)
    run.close()
    if reason != "a stop signal" and dist.is_main:
        finish(run, argv, ended_by=reason)
    return 0


def after_update(run: Run) -> str | None:
    """The end of update `run.state.step`: validate and save where the schedule says, and where the run ends;
    returns why it ends, or None to go on."""
    t, step = run.job.train, run.state.step
    run.state.unfinished_update = False
    reason = stop_reason(run)
    if step % t.valid_every_steps == 0 or reason is not None:
        validate(run)
        reason = reason or stop_reason(run)
    if step % t.save_every_steps == 0 or reason is not None:
        run.save_numbered()
    elif t.save_every_minutes and run.clock.since_save >= 60 * t.save_every_minutes:
        run.save_last()
    return reason


@releasing_locks  # the run_dir's lock (hold_run_dir) ends with the run, also for in-process callers
def run_training(cfg: DictConfig, argv: list[str] | None = None, started: float | None = None) -> int:
    """`train` with the stop-signal handlers installed and its failures as one-line errors. The run's wall
    clock (train.max_time) counts from `started` (time.monotonic()), by default this process's start (a later
    job of a multirun: its own start)."""
    started = run_clock_start() if started is None else started
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
