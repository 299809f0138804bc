"""Writing files that must never be seen half-written, and the test-only crash points inside those writes.

`atomic_write` is the one way this project writes such a file (checkpoints, vocabularies, caches, scores,
run records); `link_or_copy` gives a second name to one (last.pt). A failed write raises a one-line
WriteError and leaves whatever was at the path before intact.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

from data.errors import WriteError

# Test-only crash hook. TRANSFORMER_CRASH_AT=<point>[:<n>] SIGKILLs this process the n-th time (default: the
# first) it reaches the named point of a checkpoint write, so that tests/training/test_reliability.py and
# tools/crash_soak.py can prove that a crash anywhere leaves every checkpoint readable and resume exact.
# Unset (always, outside those tests) it costs one dictionary lookup per checkpoint written.
CRASH_POINTS = (
    "before-fsync",        # atomic_write(): the temporary file is written, not yet fsynced
    "before-rename",       # atomic_write(): fsynced, not yet renamed over the destination
    "before-dir-fsync",    # atomic_write(): renamed, the directory not yet fsynced
    "before-link-rename",  # link_or_copy(): the temporary link to the new last.pt exists, not yet renamed
    "before-last",         # train.py: the numbered checkpoint is written, last.pt not yet updated
    "mid-prune",           # prune(): about to delete one of the old numbered checkpoints
)
_crash_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process here if TRANSFORMER_CRASH_AT names this point (test-only; see CRASH_POINTS)."""
    spec = os.environ.get("TRANSFORMER_CRASH_AT")
    if not spec or spec.partition(":")[0] != name:
        return
    _crash_counts[name] = _crash_counts.get(name, 0) + 1
    if _crash_counts[name] == int(spec.partition(":")[2] or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[Any], None], *, what: str = "file",
                 elsewhere: str = "choose another run_dir") -> None:
    """Write `data` (text as UTF-8, bytes, or a function writing to a binary file) to `path` atomically: a
    temporary file in the same directory, fsync, rename, fsync of the directory. The one way this project
    writes a file that must never be seen half-written (checkpoints, vocabularies, caches, scores).

    A crash or a failed write (disk full, unwritable directory) never leaves a partial file under `path`,
    and whatever was at `path` before stays intact. I/O failures raise WriteError, whose fix ends with
    `elsewhere` (the key that chooses where the file goes).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            crash_point("before-fsync")
            os.fsync(f.fileno())
        crash_point("before-rename")
        os.replace(tmp, path)
        crash_point("before-dir-fsync")
        _fsync_dir(path.parent)
    except BaseException as e:
        remove_quietly(tmp)
        os_error = _os_error_in_chain(e)
        if os_error is None:
            raise  # not an I/O failure (e.g. an object torch cannot serialise): a bug, keep the traceback
        reason = os_error.strerror or str(os_error)
        raise WriteError(
            f"could not write {what} {path}: {reason}; {_fix_for(os_error)} or {elsewhere} "
            f"(earlier {what}s are intact)"
        ) from e


def _fix_for(error: OSError) -> str:
    """What to do about a failed write, by its cause."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free some space"
    if error.errno == errno.EFBIG:
        return "raise the file size limit (ulimit -f)"
    return "make that directory writable"


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable. Some filesystems refuse fsync on a directory; the rename stands anyway."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes, read 16 MiB at a time."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def file_identity(path: Path) -> dict:
    """What tells a file's version apart (a resumed job must read the same files): its size and the SHA-256 of
    its bytes. Not its path or modification time: a corpus or checkpoint copied, moved, restored from a backup or
    mounted again is the same file, and a resumed job goes on with it (about a second a GB to hash)."""
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _os_error_in_chain(error: BaseException) -> OSError | None:
    """torch.save reports a failed write as a RuntimeError whose __context__ is the OSError."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make `dst` (e.g. last.pt) hold the same bytes as `src` (a numbered checkpoint), atomically.

    A hard link costs no space or time; where the filesystem has none, a copy. Either way the new name
    appears by rename, so `dst` is never partial. Sharing an inode is safe: `save` never writes in place.
    """
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.tmp")
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        crash_point("before-link-rename")
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except OSError as e:
        remove_quietly(tmp)
        raise WriteError(
            f"could not write checkpoint {dst}: {e.strerror or e}; {_fix_for(e)} or choose another run_dir "
            "(earlier checkpoints are intact)"
        ) from e
