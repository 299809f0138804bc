"""Translate a test set (or take a given translation), score it, and add a row to the paper's tables.

    python evaluate.py checkpoint=runs/paper_base_en_de-wmt14_en_de testset=wmt14/full
    python evaluate.py checkpoint=runs/quickstart src=corpus/test.en ref=corpus/test.de
    python evaluate.py hyp=system.de ref=newstest2014.de          # any system's output

stdout: one line per metric (sacreBLEU's BLEU and chrF lines with their signatures, then `tokBLEU|...`,
the paper's tokenized BLEU). Hypotheses and scores.json go to `out` (default run_dir/eval/<test set>/);
a row is appended to `table` (default run_dir/eval/table.md) in the layout of the paper's Table 2 or 3.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import torch
from omegaconf import ListConfig

from transformer import checkpoint as ckpt
from transformer.cli import ConfigError, compose_config, main_with_user_errors, setup_logging
from transformer.kernels import keep_freed_memory
from transformer.loss import label_smoothed_nll
from transformer.scoring import append_table_row, load_testset, read_lines, sacrebleu_scores, training_flops
from transformer.translation import length_sorted_batches, pad_rows

from translate import check_decode_config, load_translator, pick_device, translate_texts

log = logging.getLogger("evaluate")


@torch.inference_mode()
def perplexity(translator, sources: list[str], references: list[str], device, max_tokens: int) -> float:
    """Per-piece perplexity of the references given the sources (the paper's Table 3 'PPL (dev)')."""
    model = translator.model
    config = model.config
    src_ids = translator.vocab.encode(sources)
    tgt_ids = translator.vocab.encode(references)
    keep = [i for i in range(len(src_ids)) if src_ids[i] and tgt_ids[i]]
    lengths = [max(len(src_ids[i]), len(tgt_ids[i])) + 1 for i in keep]
    nll_sum, tokens = 0.0, 0
    for batch in length_sorted_batches(lengths, max_tokens):
        rows = [keep[j] for j in batch]
        src = pad_rows(([*src_ids[i], config.eos_id] for i in rows), config.pad_id, device)
        tgt_in = pad_rows(([config.bos_id, *tgt_ids[i]] for i in rows), config.pad_id, device)
        tgt_out = pad_rows(([*tgt_ids[i], config.eos_id] for i in rows), config.pad_id, device)
        if hasattr(model, "models"):  # an ensemble: score the first model only
            logits = model.models[0](src, tgt_in)
        else:
            logits = model(src, tgt_in)
        _, nll = label_smoothed_nll(logits, tgt_out, epsilon=0.0, ignore_index=config.pad_id)
        nll_sum += float(nll)
        tokens += int((tgt_out != config.pad_id).sum())
    return math.exp(nll_sum / max(tokens, 1))


def references_and_sources(cfg, translator) -> tuple[list[str] | None, list[str], str]:
    """(sources or None, references, a name for the test set)."""
    if cfg.testset and (cfg.src or cfg.ref):
        raise ConfigError("give either testset=<sacreBLEU name> or src=/ref= files, not both")
    if cfg.testset:
        langpair = cfg.langpair
        if langpair is None:
            if translator is None or not translator.src_lang:
                raise ConfigError("testset= needs langpair=<src>-<tgt> (e.g. langpair=en-de) without a checkpoint")
            langpair = f"{translator.src_lang}-{translator.tgt_lang}"
        try:
            sources, references = load_testset(cfg.testset, langpair)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return sources, references, cfg.testset.replace("/", "_")
    if not cfg.ref:
        raise ConfigError("nothing to score against: give testset=<sacreBLEU name> or ref=<file>")
    references = read_file(cfg.ref, "ref")
    sources = read_file(cfg.src, "src") if cfg.src else None
    if sources is not None and len(sources) != len(references):
        raise ConfigError(f"src={cfg.src} has {len(sources)} lines but ref={cfg.ref} has {len(references)}: "
                          "give a source and reference of the same test set")
    return sources, references, Path(cfg.ref).stem


def read_file(path: str, key: str) -> list[str]:
    if not Path(path).is_file():
        raise ConfigError(f"{key}={path} is not a file")
    return read_lines(path)


def main(argv: list[str]) -> int:
    cfg = compose_config(argv, config_name="evaluate")
    setup_logging()
    check_decode_config(cfg.decode)
    if cfg.split not in ("auto", "dev", "test"):
        raise ConfigError(f"split={cfg.split} is not one of auto, dev (a Table 3 row), test (a Table 2 row)")
    device = pick_device(cfg.device)
    if cfg.hyp is None and cfg.checkpoint is None:
        raise ConfigError("give checkpoint=<run_dir or .pt> to translate, or hyp=<file> to score a translation")
    translator = load_translator(cfg.checkpoint, device) if cfg.checkpoint is not None else None
    sources, references, set_name = references_and_sources(cfg, translator)

    # 1. The hypotheses: given, or decoded now.
    if cfg.hyp is not None:
        hypotheses = read_file(cfg.hyp, "hyp")
    else:
        if sources is None:
            raise ConfigError("decoding needs the source: give src=<file> with ref=<file>, or testset=<name>")
        hypotheses = [row[0][0] for row in translate_texts(translator, sources, cfg.decode, device,
                                                          source=set_name)]
    if len(hypotheses) != len(references):
        raise ConfigError(f"the translation has {len(hypotheses)} lines but the reference has {len(references)}: "
                          "score a translation of this test set")

    # 2. Scores: sacreBLEU (BLEU, chrF) with signatures, and the paper's tokenized BLEU.
    lang = cfg.lang or (translator.tgt_lang if translator else None)
    if lang is None and cfg.ref:
        lang = Path(cfg.ref).suffix.lstrip(".") or None
    if lang is None and cfg.langpair:
        lang = cfg.langpair.split("-")[1]
    if not lang:
        raise ConfigError("the target language is unknown: give lang=<code>, e.g. lang=de")
    try:
        scores = sacrebleu_scores(hypotheses, references, lang=lang)
    except ValueError as error:  # e.g. an empty reference: nothing to score
        raise ConfigError(f"{error}: give a non-empty reference and translation") from None
    for score in scores:
        print(score.line, flush=True)
    results = {"testset": set_name, "lang": lang, "lines": len(references),
               "scores": {s.name: s.as_dict() for s in scores}}

    # 3. What the tables need of the model: perplexity, parameters, steps, time.
    path = ckpt.resolve(str(cfg.checkpoint)) if isinstance(cfg.checkpoint, str) else None
    state = training_record(translator.states[0], path) if translator else None
    if translator is not None and sources is not None:
        results["ppl"] = perplexity(translator, sources, references, device, cfg.decode.max_tokens)
        log.info("perplexity of the references: %.2f", results["ppl"])
    if state is not None:
        model_cfg = state["model_config"]
        params = sum(t.numel() for t in state["model"].values())
        results.update({"params": params, "step": state.get("step"),
                        "train_seconds": state.get("train_seconds"), "model_config": model_cfg})

    # 4. Files: hypotheses, scores.json, the table row.
    run_dir = ckpt.run_dir_of(path) if path is not None else None
    out = Path(cfg.out) if cfg.out else (run_dir / "eval" / set_name if run_dir else None)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "hyp.txt").write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
        (out / "scores.json").write_text(json.dumps(results, indent=2) + "\n")
        log.info("wrote %s and %s", out / "hyp.txt", out / "scores.json")
    table = Path(cfg.table) if cfg.table else (run_dir / "eval" / "table.md" if run_dir else None)
    if table is not None:
        split = cfg.split
        if split == "auto":
            split = "dev" if re.search(r"2013|wmt13", set_name) else "test"
        append_table_row(table, table_row(cfg, results, state, run_dir, lang, split), table="3" if split == "dev"
                         else "2")
        log.info("appended a row to %s", table)
    return 0


TRAINING_KEYS = ("train_seconds", "world_size", "device", "train_tokens")


def training_record(state: dict, path: Path | None) -> dict:
    """`state` with what training cost (TRAINING_KEYS), for Table 2's GPU-hours and FLOPs columns.

    An averaged checkpoint holds weights only; its cost is that of the training checkpoint of its newest
    step in the same run (the numbered one, or last.pt at that step), when the run still has it.
    """
    if (state.get("kind") != "averaged" or not isinstance(state.get("step"), int) or path is None
            or ckpt.run_dir_of(path) is None):
        return state
    run_dir = ckpt.run_dir_of(path)
    for candidate in (ckpt.numbered_path(run_dir, state["step"]), ckpt.last_path(run_dir)):
        if not candidate.is_file():
            continue
        try:
            trained = ckpt.load(candidate, mmap=True)
        except ckpt.CheckpointError:
            continue
        if trained.get("step") == state.get("step"):
            return {**state, **{key: trained[key] for key in TRAINING_KEYS if key in trained}}
    log.warning("no training checkpoint of update %s in %s: the table row has no training cost",
                state.get("step"), run_dir)
    return state


def table_row(cfg, results: dict, state: dict | None, run_dir: Path | None, lang: str, split: str) -> dict:
    """One row for the paper's Table 2 (test) or Table 3 (dev)."""
    scores = results["scores"]
    if cfg.name:
        name = cfg.name
    elif run_dir is not None:
        name = run_dir.name
    elif cfg.checkpoint is not None:  # a loose .pt file, or an ensemble of them
        names = cfg.checkpoint if isinstance(cfg.checkpoint, (list, ListConfig)) else [cfg.checkpoint]
        name = " + ".join(Path(str(n)).stem for n in names)
    else:
        name = Path(cfg.hyp).name
    row = {"model": name, "lang": lang, "bleu": scores["BLEU"]["score"], "tokbleu": scores["tokBLEU"]["score"],
           "ppl": results.get("ppl")}
    if state is not None:
        m = state["model_config"]
        train_cfg = (state.get("config") or {}).get("train", {})
        hours = (state.get("train_seconds") or 0) / 3600 * state.get("world_size", 1)
        row.update({
            "steps": state.get("step"), "params": results["params"],
            "gpu_hours": hours if state.get("device") == "cuda" else None,
            "flops": training_flops(results["params"] - m["vocab_size"] * m["d_model"],
                                    state.get("train_tokens") or 0) or None,
            "N": m["encoder_layers"], "d_model": m["d_model"], "d_ff": m["d_ff"], "h": m["heads"],
            "d_k": m["d_model"] // m["heads"], "d_v": m["d_model"] // m["heads"], "p_drop": m["dropout"],
            "eps_ls": train_cfg.get("label_smoothing"),
        })
    return row


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    main_with_user_errors(main)()
