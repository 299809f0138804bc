"""The shared source/target vocabulary: a SentencePiece BPE model with fixed special ids.

Every vocabulary this framework trains uses PAD=0, UNK=1, BOS=2, EOS=3 and byte fallback (a character
outside the pieces is spelled as UTF-8 byte pieces, so no input is unencodable and UNK never appears).
A user's own model (`data.spm_model`) must use the same four ids.

Text goes through SentencePiece's `nmt_nfkc` normalisation (NFKC, some control characters removed,
whitespace runs collapsed), so `decode(encode(x)) == normalize(x)`, not always `x`.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
from tqdm import tqdm

from data.errors import DataError
from transformer.checkpoint import atomic_write

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


class Vocab:
    """A loaded SentencePiece model. Build with `Vocab.load` / `Vocab.from_bytes` or `train_vocab`."""

    def __init__(self, model_proto: bytes, *, origin: str = "<bytes>"):
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except (RuntimeError, TypeError):
            raise DataError(f"{origin} is not a readable SentencePiece model (a .model file from spm_train)") from None
        self._proto = bytes(model_proto)
        ids = {"pad": self._sp.pad_id(), "unk": self._sp.unk_id(), "bos": self._sp.bos_id(), "eos": self._sp.eos_id()}
        if ids != {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}:
            found = " ".join(f"{k}={v}" for k, v in ids.items())
            raise DataError(
                f"SentencePiece model {origin} has special ids {found}; this framework needs pad=0 unk=1 bos=2 eos=3 "
                "(retrain it with --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3, or set data.spm_model=null to train one)"
            )

    @classmethod
    def load(cls, path_or_bytes: str | os.PathLike | bytes) -> Vocab:
        """Load from a `.model` file or from the serialized model (e.g. the bytes a checkpoint stores)."""
        if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
            return cls.from_bytes(bytes(path_or_bytes))
        path = Path(path_or_bytes)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read SentencePiece model {path}: {e.strerror or e}") from None
        return cls(data, origin=str(path))

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> Vocab:
        return cls(model_proto)

    @property
    def size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def model_proto(self) -> bytes:
        """The serialized model: what checkpoints store and `from_bytes` reads."""
        return self._proto

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._proto).hexdigest()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Piece ids of each text, without BOS/EOS."""
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenized text of each id sequence; PAD/BOS/EOS ids are dropped (UNK, which byte fallback
        never produces, would show as " ⁇ ")."""
        return self._sp.decode([[int(i) for i in seq] for seq in ids])

    def normalize(self, texts: list[str]) -> list[str]:
        """The text that `decode(encode(x))` gives back: x after SentencePiece's normalisation."""
        return [self._sp.normalize(t).replace(_SPACE, " ").strip(" ") for t in texts]

    def pieces(self, ids: list[int]) -> list[str]:
        return [self._sp.id_to_piece(int(i)) for i in ids]

    def save(self, path: str | os.PathLike) -> None:
        """Write the model atomically (temporary file, fsync, rename)."""
        atomic_write(path, self._proto, what="vocabulary")


def train_vocab(
    texts: Iterable[str],
    path: str | os.PathLike | None,
    vocab_size: int,
    *,
    character_coverage: float = 0.9999,
    num_threads: int = 1,
    total: int | None = None,
) -> Vocab:
    """Train a BPE model on `texts` (already sampled: all of them are used) and save it to `path`.

    The caller bounds the sample (`data.vocab_sample`); SentencePiece keeps the sentences in memory.
    `total` only sizes the progress bar.
    """
    model = io.BytesIO()
    read_all = threading.Event()
    failure: list[BaseException] = []

    def sample():
        yield from tqdm(texts, total=total, desc="vocabulary: reading sample", unit=" sentences", mininterval=1.0)
        read_all.set()

    def work():
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sample(),
                model_writer=model,
                vocab_size=vocab_size,
                model_type="bpe",
                character_coverage=character_coverage,
                byte_fallback=True,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                normalization_rule_name="nmt_nfkc",
                input_sentence_size=0,  # the caller samples; 0 = use every sentence given
                num_threads=max(1, num_threads),
                minloglevel=2,
            )
        except BaseException as e:  # handed to the calling thread
            failure.append(e)
        finally:
            read_all.set()

    # SentencePiece reports no progress while it merges: the calling thread shows the time it takes.
    trainer = threading.Thread(target=work, name="sentencepiece-train", daemon=True)
    trainer.start()
    read_all.wait()
    if trainer.is_alive():
        with tqdm(desc=f"vocabulary: training {vocab_size} BPE pieces", bar_format="{desc} ({elapsed})") as timer:
            while trainer.is_alive():
                trainer.join(1.0)
                timer.refresh()
    trainer.join()
    if failure:
        if isinstance(failure[0], RuntimeError):
            raise DataError(f"SentencePiece training failed: {_spm_message(failure[0])} (data.vocab_size={vocab_size})")
        raise failure[0]
    vocab = Vocab(model.getvalue(), origin="the trained vocabulary")
    if path is not None:
        vocab.save(path)
    return vocab


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _spm_message(e: BaseException) -> str:
    """SentencePiece's message without its source location: "INTERNAL: x.cc(744) [cond] Text" -> "Text"."""
    line = _first_line(e)
    return line.rsplit("] ", 1)[-1].strip() or line


