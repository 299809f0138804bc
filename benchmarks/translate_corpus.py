"""Translating a monolingual corpus (back-translation's step 2): translate.py against CTranslate2's translate_file.

    python benchmarks/translate_corpus.py --run-dir runs/bt_de_en --input lowres/mono.de --lines 3000
    python benchmarks/translate_corpus.py --run-dir RUN --input FILE --lines 20 --smoke   # every step, quickly

Each engine runs as the command a user runs, in its own process, timed from start to the last line written
(interpreter start, imports, model load, reading, translating, writing; medians of the passes, the engines
in turns):
- ours: `python translate.py checkpoint=RUN input=IN output=OUT device=cpu quiet=true` with the search below:
  streaming in chunks of `chunk_lines` lines, each chunk written to `OUT.parts/` and joined at the end
  (docs/BACKTRANSLATION.md), so the resumable path is what is timed;
- CTranslate2: a Python process that loads the model written by `transformer.interop.ct2_export.export_ctranslate2`
  and calls `translate_file(IN, OUT, source_tokenize_fn=, target_detokenize_fn=)` with the run's SentencePiece
  models (`max_batch_size=32`, examples, its default).
The searches (`--threads` threads each: torch threads, CTranslate2's intra_threads):
- beam 4 with the length penalty |Y|^1 (ours `decode.lenpen_style=power decode.lenpen=1`), ours with its exact
  stop rule and CTranslate2 with patience 4, the setting at which their outputs agree (benchmarks/decode_real.py);
- sampling from the whole distribution, temperature 1 (ours `decode=sampling`; CTranslate2 `beam_size=1,
  sampling_topk=0`): Edunov et al.'s back-translation. The engines draw different random numbers, so their
  outputs differ; only the speed is compared.
Lines/s = input lines / wall seconds of the whole command. A corpus of millions of lines pays the start once:
each engine also translates the first line alone (the start: interpreter, imports, model load; the median of
the passes), and "after the start" = (lines - 1) / (seconds - that).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import ROOT, load_average, load_remark, machine, median, table, versions, write_section
from transformer.interop import ct2_export
from transformer.decoding.translation import Translator

HEADING = "## Translating a monolingual corpus"
SEARCHES = {"beam 4": {"ours": ["decode.beam=4", "decode.lenpen_style=power", "decode.lenpen=1"],
                       "ct2": {"beam_size": 4, "patience": 4, "length_penalty": 1.0}},
            "sampling": {"ours": ["decode=sampling"], "ct2": {"beam_size": 1, "sampling_topk": 0}}}
CT2_SCRIPT = """
import json, sys, ctranslate2, sentencepiece
model, src, out, threads, options = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
source = sentencepiece.SentencePieceProcessor(model_file=model + "/source.spm")
target = sentencepiece.SentencePieceProcessor(model_file=model + "/target.spm")
translator = ctranslate2.Translator(model, device="cpu", compute_type="float32", inter_threads=1, intra_threads=threads)
translator.translate_file(src, out, max_batch_size=32, source_tokenize_fn=lambda line: source.encode(line, out_type=str),
                          target_detokenize_fn=lambda pieces: target.decode(pieces), **json.loads(options))
"""


def run_timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"error: {shlex.join(command)} failed:\n{result.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="a run directory of train.py (or a .pt file)")
    parser.add_argument("--input", type=Path, required=True, help="monolingual source text, a line each")
    parser.add_argument("--lines", type=int, default=3000, help="its first N lines (default 3000)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per engine and search (default 3)")
    parser.add_argument("--write", type=Path, help="Markdown file whose section to replace")
    parser.add_argument("--smoke", action="store_true", help="one pass each, to show that every step runs")
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    torch.set_num_threads(args.threads)
    load_before = load_average()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = args.input.read_text(encoding="utf-8").splitlines(keepends=True)[:args.lines]
        source = tmp / "input.txt"
        source.write_text("".join(lines), encoding="utf-8")
        first = tmp / "first.txt"
        first.write_text(lines[0], encoding="utf-8")
        translator = Translator.load(args.run_dir, "cpu")
        ct2_dir = ct2_export.export_ctranslate2(translator.model, translator.vocab, tmp / "ct2")
        for search, options in SEARCHES.items():
            ours = [sys.executable, "translate.py", f"checkpoint={args.run_dir.resolve()}", f"input={source}",
                    f"output={tmp / 'ours.txt'}", "device=cpu", "quiet=true", *options["ours"]]
            ct2 = [sys.executable, "-c", CT2_SCRIPT, str(ct2_dir), str(source), str(tmp / "ct2.txt"),
                   str(args.threads), json.dumps(options["ct2"])]
            seconds = {"ours": [], "CTranslate2 float32": []}
            start = {"ours": [], "CTranslate2 float32": []}
            for _ in range(repeats):
                for name, command in (("ours", ours), ("CTranslate2 float32", ct2)):
                    for text, times in ((first, start[name]), (source, seconds[name])):
                        if name == "ours":  # translate.py would resume into the finished output
                            (tmp / "ours.txt").unlink(missing_ok=True)
                        times.append(run_timed([part.replace(str(source), str(text)) for part in command], env))
            ours_out = (tmp / "ours.txt").read_text(encoding="utf-8").splitlines()
            if len(ours_out) != len(lines):
                sys.exit(f"error: translate.py wrote {len(ours_out)} lines for {len(lines)}")
            rate = {name: len(lines) / median(s) for name, s in seconds.items()}
            steady = {name: (len(lines) - 1) / max(median(s) - median(start[name]), 1e-9) for name, s in seconds.items()}
            for name, s in seconds.items():
                rows.append([search, name, f"{rate[name]:,.1f}", f"{median(s):.1f}", f"{min(s):.1f}–{max(s):.1f}",
                             f"{rate[name] / rate['CTranslate2 float32']:.2f}×", f"{median(start[name]):.1f}",
                             f"{steady[name]:,.1f}", f"{steady[name] / steady['CTranslate2 float32']:.2f}×"])
                print(f"{search} {name}: {rate[name]:,.1f} lines/s ({median(s):.1f} s), start {median(start[name]):.1f} s",
                      flush=True)
    load_after = load_average()
    command = ["python", "benchmarks/translate_corpus.py", "--run-dir", str(args.run_dir), "--input", str(args.input),
               "--lines", str(args.lines), "--threads", str(args.threads)]
    command += ["--smoke"] if args.smoke else ["--repeats", str(args.repeats)]
    smoke = "**Smoke run**: the figures only show that every step runs. " if args.smoke else ""
    section = "\n".join([
        HEADING, "",
        f"{smoke}Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine(torch.device('cpu'))}; "
        f"{load_remark(load_before, load_after)}. {versions('ctranslate2', 'sentencepiece')}. Command: "
        f"`{shlex.join(command + (['--write', str(args.write)] if args.write else []))}` ({repeats} timed "
        f"pass(es) per engine and search, in turns, medians). Text: the first {len(lines):,} lines of "
        f"{args.input.name}. Model: `{args.run_dir}` ({translator.model.config.d_model} wide, "
        f"{translator.model.config.encoder_layers}+{translator.model.config.decoder_layers} layers, vocabulary "
        f"{translator.model.config.vocab_size}). Each engine timed as a whole command (start, load, translate, "
        "write); the searches: the docstring of benchmarks/translate_corpus.py.", "",
        table(["search", "engine", "lines/s", "seconds (median)", "spread", "against CTranslate2",
               "start (s, 1 line)", "lines/s after the start", "against CTranslate2"], rows),
    ]) + "\n"
    print(section)
    if args.write:
        write_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
