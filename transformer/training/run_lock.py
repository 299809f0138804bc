"""One training per run directory, under torchrun too: global rank 0 holds the run_dir's writer lock
(data/lock.py) for the whole job, and every rank learns whether it got it before anything is written.

Rank 0 asks for the lock right after the process group forms, and the answer is the group's first
collective (a broadcast): a refusal is one line on rank 0 naming the holder and one line on every other rank
pointing to it, and no rank has created, cleaned or written anything in the run directory. One rank holds
the lock for all: a second torchrun job on the same run_dir is refused by its own rank 0. On several nodes
that protection needs a filesystem whose locks work across machines (docs/RELIABILITY.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.errors import ConfigError
from data.lock import DirectoryInUse, hold
from transformer import distributed


def hold_run_dir(run_dir: Path, dist: distributed.DistInfo, device: torch.device) -> None:
    """Take run_dir's writer lock on rank 0 until the training returns (train.py's `releasing_locks`);
    raise a one-line DirectoryInUse on every rank when another process holds it."""
    refusal: ConfigError | None = None
    if dist.is_main:
        try:
            hold(run_dir, what=f"run_dir {run_dir}",
                 fix="two trainings in one run_dir overwrite each other's checkpoints; wait for that run to end "
                     "(or stop it) and run the same command to resume, or choose another run_dir")
        except ConfigError as error:
            refusal = error
    refused = distributed.broadcast_from_main([float(refusal is not None)], device=device)[0]
    if refusal is not None:
        raise refusal
    if refused:
        raise DirectoryInUse(f"rank {dist.rank}: rank 0 could not take run_dir {run_dir} (its message names the "
                             "process that holds it); nothing was written: wait for that run to end, or choose "
                             "another run_dir")
