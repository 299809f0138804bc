"""One test set scored, the pieces evaluate.py puts together: what to score against, the scores, the
model's figures for the tables (perplexity, parameters, steps, training cost) and the table row.

    test = read_test_set(job, translator)              # sources (or None), references, its name
    scores = score(hypotheses, test, lang=..., tokenized=...)   # sacreBLEU BLEU, chrF, tokBLEU (+ lcBLEU)
    row = table_row(job, results, record, run_dir, lang, split)  # a row of Table 2 (test) or Table 3 (dev)

Every check of a user's request raises a one-line ConfigError before a model is loaded where it can.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from data.errors import ConfigError
from data.lines import read_text_lines
from data.paths import check_input
from transformer import checkpoint as ckpt
from transformer.checkpoint import TrainState
from transformer.config import EvaluateJob, model_config_with_defaults
from transformer.evaluation.scoring import Score, lc_bleu, sacrebleu_scores
from transformer.evaluation.tables import training_flops
from transformer.evaluation.testsets import load_testset, testset_langpairs
from transformer.evaluation.measures import corpus_nll

log = logging.getLogger("evaluate")


@dataclass(frozen=True)
class TestSet:
    sources: list[str] | None  # None: only a reference was given (hyp= scoring needs no source)
    references: list[str]
    name: str  # the test set's name, or the reference file's stem
    language: str | None = None  # a multilingual model's tgt_lang: each language's files apart

    @property
    def folder(self) -> str:
        """The folder under run_dir/eval/: the name, and a multilingual model's target language after it."""
        return f"{self.name}.{self.language}" if self.language else self.name


@dataclass(frozen=True)
class Destinations:
    """Where one evaluation reads its checkpoint's run and writes: `out` (hyp.txt, scores.json, the report),
    the `table` a row is appended to, and whether a report is written."""

    checkpoint: Path | None  # the checkpoint file a run directory or path resolves to (None: an ensemble, or hyp=)
    run_dir: Path | None
    out: Path | None  # out=, else run_dir/eval/<test set>
    table: Path | None  # table=, else run_dir/eval/table.md
    report: bool  # report=, else on for a run directory (whose logs the learning curves read)

    @classmethod
    def of(cls, job: EvaluateJob, test: TestSet) -> Destinations:
        path = ckpt.resolve(str(job.checkpoint)) if isinstance(job.checkpoint, str) else None
        run_dir = ckpt.run_dir_of(path) if path is not None else None
        out = Path(job.out) if job.out else (run_dir / "eval" / test.folder if run_dir else None)
        report = job.report
        if report is None:
            report = isinstance(job.checkpoint, str) and Path(job.checkpoint).is_dir()
        if report and out is None:
            raise ConfigError("report=true writes beside scores.json: give out=<directory>")
        table = Path(job.table) if job.table else (run_dir / "eval" / "table.md" if run_dir else None)
        return cls(checkpoint=path, run_dir=run_dir, out=out, table=table, report=report)


# --------------------------------------------------------------------------------------- the request


def read_file(path: str, key: str) -> list[str]:
    """The lines of `key`=path as sacreBLEU scores them (trailing whitespace removed). Invalid UTF-8 in what a
    score is computed against (ref=, tok_ref=) is a one-line error, in a hypothesis or source a warning naming
    the line (data/lines.py says why)."""
    check_input(path, key)
    return [line.rstrip() for line in read_text_lines(path, key, strict=key in ("ref", "tok_ref"))]


def hyp_files(hyp) -> list[str]:
    """hyp= as a list of files: none, one (`hyp=a.txt` or `hyp=[a.txt]`), or several systems to compare."""
    files = [] if hyp is None else [str(h) for h in hyp] if isinstance(hyp, (list, tuple)) else [str(hyp)]
    if isinstance(hyp, (list, tuple)) and not files:
        raise ConfigError("hyp=[] names no translation: give hyp=<file>, or hyp=[baseline,system,...] to compare")
    return files


def check_testset_name(job: EvaluateJob) -> None:
    """testset= alone (no src=/ref=) and a name sacreBLEU knows: checked before any model or file is read."""
    if job.src or job.ref:
        raise ConfigError("give either testset=<sacreBLEU name> or src=/ref= files, not both")
    try:
        testset_langpairs(job.testset)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def read_test_set(job: EvaluateJob, translator=None) -> TestSet:
    """The sources and references of testset= (its language pair from langpair= or the checkpoint) or of
    src=/ref= files."""
    if job.testset:
        check_testset_name(job)
        langpair = job.langpair
        model_pair = f"{translator.src_lang}-{translator.tgt_lang}" if translator and translator.src_lang else None
        if langpair is not None and model_pair is not None and langpair != model_pair:
            raise ConfigError(f"langpair={langpair} is not the model's language pair ({model_pair}): leave langpair "
                              f"out, or give a checkpoint that translates {langpair}")
        if langpair is None:
            if translator is None or not translator.src_lang:
                raise ConfigError("testset= needs langpair=<src>-<tgt> (e.g. langpair=en-de) without a checkpoint")
            langpair = f"{translator.src_lang}-{translator.tgt_lang}"
        try:
            sources, references = load_testset(job.testset, langpair)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return TestSet(sources, references, job.testset.replace("/", "_"))
    if not job.ref:
        raise ConfigError("nothing to score against: give testset=<sacreBLEU name> or ref=<file>")
    references = read_file(job.ref, "ref")
    sources = read_file(job.src, "src") if job.src else None
    if sources is not None and len(sources) != len(references):
        raise ConfigError(f"src={job.src} has {len(sources)} lines but ref={job.ref} has {len(references)}: "
                          "give a source and reference of the same test set")
    return TestSet(sources, references, Path(job.ref).stem)


def target_language(job: EvaluateJob, translator=None) -> str:
    """lang=, else the checkpoint's target language, the reference file's suffix, or langpair's target."""
    lang = job.lang or (translator.tgt_lang if translator else None)
    if lang is None and job.ref:
        lang = Path(job.ref).suffix.lstrip(".") or None
    if lang is None and job.langpair:
        lang = job.langpair.split("-")[1]
    if not lang:
        raise ConfigError("the target language is unknown: give lang=<code>, e.g. lang=de")
    return lang


def split_of(job: EvaluateJob, set_name: str) -> str:
    """dev (a Table 3 row) or test (a Table 2 row); split=auto: dev for newstest2013, else test."""
    if job.split != "auto":
        return job.split
    return "dev" if re.search(r"2013|wmt13", set_name) else "test"


def table_kind(job: EvaluateJob, set_name: str) -> str:
    return "3" if split_of(job, set_name) == "dev" else "2"


# ------------------------------------------------------------------------------------------ the scores


def score(hypotheses: list[str], test: TestSet, *, lang: str,
          tokenized: tuple[str, list[str]] | None = None) -> list[Score]:
    """sacreBLEU's BLEU and chrF and the paper's tokBLEU; with `tokenized` (the file and lines of the task's
    own lowercased tokenised reference, tok_ref=), also the Multi30k papers' lcBLEU."""
    if len(hypotheses) != len(test.references):
        raise ConfigError(f"the translation has {len(hypotheses)} lines but the reference has "
                          f"{len(test.references)}: score a translation of this test set")
    try:
        scores = sacrebleu_scores(hypotheses, test.references, lang=lang)
    except ValueError as error:  # e.g. an empty reference: nothing to score
        raise ConfigError(f"{error}: give a non-empty reference and translation") from None
    if tokenized is not None:
        file, lines = tokenized
        if len(lines) != len(test.references):
            raise ConfigError(f"tok_ref={file} has {len(lines)} lines but the reference has {len(test.references)}: "
                              "give the tokenised reference of the same test set")
        scores.append(lc_bleu(hypotheses, lines, lang))
    return scores


def training_record(record: dict, path: Path | None) -> dict:
    """A checkpoint's record (`Translator.checkpoints`) with what training cost (`TrainState`), for Table 2's
    GPU-hours and FLOPs columns.

    An averaged checkpoint holds weights only; its cost is that of the training checkpoint of its newest
    step in the same run (the numbered one, or last.pt at that step), when the run still has it.
    """
    if (record.get("kind") != "averaged" or not isinstance(record.get("step"), int) or path is None
            or ckpt.run_dir_of(path) is None):
        return record
    run_dir = ckpt.run_dir_of(path)
    for candidate in (ckpt.numbered_path(run_dir, record["step"]), ckpt.last_path(run_dir)):
        if not candidate.is_file():
            continue
        try:
            trained = ckpt.load(candidate, mmap=True)
        except ckpt.CheckpointError:
            continue
        if trained.get("step") == record.get("step"):
            state = TrainState.read(trained)
            return {**record, "train_seconds": state.train_seconds, "world_size": state.world_size,
                    "device": state.device, "train_tokens": state.train_tokens}
    log.warning("no training checkpoint of update %s in %s: the table row has no training cost",
                record.get("step"), run_dir)
    return record


def model_figures(translator, path: Path | None, test: TestSet, device) -> tuple[dict, dict | None]:
    """What the tables need of the model: the perplexity of the references (with a source), the parameters,
    the step and the training time; and the checkpoint's record with its training cost (`training_record`).
    An ensemble is scored as one model: its perplexity is that of the members' mean log-probabilities,
    renormalised (tests/evaluation/test_translate_evaluate.py computes it by hand)."""
    if translator is None:
        return {}, None
    figures = {}
    if test.sources is not None:
        vocab = translator.vocab
        sources = [translator.source_prefix + row for row in vocab.encode(test.sources)]  # a target tag first
        figures["ppl"] = corpus_nll(translator.model, sources, vocab.encode_target(test.references),
                                    max_tokens=translator.decode.max_tokens, device=device)["ppl"]
        log.info("perplexity of the references: %.2f", figures["ppl"])
    record = training_record(translator.checkpoints[0], path)
    figures.update({"params": record["params"], "step": record.get("step"),
                    "train_seconds": record.get("train_seconds"), "model_config": record["model_config"]})
    return figures, record


def row_name(job: EvaluateJob, run_dir: Path | None) -> str:
    """name=, else the run directory's name, the checkpoint files' stems, or the hypothesis file's name."""
    if job.name:
        return job.name
    if run_dir is not None:
        return run_dir.name
    if job.checkpoint is not None:  # a loose .pt file, or an ensemble of them
        names = job.checkpoint if isinstance(job.checkpoint, list) else [job.checkpoint]
        return " + ".join(Path(str(n)).stem for n in names)
    return Path(job.hyp).name


def table_row(job: EvaluateJob, results: dict, record: dict | None, run_dir: Path | None, lang: str,
              split: str) -> dict:
    """One row for the paper's Table 2 (test) or Table 3 (dev)."""
    scores = results["scores"]
    row = {"model": row_name(job, run_dir), "set": results.get("testset"), "lang": lang,
           "bleu": scores["BLEU"]["score"], "tokbleu": scores["tokBLEU"]["score"], "ppl": results.get("ppl")}
    if record is not None:
        m = model_config_with_defaults(record["model_config"])  # a record from before d_k or positions existed
        state = TrainState.read(record)
        train_cfg = (record.get("config") or {}).get("train", {})
        row.update({
            "steps": record.get("step"), "params": results["params"],
            "gpu_hours": state.train_seconds / 3600 * state.world_size if state.device == "cuda" else None,
            "flops": training_flops(results["params"] - m["vocab_size"] * m["d_model"], state.train_tokens) or None,
            "N": m["encoder_layers"], "d_model": m["d_model"], "d_ff": m["d_ff"], "h": m["heads"],
            "d_k": m["d_k"] or m["d_model"] // m["heads"], "d_v": m["d_model"] // m["heads"], "p_drop": m["dropout"],
            "eps_ls": train_cfg.get("label_smoothing"), "positions": m["positions"],
        })
    return row
