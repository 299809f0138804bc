"""One writer per directory: an exclusive OS file lock that the kernel releases when its process ends.

train.py holds one on its run_dir for the whole run, evaluate.py on its `out=` folder, each rank of a sharded
corpus translation on its share of `<output>.parts/`. A second process that asks for the same lock is refused
at once with a one-line DirectoryInUse (a ConfigError: exit status 2) naming the holder (PID, host, start time
and command, which the holder writes into the lock file) and what to do. The lock is `flock` on
`<directory>/.writer.lock`: a SIGKILLed or crashed holder leaves the file behind but never the lock, so the
next run starts without any clean-up. The file itself is never removed (removing a lock file races with a
process that has just opened it).

Shared filesystems: NFS (v3 with lockd, v4), GPFS and Lustre mounted with `-o flock` honour flock across
machines; Lustre with `-o localflock` and some FUSE/SMB mounts honour it within one machine only, and there a
second run on another node is not refused. Where the filesystem refuses locks altogether (ENOLCK,
EOPNOTSUPP), a warning says so and the run goes on unprotected. docs/RELIABILITY.md has the multi-node rule.

`hold(directory, ...)` takes a lock for the innermost function decorated with `@releasing_locks` (the entry
points' `run`): it is released when that function returns or raises, so that in-process callers (tests,
notebooks) can run again on the same directory; a lock this process holds already is not asked for again.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import functools
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Callable, TypeVar

from data.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".writer.lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

F = TypeVar("F", bound=Callable)


class DirectoryInUse(ConfigError):
    """Another process writes into this directory now; `str` names it and what to do."""


class WriterLock:
    """An exclusive flock on `path`, held from `acquire()` to `release()` (or the end of the process)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None
        self.made_folder = False  # the folder was created for the lock: removed on release if nothing else came

    def acquire(self, *, what: str, fix: str) -> WriterLock:
        """Take the lock, or raise DirectoryInUse: `<what> is in use by <holder>: <fix>`."""
        try:
            self.made_folder = not self.path.parent.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise ConfigError(f"cannot create the lock file {self.path}: {error.strerror or error}; {fix}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryInUse(f"{what} is in use by {holder(self.path)}: {fix}") from None
            if error.errno in _UNSUPPORTED:
                log.warning("the filesystem of %s does not support file locks (%s): nothing stops a second "
                            "process from writing there at the same time", self.path.parent, error.strerror)
                return self
            raise
        self.fd = fd
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  "command": " ".join([os.path.basename(sys.argv[0] if sys.argv else "python"), *sys.argv[1:]])[:300]}
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(record) + "\n").encode("utf-8"))
        except OSError:
            pass  # the lock holds without its description (a full disk): the refusal then says less
        return self

    def release(self) -> None:
        """Release the lock; a folder made for it that holds nothing else (the run failed before writing) goes
        too, so that an error leaves no trace (removed while still locked: a process that opened the file
        before then was refused)."""
        if self.fd is None:
            return
        if self.made_folder:
            try:
                if [p.name for p in self.path.parent.iterdir()] == [self.path.name]:
                    self.path.unlink()
                    self.path.parent.rmdir()
            except OSError:
                pass
        os.close(self.fd)  # closing the last descriptor of the open file releases the flock
        self.fd = None


def holder(path: Path) -> str:
    """Who holds the lock at `path`, as its holder described itself."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return (f"PID {record['pid']} on host {record['host']}, started {record['started']} "
                f"({record.get('command', '?')})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not described itself yet)"


# Locks taken by `hold`, per active `releasing_locks` call (innermost last); path -> lock.
_frames: list[dict[str, WriterLock]] = []
_process_lifetime: dict[str, WriterLock] = {}  # taken outside any releasing_locks call: held until exit


def hold(directory: str | os.PathLike, *, what: str, fix: str, name: str = LOCK_NAME) -> WriterLock:
    """The lock `<directory>/<name>`, taken until the innermost `releasing_locks` function returns."""
    path = Path(directory, name).absolute()
    for frame in (*_frames, _process_lifetime):
        if str(path) in frame:
            return frame[str(path)]
    lock = WriterLock(path).acquire(what=what, fix=fix)
    (_frames[-1] if _frames else _process_lifetime)[str(path)] = lock
    return lock


def releasing_locks(function: F) -> F:
    """Decorate a function so that every lock `hold` takes while it runs is released when it returns or raises."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        _frames.append({})
        try:
            return function(*args, **kwargs)
        finally:
            for lock in _frames.pop().values():
                lock.release()

    return wrapper  # type: ignore[return-value]
