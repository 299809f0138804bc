"""Scoring translations: sacreBLEU, chrF, the paper's tokenized BLEU, the Multi30k papers' lcBLEU, and the
package versions a score depends on (test sets: transformer/evaluation/testsets.py; the results tables: tables.py).

Pure functions over lists of strings and files; no model, no Hydra. evaluate.py wires them; one command of
its own, `python -m transformer.evaluation.scoring lc-norm-tok LANG IN OUT`, makes a tok_ref= file (`main`).

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

from __future__ import annotations

import functools
import importlib.metadata
import logging
import platform
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sacrebleu.metrics import BLEU, CHRF

if TYPE_CHECKING:  # imported where tokenised BLEU is scored: half a second that most commands never need
    import sacremoses


log = logging.getLogger(__name__)

__all__ = [
    "Score",
    "bleu_metric",
    "sacrebleu_scores",
    "tok_bleu",
    "tokbleu_tokenize",
    "lc_bleu",
    "lc_norm_tok",
    "replace_unicode_punctuation",
    "moses_compound_split",
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


def bleu_metric(lang: str, **options: Any) -> BLEU:
    """sacreBLEU's BLEU with its default tokenizer for the target language `lang`, or a one-line ConfigError
    where that tokenizer needs a package this installation lacks (Japanese and Korean: MeCab)."""
    from data.errors import ConfigError

    try:
        return BLEU(trg_lang=lang, **options)
    except RuntimeError:  # sacreBLEU's ja-mecab and ko-mecab tokenizers, when their package is missing
        raise ConfigError(f"BLEU into {lang} tokenizes with sacreBLEU's {lang}-mecab tokenizer, which is not "
                          f"installed here: pip install 'sacrebleu[{lang}]'") from None


def sacrebleu_scores(hyps: list[str], refs: list[str], lang: str) -> list[Score]:
    """sacreBLEU BLEU, chrF and the paper's tokBLEU of detokenized `hyps` against one reference each.

    `lang` is the target language (ISO code, e.g. "de"): it picks sacreBLEU's default BLEU tokenizer and
    the Moses tokenizer's rules for tokBLEU. Raises ValueError when the line counts differ.
    """
    _check_pair(hyps, refs)
    results = []
    for metric in (bleu_metric(lang), CHRF()):
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
    import sacremoses

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
    signature = f"tok:moses-{lang}|split:compound|version:sacremoses-{importlib.metadata.version('sacremoses')}"
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
# French normaliser gives `... neude . &quot;` (tests/evaluation/test_scoring.py checks all three).


@functools.lru_cache(maxsize=8)
def _moses_normalizer(lang: str) -> sacremoses.MosesPunctNormalizer:
    import sacremoses

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
    signature = f"case:lc|norm:moses-{lang}|tok:moses-{lang}|ref:tokenized|version:sacremoses-{importlib.metadata.version('sacremoses')}"
    return Score(name="lcBLEU", score=float(score.score), signature=signature,
                 line=score.format(width=2, signature=signature), details=_bleu_details(score))


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


def main(argv: list[str] | None = None) -> int:
    """`python -m transformer.evaluation.scoring lc-norm-tok LANG IN OUT`: a reference put through the Multi30k
    task's preprocessing (`lc_norm_tok`), for evaluate.py's `tok_ref=` on a set without an official lowercased
    tokenised file, such as a validation set."""
    import argparse
    import sys
    from pathlib import Path

    from data.errors import ConfigError, WriteError
    from data.files import atomic_write
    from data.lines import read_text_lines

    parser = argparse.ArgumentParser(prog="python -m transformer.evaluation.scoring",
                                     description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    lc = commands.add_parser("lc-norm-tok", help="lowercase, Moses-normalise and -tokenise a reference (Multi30k's "
                                                 "lc.norm.tok)")
    lc.add_argument("lang", help="its language, for the Moses rules (de, fr, en, cs, ...)")
    lc.add_argument("input", help="the reference, one sentence a line")
    lc.add_argument("output", help="the file to write, for tok_ref=")
    args = parser.parse_args(argv)
    try:
        if not Path(args.input).is_file():
            raise ConfigError(f"{args.input}: no such file; give the reference to preprocess")
        lines = read_text_lines(args.input, "input", strict=True)
        atomic_write(Path(args.output), "".join(line + "\n" for line in lc_norm_tok(lines, args.lang)),
                     what="lowercased tokenised reference", elsewhere="give another OUT")
    except (ConfigError, WriteError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(lines)} lines, lowercased, Moses-normalised and -tokenised ({args.lang})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
