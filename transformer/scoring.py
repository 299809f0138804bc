"""Scoring translations: sacreBLEU, chrF, the paper's tokenized BLEU, test sets and the results tables.

Pure functions over lists of strings and files; no model, no Hydra. evaluate.py wires them.

Three metrics, one line each, in sacreBLEU's own format (`NAME|signature = score details`):

    BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0 = 34.97 64.3/40.6/28.3/20.2 (BP = ...)
    chrF2|nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0 = 63.75
    tokBLEU|tok:moses-de|split:compound|version:sacremoses-0.2.0 = 35.75 65.2/41.4/29.0/20.9 (BP = ...)

BLEU and chrF are sacreBLEU's Python API with its defaults, so they equal `sacrebleu REF -i HYP -m bleu
chrf -w 2` (the CLI prints one decimal unless given `-w 2`). The BLEU tokenizer is sacreBLEU's default for
the target language, as with the CLI's `-l`: 13a for German, French, English (`zh`, `ja-mecab`,
`ko-mecab` for Chinese, Japanese, Korean).

tokBLEU is the number the paper reports: tensor2tensor's get_ende_bleu.sh, step by step,

    replace-unicode-punctuation.perl < hyp                      (hypothesis only)
    tokenizer.perl -l $lang                                      (both sides; escaping on, no -a)
    perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'            (both sides)
    multi-bleu.perl ref < hyp

with sacremoses' MosesTokenizer (a line-for-line port of tokenizer.perl as of 2018) for the tokenizer and
sacreBLEU on the tokens (`tokenize="none"`, `smooth_method="none"`: multi-bleu's arithmetic, where a
zero n-gram precision gives 0) for multi-bleu. The signature's version is sacremoses' because the
tokenizer is the only part whose behaviour has changed between versions: today's Moses tokenizer.perl
also splits a line-final "NN." (a number or a non-breaking prefix before the last period), which
sacremoses 0.2 and the 2018 perl do not; on newstest2014 that moves the two systems in
../shared/data/systems from 35.75 / 29.67 (2018 perl, and this module) to 35.76 / 29.68 (today's perl).
fairseq's compound_split_bleu.sh tokenizes with `-a` and scores ~0.9 higher: not the paper's number.
"""

import copy
import functools
import importlib.metadata
import logging
import math
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sacremoses
from sacrebleu.metrics import BLEU, CHRF

from transformer.checkpoint import atomic_write

log = logging.getLogger(__name__)

__all__ = [
    "Score",
    "sacrebleu_scores",
    "tok_bleu",
    "tokbleu_tokenize",
    "lc_bleu",
    "lc_norm_tok",
    "replace_unicode_punctuation",
    "moses_compound_split",
    "read_lines",
    "load_testset",
    "append_table_row",
    "training_flops",
    "ROW_KEYS",
    "TABLE2_COLUMNS",
    "TABLE3_COLUMNS",
]


# ----------------------------------------------------------------------------------------------------
# Scores
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    """One metric on one test set: `line` is what evaluate.py prints, `as_dict()` what scores.json holds."""

    name: str  # "BLEU", "chrF2", "tokBLEU"
    score: float  # unrounded
    signature: str  # "nrefs:1|case:mixed|..." (what follows "NAME|" in the line)
    line: str  # "NAME|signature = 34.97 ..."
    details: dict[str, Any] = field(default_factory=dict)  # BLEU: precisions, bp, ratio, hyp_len, ref_len

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "score": self.score, "signature": self.signature, "line": self.line,
                **self.details}


def _check_pair(hyps: list[str], refs: list[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"the hypotheses have {len(hyps)} lines but the references have {len(refs)}: "
                         "give one translation per reference line")
    if not hyps:
        raise ValueError("nothing to score: the hypotheses and references are empty")


def _bleu_details(score) -> dict[str, Any]:
    return {"precisions": [round(p, 4) for p in score.precisions], "bp": score.bp, "ratio": score.ratio,
            "hyp_len": score.sys_len, "ref_len": score.ref_len}


def sacrebleu_scores(hyps: list[str], refs: list[str], lang: str) -> list[Score]:
    """sacreBLEU BLEU, chrF and the paper's tokBLEU of detokenized `hyps` against one reference each.

    `lang` is the target language (ISO code, e.g. "de"): it picks sacreBLEU's default BLEU tokenizer and
    the Moses tokenizer's rules for tokBLEU. Raises ValueError when the line counts differ.
    """
    _check_pair(hyps, refs)
    results = []
    for metric in (BLEU(trg_lang=lang), CHRF()):
        score = metric.corpus_score(hyps, [refs])
        signature = metric.get_signature().format()
        details = _bleu_details(score) if isinstance(metric, BLEU) else {}
        results.append(Score(name=score.name, score=float(score.score), signature=signature,
                             line=score.format(width=2, signature=signature), details=details))
    results.append(tok_bleu(hyps, refs, lang))
    return results


# ----------------------------------------------------------------------------------------------------
# tokBLEU: tensor2tensor's get_ende_bleu.sh
# ----------------------------------------------------------------------------------------------------

# Moses scripts/tokenizer/replace-unicode-punctuation.perl, every substitution in the script's order.
# The script reads bytes (its binmode lines are commented out), so each pattern is a fixed UTF-8 sequence
# and matches exactly where the character does; " *" is a literal space, not \s. Two places where
# sacremoses' MosesPunctNormalizer.REPLACE_UNICODE_PUNCTUATION is not the script: it reads "。\s*" and
# "．\s*", and maps "１" to "1" where the script maps it to '"' (a slip in the original, kept here because
# the paper's numbers went through it).
_UNICODE_PUNCTUATION = [(re.compile(pattern), replacement) for pattern, replacement in [
    ("，", ","), ("。 *", ". "), ("、", ","), ("”", '"'), ("“", '"'), ("∶", ":"), ("：", ":"), ("？", "?"),
    ("《", '"'), ("》", '"'), ("）", ")"), ("！", "!"), ("（", "("), ("；", ";"), ("１", '"'), ("」", '"'),
    ("「", '"'), ("０", "0"), ("３", "3"), ("２", "2"), ("５", "5"), ("６", "6"), ("９", "9"), ("７", "7"),
    ("８", "8"), ("４", "4"), ("． *", ". "), ("～", "~"), ("’", "'"), ("…", "..."), ("━", "-"), ("〈", "<"),
    ("〉", ">"), ("【", "["), ("】", "]"), ("％", "%"),
]]

# perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g' on bytes: \s is ASCII whitespace only (re.ASCII), and
# /g is non-overlapping, as re.sub is: "a-b-c" -> "a ##AT##-##AT## b-c".
_COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)


def replace_unicode_punctuation(line: str) -> str:
    """Moses' replace-unicode-punctuation.perl on one line (get_ende_bleu.sh applies it to hypotheses)."""
    for pattern, replacement in _UNICODE_PUNCTUATION:
        line = pattern.sub(replacement, line)
    return line


def moses_compound_split(line: str) -> str:
    """`(\\S)-(\\S) -> $1 ##AT##-##AT## $2`, perl's non-overlapping s///g (GNMT / ConvS2S convention)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


@functools.lru_cache(maxsize=8)
def _moses_tokenizer(lang: str) -> sacremoses.MosesTokenizer:
    return sacremoses.MosesTokenizer(lang=lang)


def _moses_tokenize(lines: list[str], lang: str) -> list[str]:
    """tokenizer.perl -l lang (default escaping: & < > ' " | [ ] become &amp; ... &#93;; no -a)."""
    tokenizer = _moses_tokenizer(lang)
    return [tokenizer.tokenize(line, escape=True, return_str=True, aggressive_dash_splits=False)
            for line in lines]


def tokbleu_tokenize(lines: list[str], lang: str, *, hypothesis: bool) -> list[str]:
    """get_ende_bleu.sh's text processing before multi-bleu: punctuation replacement (hypotheses only),
    Moses tokenization with escaping, compound splitting."""
    if hypothesis:
        lines = [replace_unicode_punctuation(line) for line in lines]
    return [moses_compound_split(line) for line in _moses_tokenize(lines, lang)]


def tok_bleu(hyps: list[str], refs: list[str], lang: str) -> Score:
    """The paper's BLEU: tensor2tensor's get_ende_bleu.sh (see the module docstring)."""
    _check_pair(hyps, refs)
    hyp_tokens = tokbleu_tokenize(hyps, lang, hypothesis=True)
    ref_tokens = tokbleu_tokenize(refs, lang, hypothesis=False)
    score = BLEU(tokenize="none", force=True, smooth_method="none").corpus_score(hyp_tokens, [ref_tokens])
    score.name = "tokBLEU"
    signature = f"tok:moses-{lang}|split:compound|version:sacremoses-{sacremoses.__version__}"
    return Score(name="tokBLEU", score=float(score.score), signature=signature,
                 line=score.format(width=2, signature=signature), details=_bleu_details(score))


# ----------------------------------------------------------------------------------------------------
# lcBLEU: the Multi30k papers' BLEU, against the official lowercased, normalised, tokenised references
# ----------------------------------------------------------------------------------------------------

# The multimodal MT papers (Multi30k, WMT16-18 multimodal tasks) score lowercased, Moses-normalised and
# -tokenised text with multi-bleu.perl against the task's official `*.lc.norm.tok.<lang>` references. Those
# files are the raw references through the task's preprocessing script,
#     lowercase.perl | normalize-punctuation.perl -l $lang | tokenizer.perl -l $lang   (escaping on, no -a)
# which `lc_norm_tok` reproduces with sacremoses: test_2016_flickr's German and English files line for line,
# the French one but for line 694, where the official file has `... neude &quot; .` and sacremoses'
# French normaliser gives `... neude . &quot;` (tests/test_scoring.py checks all three).


@functools.lru_cache(maxsize=8)
def _moses_normalizer(lang: str) -> sacremoses.MosesPunctNormalizer:
    return sacremoses.MosesPunctNormalizer(lang=lang)


def lc_norm_tok(lines: list[str], lang: str) -> list[str]:
    """Lowercase, Moses punctuation normalisation, Moses tokenization with escaping: the Multi30k task's
    preprocessing of its `lc.norm.tok` files."""
    normalizer, tokenizer = _moses_normalizer(lang), _moses_tokenizer(lang)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), escape=True, return_str=True,
                               aggressive_dash_splits=False) for line in lines]


def lc_bleu(hyps: list[str], tokenized_refs: list[str], lang: str) -> Score:
    """The Multi30k papers' BLEU: detokenized `hyps` lowercased, normalised and tokenised (`lc_norm_tok`),
    scored with multi-bleu's arithmetic against references that are already so (used as they are)."""
    _check_pair(hyps, tokenized_refs)
    score = BLEU(tokenize="none", force=True, smooth_method="none").corpus_score(lc_norm_tok(hyps, lang),
                                                                               [tokenized_refs])
    score.name = "lcBLEU"
    signature = f"case:lc|norm:moses-{lang}|tok:moses-{lang}|ref:tokenized|version:sacremoses-{sacremoses.__version__}"
    return Score(name="lcBLEU", score=float(score.score), signature=signature,
                 line=score.format(width=2, signature=signature), details=_bleu_details(score))


# ----------------------------------------------------------------------------------------------------
# Text files and sacreBLEU test sets
# ----------------------------------------------------------------------------------------------------


def read_lines(path: str | os.PathLike) -> list[str]:
    """The lines of a UTF-8 text file, split on "\\n" only, invalid bytes replaced by U+FFFD and trailing
    whitespace removed: exactly how sacreBLEU's command line reads hypotheses and references."""
    with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
        return [line.rstrip() for line in f]


def _sacrebleu_cache() -> str:
    return os.environ.get("SACREBLEU", os.path.join(os.path.expanduser("~"), ".sacrebleu"))


def _dataset(name: str):
    """sacreBLEU's dataset object, rooted at the cache $SACREBLEU names now.

    sacreBLEU reads $SACREBLEU once, when `sacrebleu` is imported, and roots every dataset there. A
    process that sets the variable later (a test, a notebook) gets a copy re-rooted at the current value.
    """
    from sacrebleu.dataset import DATASETS  # here: it must see $SACREBLEU as it is now (above)

    if name not in DATASETS:
        raise ValueError(f"unknown sacreBLEU test set {name!r} (`sacrebleu --list` shows them; "
                         "newstest2014 is wmt14/full)")
    dataset = DATASETS[name]
    outdir = os.path.join(_sacrebleu_cache(), dataset.name)
    if os.path.abspath(dataset._outdir) != os.path.abspath(outdir):
        dataset = copy.copy(dataset)  # sacreBLEU >= 2.2 keeps its paths in these two attributes
        dataset._outdir, dataset._rawdir = outdir, os.path.join(outdir, "raw")
    return dataset


def _testset(name: str):
    """sacreBLEU's dataset `name`; ValueError naming the fix for an unknown name or the filtered `wmt14`."""
    if name == "wmt14":
        raise ValueError("sacreBLEU's 'wmt14' is the filtered newstest2014 (2737 lines for en-de); "
                         "newstest2014 means the full 3003-line set: use testset=wmt14/full")
    return _dataset(name)


def testset_langpairs(name: str) -> list[str]:
    """The language pairs of a sacreBLEU test set; ValueError naming the fix for an unknown or refused name."""
    return sorted(_testset(name).langpairs)


def load_testset(name: str, langpair: str) -> tuple[list[str], list[str]]:
    """(source lines, reference lines) of a sacreBLEU test set, e.g. ("wmt14/full", "en-de").

    Reads sacreBLEU's cache ($SACREBLEU, default ~/.sacrebleu; offline with
    SACREBLEU=../shared/data/sacrebleu), downloading only what it lacks. The filtered `wmt14` is refused:
    newstest2014 means the full 3003-line set. A set with several references gives its first.
    """
    dataset = _testset(name)
    if langpair not in dataset.langpairs:
        raise ValueError(f"sacreBLEU test set {name!r} has no language pair {langpair!r} "
                         f"(it has {', '.join(sorted(dataset.langpairs))})")
    try:
        source = dataset.get_source_file(langpair)
        references = dataset.get_reference_files(langpair)
    except (Exception, SystemExit) as e:  # sacreBLEU's downloader exits on a bad checksum
        raise ValueError(f"cannot get sacreBLEU test set {name} {langpair} into the cache {_sacrebleu_cache()} "
                         f"({type(e).__name__}: {e}); offline, set SACREBLEU to a cache that holds it, "
                         "e.g. SACREBLEU=../shared/data/sacrebleu") from None
    src_lines, ref_lines = read_lines(source), read_lines(references[0])
    if len(src_lines) != len(ref_lines):
        raise ValueError(f"sacreBLEU test set {name} {langpair} in {_sacrebleu_cache()} is damaged: "
                         f"{len(src_lines)} source lines but {len(ref_lines)} reference lines")
    return src_lines, ref_lines


# ----------------------------------------------------------------------------------------------------
# Results tables in the paper's layout, and the training-cost column
# ----------------------------------------------------------------------------------------------------


def training_flops(params_non_embedding: int, tokens: int) -> float:
    """Training compute ≈ 6 · N · tokens (Kaplan et al. 2020): per token 2N FLOPs forward (a multiply and
    an add per weight) and 4N backward.

    N = parameters outside the embedding (the shared embedding is a lookup on the input side);
    tokens = target tokens trained on (updates × target tokens per update). In an encoder-decoder each
    weight sees one side, and source and target are about equally long, so the target count stands for
    both sides. Left out: attention's length-dependent terms and the output projection (2·V·D per target
    token forward, 6·V·D with backward), about 40% on top of 6N for the base model at 37k vocabulary.
    This counts the model's arithmetic; the paper's Table 2 column is instead the hardware's capacity over
    the run, training time × GPUs × each GPU's sustained single-precision FLOPS (its footnote: 2.8, 3.7,
    6.0 and 9.5 TFLOPS for K80, K40, M40 and P100), several times larger (base: 8 P100 × 12 h, 3.3·10^18
    there, 6N·tokens ≈ 0.7·10^18). That figure is the table's GPU-hours column × the GPU's FLOPS, which
    no checkpoint records.
    """
    return 6.0 * float(params_non_embedding) * float(tokens)


# The row a caller passes: one evaluation of one model. `lang` (the target language) places bleu/tokbleu in
# Table 2's EN-DE or EN-FR columns; in Table 3 "BLEU (dev)" is tokbleu, the paper's metric.
ROW_KEYS = ("model", "lang", "bleu", "tokbleu", "ppl", "steps", "params", "gpu_hours", "flops",
            "N", "d_model", "d_ff", "h", "d_k", "d_v", "p_drop", "eps_ls", "positions")
_MISSING = "–"  # an en dash, for a value a run does not have


def _text(value: Any) -> str:
    return str(value).replace("\n", " ").replace("|", "\\|").strip() or _MISSING


def _fixed(decimals: int):
    return lambda value: f"{value:.{decimals}f}"


def _general(value: Any) -> str:
    return f"{value:g}"


def _integer(value: Any) -> str:
    return str(int(value))


def _power_of_ten(value: Any) -> str:  # the paper's "3.3 · 10^18"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa} · 10^{int(exponent)}"


def _millions(value: Any) -> str:
    return f"{value / 1e6:.0f}"


# (column title, key of the expanded row, number format), in the paper's order
TABLE2_COLUMNS = [
    ("Model", "model", _text),
    ("EN-DE BLEU (sacreBLEU)", "en_de_bleu", _fixed(2)),
    ("EN-DE tokBLEU", "en_de_tokbleu", _fixed(2)),
    ("EN-FR BLEU (sacreBLEU)", "en_fr_bleu", _fixed(2)),
    ("EN-FR tokBLEU", "en_fr_tokbleu", _fixed(2)),
    ("Training steps", "steps", _integer),
    ("GPU-hours", "gpu_hours", _fixed(1)),
    ("Training FLOPs", "flops", _power_of_ten),
]
TABLE3_COLUMNS = [
    ("Model", "model", _text),  # the paper's unlabelled first column (base, (A), ..., big)
    ("N", "N", _integer),
    ("d_model", "d_model", _integer),
    ("d_ff", "d_ff", _integer),
    ("h", "h", _integer),
    ("d_k", "d_k", _integer),
    ("d_v", "d_v", _integer),
    ("P_drop", "p_drop", _general),
    ("ε_ls", "eps_ls", _general),
    ("positions", "positions", _text),  # sinusoidal (§3.5) | learned: row (E), the paper's free-text cell
    ("train steps", "steps", _integer),
    ("PPL (dev)", "ppl", _fixed(2)),
    ("BLEU (dev)", "tokbleu", _fixed(2)),
    ("params ×10^6", "params", _millions),
]
_TABLES = {
    "2": ("## Table 2: newstest2014 (test): BLEU and training cost", TABLE2_COLUMNS),
    "3": ("## Table 3: variations on the base model, newstest2013 (dev); BLEU is tokBLEU", TABLE3_COLUMNS),
}


def _cell(value: Any, number_format) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return _MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _text(value)
    return number_format(value)


def _expand(row: dict[str, Any]) -> dict[str, Any]:
    """The row with Table 2's language columns filled from `lang`."""
    cells = dict(row)
    lang = row.get("lang")
    if lang in ("de", "fr"):
        cells[f"en_{lang}_bleu"], cells[f"en_{lang}_tokbleu"] = row.get("bleu"), row.get("tokbleu")
    elif row.get("bleu") is not None or row.get("tokbleu") is not None:
        log.warning("Table 2 has EN-DE and EN-FR columns only: the BLEU of %s (target %s) is left out of it",
                    row.get("model"), lang)
        cells["model"] = f"{row.get('model') or _MISSING} (→{lang})"
    return cells


def _table_lines(table: str) -> list[str]:
    heading, columns = _TABLES[table]
    titles = [title for title, _, _ in columns]
    return [heading, "", "| " + " | ".join(titles) + " |", "|" + "|".join(" --- " for _ in titles) + "|"]


def append_table_row(table_path: str | os.PathLike, row: dict[str, Any], table: str = "2") -> None:
    """Append one evaluation to Table 2 ("2": a test-set run), Table 3 ("3": a dev-set run) or both ("both").

    `row` holds any of ROW_KEYS: model (a name), lang (target language: "de" fills Table 2's EN-DE
    columns, "fr" its EN-FR ones), bleu (sacreBLEU), tokbleu, ppl, steps, params (a count; shown in
    millions), gpu_hours, flops, and the architecture N, d_model, d_ff, h, d_k, d_v, p_drop, eps_ls, positions
    (sinusoidal | learned).
    Numbers are formatted per column; a missing key or None shows "–"; an unknown key is an error.
    Creates the file with both tables when absent; the write is atomic.
    """
    tables = {"2": ["2"], "3": ["3"], "both": ["2", "3"]}.get(str(table))
    if tables is None:
        raise ValueError(f"table must be '2', '3' or 'both', not {table!r}")
    unknown = sorted(set(row) - set(ROW_KEYS))
    if unknown:
        raise ValueError(f"unknown results-table keys {unknown}; known: {', '.join(ROW_KEYS)}")

    path = Path(table_path)
    if path.exists():
        lines = path.read_text(encoding="utf-8").splitlines()
    else:
        lines = ["# Results (the layout of the paper's Tables 2 and 3)", ""]
        for t in ("2", "3"):
            lines += _table_lines(t) + [""]

    for t in tables:
        heading, columns = _TABLES[t]
        cells = _expand(row) if t == "2" else row
        new_row = "| " + " | ".join(_cell(cells.get(key), number_format) for _, key, number_format in columns) + " |"
        if heading not in lines:  # a file from elsewhere, or a table someone deleted: add it at the end
            lines += ([""] if lines and lines[-1] else []) + _table_lines(t)
        pos = lines.index(heading) + 1
        while pos < len(lines) and not lines[pos].startswith(("|", "#")):  # to the table's header row
            pos += 1
        if pos == len(lines) or lines[pos].startswith("#"):  # a heading without its table
            lines[pos:pos] = _table_lines(t)[2:] + [""]
        while pos < len(lines) and lines[pos].startswith("|"):  # past the table's last row
            pos += 1
        lines.insert(pos, new_row)

    atomic_write(path, "\n".join(lines).rstrip("\n") + "\n", what="table")


def table_markdown(row: dict[str, Any], table: str = "2") -> list[str]:
    """Table 2 ("2") or 3 ("3") as Markdown lines holding only `row` (as `append_table_row` writes it),
    heading excluded: for a report."""
    _, columns = _TABLES[table]
    cells = _expand(row) if table == "2" else row
    return _table_lines(table)[2:] + [
        "| " + " | ".join(_cell(cells.get(key), number_format) for _, key, number_format in columns) + " |"]


SCORED_WITH = ("torch", "sacrebleu", "sacremoses", "sentencepiece", "datasets")


def package_versions() -> dict[str, str | None]:
    """The versions of Python and of the packages a score depends on (sacreBLEU and sacremoses tokenize,
    SentencePiece splits, torch decodes), recorded with every evaluation output and run: a figure can then
    be reproduced, or explained, with the same versions."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in SCORED_WITH:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions
