"""Token batching (fairseq's `max_tokens`), the data order over epochs and ranks, and collation.

- `batch_by_size`: a pure function of the lengths and the budget. Pairs are sorted by padded size, so a
  batch holds pairs of similar length; a batch's padded size, batch size × max(longest source + EOS,
  longest target + 1), never exceeds `max_tokens`. A pair that alone exceeds it is skipped and counted,
  never truncated.
- `BatchStream`: the fixed batches, reshuffled each epoch from (seed, epoch), read as one endless global
  stream (with `epoch_rows`, for a mix that draws its fractional shares afresh each epoch, each epoch's own
  batches of its rows). Update u takes the next world_size × update_freq batches of the stream (crossing into
  the next epoch when needed: no partial updates) and rank r gets slots r·k … r·k+k-1 of them, so N ranks ×
  k passes consume exactly the batches of 1 rank × N·k passes. Its position (epoch, offset into the
  epoch) is in global-stream terms, so it can be saved and restored under another world size.
- `TokenArrays`: a split's token ids as flat arrays (memory-mapped from the data cache in training), the
  layout `collate` reads with a few vectorised gathers (fairseq's indexed datasets keep the same layout).
- `collate`: pad one batch into tensors; teacher forcing: decoder input [BOS] + y, labels y + [EOS].
- `Prefetcher`: collates the next update's batches while the device computes the current one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from data.errors import DataError
from data.vocab import BOS_ID, EOS_ID, PAD_ID

if TYPE_CHECKING:
    import datasets


def padded_length(length, multiple: int = 1):
    """A padded length (int or array) rounded up to a multiple of `multiple` (train.pad_to_multiple)."""
    return -(-length // multiple) * multiple


def batch_by_size(src_lens, tgt_lens, max_tokens: int, *, multiple: int = 1) -> tuple[list[np.ndarray], int]:
    """Group pair indices into batches whose padded size stays within `max_tokens`.

    Lengths are in pieces without specials; what gets padded is the source + EOS and the target + 1
    (BOS + y as decoder input, y + EOS as labels), each rounded up to a multiple of `multiple` (collate pads
    to the same). Returns (batches, number of skipped pairs). The batches are in increasing size order;
    `BatchStream` shuffles them.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    src = padded_length(np.asarray(src_lens, dtype=np.int64) + 1, multiple)
    tgt = padded_length(np.asarray(tgt_lens, dtype=np.int64) + 1, multiple)
    if src.shape != tgt.shape or src.ndim != 1:
        raise ValueError(f"src_lens and tgt_lens must be 1-D of one length, got {src.shape} and {tgt.shape}")
    size = np.maximum(src, tgt)
    order = np.lexsort((src, tgt, size))  # by padded size, then target, then source length (stable)
    fits = int(np.count_nonzero(size <= max_tokens))
    order, sizes = order[:fits], size[order[:fits]]  # the oversized pairs sort last
    batches = []
    start = 0
    while start < fits:
        # sizes is non-decreasing, so (count × size of the last pair) grows along the window, and the
        # batch is the longest prefix that stays within the budget.
        window = sizes[start : start + max_tokens // sizes[start]]
        count = int(np.count_nonzero(np.arange(1, window.size + 1) * window <= max_tokens))
        batches.append(order[start : start + count])
        start += count
    return batches, len(size) - fits


class BatchStream:
    """The endless, deterministic order of batches over epochs, dealt to the ranks of each update.

    Iterating (or `next_update()`) yields, per update, this rank's `update_freq` items `(slot, indices)`:
    `slot` is the batch's index within the update (0 … world_size·update_freq - 1, the same whatever the
    world size), `indices` the dataset rows of the batch. `skipped` counts the pairs over the budget.
    `data` names the training set (its cache entry: the corpora, their weights and tags, cleaning, vocabulary):
    a saved position is restored only into the stream of the same data.

    `epoch_rows` (epoch → row indices, a pure function of the epoch): the rows each epoch batches, for a mix
    whose fractional shares are drawn afresh every epoch (data.pipeline); each epoch then has its own batches
    (cut by `batch_by_size` from its rows' lengths) and its own count of them. None: every row, every epoch,
    one set of batches.
    """

    def __init__(self, src_lens, tgt_lens, *, max_tokens: int, seed: int, world_size: int = 1, rank: int = 0,
                 update_freq: int = 1, data: str = "", multiple: int = 1,
                 epoch_rows: Callable[[int], np.ndarray] | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if update_freq < 1:
            raise ValueError(f"update_freq must be >= 1, got {update_freq}")
        self._lengths = np.asarray(src_lens, dtype=np.int64), np.asarray(tgt_lens, dtype=np.int64)
        self._max_tokens, self._multiple, self._epoch_rows = max_tokens, multiple, epoch_rows
        self._batches: dict[int, list[np.ndarray]] = {}  # of an epoch (the last two: a deal crosses one boundary)
        self.data, self.seed, self.world_size, self.rank, self.update_freq = data, seed, world_size, rank, update_freq
        self._epoch, self._offset = 0, 0
        self._order: tuple[int, np.ndarray] | None = None
        self._fixed: list[np.ndarray] | None = None
        if epoch_rows is None:
            self._fixed, self.skipped = self._cut(np.arange(len(self._lengths[0])))
        else:  # the pairs over the budget: of the first epoch (each epoch draws its own)
            self._batches[0], self.skipped = self._cut(np.asarray(epoch_rows(0)))

    def _cut(self, rows: np.ndarray) -> tuple[list[np.ndarray], int]:
        src, tgt = self._lengths
        batches, skipped = batch_by_size(src[rows], tgt[rows], self._max_tokens, multiple=self._multiple)
        if not batches:
            raise DataError(f"no training batch: all {skipped} pairs are longer than "
                            f"train.max_tokens={self._max_tokens}")
        return [rows[b] for b in batches], skipped

    def batches_in(self, epoch: int) -> list[np.ndarray]:
        """The batches of `epoch` (row indices each), in size order; `epoch_order` shuffles them."""
        if self._fixed is not None:
            return self._fixed
        if epoch not in self._batches:
            self._batches = {e: b for e, b in self._batches.items() if e == epoch - 1}
            self._batches[epoch] = self._cut(np.asarray(self._epoch_rows(epoch)))[0]
        return self._batches[epoch]

    @property
    def batches(self) -> list[np.ndarray]:
        """The batches of the current epoch."""
        return self.batches_in(self._epoch)

    @property
    def epoch(self) -> int:
        """Epochs completed (0-based epoch of the next batch of the stream)."""
        return self._epoch

    @property
    def offset(self) -> int:
        """Position of the next batch within its epoch's shuffled order."""
        return self._offset

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The shuffled batch numbers of `epoch`, from (seed, epoch) alone."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(len(self.batches_in(epoch))))
        return self._order[1]

    def next_update(self) -> list[tuple[int, np.ndarray]]:
        """This rank's batches of the next update; every rank advances the position by the whole update."""
        mine, self._epoch, self._offset = self._deal(self._epoch, self._offset)
        return mine

    def peek_update(self) -> list[tuple[int, np.ndarray]]:
        """What `next_update()` will return, without moving the position."""
        return self._deal(self._epoch, self._offset)[0]

    def _deal(self, epoch: int, offset: int) -> tuple[list[tuple[int, np.ndarray]], int, int]:
        """(this rank's batches of the update at (epoch, offset), the position after that update)."""
        k = self.update_freq
        mine = []
        for slot in range(self.world_size * k):
            if self.rank * k <= slot < (self.rank + 1) * k:
                mine.append((slot, self.batches_in(epoch)[self.epoch_order(epoch)[offset]]))
            offset += 1
            if offset == len(self.batches_in(epoch)):
                epoch, offset = epoch + 1, 0
        return mine, epoch, offset

    def __iter__(self) -> Iterator[list[tuple[int, np.ndarray]]]:
        while True:
            yield self.next_update()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "offset": self._offset, "batches_per_epoch": len(self.batches), "data": self.data}

    def load_state_dict(self, state: dict) -> None:
        if state.get("data") and self.data and state["data"] != self.data:  # older checkpoints name no data
            raise DataError(
                f"the saved data position is for the training set {state['data']}, but this run's is {self.data}: "
                "the corpora, their weights or tags, the cleaning or the vocabulary changed since it was saved; "
                "resume with the data it started with, or start a new run_dir")
        if state["epoch"] < 0:
            raise ValueError(f"invalid data position {state}")
        count = len(self.batches_in(int(state["epoch"])))
        if state["batches_per_epoch"] != count:
            raise DataError(
                f"the saved data position is for {state['batches_per_epoch']} batches per epoch, but this run has "
                f"{count}: the corpus, vocabulary or train.max_tokens changed since it was saved"
            )
        if not 0 <= state["offset"] < count:
            raise ValueError(f"invalid data position {state}")
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])


@dataclass(frozen=True)
class Batch:
    """One padded batch (B pairs). Axis letters: B batch, S source length, T target length."""

    src: torch.Tensor      # [B, S] int64: pieces + EOS, right-padded with PAD
    tgt_in: torch.Tensor   # [B, T] int64: BOS + y (teacher forcing: position i sees y[:i] only)
    tgt_out: torch.Tensor  # [B, T] int64: y + EOS, the labels
    src_tokens: int        # non-pad tokens in src (EOS included)
    tgt_tokens: int        # non-pad tokens in tgt_out, i.e. the labels the loss counts

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.src), move(self.tgt_in), move(self.tgt_out), self.src_tokens, self.tgt_tokens)


@dataclass(frozen=True)
class TokenArrays:
    """The pieces of every pair of a split, flat: pair i's source is src[src_offsets[i]:src_offsets[i + 1]]
    (likewise the target), without EOS.

    Why not the Arrow dataset itself: picking a batch's rows out of it costs milliseconds (a Dataset view
    per call, a take over its chunks, list flattening), while from flat arrays a batch is a few numpy
    gathers: what keeps one CPU core ahead of a GPU (docs/BENCHMARKS.md, "Input path"). In training the
    arrays are memory-mapped .npy files in the data cache (`from_dataset(out=)`, `load`), so the ranks of a machine share
    one copy in the page cache and memory does not grow with the corpus.
    """

    src: np.ndarray          # [sum of source lengths] int32
    src_offsets: np.ndarray  # [N + 1] int64
    tgt: np.ndarray
    tgt_offsets: np.ndarray

    FILES = ("src.npy", "src_offsets.npy", "tgt.npy", "tgt_offsets.npy")

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @classmethod
    def from_dataset(cls, dataset: datasets.Dataset, *, out: Path | None = None,
                     rows_per_read: int = 100_000) -> TokenArrays:
        """The `src_ids` / `tgt_ids` columns of an encoded dataset, read `rows_per_read` pairs at a time; into
        memory-mapped files in the folder `out` when given (each written under a temporary name, then renamed,
        so a reader never sees a partial file)."""
        table = dataset.with_format("arrow", columns=["src_ids", "tgt_ids"])
        parts = lambda: table.iter(batch_size=rows_per_read) if len(dataset) else iter(())  # noqa: E731
        arrays = {}
        for side in ("src", "tgt"):
            lengths = [np.diff(part.column(f"{side}_ids").combine_chunks().offsets.to_numpy()) for part in parts()]
            offsets = np.zeros(len(dataset) + 1, dtype=np.int64)
            np.cumsum(np.concatenate(lengths) if lengths else [], out=offsets[1:])
            total = int(offsets[-1])
            values = (np.empty(total, dtype=np.int32) if out is None else
                      np.lib.format.open_memmap(out / f"{side}.npy.tmp", mode="w+", dtype=np.int32, shape=(total,)))
            for part, (start, end) in zip(parts(), _spans(offsets, rows_per_read)):
                values[start:end] = part.column(f"{side}_ids").combine_chunks().flatten().to_numpy()
            arrays[side], arrays[f"{side}_offsets"] = values, offsets
        if out is None:
            return cls(**arrays)
        for side in ("src", "tgt"):
            arrays[side].flush()
            with open(out / f"{side}_offsets.npy.tmp", "wb") as f:
                np.save(f, arrays[f"{side}_offsets"], allow_pickle=False)
        for name in cls.FILES:  # `saved_in` wants all four: an interrupted rename is written again
            os.replace(out / f"{name}.tmp", out / name)
        return cls.load(out)

    @classmethod
    def gathered(cls, parts: list[tuple[TokenArrays, np.ndarray, int | None]], *, out: Path,
                 rows_per_write: int = 100_000) -> TokenArrays:
        """A mix of splits: for each (arrays, rows, prefix) the pairs `rows` of `arrays` (in that order; a row may
        repeat), one part after the other, with the piece `prefix` (when not None) put first in each source.
        Into memory-mapped files in the folder `out`, each under a temporary name until complete."""
        for side in ("src", "tgt"):
            lengths = []
            for source, rows, prefix in parts:
                row_lengths = np.diff(getattr(source, f"{side}_offsets"))[rows]
                lengths.append(row_lengths + 1 if prefix is not None and side == "src" else row_lengths)
            offsets = np.zeros(sum(len(n) for n in lengths) + 1, dtype=np.int64)
            np.cumsum(np.concatenate(lengths) if lengths else [], out=offsets[1:])
            values = np.lib.format.open_memmap(out / f"{side}.npy.tmp", mode="w+", dtype=np.int32,
                                               shape=(int(offsets[-1]),))
            first = 0  # the mix's row where this part starts
            for source, rows, prefix in parts:
                prefix = prefix if side == "src" else None
                for start in range(0, len(rows), rows_per_write):
                    piece_rows = np.asarray(rows[start:start + rows_per_write], dtype=np.int64)
                    body, body_lengths = _gather(getattr(source, side), getattr(source, f"{side}_offsets"),
                                                 piece_rows)
                    starts = offsets[first + start:first + start + len(piece_rows)]
                    skip = 0 if prefix is None else 1
                    if prefix is not None:
                        values[starts] = prefix
                    at = np.cumsum(body_lengths) - body_lengths
                    values[np.arange(len(body), dtype=np.int64) + np.repeat(starts + skip - at, body_lengths)] = body
                first += len(rows)
            values.flush()
            with open(out / f"{side}_offsets.npy.tmp", "wb") as f:
                np.save(f, offsets, allow_pickle=False)
        for name in cls.FILES:
            os.replace(out / f"{name}.tmp", out / name)
        return cls.load(out)

    @classmethod
    def load(cls, directory: Path) -> TokenArrays:
        """The arrays `from_dataset(out=directory)` wrote, memory-mapped read-only."""
        # Plain ndarray views of the maps: np.memmap's own indexing adds a Python call per gather.
        return cls(**{name[:-4]: np.load(directory / name, mmap_mode="r", allow_pickle=False).view(np.ndarray)
                      for name in cls.FILES})

    @classmethod
    def saved_in(cls, directory: Path) -> bool:
        return all((directory / name).is_file() for name in cls.FILES)


def _spans(offsets: np.ndarray, rows: int) -> Iterator[tuple[int, int]]:
    """(first value, end) of each slice of `rows` pairs."""
    for first in range(0, len(offsets) - 1, rows):
        yield int(offsets[first]), int(offsets[min(first + rows, len(offsets) - 1)])


def _gather(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the pieces of `rows`, one row after the other; their lengths)."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    at = np.cumsum(lengths) - lengths  # where each row starts in the output
    index = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - at, lengths)
    return values[index], lengths


def collate(tokens: TokenArrays, indices, *, device: torch.device | str | None = None, pad_id: int = PAD_ID,
            bos_id: int = BOS_ID, eos_id: int = EOS_ID, multiple: int = 1) -> Batch:
    """Pad the pairs `indices` of a split into a `Batch` (on `device`); `multiple`: both lengths rounded up to
    a multiple of it (fewer distinct shapes)."""
    rows = np.asarray(indices, dtype=np.int64)
    src_values, src_lens = _gather(tokens.src, tokens.src_offsets, rows)
    tgt_values, tgt_lens = _gather(tokens.tgt, tokens.tgt_offsets, rows)
    B = len(rows)
    S = padded_length(int(src_lens.max(initial=0)) + 1, multiple)
    T = padded_length(int(tgt_lens.max(initial=0)) + 1, multiple)
    rows_b = np.arange(B)

    src = np.full((B, S), pad_id, dtype=np.int64)
    src[np.arange(S) < src_lens[:, None]] = src_values         # pieces, row by row
    src[rows_b, src_lens] = eos_id
    tgt_out = np.full((B, T), pad_id, dtype=np.int64)
    body = np.arange(T) < tgt_lens[:, None]                     # [B, T]: where y goes
    tgt_out[body] = tgt_values
    tgt_out[rows_b, tgt_lens] = eos_id
    tgt_in = np.full((B, T), pad_id, dtype=np.int64)
    tgt_in[:, 0] = bos_id
    tgt_in[:, 1:][body[:, :-1]] = tgt_values                    # y shifted right by one
    batch = Batch(src=torch.from_numpy(src), tgt_in=torch.from_numpy(tgt_in), tgt_out=torch.from_numpy(tgt_out),
                  src_tokens=int(src_lens.sum()) + B, tgt_tokens=int(tgt_lens.sum()) + B)
    if device is None:
        return batch
    if torch.device(device).type == "cuda":  # from page-locked memory the copy is asynchronous
        return Batch(batch.src.pin_memory(), batch.tgt_in.pin_memory(), batch.tgt_out.pin_memory(),
                     batch.src_tokens, batch.tgt_tokens).to(device, non_blocking=True)
    return batch.to(device)


class Prefetcher:
    """The batches of each update, collated (and on CUDA, sent to the device) while the previous update
    computes: `prepare(stream)` at the end of an update, after its work is queued on the device and before
    the host waits for it; `next_update(stream)` at the start of the next. What was prepared is used only
    if the stream is still at the position it was prepared at (a redone or restored update collates anew).
    """

    def __init__(self, tokens: TokenArrays, device: torch.device, *, pad_id: int = PAD_ID, bos_id: int = BOS_ID,
                 eos_id: int = EOS_ID, multiple: int = 1):
        self.tokens, self.device = tokens, device
        self.ids = {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}  # the vocabulary's (Marian's differ)
        self.multiple = multiple
        self._ahead: tuple[dict, list[tuple[int, Batch]]] | None = None

    def _collate(self, update: list[tuple[int, np.ndarray]]) -> list[tuple[int, Batch]]:
        return [(slot, collate(self.tokens, rows, device=self.device, multiple=self.multiple, **self.ids))
                for slot, rows in update]

    def prepare(self, stream: BatchStream) -> None:
        self._ahead = (stream.state_dict(), self._collate(stream.peek_update()))

    def next_update(self, stream: BatchStream) -> list[tuple[int, Batch]]:
        position, ahead, self._ahead = stream.state_dict(), self._ahead, None
        update = stream.next_update()
        return ahead[1] if ahead is not None and ahead[0] == position else self._collate(update)
