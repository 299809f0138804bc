"""Is system B really better than system A? sacreBLEU's paired significance tests, as a table.

    python evaluate.py hyp=[baseline.de,new.de,...] ref=newstest2014.de

Every system is scored (BLEU, chrF, the paper's tokBLEU: `scoring.sacrebleu_scores`, the numbers a
single-system evaluation prints) and compared with the first by sacreBLEU's own `PairedTest`, the code
behind `sacrebleu REF -i A B ... --paired-bs` (or `--paired-ar`), with the same metric objects and
defaults, so its means, intervals and p-values equal the command line's:

- `bs`, paired bootstrap resampling (Koehn 2004; Moses' bootstrap-hypothesis-difference-significance.pl):
  1000 resamples of the test set's sentences, drawn once and shared by every system; per system the
  bootstrap mean with the 95 % interval's half-width (μ ± CI), and the p-value of the absolute difference
  to the baseline.
- `ar`, paired approximate randomization (Riezler & Maxwell 2005, multeval): 10000 trials swapping the
  two systems' sentences; the interval then comes from 1000 bootstrap resamples, as sacreBLEU's does.

The random numbers come from sacreBLEU's seed: the environment variable SACREBLEU_SEED (default 12345, the
command line's), read by sacreBLEU itself. tokBLEU is reported beside them, without a test of its own.
Pure functions over lists of strings; no model, no Hydra.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sacrebleu.metrics import CHRF
from sacrebleu.significance import PairedTest

from data.files import atomic_write
from transformer.evaluation.scoring import bleu_metric, sacrebleu_scores

__all__ = ["TESTS", "SystemResult", "Significance", "paired_significance"]

TESTS = ("bs", "ar")  # sacreBLEU's test_type: paired bootstrap resampling, approximate randomization


@dataclass(frozen=True, kw_only=True)
class MetricResult:
    """One metric of one system: the corpus score; the bootstrap mean and the half-width of its 95 %
    interval; the p-value against the baseline (None for the baseline itself)."""

    score: float
    mean: float
    ci: float
    p_value: float | None


@dataclass(frozen=True, kw_only=True)
class SystemResult:
    name: str
    bleu: MetricResult
    chrf: MetricResult
    tokbleu: float  # the paper's metric, no test
    lines: tuple[str, ...]  # the single-system result lines of BLEU, chrF2 and tokBLEU (evaluate.py's stdout)


@dataclass(frozen=True, kw_only=True)
class Significance:
    """The systems (the baseline first) and what the test was."""

    test: str  # bs | ar
    samples: int  # resamples (bs) or trials (ar)
    signatures: dict[str, str]  # "BLEU" / "chrF2" -> sacreBLEU's signature (with the seed and sample count)
    systems: list[SystemResult]

    def as_dict(self) -> dict[str, Any]:
        return {"test": self.test, "samples": self.samples, "signatures": self.signatures,
                "systems": [asdict(system) for system in self.systems]}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2) + "\n"

    def write(self, out: Path, title: str) -> None:
        """significance.md (`title`, then the table) and significance.json in `out`."""
        atomic_write(out / "significance.md", f"# {title}\n\n" + self.markdown())
        atomic_write(out / "significance.json", self.to_json())

    def markdown(self) -> str:
        """The table evaluate.py prints and writes to significance.md, with the signatures and how to read it."""
        what = {"bs": f"paired bootstrap resampling, {self.samples} resamples",
                "ar": f"paired approximate randomization, {self.samples} trials"}[self.test]
        lines = ["| System | BLEU | BLEU μ ± 95% CI | p (BLEU) | chrF2 | chrF2 μ ± 95% CI | p (chrF2) | tokBLEU |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for number, system in enumerate(self.systems):
            name = ("baseline: " if number == 0 else "") + system.name.replace("|", "\\|")
            cells = [name]
            for metric in (system.bleu, system.chrf):
                cells += [f"{metric.score:.2f}", f"{metric.mean:.2f} ± {metric.ci:.2f}", _p_value(metric.p_value)]
            cells.append(f"{system.tokbleu:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"Each system against the baseline ({what}; sacreBLEU's PairedTest). p: the chance of an "
                  "absolute difference at least this large if both systems came from the same process; "
                  "* marks p < 0.05. A small p says the systems differ, not which one is better.", ""]
        lines += [f"- {name}|{signature}" for name, signature in self.signatures.items()]
        return "\n".join(lines) + "\n"


def _p_value(p: float | None) -> str:
    if p is None:
        return "–"
    return f"{p:.4f}" + ("*" if p < 0.05 else "")


def paired_significance(systems: list[tuple[str, list[str]]], references: list[str], *, lang: str,
                        test: str = "bs", samples: int = 0) -> Significance:
    """Score each (name, hypotheses) system and test it against the first with sacreBLEU's PairedTest.

    `lang` is the target language (BLEU's tokenizer, tokBLEU's Moses rules); `samples` 0 takes sacreBLEU's
    default (1000 resamples for bs, 10000 trials for ar). Raises ValueError on fewer than two systems, a
    repeated name, an unknown test, or a system whose line count differs from the references'.
    """
    if test not in TESTS:
        raise ValueError(f"unknown paired test {test!r}: use bs (bootstrap resampling) or ar (approximate "
                         "randomization)")
    if samples < 0:
        raise ValueError(f"the number of paired samples must be >= 0 (0: sacreBLEU's default), not {samples}")
    if len(systems) < 2:
        raise ValueError("a paired test needs at least two systems: the baseline first, then the others")
    names = [name for name, _ in systems]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{repeated[0]} is given twice: give each system once")
    single = [sacrebleu_scores(hyps, references, lang=lang) for _, hyps in systems]  # also checks line counts
    metrics = {"BLEU": bleu_metric(lang, references=[references]), "chrF2": CHRF(references=[references])}
    # Under `ar`, n_ar_confidence=0 asks for sacreBLEU's default bootstrap (1000) for the interval too; under
    # `bs` the resamples give the interval, and -1 (the command line's value) keeps the signature's bs:N true.
    paired = PairedTest(systems, metrics, references=None, test_type=test, n_samples=samples,
                        n_ar_confidence=0 if test == "ar" else -1)
    signatures, results = paired()
    rows = []
    for number, (name, _) in enumerate(systems):
        by_name = {score.name: score for score in single[number]}
        bleu, chrf = results["BLEU"][number], results["chrF2"][number]
        rows.append(SystemResult(name=name, bleu=_metric_result(bleu), chrf=_metric_result(chrf),
                                 tokbleu=by_name["tokBLEU"].score, lines=tuple(s.line for s in single[number])))
    return Significance(test=test, samples=paired.n_samples,
                        signatures={name: sig.format() for name, sig in signatures.items()},
                        systems=rows)


def _metric_result(result) -> MetricResult:
    return MetricResult(score=float(result.score), mean=float(result.mean), ci=float(result.ci),
                        p_value=None if result.p_value is None else float(result.p_value))
