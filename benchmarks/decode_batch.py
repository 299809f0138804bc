"""Our decoding batch on real text: `decode.max_tokens` (source tokens a batch), `search.COMPACT_SHARE` (the
share of a batch's sentences that must have finished before the batch drops them) and `model.ENCODE_GROUP`
(sources the encoder takes at a time), swept on a trained model.

    python benchmarks/decode_batch.py --run-dir RUN --src F.de --ref F.en --lines 500 --threads 1 --write docs/BENCHMARKS.md
    python benchmarks/decode_batch.py --run-dir RUN --src F.de --ref F.en --smoke     # every step on 20 lines

Three sweeps around the defaults (max_tokens 8000, share 0.25, encoder groups of 32): each value of one
setting with the others at their defaults (`--groups 0`: the whole batch as one group, as the encoder ran
before groups). Every setting translates the same text with the same weights and the run's own
search (translate.py's path: `Translator.load(RUN).translate(lines)`), the settings taking turns (1 warm-up
pass, then `--repeats` timed passes each; medians). A batch's size changes only the shapes the kernels see, so
outputs equal those of the default up to rounding; the table counts the lines that are the same string.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from _common import (alternate, check_heading, command_line, describe, load_average, load_remark, machine, median,
                     publish, table, versions)
from transformer import model as model_module
from transformer import search as search_module
from transformer.config import DecodeConfig
from transformer.kernels import keep_freed_memory
from transformer.evaluation.scoring import sacrebleu_scores
from transformer.search import SearchWork
from transformer.evaluation.testsets import read_lines
from transformer.decoding.translation import Translator

HEADING = "## Decoding batch"
DEFAULT_MAX_TOKENS = DecodeConfig().max_tokens
DEFAULT_SHARE = search_module.COMPACT_SHARE
DEFAULT_GROUP = model_module.ENCODE_GROUP
WHOLE_BATCH = 0  # --groups 0: one group, however many sources the batch holds
CPU = torch.device("cpu")


class Setting:
    """One (max_tokens, share, encoder group): translates the lines with it and keeps what its last pass
    computed."""

    def __init__(self, translator: Translator, max_tokens: int, share: float, group: int):
        self.translator = translator.with_decode(max_tokens=max_tokens)
        self.max_tokens, self.share, self.group = max_tokens, share, group
        self.work: SearchWork | None = None
        self.output: list[str] = []

    @property
    def name(self) -> str:
        return f"max_tokens {self.max_tokens}, share {self.share:g}, group {self.group_name}"

    @property
    def group_name(self) -> str:
        return "whole batch" if self.group == WHOLE_BATCH else str(self.group)

    def translate(self, lines: list[str]) -> None:
        self.work = SearchWork()
        share, search_module.COMPACT_SHARE = search_module.COMPACT_SHARE, self.share
        group, model_module.ENCODE_GROUP = model_module.ENCODE_GROUP, self.group or sys.maxsize
        try:
            self.output = self.translator.translate(lines, work=self.work)
        finally:
            search_module.COMPACT_SHARE, model_module.ENCODE_GROUP = share, group


def settings_of(args, translator: Translator) -> list[Setting]:
    triples = [(tokens, DEFAULT_SHARE, DEFAULT_GROUP) for tokens in args.max_tokens]
    triples += [(DEFAULT_MAX_TOKENS, share, DEFAULT_GROUP) for share in args.shares]
    triples += [(DEFAULT_MAX_TOKENS, DEFAULT_SHARE, group) for group in args.groups]
    triples = list(dict.fromkeys([(DEFAULT_MAX_TOKENS, DEFAULT_SHARE, DEFAULT_GROUP), *triples]))  # default first
    return [Setting(translator, *triple) for triple in triples]


def run(args) -> str:
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    lines, refs = read_lines(args.src)[:args.lines], read_lines(args.ref)[:args.lines]
    if not lines or len(lines) != len(refs):
        sys.exit(f"error: {args.src} has {len(lines)} lines and {args.ref} {len(refs)}: give a non-empty parallel "
                 "pair")
    translator = Translator.load(args.run_dir, CPU)
    settings = settings_of(args, translator)
    settings[0].translate(lines[:10])  # the weights packed once (shared by every setting), outside the timing
    load_before = load_average()
    times = alternate({s.name: (lambda s=s: s.translate(lines)) for s in settings}, device=CPU,
                      warmup=args.warmup, repeats=args.repeats)
    load_after = load_average()
    default = settings[0].output
    lang = translator.tgt_lang or "de"
    rows = []
    for s in settings:
        wall, work = median(times[s.name]), s.work
        same = sum(a == b for a, b in zip(s.output, default, strict=True))
        rows.append([s.max_tokens, f"{s.share:g}", s.group_name, f"{len(lines) / wall:.1f}", f"{wall:.2f}",
                     f"{min(times[s.name]):.2f}–{max(times[s.name]):.2f}", f"{work.steps:,}", f"{work.computed:,}",
                     f"{1000 * wall / work.computed:.3f}",
                     f"{sacrebleu_scores(s.output, refs, lang=lang)[0].score:.2f}",
                     f"{same} / {len(lines)}"])
    decode = translator.decode
    return "\n".join([
        args.heading, "",
        ("**Smoke run**: the figures only show that every step runs. " if args.smoke else "")
        + f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine(CPU)}; {load_remark(load_before, load_after)}. "
        f"{versions('sacrebleu')}. Command: `{command_line('decode_batch.py')}` "
        f"({args.warmup} warm-up + {args.repeats} timed passes per setting, in turns, medians).", "",
        f"Text: {args.src.name} ({len(lines)} lines). Model: `{args.run_dir}` (update "
        f"{translator.checkpoints[0].get('step')}), {describe(translator.model.config)}. Search: the run's own "
        f"(beam {decode.beam}, length penalty {decode.lenpen_style} α {decode.lenpen:g}, stop rule "
        f"{decode.stop}, precision {decode.precision}). Rows: `decode.max_tokens` (source tokens a batch), "
        "`search.COMPACT_SHARE` (the share of finished sentences at which a batch drops them) and "
        "`model.ENCODE_GROUP` (sources the encoder takes at a time, in order of length); decoder steps and "
        "computed row-steps of the last pass (search.SearchWork); lines equal to the default's "
        f"(max_tokens {DEFAULT_MAX_TOKENS}, share {DEFAULT_SHARE:g}, group {DEFAULT_GROUP}).", "",
        table(["max_tokens", "share", "encoder group", "sentences/s", "seconds a pass (median)", "spread",
               "decoder steps", "computed row-steps", "ms per computed row-step", "sacreBLEU",
               "same output as the default"], rows),
    ]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="a run directory of train.py (or a .pt file)")
    parser.add_argument("--src", type=Path, required=True, help="source text, a line each")
    parser.add_argument("--ref", type=Path, required=True, help="its reference translation")
    parser.add_argument("--lines", type=int, default=None, help="only the first N lines")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[2000, 4000, 16000],
                        help="decode.max_tokens values beside the default (default 2000 4000 16000)")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.125, 0.5],
                        help="COMPACT_SHARE values beside the default (default 0.125 0.5)")
    parser.add_argument("--groups", type=int, nargs="+", default=[WHOLE_BATCH],
                        help="ENCODE_GROUP values beside the default (default 0: the whole batch, one group)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes per setting (default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per setting (default 2)")
    parser.add_argument("--write", type=Path, help="Markdown file whose section to replace")
    parser.add_argument("--heading", default=HEADING, help=f"the section's heading (default '{HEADING}')")
    parser.add_argument("--smoke", action="store_true", help="20 lines, one timed pass, no warm-up (for tests)")
    args = parser.parse_args()
    check_heading(parser, args.heading)
    if args.smoke:
        args.lines, args.warmup, args.repeats = min(args.lines or 20, 20), 0, 1
    publish(run(args), args.write, args.heading)


if __name__ == "__main__":
    main()
