"""What a run looks like: `evaluate.py ... report=true` writes report.md and PNG figures next to scores.json.

- learning curves read from the run's TensorBoard logs (`read_scalars`, `learning_curves_figure`);
- BLEU and chrF (sacreBLEU) by source-length bucket, with the sentences per bucket (`length_buckets`);
- the cross-attention of the evaluated model on three test sentences, per layer, heads averaged
  (`attention_figure`, which train.py also sends to TensorBoard at each validation);
- the Table 2 / 3 row evaluate.py appends to the results table.

It reuses evaluate.py's translations (nothing is decoded again): the attention comes from one
teacher-forced pass over a translation (transformer/evaluation/alignment.py). Figures are drawn on matplotlib
`Figure`s rendered by the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from sacrebleu.metrics import CHRF

from data.files import atomic_write
from transformer.evaluation.alignment import cross_attention
from transformer.evaluation.scoring import bleu_metric
from transformer.model import Transformer
from transformer.evaluation.tables import table_markdown

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(**kwargs) -> Figure:
    """A new matplotlib Figure. matplotlib is imported here, when the first figure is drawn: its import costs
    almost half a second, which every train.py, translate.py and evaluate.py would otherwise pay at start."""
    from matplotlib.figure import Figure

    return Figure(layout="constrained", **kwargs)

MAX_POINTS = 1000  # curves longer than this are averaged into this many bins (a 300k-update run logs 3000+ points)
MAX_PIECES = 40  # attention figures show sentences of at most this many pieces a side (readable labels)
ATTENTION_SENTENCES = 3


# ------------------------------------------------------------------------------------------ learning curves


@dataclass(frozen=True)
class Series:
    steps: np.ndarray  # update numbers, increasing
    values: np.ndarray


def read_scalars(tensorboard_dir: Path) -> dict[str, Series]:
    """Every scalar tag of a run's TensorBoard directory, by update (tensorboard's EventAccumulator reads
    the event files).

    A resumed run appends a new event file that starts again from the update it resumed at: in the order
    of writing, a step at or before the latest one orphans the values logged from that step on, so each
    update keeps the value of the run that went on.
    """
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={SCALARS: 0})  # 0: keep every event
    chatty = logging.getLogger("tensorboard")
    level = chatty.level
    chatty.setLevel(logging.WARNING)  # its directory watcher logs one INFO line per event file
    try:
        accumulator.Reload()
    finally:
        chatty.setLevel(level)
    series = {}
    for tag in accumulator.Tags().get(SCALARS, []):
        kept: dict[int, float] = {}
        latest = None
        for event in sorted(accumulator.Scalars(tag), key=lambda event: event.wall_time):
            if latest is not None and event.step <= latest:
                kept = {step: value for step, value in kept.items() if step < event.step}
            kept[event.step], latest = event.value, event.step
        steps = np.array(sorted(kept), dtype=np.int64)
        series[tag] = Series(steps=steps, values=np.array([kept[s] for s in steps], dtype=np.float64))
    return series


def training_hours(scalars: dict[str, Series]) -> Series | None:
    """Hours of training clock at each logged update: the sum over logging windows of updates × seconds per
    update (train/tokens_per_update / train/tokens_per_s), so validation, saving and pauses between a stop
    and a resume do not count. None without those tags."""
    per_update, per_second = scalars.get("train/tokens_per_update"), scalars.get("train/tokens_per_s")
    if per_update is None or per_second is None or not np.array_equal(per_update.steps, per_second.steps):
        return None
    updates = np.diff(per_update.steps, prepend=0)
    seconds = np.cumsum(updates * per_update.values / np.maximum(per_second.values, 1e-9))
    return Series(steps=per_update.steps, values=seconds / 3600)


def downsample(series: Series, points: int = MAX_POINTS) -> Series:
    """At most `points` points: the mean step and value of consecutive equal-sized bins."""
    if len(series.steps) <= points:
        return series
    bins = np.array_split(np.arange(len(series.steps)), points)
    return Series(steps=np.array([series.steps[b].mean() for b in bins]),
                  values=np.array([series.values[b].mean() for b in bins]))


# (title, y label, log y, [(tag, legend)])
CURVE_PANELS = [
    ("Loss", "per-token loss (nats, log scale)", True,
     [("train/loss", "train loss (label-smoothed)"), ("train/nll", "train NLL"),
      ("valid/loss", "valid loss (label-smoothed)"), ("valid/nll", "valid NLL")]),
    ("Validation BLEU", "sacreBLEU", False, [("valid/bleu", "valid BLEU")]),
    ("Learning rate", "learning rate", False, [("train/lr", "lr")]),
    ("Throughput", "target tokens / s (all ranks)", False, [("train/tokens_per_s", "tokens/s")]),
]


def learning_curves_figure(scalars: dict[str, Series], *, title: str) -> Figure:
    """Loss and NLL, validation BLEU, learning rate and throughput; left against updates, right against
    training hours (`training_hours`; the right column is left empty when the logs cannot give them)."""
    hours = training_hours(scalars)
    figure = _figure(figsize=(12, 13))
    axes = figure.subplots(len(CURVE_PANELS), 2, squeeze=False)
    figure.suptitle(title)
    for row, (panel, ylabel, log_y, tags) in enumerate(CURVE_PANELS):
        for column in range(2):
            ax = axes[row][column]
            drawn = 0
            for tag, legend in tags:
                series = scalars.get(tag)
                if series is None or not len(series.steps) or (column == 1 and hours is None):
                    continue
                series = downsample(series)
                x = series.steps
                if column == 1:  # the hours at each update, interpolated between logged updates
                    x = np.interp(series.steps, np.r_[0, hours.steps], np.r_[0, hours.values])
                marker = "o" if len(x) < 30 else None
                ax.plot(x, series.values, label=legend, marker=marker, markersize=3, linewidth=1.2)
                drawn += 1
            ax.set_title(f"{panel} against {'updates' if column == 0 else 'training hours'}")
            ax.set_xlabel("update" if column == 0 else "training hours (update clock, h)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if not drawn:
                missing = ", ".join(tag for tag, _ in tags)
                ax.text(0.5, 0.5, f"not in the logs: {missing}", ha="center", va="center", transform=ax.transAxes,
                        fontsize=9, color="gray")
                continue
            if log_y:
                ax.set_yscale("log")
            if drawn > 1:
                ax.legend(fontsize=8)
    return figure


# ---------------------------------------------------------------------------------------- length buckets


@dataclass(frozen=True)
class Bucket:
    shortest: int  # words, inclusive
    longest: int
    sentences: int
    bleu: float
    chrf: float

    @property
    def label(self) -> str:
        return f"{self.shortest}" if self.shortest == self.longest else f"{self.shortest}–{self.longest}"


def length_buckets(lengths: Sequence[int], hypotheses: Sequence[str], references: Sequence[str], *, lang: str,
                   max_buckets: int = 6) -> list[Bucket]:
    """sacreBLEU's BLEU (the target language's default tokenizer, as evaluate.py's) and chrF of the
    sentences grouped by `lengths` (source words), into at most `max_buckets` buckets of about equal
    sentence counts (quantiles), a length never split between two buckets."""
    ordered = sorted(lengths)
    bounds: list[int] = []  # a bucket starts at each bound
    for k in range(1, max_buckets):
        cut = ordered[len(ordered) * k // max_buckets]
        if cut > ordered[0] and (not bounds or cut > bounds[-1]):
            bounds.append(cut)
    members: list[list[int]] = [[] for _ in range(len(bounds) + 1)]
    for index, length in enumerate(lengths):
        members[bisect.bisect_right(bounds, length)].append(index)
    buckets = []
    for rows in members:
        if not rows:
            continue
        hyps, refs = [hypotheses[i] for i in rows], [[references[i] for i in rows]]
        buckets.append(Bucket(shortest=min(lengths[i] for i in rows), longest=max(lengths[i] for i in rows),
                              sentences=len(rows), bleu=bleu_metric(lang).corpus_score(hyps, refs).score,
                              chrf=CHRF().corpus_score(hyps, refs).score))
    return buckets


def length_buckets_figure(buckets: Sequence[Bucket], *, unit: str, title: str) -> Figure:
    figure = _figure(figsize=(max(6.0, 1.3 * len(buckets) + 2), 4.5))
    ax = figure.subplots()
    x = np.arange(len(buckets))
    width = 0.38
    bleu = ax.bar(x - width / 2, [b.bleu for b in buckets], width, label="BLEU")
    chrf = ax.bar(x + width / 2, [b.chrf for b in buckets], width, label="chrF")
    ax.bar_label(bleu, fmt="%.1f", fontsize=8)
    ax.bar_label(chrf, fmt="%.1f", fontsize=8)
    ax.set_xticks(x, [f"{b.label}\n({b.sentences} sent.)" for b in buckets])
    ax.set_xlabel(f"{unit} length (words); sentences per bucket in brackets")
    ax.set_ylabel("score (sacreBLEU, 0–100)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return figure


# ------------------------------------------------------------------------------------------------ attention


def attention_figure(attention: torch.Tensor, src_pieces: Sequence[str], tgt_pieces: Sequence[str], *,
                     title: str) -> Figure:
    """Heatmaps of cross-attention [layers, H, T + 1, S + 1] (`alignment.cross_attention`), one per decoder
    layer, heads averaged: rows are the target pieces (the step that outputs each), columns the source
    pieces, both ending with EOS."""
    layers = attention.shape[0]
    maps = attention.mean(dim=1).numpy()  # [layers, T+1, S+1]
    xlabels, ylabels = [*src_pieces, "</s>"], [*tgt_pieces, "</s>"]
    cell = 0.28
    width = min(6 + layers * (1.5 + cell * len(xlabels)), 40)
    height = min(2.5 + cell * len(ylabels), 16)
    figure = _figure(figsize=(width, height))
    axes = figure.subplots(1, layers, squeeze=False)[0]
    figure.suptitle(title)
    image = None
    for layer, ax in enumerate(axes):
        image = ax.imshow(maps[layer], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(xlabels)), xlabels, rotation=90, fontsize=8)
        ax.set_yticks(range(len(ylabels)), ylabels, fontsize=8)
        ax.set_xlabel("source pieces")
        ax.set_ylabel("target pieces (the step that outputs each)")
        ax.set_title(f"decoder layer {layer} (mean of {attention.shape[1]} heads)", fontsize=10)
    figure.colorbar(image, ax=list(axes), label="attention weight (0–1)", shrink=0.8)
    return figure


def pair_attention_figure(model: Transformer, vocab, src_ids: Sequence[int], tgt_ids: Sequence[int], *,
                          title: str) -> Figure:
    """`attention_figure` of one sentence pair given as piece ids (teacher-forced target)."""
    attention = cross_attention(model, src_ids, tgt_ids)
    return attention_figure(attention, vocab.pieces(src_ids), vocab.pieces(tgt_ids, target=True), title=title)


def first_short_pairs(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], count: int) -> list[int]:
    """Indices of the first `count` pairs with both sides non-empty and at most MAX_PIECES pieces."""
    chosen = []
    for index, (src, tgt) in enumerate(zip(src_ids, tgt_ids)):
        if 0 < len(src) <= MAX_PIECES and 0 < len(tgt) <= MAX_PIECES:
            chosen.append(index)
            if len(chosen) == count:
                break
    return chosen


def validation_attention_figure(model: Transformer, vocab, src_ids: Sequence[Sequence[int]],
                                tgt_ids: Sequence[Sequence[int]], *, step: int) -> Figure | None:
    """train.py's TensorBoard image valid/attention: the cross-attention of the first short pair of these
    (validation pairs, the reference teacher-forced), per layer; None when none is short enough."""
    chosen = first_short_pairs(src_ids, tgt_ids, 1)
    if not chosen:
        return None
    index = chosen[0]
    return pair_attention_figure(model, vocab, src_ids[index], tgt_ids[index],
                                 title=f"Cross-attention, validation sentence {index + 1}, update {step}")


# ---------------------------------------------------------------------------------------------- the report


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What evaluate.py has once it has scored a test set: all the report needs, nothing decoded again."""

    out: Path  # where scores.json is; the report goes beside it
    name: str  # the model's name (the table row's)
    testset: str
    lang: str
    sources: list[str] | None
    hypotheses: list[str]
    references: list[str]
    score_lines: list[str]  # sacreBLEU's and tokBLEU's result lines, as printed
    results: dict  # scores.json
    row: dict  # the table row
    table: str  # "2" or "3"
    run_dir: Path | None
    model: Transformer | None  # the evaluated model (an ensemble's first), for the attention figures
    vocab: object | None  # data.vocab.Vocab or MarianVocab
    source_prefix: list[int] = field(default_factory=list)  # a multilingual model's target tag


def write_report(evaluation: Evaluation) -> Path:
    """report.md and its PNG figures in `evaluation.out`; returns report.md's path."""
    e, out = evaluation, evaluation.out
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {e.name} on {e.testset}", ""]
    step = e.results.get("step")
    lines += [f"{e.results['lines']} sentences, target language `{e.lang}`"
              + (f", model of update {step}" if step is not None else "") + ". Scores:", "", "```",
              *e.score_lines, "```", ""]
    if e.results.get("ppl") is not None:
        lines += [f"Perplexity of the references (per piece): {e.results['ppl']:.2f}", ""]
    lines += [f"## The row of the paper's Table {e.table}", "", *table_markdown(e.row, e.table), ""]

    lines += ["## Learning curves", ""]
    tensorboard = e.run_dir / "tensorboard" if e.run_dir is not None else None
    scalars = read_scalars(tensorboard) if tensorboard is not None and tensorboard.is_dir() else {}
    if scalars:
        save(learning_curves_figure(scalars, title=f"{e.name}: training"), out / "learning_curves.png")
        lines += ["![Learning curves](learning_curves.png)", "",
                  f"From `{tensorboard}`. Training hours count the updates' own time (validation, saving and "
                  "pauses excluded); curves of more than "
                  f"{MAX_POINTS} points are averaged into {MAX_POINTS} bins.", ""]
    else:
        lines += ["No TensorBoard logs: evaluate a run directory (checkpoint=<run_dir>) to see them.", ""]

    unit = "source" if e.sources is not None else "reference"
    lengths = [len(text.split()) for text in (e.sources if e.sources is not None else e.references)]
    buckets = length_buckets(lengths, e.hypotheses, e.references, lang=e.lang)
    save(length_buckets_figure(buckets, unit=unit, title=f"{e.name} on {e.testset}: scores by {unit} length"),
         out / "length_buckets.png")
    lines += [f"## BLEU and chrF by {unit} length", "", "![Scores by length](length_buckets.png)", "",
              f"| {unit} words | sentences | BLEU | chrF |", "| --- | --- | --- | --- |",
              *(f"| {b.label} | {b.sentences} | {b.bleu:.2f} | {b.chrf:.2f} |" for b in buckets), "",
              "Buckets hold about equal numbers of sentences; BLEU of few sentences is noisy"
              + ("; BLEU is 0 for a bucket of sentences shorter than 4 words (no 4-grams to match)."
                 if any(b.longest < 4 for b in buckets) else "."), ""]

    lines += ["## Cross-attention on test sentences", ""]
    if e.model is not None and e.sources is not None:
        # The sources as the model read them (a multilingual model's tag first), the translations in target ids.
        src_ids = [e.source_prefix + ids if ids else ids for ids in e.vocab.encode(e.sources)]
        hyp_ids = e.vocab.encode_target(e.hypotheses)
        chosen = first_short_pairs(src_ids, hyp_ids, ATTENTION_SENTENCES)
        if not chosen:
            empty = sum(not ids for ids in hyp_ids)
            lines += [f"No figure: no test sentence has a non-empty translation and a source of at most {MAX_PIECES} "
                      f"pieces ({empty} of {len(hyp_ids)} translations are empty"
                      + ("; a model this early in training often outputs nothing" if empty else "") + ").", ""]
        for number, index in enumerate(chosen, start=1):
            name = f"attention-{number}.png"
            save(pair_attention_figure(e.model, e.vocab, src_ids[index], hyp_ids[index],
                                       title=f"Cross-attention, test sentence {index + 1}"), out / name)
            lines += [f"Sentence {index + 1}: {e.sources[index]}  ", f"Translation: {e.hypotheses[index]}", "",
                      f"![Cross-attention of sentence {index + 1}]({name})", ""]
        if chosen:
            lines += ["Each row is the step that outputs a target piece of the model's own translation "
                      "(teacher-forced, not decoded again); attention that parks on the source's `</s>` is common "
                      "and carries little information.", ""]
    else:
        lines += ["Needs a checkpoint and the source sentences.", ""]
    path = out / "report.md"
    atomic_write(path, "\n".join(lines))
    return path


def save(figure: Figure, path: Path) -> None:
    figure.savefig(path, dpi=90)
