"""One call from a `data.*` config to a vocabulary and encoded splits: `prepare`.

    prepared = prepare(cfg.data, run_dir, splits=("train", "valid"), seed=cfg.seed, log=log.info)
    prepared.vocab                   # data.vocab.Vocab (also saved as run_dir/spm.model)
    prepared.train.dataset           # datasets.Dataset: src_ids, tgt_ids, src_len, tgt_len
    prepared.train.src_lengths       # numpy int64 [N], pieces without EOS (also .tgt_lengths)
    prepared.train.epoch_rows        # a mix drawing fractions afresh: epoch -> its rows (else None)
    prepared.train.report            # data.corpus.CleanReport: what cleaning removed
    prepared.train.tokens            # data.batching.TokenArrays: the ids, flat and memory-mapped, for collate
    prepared.valid.dataset           # ... plus the stripped text src, tgt (for BLEU); also .test

`prepare` is idempotent: a second call with the same corpus, cleaning keys and vocabulary loads the
encoded splits from the cache (`data.cache_dir`, default `run_dir/data`) without reading the corpus
again, and the vocabulary stored in the run directory is reused, never retrained. Calling it ahead of
training (`python train.py ... prepare_only=true`) lets a CPU machine prepare what GPUs then train on.
See docs/DATA.md for the keys and the cache layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from filelock import FileLock

from data import corpus
from data.batching import TokenArrays
from data.corpus import CleanReport
from data.config import DataConfig, temperature_weights
from data.errors import ConfigError, DataError
from data.files import atomic_write
from data.vocab import Vocab, extend_vocab, load_vocab, train_vocab

if TYPE_CHECKING:
    import datasets

SPLITS = ("train", "valid", "test")
CACHE_FORMAT = 1
VOCAB_FILE = "spm.model"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """One encoded split: the dataset (memory-mapped Arrow) and its lengths in pieces, without specials."""

    dataset: datasets.Dataset
    src_lengths: np.ndarray
    tgt_lengths: np.ndarray
    report: CleanReport
    cache_entry: Path
    tokens: TokenArrays  # the same ids as flat memory-mapped arrays, for batching (data.batching.collate)
    # a mix with a fractional weight: the rows of each epoch (its shares drawn afresh), for data.batching's
    # BatchStream; None: every row, every epoch
    epoch_rows: Callable[[int], np.ndarray] | None = None


@dataclass(frozen=True)
class Prepared:
    vocab: Vocab
    vocab_path: Path
    splits: dict[str, Split]

    @property
    def train(self) -> Split:
        return self._split("train")

    @property
    def valid(self) -> Split:
        return self._split("valid")

    @property
    def test(self) -> Split:
        return self._split("test")

    def valid_sets(self, settings: DataConfig) -> dict[tuple[str, str], Split]:
        """The validation sets by (source, target) language: the main pair's, then each extra corpus's that has a
        valid_prefix (a multilingual run validates every pair)."""
        sets = {settings.pair(): self.valid}
        for i, extra in enumerate(settings.extra_train, start=1):
            if f"valid+{i}" in self.splits:
                sets.setdefault(settings.pair(extra), self.splits[f"valid+{i}"])
        return sets

    def _split(self, name: str) -> Split:
        if name not in self.splits:
            raise ValueError(f"the {name} split was not prepared (splits={tuple(self.splits)})")
        return self.splits[name]


def data_config(cfg: DataConfig | Mapping) -> DataConfig:
    """`cfg` as a checked DataConfig: train.py's, or a mapping of its keys (absent ones take the defaults)."""
    if isinstance(cfg, DataConfig):
        return cfg
    names = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = sorted(set(cfg) - names)
    if unknown:
        raise DataError(f"unknown config key data.{unknown[0]} (see docs/DATA.md)")
    try:
        return DataConfig(**cfg)
    except ConfigError as error:
        raise DataError(str(error)) from None


def source(cfg: DataConfig, split: str) -> corpus.Source:
    """Where `split` ("train", "valid" or "test") is read from: the hub dataset's split, or <prefix>.<lang>;
    "train+<i>" is the extra training corpus `data.extra_train[i - 1]`."""
    if split.startswith(("train+", "valid+")):
        extra = cfg.extra_train[int(split[6:]) - 1]
        prefix = extra.prefix if split.startswith("train+") else extra.valid_prefix
        return corpus.text_source(prefix, extra.src_lang or cfg.src_lang, extra.tgt_lang or cfg.tgt_lang)
    if cfg.dataset:
        return corpus.HubSource(name=cfg.dataset, subset=cfg.subset, split=getattr(cfg, f"{split}_split"),
                                src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang, revision=cfg.revision)
    prefix = getattr(cfg, f"{split}_prefix")
    if not prefix:
        raise DataError(f"data.{split}_prefix is not set; the {split} split needs <prefix>.{cfg.src_lang} "
                        f"and <prefix>.{cfg.tgt_lang}")
    return corpus.text_source(prefix, cfg.src_lang, cfg.tgt_lang)


def cleaning(cfg: DataConfig, split: str) -> dict:
    """Training pairs are filtered; valid and test keep every line (BLEU needs them aligned with their
    references), so there only the text is stripped."""
    if split.startswith("train"):
        return {"max_len": cfg.max_len, "max_len_ratio": cfg.max_len_ratio, "dedup": cfg.dedup, "drop_empty": True}
    return {"max_len": None, "max_len_ratio": None, "dedup": False, "drop_empty": False}


def training_corpora(cfg: DataConfig) -> list[tuple[str, float, str | None]]:
    """(split name, weight, tag) of every training corpus: the main one ("train"), then data.extra_train."""
    return [("train", cfg.train_weight, cfg.train_tag)] + [(f"train+{i}", c.weight, c.tag)
                                                            for i, c in enumerate(cfg.extra_train, start=1)]


def prepare(
    data_cfg: Mapping,
    run_dir: str | os.PathLike,
    *,
    splits: Sequence[str] = ("train", "valid"),
    seed: int,
    log: Callable[[str], None] = _log.info,
    vocab: Vocab | None = None,
    extend: Vocab | None = None,
) -> Prepared:
    """The vocabulary and the encoded `splits` (names from "train", "valid", "test").

    `vocab`, when given (e.g. the one a checkpoint carries for fine-tuning), is used instead of training
    or loading one. `extend` (data.vocab=extend): the checkpoint's vocabulary, which the run's vocabulary extends
    with pieces learned on the corpus (`data.vocab.extend_vocab`). Safe to call from several processes at once (a file lock serialises them: call it
    on every rank, the first one prepares, the others load).
    """
    settings = data_config(data_cfg)
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    for split in [*splits, *(name for name, _, _ in training_corpora(settings)[1:] if "train" in splits)]:
        source(settings, split)  # a missing file or prefix is reported before the vocabulary is trained
    run_dir = Path(run_dir)
    cache_dir = Path(settings.cache_dir).expanduser() if settings.cache_dir else run_dir / "data"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / ".prepare.lock")):
        hashes = corpus.FileHashes(cache_dir / "file-hashes.json")
        cleaned: dict[str, tuple[datasets.Dataset, CleanReport]] = {}

        def load_clean(split: str) -> tuple[datasets.Dataset, CleanReport]:
            if split not in cleaned:
                raw = corpus.load(source(settings, split), cache_dir=cache_dir, hashes=hashes)
                ds, report = corpus.clean(raw, **cleaning(settings, split), num_proc=settings.num_workers)
                log(f"data: {split}: {report.summary()}")
                if report.kept == 0:
                    what = {"train": "training corpus"}.get(split, f"{split} split")
                    if split.startswith("train+"):
                        what = f"training corpus data.extra_train[{int(split[6:]) - 1}]"
                    raise DataError(f"the {what} is empty after cleaning: {report.summary()} "
                                    "(check the files, or relax data.max_len / data.max_len_ratio)")
                cleaned[split] = ds, report
            return cleaned[split]

        vocab, vocab_path = _resolve_vocab(settings, run_dir, vocab, load_clean=load_clean, seed=seed, log=log,
                                           extend=extend)
        encoded = lambda split: _split(settings, split, vocab, cache_dir=cache_dir, hashes=hashes,  # noqa: E731
                                       load_clean=load_clean, log=log)
        out = {}
        extra_valid = [f"valid+{i}" for i, c in enumerate(settings.extra_train, start=1) if c.valid_prefix]
        for split in [*splits, *(extra_valid if "valid" in splits else [])]:
            if split == "train" and settings.mixes_corpora:
                out[split] = _mixed_training_set(settings, vocab, encoded, cache_dir=cache_dir, seed=seed, log=log)
            else:
                out[split] = encoded(split)
    return Prepared(vocab=vocab, vocab_path=vocab_path, splits=out)


def _split(settings: DataConfig, split: str, vocab: Vocab, *, cache_dir: Path, hashes, load_clean, log) -> Split:
    ds, report, entry = _encoded_split(settings, split, vocab, cache_dir=cache_dir, hashes=hashes,
                                       load_clean=load_clean, log=log)
    src_lengths, tgt_lengths = corpus.lengths(ds)
    if not TokenArrays.saved_in(entry):  # also for a cache entry written before they existed
        TokenArrays.from_dataset(ds, out=entry)
    return Split(dataset=ds, src_lengths=src_lengths, tgt_lengths=tgt_lengths, report=report, cache_entry=entry,
                 tokens=TokenArrays.load(entry))


# ------------------------------------------------------------------------------------ several corpora
def _mixed_training_set(settings: DataConfig, vocab: Vocab, encoded: Callable[[str], Split], *, cache_dir: Path,
                        seed: int, log) -> Split:
    """The training set of several corpora (or of one with a weight): an epoch holds each corpus's pairs
    `weight` times, its sources led by its tag, one corpus after the other; BatchStream shuffles the batches.
    Whole weights: the copies are laid out once (memory-mapped, cached like a split, keyed by its parts). A
    fraction of a time (weight 1.5, or a large corpus's share under data.temperature): each corpus is laid out
    once and every epoch draws its fraction afresh from (seed, corpus, epoch) (`Split.epoch_rows`), as
    fairseq's ResamplingDataset does: every pair has the same chance each epoch, not one subset for the run."""
    corpora = training_corpora(settings)
    parts = [(name, encoded(name), weight, _tag_id(vocab, tag, name)) for name, weight, tag in corpora]
    if settings.temperature is not None:  # each corpus's share from its size (data/config.py)
        weights = temperature_weights([len(split.src_lengths) for _, split, _, _ in parts], settings.temperature)
        parts = [(name, split, weight, tag_id) for (name, split, _, tag_id), weight in zip(parts, weights)]
    sizes = [len(split.src_lengths) for _, split, _, _ in parts]
    redrawn = any(_drawn(n, weight) for (_, _, weight, _), n in zip(parts, sizes))
    key = {"format": CACHE_FORMAT, "seed": seed,
           "parts": [[split.cache_entry.name, weight, tag_id] for _, split, weight, tag_id in parts]}
    if redrawn:
        key["epochs"] = "redrawn"
    entry = cache_dir / f"train-mix-{corpus.digest(key)}"
    laid_out = [np.arange(n, dtype=np.int64) if redrawn else _weighted_rows(n, weight, seed=seed, corpus=i)
                for i, ((_, _, weight, _), n) in enumerate(zip(parts, sizes))]
    if not TokenArrays.saved_in(entry):
        entry.mkdir(parents=True, exist_ok=True)
        TokenArrays.gathered([(split.tokens, r, tag_id) for (_, split, _, tag_id), r in zip(parts, laid_out)],
                             out=entry)
    for (name, split, weight, tag_id), n in zip(parts, sizes):
        tag = f", tag {vocab.pieces([tag_id])[0]}" if tag_id is not None else ""
        fresh = " (the fraction drawn afresh each epoch)" if _drawn(n, weight) else ""
        log(f"data: training corpus {_corpus_name(name)}: {n} pairs × weight {weight:g}{tag} = "
            f"{int(round(weight * n))} pairs an epoch{fresh}")
    tokens = TokenArrays.load(entry)
    reports = [split.report for _, split, _, _ in parts]
    report = CleanReport(**{field: sum(getattr(r, field) for r in reports) for field in ("read", "empty", "too_long",
                                                                                        "ratio", "duplicates")})
    epoch_rows = None
    if redrawn:
        starts = np.cumsum([0, *sizes[:-1]])
        weights = [weight for _, _, weight, _ in parts]

        def epoch_rows(epoch: int) -> np.ndarray:
            return np.concatenate([start + _weighted_rows(n, weight, seed=seed, corpus=i, epoch=epoch)
                                   for i, (start, n, weight) in enumerate(zip(starts, sizes, weights))])
    return Split(dataset=corpus.concatenate([split.dataset for _, split, _, _ in parts]),
                 src_lengths=np.diff(tokens.src_offsets), tgt_lengths=np.diff(tokens.tgt_offsets),
                 report=report, cache_entry=entry, tokens=tokens, epoch_rows=epoch_rows)


def _corpus_name(split: str) -> str:
    return "data.train_prefix/dataset" if split == "train" else f"data.extra_train[{int(split[6:]) - 1}]"


def _weighted_rows(n: int, weight: float, *, seed: int, corpus: int, epoch: int = 0) -> np.ndarray:
    """Row indices of a corpus of n pairs for one epoch at `weight`: every row int(weight) times, then the
    fractional rest as distinct rows drawn from (seed, corpus, epoch)."""
    whole, rest = _copies(n, weight)
    rng = np.random.default_rng([seed, corpus, 0xB7] + ([epoch] if epoch else []))  # epoch 0: as before epochs
    drawn = np.sort(rng.choice(n, size=rest, replace=False))
    return np.concatenate([np.tile(np.arange(n, dtype=np.int64), whole), drawn.astype(np.int64)])


def _copies(n: int, weight: float) -> tuple[int, int]:
    """(whole copies, pairs drawn) of a corpus of n pairs at `weight` an epoch (2.5: 2 copies and n / 2 drawn),
    from the rounded total, so that a weight of 0.9999999999999999 (data.temperature=1) is one whole copy."""
    return divmod(int(round(weight * n)), n) if n else (0, 0)


def _drawn(n: int, weight: float) -> int:
    """How many of a corpus's n pairs the fraction of its weight draws each epoch (weight 2.5: n / 2)."""
    return _copies(n, weight)[1]


def _tag_id(vocab: Vocab, tag: str | None, split: str) -> int | None:
    if tag is None:
        return None
    found = vocab.piece_id(tag) if hasattr(vocab, "piece_id") else None
    if found is None:
        key = "data.train_tag" if split == "train" else f"{_corpus_name(split)}.tag"
        raise DataError(f"{key}={tag} is not a piece of the vocabulary: a vocabulary trained "
                        f"here reserves it; with data.spm_model or init_from's (data.vocab=keep), train one with it as "
                        "a user-defined symbol, or use data.vocab=transfer")
    return found


# ------------------------------------------------------------------------------------------ vocabulary
def _resolve_vocab(settings: DataConfig, run_dir: Path, given: Vocab | None, *, load_clean, seed: int,
                   log, extend: Vocab | None = None) -> tuple[Vocab, Path]:
    """The run's vocabulary: given > data.spm_model > run_dir/spm.model > trained (then stored there; with
    `extend`, the pieces it has that `extend` lacks are added to `extend`)."""
    path = run_dir / VOCAB_FILE
    stored = load_vocab(path) if path.is_file() else None
    if given is not None:
        source, vocab = "the given vocabulary", given
    elif settings.spm_model:
        source, vocab = f"data.spm_model={settings.spm_model}", load_vocab(Path(settings.spm_model).expanduser())
        _check_case(vocab, settings, source)
        if settings.vocab_size is not None and settings.vocab_size != vocab.size:
            log(f"data: data.vocab_size={settings.vocab_size} is ignored: data.spm_model has {vocab.size} pieces")
    elif stored is not None:
        if settings.vocab_size is not None and stored.size != settings.vocab_size:
            raise DataError(f"{path} has {stored.size} pieces but data.vocab_size={settings.vocab_size}; a stored "
                            f"vocabulary is never retrained: use a new run_dir or set data.vocab_size={stored.size}")
        _check_case(stored, settings, str(path))
        log(f"data: vocabulary: {path} ({stored.size} pieces)")
        return stored, path
    else:
        if settings.vocab_size is None:
            raise DataError(f"data.vocab_size is null and there is no vocabulary to use ({path}, data.spm_model): "
                            "set data.vocab_size (37000 for WMT14 EN-DE, 32000 for EN-FR)")
        # Sampled from every training corpus as it is (each once, untagged; with data.temperature, each at its
        # share, so that a small language is not underrepresented); the tags are reserved pieces.
        train = [load_clean(name)[0] for name, _, _ in training_corpora(settings)]
        if settings.temperature is not None:
            weights = temperature_weights([len(ds) for ds in train], settings.temperature)
            train = [ds.select(_weighted_rows(len(ds), w, seed=seed, corpus=i))
                     for i, (ds, w) in enumerate(zip(train, weights))]
        train = corpus.concatenate(train)
        sentences, total = corpus.sample_sentences(train, settings.vocab_sample, seed=seed)
        reserved = f", reserving {', '.join(settings.tags)}" if settings.tags else ""
        log(f"data: training a {settings.vocab_size}-piece BPE vocabulary on {total} sentences "
            f"(sampled from {len(train)} pairs, both sides){reserved}")
        start = time.monotonic()
        vocab = train_vocab(sentences, None if extend else path, settings.vocab_size, num_threads=settings.num_workers,
                            total=total, reserved=settings.tags, lowercase=settings.lowercase)
        if extend is not None:
            vocab, added = extend_vocab(extend, vocab, limit=settings.extend_pieces, reserved=settings.tags)
            vocab.save(path)
            log(f"data: data.vocab=extend: the checkpoint's {extend.size} pieces and {added} of the "
                f"{settings.vocab_size} learned on this corpus (data.extend_pieces={settings.extend_pieces})")
        log(f"data: vocabulary: {path} ({vocab.size} pieces, {time.monotonic() - start:.1f} s)")
        return vocab, path
    if stored is not None and stored.sha256 != vocab.sha256:
        raise DataError(f"{path} differs from {source}; a run keeps one vocabulary: use a new run_dir")
    if stored is None:
        vocab.save(path)
    log(f"data: vocabulary: {source} ({vocab.size} pieces), stored as {path}")
    return vocab, path


def _check_case(vocab: Vocab, settings: DataConfig, source: str) -> None:
    """A vocabulary chosen by file (data.spm_model, run_dir's) folds case exactly when data.lowercase says so.
    (A checkpoint's, with data.vocab=keep, is the model's own and is taken as it is.)"""
    if getattr(vocab, "lowercases", False) != settings.lowercase:
        raise DataError(f"{source} {'folds' if settings.lowercase is False else 'keeps'} case but data.lowercase="
                        f"{str(settings.lowercase).lower()}: set data.lowercase={str(not settings.lowercase).lower()} "
                        "or use a vocabulary trained for it")


# ------------------------------------------------------------------------------------------ encoded splits
def _encoded_split(settings: DataConfig, split: str, vocab: Vocab, *, cache_dir: Path, hashes, load_clean,
                   log) -> tuple[datasets.Dataset, CleanReport, Path]:
    """The split from its cache entry, or loaded, cleaned and encoded into a new one."""
    corpus_id = corpus.identity(source(settings, split), hashes)
    keep_text = split != "train"
    # A multilingual run's validation and test pairs lead with their pair's tag (the main pair's, or valid+i's
    # corpus's).
    tag = (settings.extra_train[int(split[6:]) - 1].tag if split.startswith("valid+")
           else settings.train_tag if split in ("valid", "test") else None)
    tag_id = _tag_id(vocab, tag, "train" if split in ("valid", "test") else f"train+{split[6:]}") if tag else None
    key = {"format": CACHE_FORMAT, "corpus": corpus_id, "langs": [settings.src_lang, settings.tgt_lang],
           "clean": cleaning(settings, split), "vocab": vocab.sha256, "keep_text": keep_text}
    if tag_id is not None:
        key["tag"] = tag_id
    entry = cache_dir / f"{split}-{corpus.digest(key)}"
    meta_path = entry / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = None  # absent (not done, or interrupted) or unreadable: encode again
    if meta is not None and all((entry / name).is_file() for name in meta["files"]):
        ds = _open(entry, meta["files"])
        report = CleanReport(**meta["report"])
        log(f"data: {split}: {len(ds)} pairs from the cache {entry} ({report.summary()})")
        return ds, report, entry
    shutil.rmtree(entry, ignore_errors=True)
    ds, report = load_clean(split)
    start = time.monotonic()
    encoded = corpus.encode(ds, vocab, cache_file=entry / "encoded.arrow", num_proc=settings.num_workers,
                            keep_text=keep_text, desc=f"encoding {split}")
    if tag_id is not None:
        encoded = encoded.map(lambda batch: {"src_ids": [[tag_id, *ids] for ids in batch["src_ids"]],
                                             "src_len": [n + 1 for n in batch["src_len"]]},
                              batched=True, features=encoded.features, cache_file_name=str(entry / "tagged.arrow"),
                              load_from_cache_file=False, new_fingerprint=corpus.digest({"tagged": str(entry)}),
                              desc=f"tagging {split}")
    files = [Path(f["filename"]).name for f in encoded.cache_files]
    meta = {"key": key, "files": files, "rows": len(encoded), "report": report.to_dict(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write(meta_path, json.dumps(meta, indent=1), what="cache entry")  # written last: an entry without meta.json is incomplete and is redone
    log(f"data: {split}: encoded {len(encoded)} pairs in {time.monotonic() - start:.1f} s into {entry}")
    return _open(entry, files), report, entry


def _open(entry: Path, files: list[str]) -> datasets.Dataset:
    return corpus.concatenate([corpus.open_arrow(entry / name) for name in files])
