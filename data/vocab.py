"""The vocabularies: text to token ids and back. Two kinds, loaded from their bytes by `load_vocab`:

- `Vocab` (the framework's own): one SentencePiece BPE model shared by source and target, with fixed
  special ids. Every vocabulary this framework trains uses PAD=0, UNK=1, BOS=2, EOS=3 and byte fallback (a
  character outside the pieces is spelled as UTF-8 byte pieces, so no input is unencodable and UNK never
  appears). A user's own model (`data.spm_model`) must use the same four ids. Text goes through
  SentencePiece's `nmt_nfkc` normalisation (NFKC, some control characters removed, whitespace runs
  collapsed), so `decode(encode(x)) == normalize(x)`, not always `x`.
- `MarianVocab` (imported OPUS-MT / Marian models, transformer/interop/marian.py): a source and a target SentencePiece
  model whose pieces share one id table (Marian's `vocab.json`; or one table per side, `target_vocab.json`).
  Ids are carried as Marian numbers them, not remapped: EOS=0, UNK=1, PAD = the id of `<pad>` (the last one
  in OPUS-MT models), no BOS: the decoder starts with PAD (bos_id = pad_id; another decoder start id is
  carried as bos_id). Stored as one JSON document.

Both give `encode` (source side), `encode_target`, `decode` (target side), the special ids and
`token_config()`, the vocabulary's part of a `TransformerConfig`.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm
from tqdm import tqdm

from data.errors import DataError
from data.files import atomic_write

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
        return cls(_read_model(path_or_bytes), origin=str(path_or_bytes))

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> Vocab:
        return cls(model_proto)

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    @property
    def size(self) -> int:
        return self._sp.get_piece_size()

    def token_config(self) -> dict[str, int | None]:
        """The `TransformerConfig` fields that come from the vocabulary."""
        return {"vocab_size": self.size, "target_vocab_size": None, "pad_id": PAD_ID, "unk_id": UNK_ID,
                "bos_id": BOS_ID, "eos_id": EOS_ID}

    @property
    def model_proto(self) -> bytes:
        """The serialized model: what checkpoints store and `from_bytes` reads."""
        return self._proto

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._proto).hexdigest()

    def encode(self, texts: list[str], *, num_threads: int = -1) -> list[list[int]]:
        """Piece ids of each text, without BOS/EOS (num_threads -1: SentencePiece's default, every core)."""
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    encode_target = encode  # one model for both sides

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenized text of each id sequence; PAD/BOS/EOS ids are dropped (UNK, which byte fallback
        never produces, would show as " ⁇ ")."""
        return self._sp.decode([[int(i) for i in seq] for seq in ids])

    @property
    def lowercases(self) -> bool:
        """Whether the model's normalisation folds case (trained with data.lowercase=true): it reads "A" as "a"
        and so only ever writes lowercase."""
        return self.normalize(["ÄB"]) == ["äb"]

    def normalize(self, texts: list[str]) -> list[str]:
        """The text that `decode(encode(x))` gives back: x after SentencePiece's normalisation."""
        return [self._sp.normalize(t).replace(_SPACE, " ").strip(" ") for t in texts]

    def encode_words(self, text: str, *, target: bool = False) -> tuple[list[int], list[int]]:
        """(piece ids of `text`, the 0-based whitespace word of `text` each piece belongs to), for word
        alignments (one model for both sides: `target` changes nothing)."""
        proto = self._sp.encode(text, out_type="proto")
        return [piece.id for piece in proto.pieces], _piece_words(text, [piece.begin for piece in proto.pieces])

    def byte_ids(self) -> list[int]:
        """The ids of the byte-fallback pieces (`<0x00>` ... `<0xFF>`): what spells a character outside the pieces."""
        return [i for i in range(self.size) if self._sp.is_byte(i)]

    def pieces(self, ids: list[int], *, target: bool = False) -> list[str]:
        return [self._sp.id_to_piece(int(i)) for i in ids]

    def piece_id(self, piece: str) -> int | None:
        """The id of the piece spelled exactly `piece` (e.g. a tag trained as a user-defined symbol), or None."""
        found = self._sp.piece_to_id(piece)
        return None if found == UNK_ID and piece != self._sp.id_to_piece(UNK_ID) else found

    def save(self, path: str | os.PathLike) -> None:
        """Write the model atomically (temporary file, fsync, rename)."""
        atomic_write(path, self._proto, what="vocabulary")


_MARIAN_FORMAT = "transformer.marian_vocab"


class MarianVocab:
    """A Marian / OPUS-MT vocabulary: source and target SentencePiece models, and the table of pieces by id
    that the model's ids index (one for both sides, or `target_pieces` for the target side).

    Tokenisation is MarianTokenizer's: a leading language token `>>xx<<` is kept as one token, the rest is
    split into pieces by the side's SentencePiece model, and each piece is looked up in the table (a piece
    not in it is UNK). Decoding drops PAD, EOS, UNK (MarianTokenizer's skip_special_tokens) and BOS, joins the
    pieces with the target model. Build with `MarianVocab.create`, or load with `load_vocab`.
    """

    def __init__(self, document: bytes, *, origin: str = "<bytes>"):
        try:
            doc = json.loads(document)
            if doc.get("format") != _MARIAN_FORMAT:
                raise ValueError("not a Marian vocabulary")
            self._source = spm.SentencePieceProcessor(model_proto=base64.b64decode(doc["source_spm"]))
            self._target = spm.SentencePieceProcessor(model_proto=base64.b64decode(doc["target_spm"]))
            self.source_pieces: list[str] = list(doc["pieces"])
            self.target_pieces: list[str] = list(doc["target_pieces"] or doc["pieces"])
            self.separate = doc["target_pieces"] is not None
            self.pad_id, self.unk_id, self.eos_id = int(doc["pad_id"]), int(doc["unk_id"]), int(doc["eos_id"])
        except (ValueError, KeyError, TypeError, RuntimeError):
            raise DataError(f"{origin} is not a readable Marian vocabulary (written by python -m transformer.hf "
                            "import)") from None
        self.bos_id = int(doc.get("bos_id", self.pad_id))  # the decoder's start: PAD in Marian's models
        self._proto = bytes(document)
        self._source_index = {piece: i for i, piece in enumerate(self.source_pieces)}
        self._target_index = {piece: i for i, piece in enumerate(self.target_pieces)}
        for side, pieces in (("source", self.source_pieces), ("target", self.target_pieces)):
            if max(self.pad_id, self.unk_id, self.eos_id, self.bos_id) >= len(pieces):
                raise DataError(f"{origin}: a special id is outside the {side} table of {len(pieces)} pieces")

    @classmethod
    def create(cls, *, source_spm: bytes, target_spm: bytes, pieces: list[str], target_pieces: list[str] | None,
               pad_id: int, unk_id: int, eos_id: int, bos_id: int | None = None) -> MarianVocab:
        document = {"format": _MARIAN_FORMAT, "version": 1, "pad_id": pad_id, "unk_id": unk_id, "eos_id": eos_id,
                    "bos_id": pad_id if bos_id is None else bos_id,
                    "pieces": list(pieces), "target_pieces": None if target_pieces is None else list(target_pieces),
                    "source_spm": base64.b64encode(source_spm).decode("ascii"),
                    "target_spm": base64.b64encode(target_spm).decode("ascii")}
        return cls(json.dumps(document, ensure_ascii=False, sort_keys=True).encode("utf-8"))

    @property
    def size(self) -> int:
        """Ids of the source side (the encoder's embedding rows)."""
        return len(self.source_pieces)

    @property
    def target_size(self) -> int:
        return len(self.target_pieces)

    def token_config(self) -> dict[str, int | None]:
        return {"vocab_size": self.size, "target_vocab_size": self.target_size if self.separate else None,
                "pad_id": self.pad_id, "unk_id": self.unk_id, "bos_id": self.bos_id, "eos_id": self.eos_id}

    @property
    def model_proto(self) -> bytes:
        """The serialized vocabulary (a JSON document): what checkpoints store and `load_vocab` reads."""
        return self._proto

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._proto).hexdigest()

    @property
    def source_spm(self) -> bytes:
        return self._source.serialized_model_proto()

    @property
    def target_spm(self) -> bytes:
        return self._target.serialized_model_proto()

    def _ids(self, texts: list[str], sp: spm.SentencePieceProcessor, index: dict[str, int],
             num_threads: int) -> list[list[int]]:
        split = [_language_code(text) for text in texts]
        pieces = sp.encode([rest for _, rest in split], out_type=str, num_threads=num_threads)
        return [[index.get(piece, self.unk_id) for piece in code + row] for (code, _), row in zip(split, pieces)]

    def encode(self, texts: list[str], *, num_threads: int = -1) -> list[list[int]]:
        """Source token ids of each text, without EOS."""
        return self._ids(list(texts), self._source, self._source_index, num_threads)

    def encode_target(self, texts: list[str], *, num_threads: int = -1) -> list[list[int]]:
        """Target token ids of each text (training targets, references), without EOS."""
        return self._ids(list(texts), self._target, self._target_index, num_threads)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenized text of target id sequences; PAD, EOS and UNK are dropped."""
        skip = {self.pad_id, self.eos_id, self.unk_id, self.bos_id}
        out = []
        for seq in ids:
            pieces = [self.target_pieces[int(i)] for i in seq if int(i) not in skip]
            out.append(self._target.decode_pieces(pieces).replace(_SPACE, " ").strip())
        return out

    @property
    def lowercases(self) -> bool:
        """Whether the model's normalisation folds case (trained with data.lowercase=true): it reads "A" as "a"
        and so only ever writes lowercase."""
        return self.normalize(["ÄB"]) == ["äb"]

    def normalize(self, texts: list[str]) -> list[str]:
        return [self._target.normalize(t).replace(_SPACE, " ").strip(" ") for t in texts]

    def pieces(self, ids: list[int], *, target: bool = False) -> list[str]:
        table = self.target_pieces if target else self.source_pieces
        return [table[int(i)] for i in ids]

    def encode_words(self, text: str, *, target: bool = False) -> tuple[list[int], list[int]]:
        """`Vocab.encode_words` with the source's (or the target's) model and table; a leading language code
        (">>fr<<") is one piece of the first word, as `encode` reads it."""
        sp, index = (self._target, self._target_index) if target else (self._source, self._source_index)
        code, rest = _language_code(text)
        offset = len(text.encode("utf-8")) - len(rest.encode("utf-8"))  # the code's bytes
        proto = sp.encode(rest, out_type="proto")
        pieces = [*code, *(piece.piece for piece in proto.pieces)]
        begins = [0] * len(code) + [offset + piece.begin for piece in proto.pieces]
        return [index.get(piece, self.unk_id) for piece in pieces], _piece_words(text, begins)

    def byte_ids(self) -> list[int]:
        """Ids of byte-fallback pieces (`<0x00>` ...) in either table; OPUS-MT's models have none."""
        return sorted({i for pieces in (self.source_pieces, self.target_pieces) for i, piece in enumerate(pieces)
                       if re.fullmatch(r"<0x[0-9A-F]{2}>", piece)})

    def save(self, path: str | os.PathLike) -> None:
        atomic_write(path, self._proto, what="vocabulary")


def _language_code(text: str) -> tuple[list[str], str]:
    """A Marian text's leading target-language code (">>fr<< Bonjour": [">>fr<<"], one piece) and the rest."""
    end = text.find("<<") if text.startswith(">>") else -1
    return ([text[: end + 2]], text[end + 2 :]) if end != -1 else ([], text)


def _piece_words(text: str, begins: list[int]) -> list[int]:
    """The 0-based whitespace word of `text` of each piece, from the byte offset where SentencePiece says it
    begins (normalisation cannot move a piece to another word): the word it starts in, or else (a leading "▁"
    starts in the whitespace before a word) the next word."""
    word_ends = [m.end() for m in re.finditer(rb"\S+", text.encode("utf-8"))]  # byte offset past each word
    last = max(len(word_ends) - 1, 0)
    return [min(bisect.bisect_right(word_ends, begin), last) for begin in begins]


def _read_model(path: str | os.PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"cannot read SentencePiece model {path}: {e.strerror or e}; give the path of a .model "
                        "file (data.spm_model), or data.spm_model=null to train one") from None


def load_vocab(path_or_bytes: str | os.PathLike | bytes) -> Vocab | MarianVocab:
    """Either kind of vocabulary, from a file or from its bytes (e.g. those a checkpoint stores)."""
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data, origin = bytes(path_or_bytes), "<bytes>"
    else:
        data, origin = _read_model(path_or_bytes), str(path_or_bytes)
    if data[:1] == b"{":  # a JSON document; a SentencePiece model is a protobuf, which never starts with "{"
        return MarianVocab(data, origin=origin)
    return Vocab(data, origin=origin)


def extend_vocab(old: Vocab, learned: Vocab, *, limit: int, reserved: Sequence[str] = ()) -> tuple[Vocab, int]:
    """`old` with the pieces of `learned` (a vocabulary trained on a new corpus) that it lacks, at most `limit`,
    and the `reserved` pieces it lacks (e.g. a new language's tag), appended after its last id: every old
    piece keeps its id, string, score and type (data.vocab=extend, docs/FINETUNING.md). Returns (the extended
    vocabulary, the number of pieces added).

    The learned pieces are taken in their model's order, which for BPE is the order of its merges: a piece comes
    after the pieces it is merged from, so each added piece can be reached by merges. They get scores below every
    old piece's, so the old merges keep their priority; old text is split as before except where an added piece
    applies after them (939 of 1,000 German Multi30k captions unchanged with 800 pieces learned on Czech), and
    new characters (a new script's letters) become pieces instead of byte fallback."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    model, new = model_pb2.ModelProto(), model_pb2.ModelProto()
    model.ParseFromString(old.model_proto)
    new.ParseFromString(learned.model_proto)
    have = {piece.piece for piece in model.pieces}
    normal, defined = model_pb2.ModelProto.SentencePiece.NORMAL, model_pb2.ModelProto.SentencePiece.USER_DEFINED
    score = min((piece.score for piece in model.pieces if piece.type == normal), default=0.0)
    added = 0
    for piece in new.pieces:
        if added == limit:
            break
        if piece.type == normal and piece.piece not in have:
            score -= 1.0
            model.pieces.add(piece=piece.piece, score=score, type=normal)
            have.add(piece.piece)
            added += 1
    for tag in reserved:
        if tag not in have:
            model.pieces.add(piece=tag, score=0.0, type=defined)
            have.add(tag)
            added += 1
    return Vocab(model.SerializeToString(), origin="the extended vocabulary"), added


def train_vocab(
    texts: Iterable[str],
    path: str | os.PathLike | None,
    vocab_size: int,
    *,
    character_coverage: float = 0.9999,
    num_threads: int = 1,
    total: int | None = None,
    reserved: Sequence[str] = (),
    lowercase: bool = False,
) -> Vocab:
    """Train a BPE model on `texts` (already sampled: all of them are used) and save it to `path`.

    The caller bounds the sample (`data.vocab_sample`); SentencePiece keeps the sentences in memory.
    `total` only sizes the progress bar. `reserved`: pieces kept whole wherever they appear (SentencePiece's
    user-defined symbols), e.g. the tag of tagged back-translation. `lowercase`: SentencePiece's own
    case-folding normalisation (nmt_nfkc_cf): the model lowercases what it encodes, so a translation model on it
    reads any case and writes lowercase.
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
                normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
                input_sentence_size=0,  # the caller samples; 0 = use every sentence given
                user_defined_symbols=list(reserved),
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
            message = _spm_message(failure[0])
            too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
            if too_small:  # SentencePiece's advice names its own flag (--character_coverage), not ours
                raise DataError(f"data.vocab_size={vocab_size} is too small for this corpus: its characters and the "
                                f"special pieces need {too_small[1]} pieces; set data.vocab_size to at least "
                                f"{too_small[1]} (or give a trained model with data.spm_model)")
            raise DataError(f"SentencePiece training failed: {message} (data.vocab_size={vocab_size})")
        raise failure[0]
    vocab = Vocab(model.getvalue(), origin="the trained vocabulary")
    if path is not None:
        vocab.save(path)
    return vocab


def _last_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _spm_message(e: BaseException) -> str:
    """SentencePiece's message without its source location: "INTERNAL: x.cc(744) [cond] Text" -> "Text"."""
    line = _last_line(e)
    return line.rsplit("] ", 1)[-1].strip() or line


