"""`train.max_time`, the run's wall-clock budget: what the run has spent, all its processes together, and
what its next pieces of work will cost.

A scheduler's allocation is wall-clock, so the budget counts everything a run does: start-up, updates,
validation, checkpoints, the averaging and test translation at the end, and every earlier process of the
run up to its last checkpoint (`TrainState.wall_seconds`; time after a process's last checkpoint is lost
with it, as in fairseq's cumulative training time). fairseq's `--stop-time-hours` and Sockeye's
`--max-seconds` count the same way but check after an update or a checkpoint, so they overrun by one. This
run stops *before* work that would not fit: train.py continues past an update only while the next update,
a validation, the last checkpoint and the end of the run still fit (`another_update_fits`), each priced by
its measured duration (the slowest recent update and validation, whose times vary with the batch and the
machine's load; the latest save; `Costs`; carried in every checkpoint, so a resumed run prices its work from its
first update; 0 in a new run until measured once: set max_time with room for the first validation and save).
The end of the run also holds a deadline: the test translation stops at the first batch that would start
after it, and says so. What the budget does not see: the time between a process's last checkpoint and its
end (lost with a crash), a launcher's restart gap, and the one batch of test translation or one update
whose measured cost was exceeded.

The pure training clock (`TrainState.train_seconds`: updates only) is a different figure: the throughput
and the "training hours" of the tables use it, never this budget.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path


def process_age() -> float:
    """Seconds since this process started (Linux /proc; 0.0 where it cannot be read: counted from now)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return 0.0


_CLOCK_STARTED = False  # whether a run of this process has started its clock (`run_clock_start`)


def run_clock_start() -> float:
    """The time.monotonic() from which a run started on the command line counts its budget: the process's start
    for its first run (imports and start-up are part of the run), now for a later one (Hydra's multirun runs
    its jobs one after another in one process, and a job's budget is its own)."""
    global _CLOCK_STARTED
    first, _CLOCK_STARTED = not _CLOCK_STARTED, True
    return time.monotonic() - (process_age() if first else 0.0)


@dataclass(frozen=True)
class Costs:
    """Seconds that each kind of work took in this process (rank 0's figures decide for every rank)."""

    update: float = 0.0  # the slowest of the recent updates
    validation: float = 0.0  # the slowest of the recent validations (loss, BLEU, figures)
    save: float = 0.0  # the latest checkpoint write
    finish: float = 0.0  # the end of the run: averaging and the test translation, as priced by `Budget.finish_cost`


def another_update_fits(left: float, costs: Costs, *, now: float) -> bool:
    """Whether a run with `left` seconds of budget, about to spend `now` seconds on this update's own
    validation and checkpoint, can afford one more update and still validate, save and finish after it."""
    return left - now >= costs.update + costs.validation + costs.save + costs.finish


def out_of_time(train, step: int, clock) -> str | None:
    """train.py's max_time rule after update `step`, from rank 0's agreed `clock` (agreement.Clock): the stop
    reason when another update would not fit (`another_update_fits`), else None. This update's own
    validation and save (by step, or save_every_minutes) come first."""
    saves = step % train.save_every_steps == 0 or (
        train.save_every_minutes and clock.since_save >= 60 * train.save_every_minutes)
    now = (clock.costs.validation if step % train.valid_every_steps == 0 else 0.0) + (clock.costs.save if saves else 0.0)
    left = train.max_time - clock.wall_seconds - clock.costs.update  # the clock was read before this update
    if another_update_fits(left, clock.costs, now=now):
        return None
    return f"max_time={train.max_time:g}s (wall clock; {max(left, 0):.0f}s left)"


def time_to_end(train, step: int, *, seconds_per_update: float, spent: float) -> tuple[float, str]:
    """The progress line's ETA after update `step`: the seconds until the first of train.max_steps (at
    `seconds_per_update`) and train.max_time (`spent` of it on the wall clock: the run ends inside it) ends the
    run, and which of them that is. (nan, "max_epochs") or (nan, "no limit") where neither is set."""
    ends = []
    if train.max_steps:
        ends.append((max(train.max_steps - step, 0) * seconds_per_update, f"max_steps={train.max_steps}"))
    if train.max_time:
        ends.append((max(train.max_time - spent, 0.0), f"max_time={train.max_time:g}s"))
    if not ends:
        return math.nan, "max_epochs" if train.max_epochs else "no limit"
    return min(ends, key=lambda end: end[0])


@dataclass
class Budget:
    """The run's wall clock: `spent_before` seconds of earlier processes (from the checkpoint) plus this
    process since `started` (a time.monotonic() value: the process's start for train.py), and the durations
    measured so far."""

    spent_before: float = 0.0
    started: float = field(default_factory=time.monotonic)
    save: float = 0.0
    decode_line: float = 0.0  # seconds per translated line at the latest BLEU validation (0: none yet)
    updates: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    validations: collections.deque = field(default_factory=lambda: collections.deque(maxlen=5))

    @property
    def validation(self) -> float:
        """The slowest recent validation (0.0 before the first)."""
        return max(self.validations, default=0.0)

    @classmethod
    def resumed(cls, state, started: float) -> Budget:
        """The budget of a run at `state` (a TrainState): its spent time and the costs its last process measured."""
        budget = cls(spent_before=state.wall_seconds, started=started, save=state.save_seconds,
                     decode_line=state.decode_line_seconds)
        if state.update_seconds:
            budget.add_update(state.update_seconds)
        if state.validation_seconds:
            budget.validations.append(state.validation_seconds)
        return budget

    def record(self, state) -> None:
        """Write the spent time and the measured costs into `state` (before a checkpoint)."""
        state.wall_seconds, state.update_seconds = self.spent(), max(self.updates, default=0.0)
        state.validation_seconds, state.save_seconds, state.decode_line_seconds = (self.validation, self.save,
                                                                                   self.decode_line)

    def spent(self) -> float:
        return self.spent_before + time.monotonic() - self.started

    def deadline(self, max_time: float) -> float:
        """The time.monotonic() value at which the run will have spent `max_time` seconds."""
        return self.started - self.spent_before + max_time

    def add_update(self, seconds: float) -> None:
        self.updates.append(seconds)

    @contextlib.contextmanager
    def timing(self, kind: str):
        """Times the block as a `kind` of work: "validation" (one of the recent ones) or "save" (the latest)."""
        started = time.monotonic()
        try:
            yield
        finally:
            seconds = time.monotonic() - started
            if kind == "validation":
                self.validations.append(seconds)
            elif kind == "save":
                self.save = seconds
            else:
                raise ValueError(f"Budget.timing: unknown kind {kind!r}; give 'validation' or 'save'")

    def finish_cost(self, *, average_last: int, test_lines: int) -> float:
        """The end of the run: averaging reads `average_last` checkpoints and writes one (each about a
        checkpoint write), and the test translation at the latest measured seconds per line."""
        return self.save * (average_last + 1) + self.decode_line * test_lines

    def costs(self, *, average_last: int, test_lines: int) -> Costs:
        return Costs(update=max(self.updates, default=0.0), validation=self.validation, save=self.save,
                     finish=self.finish_cost(average_last=average_last, test_lines=test_lines))
