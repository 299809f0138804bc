"""Parallel corpora as HF `datasets`: loading, cleaning (with counts) and encoding to token ids.

Three sources, one result (a `datasets.Dataset` with string columns `src`, `tgt`, in file order):
- a hub dataset name and subset (`wmt/wmt14`, `de-en`), column `translation` = {lang: text};
- a local directory in the same layout (`../shared/data/wmt14`), read by the same `load_dataset` call;
- plain parallel text files by prefix: `<prefix>.<src_lang>` and `<prefix>.<tgt_lang>`, one sentence a
  line (lines end at "\\n"; a trailing "\\r" is dropped).

Nothing here holds the corpus in Python lists: data stays in memory-mapped Arrow files, and the
per-pair bookkeeping of cleaning is a few numpy arrays (a code, a hash and a kept index: 17 bytes a pair).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.errors import DataError
from data.files import atomic_write, sha256_of
from data.errors import one_line
from data.lines import count_lines, raw_lines
from data.vocab import MarianVocab, Vocab, load_vocab

if TYPE_CHECKING:
    import datasets

# `datasets` (with pandas and pyarrow: ~1.2 s of CPU) is imported by the functions that read or write a
# corpus, not here: train.py imports this module, and its --help, --cfg job and user errors need none of it.

HUB_UNREACHABLE = ("the hub cannot be reached; use data.dataset=<local dir>, experiment=quickstart, or (a dataset "
                   "in the datasets cache already) HF_DATASETS_OFFLINE=1")

# Fewer rows than this per worker are processed in the main process: starting workers would cost more.
_MIN_ROWS_PER_WORKER = 20_000


# ---------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class HubSource:
    """A split of a hub dataset (`name` = "owner/name") or of a local directory in the hub layout."""

    name: str
    subset: str | None
    split: str
    src_lang: str
    tgt_lang: str
    revision: str | None = None  # the hub repository's git revision (a commit hash pins the content)

    @property
    def is_local(self) -> bool:
        return Path(self.name).expanduser().is_dir()


@dataclass(frozen=True)
class TextSource:
    """Two aligned text files: `<prefix>.<src_lang>` and `<prefix>.<tgt_lang>`."""

    src_path: Path
    tgt_path: Path


Source = HubSource | TextSource


def text_source(prefix: str | os.PathLike, src_lang: str, tgt_lang: str) -> TextSource:
    prefix = Path(prefix).expanduser()
    src, tgt = Path(f"{prefix}.{src_lang}"), Path(f"{prefix}.{tgt_lang}")
    for path in (src, tgt):
        if not path.is_file():
            siblings = sorted(p.name for p in prefix.parent.glob(f"{prefix.name}.*")) if prefix.parent.is_dir() else []
            found = f"files with this prefix: {', '.join(siblings)}" if siblings else "no file has this prefix"
            raise DataError(f"data file not found: {path} ({found}); a data.*_prefix P names the files "
                            f"P.{src_lang} and P.{tgt_lang}: fix the prefix or data.src_lang/data.tgt_lang")
    return TextSource(src_path=src.resolve(), tgt_path=tgt.resolve())


def identity(source: Source, hashes: FileHashes) -> dict:
    """What identifies the source's content, for cache keys: file sizes and SHA-256 (not paths or times,
    so a copy of the corpus on another machine finds the data prepared here); for the hub, its name,
    subset and split (so a prepared cache is used without reaching the hub)."""
    if isinstance(source, TextSource):
        return {"kind": "text", "files": [hashes.get(source.src_path), hashes.get(source.tgt_path)]}
    if source.is_local:
        return {"kind": "local", "subset": source.subset, "split": source.split,
                "files": _directory_files(Path(source.name), hashes)}
    hub = {"kind": "hub", "name": source.name, "subset": source.subset, "split": source.split}
    return {**hub, "revision": source.revision} if source.revision else hub  # older cache keys stay valid


def _directory_files(root: Path, hashes: FileHashes) -> list:
    root = root.expanduser().resolve()
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    return [[str(p.relative_to(root)), *hashes.get(p)] for p in files]


class FileHashes:
    """SHA-256 of files, remembered by (path, size, mtime) in a JSON file so each file is read once."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._known = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self._known = {}

    def get(self, file: Path) -> list:
        """[size, sha256] of `file`."""
        file = file.resolve()
        st = file.stat()
        known = self._known.get(str(file))
        if known and known[:2] == [st.st_size, st.st_mtime_ns]:
            return [st.st_size, known[2]]
        sha = sha256_of(file)
        self._known[str(file)] = [st.st_size, st.st_mtime_ns, sha]
        atomic_write(self.path, json.dumps(self._known, indent=0), what="hash cache")
        return [st.st_size, sha]


def digest(obj) -> str:
    """A short, stable hash of a JSON-serialisable object (cache keys, fingerprints)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- loading
def load(source: Source, *, cache_dir: Path, hashes: FileHashes | None = None) -> datasets.Dataset:
    """The split as a Dataset with string columns `src`, `tgt` (raw text, file order). Text files and
    local directories are converted to Arrow once, under `cache_dir`, per content (`hashes`)."""
    hashes = hashes or FileHashes(cache_dir / "file-hashes.json")
    if isinstance(source, TextSource):
        return _load_text(source, cache_dir=cache_dir, hashes=hashes)
    return _load_hub(source, cache_dir=cache_dir, hashes=hashes)


def _load_text(source: TextSource, *, cache_dir: Path, hashes: FileHashes) -> datasets.Dataset:
    n_src, n_tgt = count_lines(source.src_path), count_lines(source.tgt_path)
    if n_src != n_tgt:
        raise DataError(
            f"misaligned parallel files: {source.src_path} has {n_src} lines but {source.tgt_path} has {n_tgt}; "
            "line n of one must be the translation of line n of the other: fix the files"
        )
    if n_src == 0:  # datasets cannot build an empty split from a generator
        raise DataError(f"empty parallel files: {source.src_path} and {source.tgt_path} have no lines; give files "
                        "with one sentence a line")
    import datasets

    # The explicit fingerprint (the files' content) is what datasets keys its cache on, so a changed file
    # is read again and an unchanged one is not.
    try:
        return datasets.Dataset.from_generator(
            _read_parallel,
            gen_kwargs={"src_path": str(source.src_path), "tgt_path": str(source.tgt_path)},
            features=datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")}),
            cache_dir=str(cache_dir / "raw"),
            fingerprint=digest(identity(source, hashes)),
        )
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, DataError):  # raised by _read_parallel, wrapped by datasets
            raise e.__cause__ from None
        raise




def _read_parallel(src_path: str, tgt_path: str):
    with open(src_path, "rb") as fs, open(tgt_path, "rb") as ft:  # raw_lines: also bare-CR line ends
        for number, (s, t) in enumerate(zip(raw_lines(fs), raw_lines(ft), strict=True), start=1):
            yield {"src": _decode_line(s, src_path, number), "tgt": _decode_line(t, tgt_path, number)}


def _decode_line(raw: bytes, path: str, number: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}, line {number}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
            "fix or remove that line in both files"
        ) from None
    if number == 1:
        text = text.removeprefix("\ufeff")
    return text.rstrip("\n").rstrip("\r")


def _select_split(splits: datasets.DatasetDict, spec: str, where: str) -> datasets.Dataset:
    """The rows `spec` names, in the datasets library's split syntax: a split ("validation"), a slice of one
    ("validation[:500]", "train[10%:]"), or several joined with "+" (e.g. to validate on the first 500 pairs of
    a 3000-pair dev set)."""
    import datasets

    try:
        parts = datasets.ReadInstruction.from_spec(spec).to_absolute({name: len(split) for name, split in
                                                                     splits.items()})
    except (ValueError, AssertionError) as e:
        name = spec.partition("[")[0]
        if name and name not in splits and "+" not in spec:
            raise DataError(f"split '{name}' not found in {where}; it has: {', '.join(splits)}") from None
        raise DataError(f"split '{spec}' of {where}: {one_line(e, limit=160)}; write a split name, a slice of one "
                        "('validation[:500]', 'train[:10%]') or several joined by '+'") from None
    chosen = [splits[part.splitname].select(range(part.from_, part.to)) if (part.from_, part.to) != (
        0, len(splits[part.splitname])) else splits[part.splitname] for part in parts]
    return concatenate(chosen)


def concatenate(parts: list[datasets.Dataset]) -> datasets.Dataset:
    """The rows of `parts` in order, as one dataset (the one part itself when there is one)."""
    import datasets

    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def open_arrow(path: Path) -> datasets.Dataset:
    """A dataset written by `encode` (memory-mapped, not read)."""
    import datasets

    return datasets.Dataset.from_file(str(path))


def _load_hub(source: HubSource, *, cache_dir: Path, hashes: FileHashes) -> datasets.Dataset:
    import datasets

    where = f"{source.name} (subset {source.subset})" if source.subset else source.name
    kwargs = {}
    if source.is_local:
        # datasets keys its cache for a local directory on the file names only, not their content, so a
        # changed directory must get its own cache folder.
        kwargs["cache_dir"] = str(cache_dir / "hf" / digest(_directory_files(Path(source.name), hashes)))
        path = str(Path(source.name).expanduser().resolve())
    elif source.name.startswith((".", "/", "~")):
        raise DataError(f"data.dataset: directory not found: {source.name}")
    else:
        path = source.name
        if source.revision:
            kwargs["revision"] = source.revision
        _check_hub_reachable()
    try:
        splits = datasets.load_dataset(path, source.subset, **kwargs)
    except ConnectionError:
        raise DataError(HUB_UNREACHABLE) from None
    except (ValueError, FileNotFoundError) as e:
        if isinstance(e, datasets.exceptions.DatasetNotFoundError):
            raise DataError(f"data.dataset: {source.name} not found on the hub or as a local directory") from None
        configs = _config_names(path)
        if configs and source.subset is None:
            raise DataError(f"data.subset is not set; {source.name} has: {', '.join(configs)}") from None
        if configs and source.subset not in configs:
            raise DataError(f"subset {source.subset!r} not found in {source.name}; it has: {', '.join(configs)} "
                            "(set data.subset)") from None
        raise DataError(f"cannot load {where}: {one_line(e, limit=240)}") from None
    except OSError as e:  # e.g. an HTTP error from the hub (gated dataset, rate limit)
        raise DataError(f"cannot load {where}: {one_line(e, limit=240)}") from None
    ds = _select_split(splits, source.split, where)
    if "translation" not in ds.column_names:
        raise DataError(f"{where} has no 'translation' column (columns: {', '.join(ds.column_names)})")
    feature = ds.features["translation"]
    langs = list(feature.languages) if isinstance(feature, datasets.Translation) else list(feature)
    for lang in (source.src_lang, source.tgt_lang):
        if lang not in langs:
            raise DataError(f"language '{lang}' not found in {where}; it has: {', '.join(langs)}")
    # flatten/rename/select are Arrow column operations: no copy of the text.
    flat = ds.flatten()
    flat = flat.select_columns([f"translation.{source.src_lang}", f"translation.{source.tgt_lang}"])
    return flat.rename_columns({f"translation.{source.src_lang}": "src", f"translation.{source.tgt_lang}": "tgt"})


def _config_names(path: str) -> list[str]:
    import datasets

    try:
        return list(datasets.get_dataset_config_names(path))
    except Exception:  # only to word an error better; the original error is reported otherwise
        return []


def _check_hub_reachable(timeout: float = 5.0) -> None:
    """Fail in seconds, not after datasets' retry loop, when the hub is out of reach."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE:
        return  # datasets uses its local cache, or raises ConnectionError at once
    endpoint = urllib.parse.urlparse(datasets.config.HF_ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError:
        raise DataError(HUB_UNREACHABLE) from None


# --------------------------------------------------------------------------------------------- cleaning
KEEP, EMPTY, TOO_LONG, RATIO = 0, 1, 2, 3


@dataclass(frozen=True)
class CleanReport:
    """How many pairs each filter removed (filters apply in this order; a pair counts once)."""

    read: int
    empty: int = 0
    too_long: int = 0
    ratio: int = 0
    duplicates: int = 0

    @property
    def kept(self) -> int:
        return self.read - self.empty - self.too_long - self.ratio - self.duplicates

    def summary(self) -> str:
        return (f"{self.read} pairs read, {self.kept} kept; removed: {self.empty} with an empty side, "
                f"{self.too_long} over max_len, {self.ratio} past max_len_ratio, {self.duplicates} duplicates")

    def to_dict(self) -> dict:
        return asdict(self)


def clean(
    ds: datasets.Dataset,
    *,
    max_len: int | None,
    max_len_ratio: float | None,
    dedup: bool,
    drop_empty: bool = True,
    num_proc: int = 1,
) -> tuple[datasets.Dataset, CleanReport]:
    """Drop pairs with an empty side, more than `max_len` whitespace words on a side, or a word-count
    ratio above `max_len_ratio` either way (Moses clean-corpus-n rules), then exact duplicates of the
    stripped pair (first occurrence kept). None turns a filter off. Text is stripped when encoded."""
    import datasets

    report = CleanReport(read=len(ds))
    if len(ds) == 0 or not (drop_empty or max_len or max_len_ratio or dedup):
        return ds, report
    scan = ds.map(
        _clean_codes,
        batched=True,
        batch_size=2000,
        input_columns=["src", "tgt"],
        remove_columns=ds.column_names,
        fn_kwargs={"max_len": max_len, "max_len_ratio": max_len_ratio, "dedup": dedup, "drop_empty": drop_empty},
        features=datasets.Features({"code": datasets.Value("int8"), "hash": datasets.Value("int64")}),
        keep_in_memory=True,  # 9 bytes a pair: the code and the hash
        num_proc=_workers(len(ds), num_proc),
        desc="cleaning",
    )
    codes = scan.data.column("code").to_numpy()
    counts = np.bincount(codes, minlength=4)
    keep = np.flatnonzero(codes == KEEP)
    duplicates = 0
    if dedup:
        hashes = scan.data.column("hash").to_numpy()[keep]
        _, first = np.unique(hashes, return_index=True)  # first occurrence of each distinct pair
        duplicates = keep.size - first.size
        keep = keep[np.sort(first)]
    report = CleanReport(read=len(ds), empty=int(counts[EMPTY]), too_long=int(counts[TOO_LONG]),
                         ratio=int(counts[RATIO]), duplicates=int(duplicates))
    if keep.size == len(ds):
        return ds, report
    return ds.select(keep, keep_in_memory=True), report


def _clean_codes(src: list[str], tgt: list[str], *, max_len, max_len_ratio, dedup, drop_empty) -> dict:
    codes, hashes = [], []
    for s, t in zip(src, tgt):
        s, t = s.strip(), t.strip()
        code = KEEP
        if drop_empty and (not s or not t):
            code = EMPTY
        elif max_len or max_len_ratio:
            ns, nt = len(s.split()), len(t.split())
            if max_len and (ns > max_len or nt > max_len):
                code = TOO_LONG
            elif max_len_ratio and (ns > max_len_ratio * nt or nt > max_len_ratio * ns):
                code = RATIO
        codes.append(code)
        if dedup:
            pair = hashlib.blake2b(f"{s}\n{t}".encode(), digest_size=8).digest()
            hashes.append(int.from_bytes(pair, "little", signed=True))
        else:
            hashes.append(0)
    return {"code": np.asarray(codes, dtype=np.int8), "hash": np.asarray(hashes, dtype=np.int64)}


def _workers(rows: int, num_proc: int) -> int | None:
    n = min(max(1, num_proc), max(1, rows // _MIN_ROWS_PER_WORKER))
    return n if n > 1 else None


# --------------------------------------------------------------------------------------------- encoding


def encode(
    ds: datasets.Dataset,
    vocab: Vocab | MarianVocab,
    *,
    cache_file: Path,
    num_proc: int = 1,
    keep_text: bool = True,
    desc: str = "encoding",
) -> datasets.Dataset:
    """Token ids of each (stripped) pair: int32 columns `src_ids`, `tgt_ids` (no BOS/EOS) and their
    lengths `src_len`, `tgt_len`; with `keep_text`, also the stripped `src`, `tgt`. Written to
    `cache_file` (with a `_0000i_of_0000n` suffix per worker when there are several)."""
    import datasets

    features = {"src_ids": datasets.List(datasets.Value("int32")), "tgt_ids": datasets.List(datasets.Value("int32")),
                "src_len": datasets.Value("int32"), "tgt_len": datasets.Value("int32")}
    if keep_text:
        features = {"src": datasets.Value("string"), "tgt": datasets.Value("string"), **features}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    return ds.map(
        _Encoder(vocab.model_proto, keep_text=keep_text),
        batched=True,
        batch_size=1000,
        input_columns=["src", "tgt"],
        remove_columns=ds.column_names,
        features=datasets.Features(features),
        cache_file_name=str(cache_file),
        load_from_cache_file=False,
        new_fingerprint=digest({"file": str(cache_file), "vocab": vocab.sha256}),
        num_proc=_workers(len(ds), num_proc),
        desc=desc,
    )


class _Encoder:
    """The `datasets.map` function; holds the vocabulary's bytes (picklable) and loads it once per process."""

    def __init__(self, model_proto: bytes, *, keep_text: bool):
        self.model_proto = model_proto
        self.keep_text = keep_text
        self._vocab = None

    def __getstate__(self):
        return {"model_proto": self.model_proto, "keep_text": self.keep_text, "_vocab": None}

    def __call__(self, src: list[str], tgt: list[str]) -> dict:
        if self._vocab is None:  # here: in the worker process that unpickled this object
            self._vocab = load_vocab(self.model_proto)
        src = [s.strip() for s in src]
        tgt = [t.strip() for t in tgt]
        src_ids = self._vocab.encode(src, num_threads=1)
        tgt_ids = self._vocab.encode_target(tgt, num_threads=1)
        out = {"src_ids": src_ids, "tgt_ids": tgt_ids,
               "src_len": [len(x) for x in src_ids], "tgt_len": [len(x) for x in tgt_ids]}
        if self.keep_text:
            out["src"], out["tgt"] = src, tgt
        return out


def lengths(ds: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Source and target lengths in pieces (without EOS/BOS) of an encoded dataset, as int64 arrays."""
    table = ds.select_columns(["src_len", "tgt_len"]).with_format("arrow")[:]
    return (table.column("src_len").to_numpy().astype(np.int64),
            table.column("tgt_len").to_numpy().astype(np.int64))


def sample_sentences(ds: datasets.Dataset, max_sentences: int, *, seed: int):
    """A random sample of at most `max_sentences` sentences, both sides, without holding the corpus:
    (iterator over stripped sentences, its length)."""
    pairs = len(ds)
    if 2 * pairs > max_sentences:
        rng = np.random.default_rng([seed, 0x5EED])
        idx = np.sort(rng.choice(pairs, size=max(1, max_sentences // 2), replace=False))
        ds = ds.select(idx, keep_in_memory=True)

    def sentences():
        for batch in ds.select_columns(["src", "tgt"]).iter(batch_size=1000):
            for s, t in zip(batch["src"], batch["tgt"]):
                yield from (x for x in (s.strip(), t.strip()) if x)

    return sentences(), 2 * len(ds)

