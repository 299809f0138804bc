"""Translate a corpus of any size: in chunks, sharded over processes, resumable after a kill.

The input is read one chunk (`chunk_lines` lines) at a time, so memory stays flat whatever its size. Into a
file (`output=`), each chunk's translation is written atomically to its own file in `<output>.parts/`, and
when every chunk is there they are joined, in input order, into `output` (atomically) and the parts are
removed. Killed anywhere, the same command starts again from the chunks already written: no line is lost,
none is written twice.

Sharding needs no process group: rank r of `world_size` (torchrun's RANK and WORLD_SIZE, or set by hand on
machines that share a filesystem) translates the chunks whose number is r modulo world_size, and whichever
rank finds every chunk written when it finishes its own joins them. A chunk's output does not depend on the
rank or the number of ranks that translated it (sampling and noise are seeded per line number), so a run may
resume with a different number of processes.

`<output>.parts/request.json` records what the chunks are a translation of (the input file's size and SHA-256,
the chunk size, the models' files, the search settings and a multilingual model's target language): the same
bytes resume wherever they were moved or copied; anything else is refused with a one-line error, since joining
chunks of two different requests would give a corpus that neither asked for.

Into a stream (stdout), chunks are translated and written in order as they are done; nothing to resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Sequence, TextIO

from tqdm import tqdm

from data.errors import ConfigError, WriteError
from data.files import atomic_write, file_identity
from data.lock import hold, releasing_locks
from data.lines import chunks, count_lines, decode_line
from transformer.decoding.translation import Translation, Translator

log = logging.getLogger(__name__)

# texts, their translations, the 0-based number of the first input line → output text (one or more lines each)
Render = Callable[[Sequence[str], Sequence[Sequence[Translation]], int], str]

_CHUNK_NAME = re.compile(r"^(\d{9})\.txt$")


@dataclass(frozen=True)
class Shard:
    """Which chunks this process translates: those whose number is `rank` modulo `world_size`."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> Shard:
        """torchrun's (or the user's) RANK and WORLD_SIZE; a plain process is the only shard."""
        try:
            rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        except ValueError:
            raise ConfigError("RANK and WORLD_SIZE must be integers (torchrun sets them)") from None
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} is not a rank of WORLD_SIZE={world_size}: ranks are 0..WORLD_SIZE-1")
        return cls(rank=rank, world_size=world_size)

    def owns(self, chunk: int) -> bool:
        return chunk % self.world_size == self.rank


def translate_stream(translator: Translator, stream: BinaryIO, out: TextIO, render: Render, *, chunk_lines: int,
                     source: str, progress: bool) -> int:
    """Translate `stream` chunk by chunk into `out`, in order, flushing each chunk; returns the lines read."""
    done = 0
    with tqdm(desc="translating", unit="line", file=sys.stderr, disable=not progress, mininterval=1.0) as bar:
        for raw in chunks(stream, chunk_lines):
            texts = [decode_line(line, source, done + i) for i, line in enumerate(raw, start=1)]
            results = translator.translate_nbest(texts, source=source, first_line=done + 1)
            out.write(render(texts, results, done))
            out.flush()
            done += len(raw)
            bar.update(len(raw))
    return done


@releasing_locks
def translate_file(translator: Translator, input: Path, output: Path, render: Render, *, chunk_lines: int,
                   request: dict, shard: Shard = Shard(), progress: bool = True) -> bool:
    """Translate the file `input` into `output` through `<output>.parts/` (the module docstring); resumes from
    the chunks already there. `request` (JSON) names the model and settings, for the resume check. Returns
    whether this process joined the chunks into `output` (false: another rank's chunks are still missing)."""
    parts = parts_dir(output)
    hold(parts, name=f".writer-rank{shard.rank}.lock", what=f"rank {shard.rank}'s share of output={output}",
         fix="another translate.py writes these chunks now (the same command run twice?); wait for it to end, "
             "or give another output=")
    total = count_lines(input)
    n_chunks = -(-total // chunk_lines)
    _claim(parts, {"input": file_identity(input), "chunk_lines": chunk_lines, **request})
    done = written_chunks(parts)
    mine = [c for c in range(n_chunks) if shard.owns(c)]
    lines_of = lambda c: min(chunk_lines, total - c * chunk_lines)  # noqa: E731
    todo = [c for c in mine if c not in done]
    where = f"rank {shard.rank} of {shard.world_size}: " if shard.world_size > 1 else ""
    if len(todo) < len(mine):
        log.info("%sresuming: %d of %d chunks already in %s", where, len(mine) - len(todo), len(mine), parts)
    bar = tqdm(total=sum(lines_of(c) for c in mine), initial=sum(lines_of(c) for c in mine if c in done),
               desc=f"{where}translating", unit="line", file=sys.stderr, disable=not progress, mininterval=1.0)
    with bar, open(input, "rb") as stream:
        for chunk, raw in enumerate(chunks(stream, chunk_lines)):
            if chunk not in todo:
                continue
            first = chunk * chunk_lines
            texts = [decode_line(line, str(input), first + i) for i, line in enumerate(raw, start=1)]
            results = translator.translate_nbest(texts, source=str(input), first_line=first + 1)
            atomic_write(parts / f"{chunk:09d}.txt", render(texts, results, first), what="translation chunk", elsewhere="give another output=")
            bar.update(len(raw))
    missing = n_chunks - len(written_chunks(parts))
    if missing:
        log.info("%smy %d chunks are written; %d chunks of other ranks are missing: the rank that writes the "
                 "last one joins them into %s", where, len(mine), missing, output)
        return False
    return join(parts, output, n_chunks)


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def written_chunks(parts: Path) -> set[int]:
    """The numbers of the chunks whose translation is complete in `parts` (written atomically: all or nothing)."""
    if not parts.is_dir():
        return set()
    return {int(m[1]) for name in os.listdir(parts) if (m := _CHUNK_NAME.match(name))}


def join(parts: Path, output: Path, n_chunks: int) -> bool:
    """Concatenate chunks 0..n_chunks-1 of `parts` into `output` (atomically), then remove `parts`; returns
    whether this process wrote `output`. Two ranks that both find every chunk written both join: the first to
    finish renames `output` into place and then `parts` out of the way (one rename: the chunks vanish all at
    once, after `output` is there), and the other, finding its next chunk gone with `parts`, leaves `output`
    to it (False) instead of reporting a failed write."""
    def write(f):
        for chunk in range(n_chunks):
            with open(parts / f"{chunk:09d}.txt", "rb") as part:
                shutil.copyfileobj(part, f)

    try:
        atomic_write(output, write, what="translation", elsewhere="give another output=")
    except WriteError:
        if not parts.exists() and output.is_file():  # another rank joined the chunks, then removed them
            return False
        raise
    removed = Path(tempfile.mkdtemp(prefix=f"{parts.name}.removed-", dir=parts.parent))
    try:
        os.rename(parts, removed / "parts")
    except FileNotFoundError:  # another rank joined too, and moved them first
        pass
    shutil.rmtree(removed, ignore_errors=True)
    return True


def _claim(parts: Path, request: dict) -> None:
    """Record `request` in `parts`, or check that the chunks already there are of the same request."""
    record = parts / "request.json"
    if record.is_file():
        try:
            before = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            before = None
        if before != json.loads(json.dumps(request)):
            changed = sorted(k for k in {*request, *(before or {})} if (before or {}).get(k) != request.get(k))
            raise ConfigError(
                f"{parts} holds chunks of another translation (different: {', '.join(changed) or 'request.json'}"
                f"): run the same command as before to resume it, or delete {parts} to start again")
        return
    atomic_write(record, json.dumps(request, indent=1, sort_keys=True) + "\n", what="translation request", elsewhere="give another output=")
