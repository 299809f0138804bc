"""Translate a test set (or take a given translation), score it, and add a row to the paper's tables.

    python evaluate.py checkpoint=runs/paper_base_en_de-wmt14-en-de testset=wmt14/full
    python evaluate.py checkpoint=runs/quickstart src=corpus/test.en ref=corpus/test.de
    python evaluate.py hyp=system.de ref=newstest2014.de          # any system's output
    python evaluate.py checkpoint=runs/quickstart testset=... report=true   # + report.md and figures
    python evaluate.py hyp=[base.de,new.de] ref=newstest2014.de   # paired significance against the first
    python evaluate.py checkpoint=runs/quickstart src=dev.en ref=dev.de checkpoints=all   # which checkpoint?

stdout: one line per metric (sacreBLEU's BLEU and chrF with their signatures, the paper's `tokBLEU|...`; with
`tok_ref=`, the Multi30k papers' `lcBLEU|...`). Hypotheses, scores.json and (report=true, the default for a
run directory) report.md go to `out` (default run_dir/eval/<test set>/, a multilingual model's
<test set>.<tgt_lang>/); a row is appended to `table` (default run_dir/eval/table.md) in the layout of the paper's
Table 2 or 3. The pieces: transformer/evaluation/steps.py;
several hyp= files: transformer/evaluation/significance.py; checkpoints=all: transformer/evaluation/sweep.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from omegaconf import DictConfig

from data.lock import hold, releasing_locks
from data.paths import check_job_paths
from transformer.evaluation import steps as evaluation
from transformer.cli import ConfigError, compose_config, decode_request, hydra_app, setup_logging, to_job
from transformer.config import EvaluateJob
from transformer.distributed import pick_device
from transformer.evaluation.steps import TestSet
from transformer.kernels import keep_freed_memory
from transformer.evaluation.report import Evaluation, write_report
from transformer.evaluation.tables import append_table_row
from transformer.search import Ensemble
from transformer.evaluation.significance import paired_significance
from transformer.evaluation.sweep import sweep_checkpoints, sweep_folder, sweep_run_dirs
from transformer.decoding.translation import Translator
from transformer.evaluation.measures import write_results
from transformer.evaluation.scoring import bleu_metric

log = logging.getLogger("evaluate")


@releasing_locks  # the out= folder's lock (hold_out) ends with the evaluation
def run(cfg: DictConfig) -> int:
    job: EvaluateJob = to_job(cfg, "evaluate")
    setup_logging()
    device = pick_device(job.device)
    check_job_paths(job)  # every file and folder given, before any is read or a model loaded (data/paths.py)
    if job.out:
        hold_out(job.out)
    systems = evaluation.hyp_files(job.hyp)
    if len(systems) > 1:
        return compare_systems(job, systems)
    job = dataclasses.replace(job, hyp=systems[0] if systems else None)
    if job.checkpoints == "all":
        sweep_run_dirs(job.checkpoint)  # a .pt file is a one-line error before any model is loaded
    # What to score against is read before any model is loaded; a test set's language pair may come from the
    # checkpoint, so only its name is checked before.
    test = None
    if job.testset:
        evaluation.check_testset_name(job)
    else:
        test = evaluation.read_test_set(job)
    tokenized = (job.tok_ref, evaluation.read_file(job.tok_ref, "tok_ref")) if job.tok_ref else None
    translator = None
    if job.checkpoint is not None:  # the run's own search settings, but for the decode.* keys given here
        decode, settings = decode_request(cfg, job.decode)
        translator = Translator.load(job.checkpoint, device, decode=decode, tgt_lang=job.tgt_lang, **settings)
    test = test or evaluation.read_test_set(job, translator)
    if translator is not None:  # a multilingual model's evaluations: a folder per target language
        test = dataclasses.replace(test, language=translator.chosen_language)
    if job.checkpoints == "all":  # the sweep loads its own models: this one only resolved the settings
        decode, lang = translator.decode, evaluation.target_language(job, translator)
        bleu_metric(lang)
        del translator
        out = Path(job.out) if job.out else sweep_folder(sweep_run_dirs(job.checkpoint), test)
        hold_out(out)
        return sweep_checkpoints(job.checkpoint, test=test, lang=lang, decode=decode, device=device, out=out,
                                 tokenized=tokenized)
    return score_one(job, test, tokenized, translator, device)


def score_one(job: EvaluateJob, test: TestSet, tokenized, translator: Translator | None, device) -> int:
    """The hypotheses (given, or decoded now), their scores on stdout, what the tables need of the model
    (perplexity, parameters, steps, cost), then the files: hypotheses, scores.json, the table row, the report."""
    where = evaluation.Destinations.of(job, test)
    if where.out is not None:
        hold_out(where.out)
    lang = evaluation.target_language(job, translator)
    bleu_metric(lang)  # sacreBLEU's tokenizer for it is installed: said before the decoding, not after
    if job.hyp is not None:
        hypotheses = evaluation.read_file(job.hyp, "hyp")
    elif test.sources is None:
        raise ConfigError("decoding needs the source: give src=<file> with ref=<file>, or testset=<name>")
    else:
        hypotheses = translator.translate(test.sources, progress=True, source=test.name)
    scores = evaluation.score(hypotheses, test, lang=lang, tokenized=tokenized)
    for score in scores:
        print(score.line, flush=True)
    results = {"testset": test.name, "lang": lang, "lines": len(test.references),
               "scores": {s.name: s.as_dict() for s in scores}}
    figures, record = evaluation.model_figures(translator, where.checkpoint, test, device)
    results.update(figures)
    if where.out is not None:
        write_results(where.out, hypotheses, results)
        log.info("wrote %s and %s", where.out / "hyp.txt", where.out / "scores.json")
    row = evaluation.table_row(job, results, record, where.run_dir, lang, evaluation.split_of(job, test.name))
    if where.table is not None:
        append_table_row(where.table, row, table=evaluation.table_kind(job, test.name))
        log.info("appended a row to %s", where.table)
    if where.report:
        started, cpu = time.monotonic(), time.process_time()
        model = translator.model if translator is not None else None
        written = write_report(Evaluation(
            out=where.out, name=row["model"], testset=test.name, lang=lang, sources=test.sources,
            hypotheses=hypotheses, references=test.references, score_lines=[score.line for score in scores],
            results=results, row=row, table=evaluation.table_kind(job, test.name), run_dir=where.run_dir,
            model=model.models[0] if isinstance(model, Ensemble) else model,  # an ensemble: its first model's attention
            vocab=translator.vocab if translator else None,
            source_prefix=translator.source_prefix if translator else []))
        log.info("wrote %s and its figures in %.1f s (%.1f s of CPU)", written, time.monotonic() - started,
                 time.process_time() - cpu)
    return 0


def compare_systems(job: EvaluateJob, files: list[str]) -> int:
    """Several hyp= files: each scored, and sacreBLEU's paired test of each against the first, as a table on
    stdout (and significance.md / significance.json in `out`, one Table 2 row per system in `table`)."""
    test = evaluation.read_test_set(job)
    systems = []
    for file in files:
        hypotheses = evaluation.read_file(file, "hyp")
        if len(hypotheses) != len(test.references):
            raise ConfigError(f"hyp {file} has {len(hypotheses)} lines but the reference has "
                              f"{len(test.references)}: every system must translate the same test set")
        systems.append((file, hypotheses))
    lang = evaluation.target_language(job)
    try:
        result = paired_significance(systems, test.references, lang=lang, test=job.paired_test,
                                     samples=job.paired_samples)
    except ValueError as error:  # a system given twice, an empty reference
        raise ConfigError(str(error)) from None
    print(result.markdown(), end="", flush=True)
    if job.out:
        result.write(Path(job.out), title=f"{test.name}: systems against {files[0]}")
        log.info("wrote significance.md and significance.json in %s", job.out)
    if job.table:
        for system in result.systems:
            append_table_row(job.table, {"model": Path(system.name).name, "set": test.name, "lang": lang,
                                         "bleu": system.bleu.score, "tokbleu": system.tokbleu},
                             table=evaluation.table_kind(job, test.name))
        log.info("appended %d rows to %s", len(result.systems), job.table)
    return 0


def hold_out(out: str | Path) -> None:
    """One evaluation writing into `out` at a time (data/lock.py), until `run` returns."""
    hold(out, what=f"out={out}", fix="another evaluation is writing its results there; wait for it to end, or "
                                     "give another out=")


def main(argv: list[str]) -> int:
    """In-process entry (tests, notebooks): `main(["checkpoint=...", ...])`."""
    return run(compose_config(argv, config_name="evaluate"))


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    hydra_app("evaluate", run)
