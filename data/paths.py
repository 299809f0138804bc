"""Every path a user gives, checked in one place before anything is read or written.

A config key that holds a path says so in the schema (`path_field(ROLE)` in transformer/config.py and
data/config.py), with one of the roles below; `check_job_paths(job)` walks a job's dataclasses and checks each
path by its role, and the entry points call it once, before any model or data is loaded. The same checks
(`check_input`, `check_output_file`, `check_output_dir`) and the two openers (`open_input`,
`open_output`) serve the Python API and `python -m transformer.hf`. Every failure is a one-line ConfigError
(exit status 2) that names the key, the path, what is wrong and what to do:

- an input must exist, be a file where a file is read (a directory where one is read), and lie under
  directories, not under a regular file;
- an output may be missing (its folders are created), but must not be a directory where a file is written
  (or a file where a directory is), must lie under directories, must be writable (tried by creating and
  removing a hidden file in its nearest existing folder: permission bits alone say nothing for root or a
  read-only mount), and must not be the same file as one of the job's inputs (`input=X output=X` would
  replace the source with its translation).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Collection, Iterator

from data.errors import ConfigError

READ_FILE = "read-file"  # an existing file (text, a SentencePiece model, a hypothesis)
READ = "read"  # an existing file or directory (a checkpoint or a run directory; a Marian directory)
READ_PREFIX = "read-prefix"  # <prefix>.<src_lang> and <prefix>.<tgt_lang> (data.*_prefix)
WRITE_FILE = "write-file"  # a file written (its folders are created)
WRITE_DIR = "write-dir"  # a directory written into (created with its parents)
ROLES = (READ_FILE, READ, READ_PREFIX, WRITE_FILE, WRITE_DIR)


def path_field(role: str, default: Any = None, *, writes: tuple[str, ...] = (), hint: str = "") -> Any:
    """A dataclass field that holds a user-given path (or a list of them) with its `role`; a WRITE_DIR names
    the files it `writes` directly inside, so that none of them may be an input; `hint` ends the message
    for a missing input (e.g. "or data.spm_model=null to train one")."""
    assert role in ROLES, role
    return dataclasses.field(default=default, metadata={"path": role, "writes": writes, "hint": hint})


@dataclasses.dataclass(frozen=True)
class PathKey:
    key: str  # as on the command line: output, data.train_prefix, data.extra_train[0].prefix
    value: str
    role: str
    writes: tuple[str, ...] = ()
    langs: tuple[str, str] | None = None  # READ_PREFIX: the files' suffixes
    hint: str = ""


def path_keys(job: Any, prefix: str = "", langs: tuple[str, str] | None = None) -> Iterator[PathKey]:
    """The path-valued keys of a job (any dataclass), recursively, with their values (None and "" skipped;
    a list gives one entry per element). A corpus that data.generate writes is an output, not an input."""
    if hasattr(job, "src_lang") and hasattr(job, "tgt_lang"):  # a corpus's own pair, where it names one
        langs = (job.src_lang or (langs or (None, None))[0], job.tgt_lang or (langs or (None, None))[1])
    generated = bool(getattr(job, "generate", None))
    for f in dataclasses.fields(job):
        value, key = getattr(job, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from path_keys(value, f"{key}.", langs)
            continue
        if isinstance(value, (list, tuple)) and value and all(dataclasses.is_dataclass(v) for v in value):
            for i, item in enumerate(value):
                yield from path_keys(item, f"{key}[{i}].", langs)
            continue
        role = f.metadata.get("path")
        if role is None or value is None or value == "":
            continue
        if role == READ_PREFIX and generated:
            role = WRITE_FILE
        many = isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig"
        for item in (list(value) if many else [value]):
            yield PathKey(key, str(item), role, f.metadata.get("writes", ()), langs, f.metadata.get("hint", ""))


def check_job_paths(job: Any, *, unread: Collection[str] = ()) -> None:
    """Check every path of `job` by its role (the module docstring): inputs first, then outputs, which must
    not be any input; but the keys in `unread` (e.g. "init_from" of a resumed run). Raises a one-line
    ConfigError."""
    keys = [k for k in path_keys(job) if k.key not in unread]
    inputs: list[tuple[str, Path]] = []
    for k in keys:
        if k.role == READ_PREFIX and k.langs is not None:
            for lang in k.langs:
                inputs.append((k.key, check_input(f"{k.value}.{lang}", k.key, directory=False, hint=k.hint)))
        elif k.role in (READ_FILE, READ):
            inputs.append((k.key, check_input(k.value, k.key, directory=False if k.role == READ_FILE else None,
                                              hint=k.hint)))
    for k in keys:
        if k.role == WRITE_FILE:
            check_output_file(k.value, k.key, inputs=inputs)
        elif k.role == WRITE_DIR:
            check_output_dir(k.value, k.key, inputs=inputs, writes=k.writes)


def check_input(path: str | os.PathLike, key: str, *, directory: bool | None = False, hint: str = "") -> Path:
    """`path` as an existing file (`directory=False`), directory (True) or either (None); else a one-line
    ConfigError naming `key`."""
    path = Path(path).expanduser()
    blocker = _file_above(path)
    if blocker is not None:
        raise ConfigError(f"{key}={path}: {blocker} is a file, not a directory: fix the path")
    if not path.exists():
        missing = path if path.parent.is_dir() else f"{path} (nor its folder {path.parent})"
        raise ConfigError(f"{key}={path}: {missing} does not exist: give an existing "
                          f"{'directory' if directory else 'file' if directory is False else 'file or directory'}"
                          f"{' ' + hint if hint else ''}")
    if directory is False and path.is_dir():
        raise ConfigError(f"{key}={path} is a directory: give a file")
    if directory is True and not path.is_dir():
        raise ConfigError(f"{key}={path} is a file: give a directory")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise ConfigError(f"{key}={path} cannot be read by this user (permission denied): fix its permissions, or "
                          "give a readable copy")
    return path


def check_output_file(path: str | os.PathLike, key: str, *, inputs: list[tuple[str, Path]] = ()) -> Path:
    """`path` as a file this process may create or replace; a one-line ConfigError naming `key` otherwise."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{key}={path} is a directory: give a file name (e.g. {path / 'out.txt'})")
    _check_creatable(path, key)
    _check_not_an_input(path, key, inputs)
    return path


def check_output_dir(path: str | os.PathLike, key: str, *, inputs: list[tuple[str, Path]] = (),
                     writes: tuple[str, ...] = ()) -> Path:
    """`path` as a directory this process may create and write `writes` into; a one-line ConfigError
    naming `key` otherwise."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path} is a file: give a directory (it is created if missing)")
    _check_creatable(path, key)
    for name in writes:
        _check_not_an_input(path / name, key, inputs)
    return path


def open_input(path: str | os.PathLike, key: str) -> IO[bytes]:
    """The file `path` opened for reading (binary); a one-line ConfigError naming `key` if it cannot be."""
    path = check_input(path, key)
    try:
        return open(path, "rb")
    except OSError as error:
        raise ConfigError(f"{key}={path} cannot be read: {error.strerror or error}") from None


def open_output(path: str | os.PathLike, key: str, *, inputs: list[tuple[str, Path]] = ()) -> IO[str]:
    """The file `path` opened for writing UTF-8 text, its folders created; a one-line ConfigError naming
    `key` if that cannot be (a directory, under a file, unwritable, the same file as one of `inputs`)."""
    path = check_output_file(path, key, inputs=inputs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w", encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{key}={path} cannot be written: {error.strerror or error}; choose another {key}") \
            from None


# --------------------------------------------------------------------------------------------- helpers


def _file_above(path: Path) -> Path | None:
    """The first ancestor of `path` that exists and is not a directory (a regular file), or None."""
    for parent in reversed(path.absolute().parents):
        if parent.exists() and not parent.is_dir():
            return parent
        if not parent.exists():
            return None
    return None


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_creatable(path: Path, key: str) -> None:
    """`path` (missing or not) can be created or replaced: no file above it, and its nearest existing folder
    takes a new file (tried: creating and removing a hidden one)."""
    blocker = _file_above(path)
    if blocker is not None:
        raise ConfigError(f"cannot create {key}={path}: {blocker} is a file, not a directory; choose another {key}")
    folder = path if path.is_dir() else _nearest_existing(path.parent)
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
    except OSError as error:
        raise ConfigError(f"cannot write {key}={path}: {folder} does not take new files "
                          f"({error.strerror or error}); choose a writable location for {key}") from None
    os.close(fd)
    os.unlink(probe)


def _check_not_an_input(path: Path, key: str, inputs) -> None:
    for input_key, input_path in inputs:
        if _same_file(path, input_path):
            raise ConfigError(f"{key}={path} is the same file as {input_key}={input_path}: writing it would "
                              f"destroy that input; give another {key}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)
