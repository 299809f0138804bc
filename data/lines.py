"""Raw text as lines, for translation: all at once, in chunks of a fixed size, or as they arrive.

Translation input is forgiving where training data is strict (data/corpus.py refuses invalid UTF-8): a line
that is not valid UTF-8 is translated with its bad bytes replaced, and a warning names it. A line ends at
"\\n"; a trailing "\\r" is dropped; a last line without "\\n" is still a line.
"""

from __future__ import annotations

import collections
import logging
import os
import select
from pathlib import Path
from typing import BinaryIO, Iterator

log = logging.getLogger(__name__)


def split_lines(raw: bytes, source: str) -> list[str]:
    """Split raw bytes into lines; invalid UTF-8 is replaced, with a warning naming the line."""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [decode_line(line, source, number) for number, line in enumerate(lines, start=1)]


def decode_line(line: bytes, source: str, number: int) -> str:
    """One input line (without its "\n") as text: a trailing "\r" is dropped, invalid UTF-8 is replaced with a
    warning naming the line (`source` line `number`)."""
    line = line.removesuffix(b"\r")
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        log.warning("%s line %d is not valid UTF-8: the bad bytes were replaced by U+FFFD", source, number)
        return line.decode("utf-8", errors="replace")


def count_lines(path: Path | str) -> int:
    """Lines as `for line in open(path, "rb")` sees them: "\\n"-terminated, plus an unterminated last one."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def chunks(stream: BinaryIO, lines: int) -> Iterator[list[bytes]]:
    """The lines of `stream` (without "\\n") in lists of `lines` (the last may be shorter), read as they are
    needed: memory holds one chunk, whatever the size of the input."""
    chunk: list[bytes] = []
    for line in stream:
        chunk.append(line.removesuffix(b"\n"))
        if len(chunk) == lines:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def arriving_lines(stream: BinaryIO, max_lines: int) -> Iterator[list[bytes]]:
    """The lines of `stream` (without "\n") as they arrive, in groups for translate.py's interactive mode:
    a group is every line already waiting, at most `max_lines` of them. It waits only when no line is
    waiting, so a lone line is never held back for others to fill a batch, and a burst is translated in
    batches of `max_lines` (bounded latency). A last line without "\n" ends the stream.

    The file descriptor is read directly (`os.read`, `select`: POSIX pipes, terminals, sockets, files), not
    through the stream's buffer, whose read-ahead would hide waiting lines from `select`. A stream without
    one (an in-memory buffer) holds every line already: it is grouped by `max_lines`.
    """
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        fd = None
    if fd is None:
        lines = stream.read().split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        for start in range(0, len(lines), max_lines):
            yield lines[start:start + max_lines]
        return
    waiting: collections.deque[bytes] = collections.deque()
    partial, ended = b"", False
    while waiting or not ended:
        if not ended and (not waiting or (len(waiting) < max_lines and _readable(fd))):
            chunk = os.read(fd, 1 << 16)  # blocks only when nothing is waiting
            if chunk:
                *complete, partial = (partial + chunk).split(b"\n")
                waiting.extend(complete)
            else:
                ended = True
                if partial:
                    waiting.append(partial)
            continue
        yield [waiting.popleft() for _ in range(min(max_lines, len(waiting)))]


def _readable(fd: int) -> bool:
    """Whether reading `fd` would return at once (data or end of file)."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # not selectable (e.g. a console on Windows): take what is waiting one by one
        return False
