"""How a model is scored on a corpus it is not trained on: BLEU of its translations (`split_bleu`) and perplexity
(`corpus_nll`: also evaluate.py's), the files a scoring leaves (`write_results`), and what train.py does with
them: a training run's validation (`run_metrics`) and its end-of-training test translation (`score_test_split`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from data.files import atomic_write
from transformer import distributed
from transformer.config import DecodeConfig
from transformer.loss import label_smoothed_nll
from transformer.report import validation_attention_figure
from transformer.scoring import Score, package_versions, sacrebleu_scores
from transformer.search import Seq2Seq
from transformer.translation import DeadlinePassed, Translator, length_sorted_batches, pad_rows, translate_ids

if TYPE_CHECKING:
    from transformer.training import Run

log = logging.getLogger("train")

def split_bleu(model: Seq2Seq, vocab, src_ids: Sequence[Sequence[int]], references: list[str], decode: DecodeConfig,
               *, lang: str, device: torch.device | str) -> tuple[list[Score], list[str]]:
    """sacreBLEU's BLEU and chrF and the paper's tokBLEU of the decoded `src_ids` against `references`;
    returns (scores, the detokenised best hypotheses). The model is put back in its training mode."""
    training = getattr(model, "training", False)
    model.eval()
    try:
        hyps = translate_ids(model, src_ids, decode, device=device)
    finally:
        model.train(training)
    texts = vocab.decode([h[0].tokens for h in hyps])
    return sacrebleu_scores(texts, references, lang=lang), texts


def write_results(out: Path, hypotheses: Sequence[str], results: dict) -> None:
    """`out`/hyp.txt (one translation per line) and `out`/scores.json (`results` and the package versions that
    produced them), each written atomically."""
    atomic_write(out / "hyp.txt", "".join(line + "\n" for line in hypotheses))
    record = {**results, "versions": results.get("versions") or package_versions()}
    atomic_write(out / "scores.json", json.dumps(record, indent=2) + "\n")


@torch.no_grad()
def corpus_nll(model, src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], *, max_tokens: int,
               device: torch.device | str, label_smoothing: float = 0.0, autocast=None,
               rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """Per-token label-smoothed loss, NLL and perplexity of the targets given the sources (the paper's
    Table 3 "PPL (dev)" is `ppl` with per-piece tokens). Rows with an empty side are skipped. Under DDP
    each rank scores every `world_size`-th batch and the sums are all-reduced (every rank must call it).
    For an ensemble, the scores are its averaged log-probabilities' (`Ensemble.forward`)."""
    config = model.config
    keep = [i for i in range(len(src_ids)) if len(src_ids[i]) and len(tgt_ids[i])]
    lengths = [max(len(src_ids[i]), len(tgt_ids[i])) + 1 for i in keep]
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nll, tokens
    training = model.training
    model.eval()
    for batch in list(length_sorted_batches(lengths, max_tokens))[rank::world_size]:
        rows = [keep[j] for j in batch]
        src = pad_rows(([*src_ids[i], config.eos_id] for i in rows), config.pad_id, device)
        tgt_in = pad_rows(([config.bos_id, *tgt_ids[i]] for i in rows), config.pad_id, device)
        tgt_out = pad_rows(([*tgt_ids[i], config.eos_id] for i in rows), config.pad_id, device)
        with autocast or contextlib.nullcontext():
            logits = model(src, tgt_in)
        loss, nll = label_smoothed_nll(logits, tgt_out, epsilon=label_smoothing, ignore_index=config.pad_id)
        sums += torch.stack([loss.double(), nll.double(), (tgt_out != config.pad_id).sum().double()])
    model.train(training)
    distributed.all_reduce_sum(sums)
    loss, nll, tokens = sums.tolist()
    tokens = max(tokens, 1.0)
    return {"loss": loss / tokens, "nll": nll / tokens, "ppl": math.exp(min(nll / tokens, 100.0))}


def run_metrics(run: Run) -> dict[str, float]:
    """A training run's validation: loss, NLL and perplexity of the validation split (all ranks) and BLEU of its
    first `train.valid_bleu_lines` lines (rank 0), logged and written to TensorBoard with sample translations
    and one sentence's attention."""
    t, valid, state = run.job.train, run.data.valid.dataset, run.state
    metrics = corpus_nll(run.model, valid["src_ids"], valid["tgt_ids"], max_tokens=t.max_tokens, device=run.device,
                         label_smoothing=t.label_smoothing, autocast=run.autocast, rank=run.dist.rank,
                         world_size=run.dist.world_size)
    if t.valid_bleu_lines > 0 and run.dist.is_main:
        rows, decoding = valid.select(range(min(t.valid_bleu_lines, len(valid)))), time.monotonic()
        scores, texts = split_bleu(run.model, run.data.vocab, rows["src_ids"], rows["tgt"], run.job.decode,
                                   lang=run.job.data.tgt_lang, device=run.device)
        metrics["bleu"] = next(s.score for s in scores if s.name == "BLEU")
        run.budget.decode_line = (time.monotonic() - decoding) / len(rows)
        samples = zip(rows["src"][: t.num_samples], texts, rows["tgt"][: t.num_samples])
        run.writer.add_text("valid/samples", "\n\n".join(f"src: {s}  \nhyp: {h}  \nref: {r}"
                                                         for s, h, r in samples), state.step)
    log.info("validation at update %d | %s", state.step, " | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    for key, value in metrics.items() if run.writer else ():
        run.writer.add_scalar(f"valid/{key}", value, state.step)
    if run.writer is not None:  # one forward pass of one sentence, rank 0
        head = run.data.valid.dataset.select(range(min(100, len(run.data.valid.dataset))))
        figure = validation_attention_figure(run.model, run.data.vocab, head["src_ids"], head["tgt_ids"],
                                             step=state.step)
        if figure is not None:
            run.writer.add_figure("valid/attention", figure, state.step, close=False)
    return metrics


def score_test_split(run: Run) -> None:
    """Translate the test split with the run's model (the averaged one, at the end of training), print
    sacreBLEU and write run_dir/eval/test, unless that would overrun train.max_time."""
    job, test = run.job, run.data.test.dataset
    log.info("translating the %d test sentences with beam %d", len(test), job.decode.beam)
    # Text in, text out, as evaluate.py translates: the same checkpoint gives the same hypotheses there.
    translator = Translator(model=run.model.eval(), vocab=run.data.vocab, decode=job.decode,
                            src_lang=job.data.src_lang, tgt_lang=job.data.tgt_lang, device=run.device, checkpoints=[])
    deadline = run.budget.deadline(job.train.max_time) if job.train.max_time else None
    try:
        texts = translator.translate(test["src"], deadline=deadline)
    except DeadlinePassed as passed:
        log.warning("no test BLEU: the test translation would overrun train.max_time=%gs (%s); score "
                    "averaged.pt with evaluate.py (the next command below)", job.train.max_time, passed)
    else:
        scores = sacrebleu_scores(texts, test["tgt"], lang=job.data.tgt_lang)
        write_results(run.run_dir / "eval" / "test", texts, {s.name: s.as_dict() for s in scores})
        for score in scores:
            print(score.line, flush=True)
        for src, hyp, ref in list(zip(test["src"], texts, test["tgt"]))[:3]:
            log.info("example | src: %s | hyp: %s | ref: %s", src, hyp, ref)
