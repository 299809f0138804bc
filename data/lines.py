"""Raw text as lines, the one reader of the project's text files: all at once, in chunks of a fixed size,
or as they arrive.

Every reader here (and data/corpus.py's for training) agrees on what a line is: it ends at "\\n", a trailing
"\\r" is dropped (CRLF), and a last line without "\\n" is still a line; a file without "\\n" whose lines end
at a bare "\\r" (classic Mac OS) has "\\r" line ends (`line_end`). A UTF-8 byte-order mark before the first line
is dropped (Windows editors write one; it is no part of the text and would make a sentence that starts
with it differ from the same sentence without it).

Invalid UTF-8: translation input is forgiving (a line that is not valid UTF-8 is translated with its bad
bytes replaced, and a warning names the file and line); what a score is computed against is strict
(`read_text_lines(strict=True)`: a reference with replaced bytes is another reference, and its score would
be silently wrong), as training data is (data/corpus.py).
"""

from __future__ import annotations

import collections
import logging
import os
import select
from pathlib import Path
from typing import BinaryIO, Iterator

from data.errors import ConfigError

log = logging.getLogger(__name__)

BOM = "\ufeff".encode("utf-8")


def split_lines(raw: bytes, source: str) -> list[str]:
    """Split raw bytes into lines; invalid UTF-8 is replaced, with a warning naming the line."""
    lines = raw.split(line_end(raw[:1 << 16]))
    if lines and lines[-1] == b"":
        lines.pop()
    return [decode_line(line, source, number) for number, line in enumerate(lines, start=1)]


def decode_line(line: bytes, source: str, number: int) -> str:
    """One input line (without its "\n") as text: a trailing "\r" is dropped, invalid UTF-8 is replaced with a
    warning naming the line (`source` line `number`)."""
    line = line.removesuffix(b"\r")
    if number == 1:
        line = line.removeprefix(BOM)
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        log.warning("%s line %d is not valid UTF-8: the bad bytes were replaced by U+FFFD", source, number)
        return line.decode("utf-8", errors="replace")


def count_lines(path: Path | str) -> int:
    """Lines as `raw_lines` sees them: terminated by the file's line end, plus an unterminated last one."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        end = line_end(f.peek(1 << 16))
        last = end
        while chunk := f.read(1 << 22):
            n += chunk.count(end)
            last = chunk[-1:]
    return n + (last != end)


def line_end(head: bytes) -> bytes:
    """b"\\r" for a file of bare carriage returns (classic Mac OS: `head`, its first bytes, has a "\\r" before its
    last byte and no "\\n"), else b"\\n": a stray "\\r" inside a line of a "\\n" file (or "\\r\\r\\n", a CRLF file
    converted twice) does not make the whole file split on "\\r"."""
    return b"\r" if b"\n" not in head and b"\r" in head[:-1] else b"\n"


def raw_lines(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of a binary stream without their "\\n" (a CRLF line keeps its "\\r": `decode_line` drops it),
    or without their "\\r" in a file of bare-CR line ends; read as they are needed."""
    peek = getattr(stream, "peek", None)
    end = line_end(peek(1 << 16)) if peek is not None else b"\n"
    if end == b"\n":
        for line in stream:
            yield line.removesuffix(b"\n")
        return
    pending = b""
    while chunk := stream.read(1 << 20):
        *complete, pending = (pending + chunk).split(end)
        yield from complete
    if pending:
        yield pending


def read_text_lines(path: Path | str, key: str, *, strict: bool = False) -> list[str]:
    """The lines of a text file (the module docstring: line ends, BOM). Invalid UTF-8: with `strict`, a one-line
    ConfigError naming `key`, the file, the line and the column; else replaced, with a warning naming them."""
    with open(path, "rb") as stream:
        raw = list(raw_lines(stream))
    if not strict:
        return [decode_line(line, str(path), number) for number, line in enumerate(raw, start=1)]
    lines = []
    for number, line in enumerate(raw, start=1):
        try:
            lines.append(decode_line_strict(line, number))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{key}={path}, line {number}: invalid UTF-8 (byte 0x{line[e.start]:02x} at column "
                              f"{e.start + 1}); a score against replaced bytes would be wrong: fix the file "
                              "(e.g. iconv -f <its encoding> -t utf-8)") from None
    return lines


def decode_line_strict(line: bytes, number: int) -> str:
    """`decode_line` without the replacement: raises UnicodeDecodeError."""
    line = line.removesuffix(b"\r")
    return (line.removeprefix(BOM) if number == 1 else line).decode("utf-8")


def chunks(stream: BinaryIO, lines: int) -> Iterator[list[bytes]]:
    """The lines of `stream` (without "\\n") in lists of `lines` (the last may be shorter), read as they are
    needed: memory holds one chunk, whatever the size of the input."""
    chunk: list[bytes] = []
    for line in raw_lines(stream):
        chunk.append(line)
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
