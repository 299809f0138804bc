"""`data.*`: the corpus, its cleaning and the vocabulary, as one checked dataclass (docs/DATA.md).

`DataConfig` is the schema of the `data` config group (transformer/config.py composes it into the jobs) and
what `data.pipeline.prepare` reads. `require`, `one_of` and `at_least` are the range checks every config
dataclass of the project uses: each raises a one-line ConfigError that names the key and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import List, Optional

from data.errors import ConfigError
from data.paths import READ_FILE, READ_PREFIX, WRITE_DIR, path_field


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def one_of(key: str, value: str, options: tuple[str, ...], note: str = "") -> None:
    require(value in options, f"{key}={value} is not one of {', '.join(options)}{note}")


def at_least(key: str, value: float | None, lowest: float, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    require(value is not None and value >= lowest,
            f"{key}={value!r} is invalid: set it to a number >= {lowest}{' or null' if nullable else ''}")


@dataclass(frozen=True, kw_only=True)
class ExtraCorpus:
    """One more training corpus beside the main one (`data.extra_train`): `<prefix>.<src_lang>` and
    `<prefix>.<tgt_lang>`, e.g. back-translations. `weight`: its pairs count this many times an epoch (2.5: each
    twice, and half of them, drawn once from the seed, a third time); `tag`: a piece put before every source
    sentence of this corpus (tagged back-translation: a reserved piece such as <BT>, docs/BACKTRANSLATION.md;
    multilingual training: the target language's, such as <2fr>). `src_lang`, `tgt_lang`: its language pair, where
    it is not the main corpus's (null: data.src_lang, data.tgt_lang)."""

    prefix: str = path_field(READ_PREFIX, "")
    weight: float = 1.0
    tag: Optional[str] = None
    src_lang: Optional[str] = None
    tgt_lang: Optional[str] = None
    valid_prefix: Optional[str] = path_field(READ_PREFIX)  # its own validation pairs (multilingual: per pair)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """`data.*`: the corpus, its cleaning and the vocabulary (docs/DATA.md). Defaults: WMT14 EN-DE."""

    src_lang: str = "en"
    tgt_lang: str = "de"
    vocab_size: Optional[int] = 37000
    # null: train a shared SentencePiece BPE model (stored in run_dir)
    spm_model: Optional[str] = path_field(READ_FILE, hint="or data.spm_model=null to train one")
    vocab: str = "keep"  # with init_from: keep (the checkpoint's) | transfer (a new one) | extend (docs/FINETUNING.md)
    extend_pieces: int = 8000  # data.vocab=extend: the most pieces added (learned on the new corpus, vocab_size of them)
    dataset: Optional[str] = None  # HF hub name or a local directory in its layout; or train_prefix
    subset: Optional[str] = None
    revision: Optional[str] = None  # a hub dataset's git revision (a commit hash pins its content); null: the newest
    train_split: str = "train"
    valid_split: str = "validation"
    test_split: str = "test"
    train_prefix: Optional[str] = path_field(READ_PREFIX)  # <prefix>.<lang>: one sentence a line
    train_weight: float = 1.0  # with data.extra_train: how many times the main corpus counts an epoch
    train_tag: Optional[str] = None  # a piece put before every source of the main corpus (multilingual: <2de>)
    # Sampling of several corpora by temperature (Arivazhagan et al. 2019): corpus i of n_i pairs is p_i ∝
    # n_i^(1/T) of an epoch of Σ n_i pairs (T = 1: each corpus once; larger T: the small ones upsampled towards
    # an equal share). null: the weights as given (data.train_weight, data.extra_train[i].weight).
    temperature: Optional[float] = None
    extra_train: List[ExtraCorpus] = field(default_factory=list)  # more training corpora (back-translations)
    valid_prefix: Optional[str] = path_field(READ_PREFIX)
    test_prefix: Optional[str] = path_field(READ_PREFIX)
    generate: Optional[str] = None  # `synthetic`: write the quickstart's generated corpus to the prefixes
    lowercase: bool = False  # a vocabulary that folds case (SentencePiece's nmt_nfkc_cf): the model reads and writes lowercase
    vocab_sample: int = 2_000_000  # sentences sampled (both sides) to train the vocabulary
    max_len: Optional[int] = 250  # training pairs with more whitespace words on a side are dropped
    max_len_ratio: Optional[float] = 1.5  # ... or whose word-length ratio exceeds this
    dedup: bool = False
    num_workers: int = 4
    cache_dir: Optional[str] = path_field(WRITE_DIR)  # null: run_dir/data

    def __post_init__(self) -> None:
        extra = [ExtraCorpus(**c) if isinstance(c, Mapping) else c for c in self.extra_train]
        object.__setattr__(self, "extra_train", extra)  # a mapping of the keys (data_config) reads as one too
        require(self.train_weight > 0, f"data.train_weight={self.train_weight} must be a positive number")
        for i, corpus in enumerate(extra):
            require(bool(corpus.prefix), f"data.extra_train[{i}] has no prefix: give prefix=<path without .<lang>>")
            require(corpus.weight > 0, f"data.extra_train[{i}].weight={corpus.weight} must be a positive number")
            require(corpus.tag is None or (bool(corpus.tag) and len(corpus.tag.split()) == 1
                                           and corpus.tag == corpus.tag.strip()),
                    f"data.extra_train[{i}].tag={corpus.tag!r} must be one word without spaces, e.g. <BT>, or null")
            pair = (corpus.src_lang or self.src_lang, corpus.tgt_lang or self.tgt_lang)
            require(pair[0] != pair[1], f"data.extra_train[{i}] translates {pair[0]} into itself: give two "
                                        "different languages (src_lang, tgt_lang)")
        require(self.train_tag is None or (bool(self.train_tag) and len(self.train_tag.split()) == 1),
                f"data.train_tag={self.train_tag!r} must be one word without spaces, e.g. <2de>, or null")
        if self.train_tag is not None:  # multilingual: every corpus's tag is its target language's
            tags = {self.tgt_lang: self.train_tag}
            for i, corpus in enumerate(extra):
                lang = corpus.tgt_lang or self.tgt_lang
                require(corpus.tag is not None and tags.setdefault(lang, corpus.tag) == corpus.tag,
                        f"data.extra_train[{i}] translates into {lang}, whose tag is {tags.get(lang)!r} with "
                        "data.train_tag set (one tag per target language): give it tag: "
                        f"{tags.get(lang) or '<2' + lang + '>'}")
                other = next((other for other, tag in tags.items() if tag == corpus.tag and other != lang), None)
                require(other is None, f"data.extra_train[{i}] translates into {lang} with tag {corpus.tag}, the tag "
                                       f"of {other}: give each target language its own tag, e.g. <2{lang}>")
        else:  # one model into several target languages cannot be told which one to write without their tags
            for i, corpus in enumerate(extra):
                require(corpus.tgt_lang in (None, self.tgt_lang),
                        f"data.extra_train[{i}] translates into {corpus.tgt_lang}, the main corpus into "
                        f"{self.tgt_lang}: a model of several target languages needs their tags: set "
                        f"data.train_tag=<2{self.tgt_lang}> and give that corpus tag: <2{corpus.tgt_lang}> "
                        "(docs/MULTILINGUAL.md)")
        require(self.temperature is None or self.temperature > 0,
                f"data.temperature={self.temperature} must be a positive number (1: each corpus once) or null")
        require(self.temperature is None or (self.train_weight == 1 and all(c.weight == 1 for c in extra)),
                "data.temperature sets every corpus's share: leave data.train_weight and the extra_train weights "
                "at 1, or set data.temperature=null")
        require(not (self.dataset and self.train_prefix),
                "both data.dataset and data.train_prefix are set: set one of them to null")
        for split in ("valid", "test"):  # a hub dataset's splits are its own: a prefix beside it would be unread
            require(not (self.dataset and getattr(self, f"{split}_prefix")),
                    f"data.dataset={self.dataset} reads its {split} split from the hub (data.{split}_split), and "
                    f"data.{split}_prefix would be ignored: set data.{split}_prefix=null, or train from files "
                    "(data.dataset=null data.train_prefix=<prefix>)")
        require(bool(self.dataset or self.train_prefix),
                "neither data.dataset nor data.train_prefix is set: set one (the other stays null)")
        require(not self.revision or bool(self.dataset),
                f"data.revision={self.revision} pins a hub dataset, but data.dataset is null: set data.dataset or "
                "data.revision=null")
        require(bool(self.src_lang and self.tgt_lang) and self.src_lang != self.tgt_lang,
                f"data.src_lang and data.tgt_lang must be two different languages (got {self.src_lang!r}, "
                f"{self.tgt_lang!r})")
        require(self.vocab_size is None or self.vocab_size >= 300,
                f"data.vocab_size must be an integer >= 300 (256 byte pieces + specials + characters) or null, "
                f"got {self.vocab_size!r}")
        one_of("data.vocab", self.vocab, ("keep", "transfer", "extend"),
               " (keep: the init_from checkpoint's vocabulary; transfer: a new one; extend: the checkpoint's with "
               "pieces of the new corpus added; see docs/FINETUNING.md)")
        require(self.extend_pieces >= 0, f"data.extend_pieces={self.extend_pieces} must be a number >= 0")
        require(self.generate in (None, "synthetic"), f"data.generate={self.generate} is not one of null, synthetic")
        require(self.max_len is None or self.max_len >= 1, f"data.max_len must be an integer >= 1 or null, "
                                                            f"got {self.max_len!r}")
        require(self.max_len_ratio is None or self.max_len_ratio >= 1,
                f"data.max_len_ratio must be a number >= 1 or null, got {self.max_len_ratio!r}")
        require(self.num_workers >= 1, f"data.num_workers must be an integer >= 1, got {self.num_workers!r}")
        require(self.vocab_sample >= 2, f"data.vocab_sample must be an integer >= 2, got {self.vocab_sample!r}")

    @property
    def mixes_corpora(self) -> bool:
        """Whether the training set is more than the main corpus taken once."""
        return bool(self.extra_train) or self.train_weight != 1 or self.train_tag is not None

    def pair(self, corpus: ExtraCorpus | None = None) -> tuple[str, str]:
        """The (source, target) languages of the main corpus (None) or of an extra one."""
        if corpus is None:
            return self.src_lang, self.tgt_lang
        return corpus.src_lang or self.src_lang, corpus.tgt_lang or self.tgt_lang

    @property
    def tags(self) -> list[str]:
        """The reserved pieces the corpora put before their sources, each once, in order."""
        return list(dict.fromkeys(t for t in [self.train_tag, *(c.tag for c in self.extra_train)] if t))


def language_tags(data: Mapping) -> dict[str, str]:
    """A multilingual run's target languages and the tag of each, from its `data.*` (a DataConfig's fields as
    a mapping, e.g. what a checkpoint saved): {data.tgt_lang: data.train_tag, each extra corpus's target
    language: its tag}; {} for a run whose main corpus has no tag (one pair, or tagged back-translation)."""
    if not data.get("train_tag"):
        return {}
    tags = {data["tgt_lang"]: data["train_tag"]}
    for corpus in data.get("extra_train") or []:
        tags.setdefault(corpus.get("tgt_lang") or data["tgt_lang"], corpus.get("tag"))
    return tags


def temperature_weights(sizes: list[int], temperature: float) -> list[float]:
    """The weight of each corpus of `sizes` pairs under sampling by temperature T: its share of an epoch of
    Σ n pairs is p_i = n_i^(1/T) / Σ_j n_j^(1/T), so it counts p_i · Σ n / n_i times (1 for every corpus at T = 1)."""
    total = sum(sizes)
    scaled = [n ** (1 / temperature) for n in sizes]
    return [s / sum(scaled) * total / n for s, n in zip(scaled, sizes)]
