"""Shared by the tests that run train.py in this process."""

from __future__ import annotations

import logging
import signal

import torch

import train


def train_main(overrides: list[str], *, threads: int = 1) -> int:
    """`train.main(overrides)` in this process at `threads` threads (one: the count torchrun gives each
    rank, so that runs compare bit for bit); then put back what it sets for the whole process: the thread
    count, the SIGTERM/SIGINT handlers (Ctrl-C must still stop pytest) and the root logger's handlers and
    level."""
    signals = (signal.SIGTERM, signal.SIGINT)
    previous_threads, handlers = torch.get_num_threads(), [signal.getsignal(sig) for sig in signals]
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    torch.set_num_threads(threads)
    try:
        return train.main(overrides)
    finally:
        torch.set_num_threads(previous_threads)
        for sig, handler in zip(signals, handlers):
            signal.signal(sig, handler)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)
