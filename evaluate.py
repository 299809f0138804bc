"""Translate a test set (or take a given translation), score it, and add a row to the paper's tables.

    python evaluate.py checkpoint=runs/paper_base_en_de-wmt14-en-de testset=wmt14/full
    python evaluate.py checkpoint=runs/quickstart src=corpus/test.en ref=corpus/test.de
    python evaluate.py hyp=system.de ref=newstest2014.de          # any system's output
    python evaluate.py checkpoint=runs/quickstart testset=... report=true   # + report.md and figures
    python evaluate.py hyp=[base.de,new.de] ref=newstest2014.de   # paired significance against the first
    python evaluate.py checkpoint=runs/quickstart src=dev.en ref=dev.de checkpoints=all   # which checkpoint?

stdout: one line per metric (sacreBLEU's BLEU and chrF lines with their signatures, then `tokBLEU|...`,
the paper's tokenized BLEU; with `tok_ref=<lowercased tokenised reference>`, also `lcBLEU|...`, the Multi30k
papers' BLEU: transformer/scoring.py). Hypotheses and scores.json go to `out` (default run_dir/eval/<test set>/);
a row is appended to `table` (default run_dir/eval/table.md) in the layout of the paper's Table 2 or 3.
An ensemble (`checkpoint=[a.pt,b.pt]`) translates and is scored as one model: its perplexity is that of
the members' mean log-probabilities, renormalised (tests/test_translate_evaluate.py computes it by hand).
With `report=true` (the default when checkpoint= is a run directory), report.md and its figures go beside
scores.json (transformer/report.py), from the translations already made.
Several hyp= files: transformer/significance.py; checkpoints=all: transformer/sweep.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from pathlib import Path

from omegaconf import DictConfig

from transformer import checkpoint as ckpt
from transformer.checkpoint import TrainState
from transformer.cli import ConfigError, compose_config, decode_request, hydra_app, pick_device, setup_logging
from transformer.config import EvaluateJob, model_config_with_defaults, to_job
from transformer.kernels import keep_freed_memory
from transformer.report import Evaluation, write_report
from transformer.search import Ensemble
from transformer.scoring import (append_table_row, lc_bleu, load_testset, read_lines, sacrebleu_scores,
                                 testset_langpairs, training_flops)
from transformer.significance import paired_significance
from transformer.sweep import sweep_checkpoints, sweep_run_dir
from transformer.translation import Translator, corpus_nll, write_results

log = logging.getLogger("evaluate")


def references_and_sources(job: EvaluateJob, translator) -> tuple[list[str] | None, list[str], str]:
    """(sources or None, references, a name for the test set); a test set's name checked first
    (`check_testset_name`)."""
    if job.testset:
        langpair = job.langpair
        if langpair is None:
            if translator is None or not translator.src_lang:
                raise ConfigError("testset= needs langpair=<src>-<tgt> (e.g. langpair=en-de) without a checkpoint")
            langpair = f"{translator.src_lang}-{translator.tgt_lang}"
        try:
            sources, references = load_testset(job.testset, langpair)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return sources, references, job.testset.replace("/", "_")
    if not job.ref:
        raise ConfigError("nothing to score against: give testset=<sacreBLEU name> or ref=<file>")
    references = read_file(job.ref, "ref")
    sources = read_file(job.src, "src") if job.src else None
    if sources is not None and len(sources) != len(references):
        raise ConfigError(f"src={job.src} has {len(sources)} lines but ref={job.ref} has {len(references)}: "
                          "give a source and reference of the same test set")
    return sources, references, Path(job.ref).stem


def check_testset_name(job: EvaluateJob) -> None:
    """testset= alone (no src=/ref=) and a name sacreBLEU knows: checked before any model or file is read."""
    if job.src or job.ref:
        raise ConfigError("give either testset=<sacreBLEU name> or src=/ref= files, not both")
    try:
        testset_langpairs(job.testset)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def read_file(path: str, key: str) -> list[str]:
    if not Path(path).is_file():
        raise ConfigError(f"{key}={path} is not a file: give a text file, one sentence a line")
    return read_lines(path)


def hyp_files(hyp) -> list[str]:
    """hyp= as a list of files: none, one (`hyp=a.txt` or `hyp=[a.txt]`), or several systems to compare."""
    files = [] if hyp is None else [str(h) for h in hyp] if isinstance(hyp, (list, tuple)) else [str(hyp)]
    if isinstance(hyp, (list, tuple)) and not files:
        raise ConfigError("hyp=[] names no translation: give hyp=<file>, or hyp=[baseline,system,...] to compare")
    return files


def target_language(job: EvaluateJob, translator) -> str:
    """lang=, else the checkpoint's target language, the reference file's suffix, or langpair's target."""
    lang = job.lang or (translator.tgt_lang if translator else None)
    if lang is None and job.ref:
        lang = Path(job.ref).suffix.lstrip(".") or None
    if lang is None and job.langpair:
        lang = job.langpair.split("-")[1]
    if not lang:
        raise ConfigError("the target language is unknown: give lang=<code>, e.g. lang=de")
    return lang


def run(cfg: DictConfig) -> int:
    job: EvaluateJob = to_job(cfg, "evaluate")
    setup_logging()
    device = pick_device(job.device)
    systems = hyp_files(job.hyp)
    if len(systems) > 1:
        return compare_systems(job, systems)
    job = dataclasses.replace(job, hyp=systems[0] if systems else None)
    if job.hyp is None and job.checkpoint is None:
        raise ConfigError("give checkpoint=<run_dir or .pt> to translate, or hyp=<file> to score a translation")
    if job.checkpoints == "all":
        if job.hyp is not None:
            raise ConfigError("checkpoints=all decodes with every checkpoint of a run: drop hyp=")
        sweep_run_dir(job.checkpoint)  # a .pt file is a one-line error before any model is loaded
    # What to score against is read before any model is loaded; a test set's language pair may come from the
    # checkpoint, so only its name is checked before.
    if job.testset:
        check_testset_name(job)
    else:
        sources, references, set_name = references_and_sources(job, None)
    tokenized = read_file(job.tok_ref, "tok_ref") if job.tok_ref else None
    translator = None
    if job.checkpoint is not None:  # the run's own search settings, but for the decode.* keys given here
        decode, settings = decode_request(cfg, job.decode)
        translator = Translator.load(job.checkpoint, device, decode=decode, **settings)
    if job.testset:
        sources, references, set_name = references_and_sources(job, translator)
    if job.checkpoints == "all":
        if sources is None:
            raise ConfigError("checkpoints=all decodes, so it needs the source: give src=<file> with ref=<file>, "
                              "or testset=<name>")
        return sweep_checkpoints(job.checkpoint, sources=sources, references=references, set_name=set_name,
                                 lang=target_language(job, translator), decode=translator.decode, device=device,
                                 out=Path(job.out) if job.out else None)
    path = ckpt.resolve(str(job.checkpoint)) if isinstance(job.checkpoint, str) else None
    run_dir = ckpt.run_dir_of(path) if path is not None else None
    out = Path(job.out) if job.out else (run_dir / "eval" / set_name if run_dir else None)
    report = job.report
    if report is None:  # on for a run directory, whose logs the learning curves read
        report = isinstance(job.checkpoint, str) and Path(job.checkpoint).is_dir()
    if report and out is None:
        raise ConfigError("report=true writes beside scores.json: give out=<directory>")

    # 1. The hypotheses: given, or decoded now.
    if job.hyp is not None:
        hypotheses = read_file(job.hyp, "hyp")
    else:
        if sources is None:
            raise ConfigError("decoding needs the source: give src=<file> with ref=<file>, or testset=<name>")
        hypotheses = translator.translate(sources, progress=True, source=set_name)
    if len(hypotheses) != len(references):
        raise ConfigError(f"the translation has {len(hypotheses)} lines but the reference has {len(references)}: "
                          "score a translation of this test set")

    # 2. Scores: sacreBLEU (BLEU, chrF) with signatures, and the paper's tokenized BLEU.
    lang = target_language(job, translator)
    try:
        scores = sacrebleu_scores(hypotheses, references, lang=lang)
    except ValueError as error:  # e.g. an empty reference: nothing to score
        raise ConfigError(f"{error}: give a non-empty reference and translation") from None
    if tokenized is not None:  # the Multi30k papers' metric, against the task's own tokenised reference
        if len(tokenized) != len(references):
            raise ConfigError(f"tok_ref={job.tok_ref} has {len(tokenized)} lines but the reference has "
                              f"{len(references)}: give the tokenised reference of the same test set")
        scores.append(lc_bleu(hypotheses, tokenized, lang))
    for score in scores:
        print(score.line, flush=True)
    results = {"testset": set_name, "lang": lang, "lines": len(references),
               "scores": {s.name: s.as_dict() for s in scores}}

    # 3. What the tables need of the model: perplexity, parameters, steps, time.
    record = training_record(translator.checkpoints[0], path) if translator else None
    if translator is not None and sources is not None:
        vocab = translator.vocab
        results["ppl"] = corpus_nll(translator.model, vocab.encode(sources), vocab.encode_target(references),
                                    max_tokens=translator.decode.max_tokens, device=device)["ppl"]
        log.info("perplexity of the references: %.2f", results["ppl"])
    if record is not None:
        results.update({"params": record["params"], "step": record.get("step"),
                        "train_seconds": record.get("train_seconds"), "model_config": record["model_config"]})

    # 4. Files: hypotheses, scores.json, the table row, the report.
    if out is not None:
        write_results(out, hypotheses, results)
        log.info("wrote %s and %s", out / "hyp.txt", out / "scores.json")
    split = split_of(job, set_name)
    row = table_row(job, results, record, run_dir, lang, split)
    table = Path(job.table) if job.table else (run_dir / "eval" / "table.md" if run_dir else None)
    if table is not None:
        append_table_row(table, row, table="3" if split == "dev" else "2")
        log.info("appended a row to %s", table)
    if report:
        started, cpu = time.monotonic(), time.process_time()
        model = translator.model if translator is not None else None
        if isinstance(model, Ensemble):  # its first model's attention
            model = model.models[0]
        written = write_report(Evaluation(
            out=out, name=row["model"], testset=set_name, lang=lang, sources=sources, hypotheses=hypotheses,
            references=references, score_lines=[score.line for score in scores], results=results, row=row,
            table="3" if split == "dev" else "2", run_dir=run_dir,
            model=model, vocab=translator.vocab if translator else None))
        log.info("wrote %s and its figures in %.1f s (%.1f s of CPU)", written, time.monotonic() - started,
                 time.process_time() - cpu)
    return 0


def split_of(job: EvaluateJob, set_name: str) -> str:
    """dev (a Table 3 row) or test (a Table 2 row); split=auto: dev for newstest2013, else test."""
    if job.split != "auto":
        return job.split
    return "dev" if re.search(r"2013|wmt13", set_name) else "test"


def compare_systems(job: EvaluateJob, files: list[str]) -> int:
    """Several hyp= files: each scored, and sacreBLEU's paired test of each against the first, as a table on
    stdout (and significance.md / significance.json in `out`, one Table 2 row per system in `table`)."""
    if job.checkpoint is not None:
        raise ConfigError("hyp=[...] compares translations already made: drop checkpoint= (or decode each "
                          "system first with translate.py)")
    if job.testset:
        check_testset_name(job)
    _, references, set_name = references_and_sources(job, None)
    systems = []
    for file in files:
        hypotheses = read_file(file, "hyp")
        if len(hypotheses) != len(references):
            raise ConfigError(f"hyp {file} has {len(hypotheses)} lines but the reference has {len(references)}: "
                              "every system must translate the same test set")
        systems.append((file, hypotheses))
    lang = target_language(job, None)
    try:
        result = paired_significance(systems, references, lang=lang, test=job.paired_test,
                                     samples=job.paired_samples)
    except ValueError as error:  # a system given twice, an empty reference
        raise ConfigError(str(error)) from None
    print(result.markdown(), end="", flush=True)
    if job.out:
        out = Path(job.out)
        ckpt.atomic_write(out / "significance.md", f"# {set_name}: systems against {files[0]}\n\n"
                          + result.markdown())
        ckpt.atomic_write(out / "significance.json", result.to_json())
        log.info("wrote %s and %s", out / "significance.md", out / "significance.json")
    if job.table:
        for system in result.systems:
            append_table_row(job.table, {"model": Path(system.name).name, "lang": lang,
                                         "bleu": system.bleu.score, "tokbleu": system.tokbleu},
                             table="3" if split_of(job, set_name) == "dev" else "2")
        log.info("appended %d rows to %s", len(result.systems), job.table)
    return 0


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


def table_row(job: EvaluateJob, results: dict, record: dict | None, run_dir: Path | None, lang: str,
              split: str) -> dict:
    """One row for the paper's Table 2 (test) or Table 3 (dev)."""
    scores = results["scores"]
    if job.name:
        name = job.name
    elif run_dir is not None:
        name = run_dir.name
    elif job.checkpoint is not None:  # a loose .pt file, or an ensemble of them
        names = job.checkpoint if isinstance(job.checkpoint, list) else [job.checkpoint]
        name = " + ".join(Path(str(n)).stem for n in names)
    else:
        name = Path(job.hyp).name
    row = {"model": name, "lang": lang, "bleu": scores["BLEU"]["score"], "tokbleu": scores["tokBLEU"]["score"],
           "ppl": results.get("ppl")}
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


def main(argv: list[str]) -> int:
    """In-process entry (tests, notebooks): `main(["checkpoint=...", ...])`."""
    return run(compose_config(argv, config_name="evaluate"))


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    hydra_app("evaluate", run)
