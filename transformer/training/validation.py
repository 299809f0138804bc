"""A training run's validation (`validate`: `run_metrics`, then `keep_best`) and its end (`finish`: the averaged
checkpoint and the test split translated, `score_test_split`). The measures are evaluation's
(transformer/evaluation/measures.py); they are the same that evaluate.py reports."""

from __future__ import annotations

import logging
import math
import time

from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.decoding.translation import DeadlinePassed, Translator
from transformer.evaluation.measures import corpus_nll, split_bleu, write_results
from transformer.evaluation.report import validation_attention_figure
from transformer.evaluation.scoring import sacrebleu_scores
from transformer.training.run import Run
from transformer.training.run_record import print_summary

log = logging.getLogger("train")


def validate(run: Run) -> dict[str, float]:
    """Loss, NLL and perplexity of the validation split (all ranks), and BLEU of its first
    `train.valid_bleu_lines` lines (rank 0); updates best and stale on every rank, and best.pt."""
    with run.budget.timing("validation"):
        metrics = run_metrics(run)
    keep_best(run, metrics)
    return metrics


def keep_best(run: Run, metrics: dict[str, float]) -> None:
    """After a validation: best and stale of train.best_metric, best.pt when it improved, and rank 0's best
    and stale given to every rank (only rank 0 computes BLEU), so that train.patience stops all ranks at the
    same update."""
    t, state = run.job.train, run.state
    if t.best_metric in metrics:
        value = metrics[t.best_metric]
        if state.best is None or (value > state.best if t.best_metric == "bleu" else value < state.best):
            state.best, state.stale = value, 0
            run.save(ckpt.best_path(run.run_dir))
        else:
            state.stale += 1
    best, stale = distributed.broadcast_from_main(
        [math.nan if state.best is None else state.best, float(state.stale)], device=run.device)
    state.best, state.stale = (None if math.isnan(best) else best), int(stale)


def run_metrics(run: Run) -> dict[str, float]:
    """A training run's validation: loss, NLL and perplexity of the validation split (all ranks) and BLEU of its
    first `train.valid_bleu_lines` lines (rank 0), logged and written to TensorBoard with sample translations
    and one sentence's attention. A multilingual run with several validation sets (data.extra_train[i].
    valid_prefix) measures each pair, logged and written as valid/<pair>/<measure>; its measures are then their
    means, which train.best_metric reads."""
    sets = run.data.valid_sets(run.job.data)
    by_pair = {f"{src}-{tgt}": pair_metrics(run, split.dataset, lang=tgt, samples=i == 0)
               for i, ((src, tgt), split) in enumerate(sets.items())}
    metrics = next(iter(by_pair.values()))
    if len(by_pair) > 1:
        metrics = {key: sum(m[key] for m in by_pair.values()) / len(by_pair) for key in metrics}
        for pair, measures in by_pair.items():
            log.info("validation at update %d | %s | %s", run.state.step, pair,
                     " | ".join(f"{k} {v:.3f}" for k, v in measures.items()))
            for key, value in measures.items() if run.writer else ():
                run.writer.add_scalar(f"valid/{pair}/{key}", value, run.state.step)
    log.info("validation at update %d | %s%s", run.state.step, " | ".join(f"{k} {v:.3f}" for k, v in metrics.items()),
             f" (the mean of {len(by_pair)} pairs)" if len(by_pair) > 1 else "")
    for key, value in metrics.items() if run.writer else ():
        run.writer.add_scalar(f"valid/{key}", value, run.state.step)
    if run.writer is not None:  # one forward pass of one sentence, rank 0
        valid = next(iter(sets.values())).dataset
        head = valid.select(range(min(100, len(valid))))
        figure = validation_attention_figure(run.model, run.data.vocab, head["src_ids"], head["tgt_ids"],
                                             step=run.state.step)
        if figure is not None:
            run.writer.add_figure("valid/attention", figure, run.state.step, close=False)
    return metrics


def pair_metrics(run: Run, valid, *, lang: str, samples: bool) -> dict[str, float]:
    """Loss, NLL and perplexity of one validation set (all ranks), and BLEU of its first lines into `lang`
    (rank 0; with `samples`, a few translations to TensorBoard)."""
    t, state = run.job.train, run.state
    metrics = corpus_nll(run.model, valid["src_ids"], valid["tgt_ids"], max_tokens=t.max_tokens, device=run.device,
                         label_smoothing=t.label_smoothing, autocast=run.autocast, rank=run.dist.rank,
                         world_size=run.dist.world_size)
    if t.valid_bleu_lines > 0 and run.dist.is_main:
        rows, decoding = valid.select(range(min(t.valid_bleu_lines, len(valid)))), time.monotonic()
        scores, texts = split_bleu(run.model, run.data.vocab, rows["src_ids"], rows["tgt"], run.job.decode,
                                   lang=lang, device=run.device)
        metrics["bleu"] = next(s.score for s in scores if s.name == "BLEU")
        run.budget.decode_line = (time.monotonic() - decoding) / len(rows)
        if samples and run.writer is not None:
            pairs = zip(rows["src"][: t.num_samples], texts, rows["tgt"][: t.num_samples])
            run.writer.add_text("valid/samples", "\n\n".join(f"src: {s}  \nhyp: {h}  \nref: {r}"
                                                              for s, h, r in pairs), state.step)
    return metrics


def score_test_split(run: Run) -> None:
    """Translate the test split with the run's model (the averaged one, at the end of training), print
    sacreBLEU and write run_dir/eval/test, unless that would overrun train.max_time."""
    job, test = run.job, run.data.test.dataset
    log.info("translating the %d test sentences with beam %d", len(test), job.decode.beam)
    # Text in, text out, as evaluate.py translates: the same checkpoint gives the same hypotheses there.
    tag = [run.data.vocab.piece_id(job.data.train_tag)] if job.data.train_tag else []  # a multilingual run's
    translator = Translator(model=run.model.eval(), vocab=run.data.vocab, decode=job.decode,
                            src_lang=job.data.src_lang, tgt_lang=job.data.tgt_lang, device=run.device, checkpoints=[],
                            source_prefix=tag)
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


def finish(run: Run, argv: list[str], ended_by: str | None = None) -> None:
    """Average the last `train.average_last` numbered checkpoints; with train.test_at_end, score the averaged
    model on the test split (`score_test_split`); say where everything is and how to train on past `ended_by`
    (the limit that ended training)."""
    run_dir, job = run.run_dir, run.job
    steps = [s for s, _ in ckpt.list_numbered(run_dir)][-job.train.average_last:]
    if not steps:
        log.warning("no checkpoint to average or test: the run stopped before its first update")
        print_summary(job, argv, ended_by)
        return
    averaged = ckpt.average([ckpt.numbered_path(run_dir, s) for s in steps])
    ckpt.save(averaged, ckpt.averaged_path(run_dir))
    log.info("averaged the checkpoints of updates %s into %s", steps, ckpt.averaged_path(run_dir))
    if job.train.test_at_end:
        run.model.load_state_dict(averaged["model"])
        score_test_split(run)
    print_summary(job, argv, ended_by)
