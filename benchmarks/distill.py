"""Teacher against students (docs/DISTILLATION.md): test-set BLEU and real-text decoding speed, same machine, same run.

    python benchmarks/distill.py --teacher runs/multi30k_en_de \
        --student runs/distill_multi30k_en_de_deep_shallow --student runs/distill_multi30k_en_de_narrow \
        --baseline runs/original_deep_shallow --threads 1,2 --write docs/DISTILLATION.md
    python benchmarks/distill.py --teacher RUN --student RUN --lines 50 --threads 1 --smoke   # every step, briefly

`--teacher A B`: an ensemble of A and B (one row; its parameters are the members' together); `--student A B` and
`--baseline A B` likewise.

Each model translates the test set (default: Multi30k's test_2016_flickr EN→DE from this repository's test data
beside the checkout) with its own run's search (the teacher's beam 4 and α 0.6; a student preset's greedy
search), in fp32 and in int8 (`decode.precision=int8`: dynamically quantised linear layers), at each thread
count. Speed is sentences per second of `Translator.translate` over the whole set after one warm-up pass over
its first 50 lines (the models in turns, so that the machine's load falls on each alike), and the ratio to the
teacher's fp32 speed at the same thread count; quality is each precision's translation's sacreBLEU (int8 costs
some) and, with a tokenised reference, lcBLEU (the Multi30k papers' metric), scored at the first thread count.
`--baseline`: the same student shape trained on the original targets, the distillation gain's other side.
`--student-beam 4`: each student and baseline also decoded with beam 4 and α 0.6 (the paper's), a row of its own
beside its run's search (seq-KD students lose little without a beam, Kim & Rush 2016: here is how little).
`--ctranslate2`: each greedy model of one checkpoint (the students) also exported to CTranslate2 in int8
(`python -m transformer.hf export RUN --ctranslate2 DIR --quantization int8`, into a temporary folder) and timed
there: `translate_batch` with greedy search, batches of 64 sentences decoded side by side on `inter_threads` =
the thread count, one thread each (CTranslate2's way to use cores for throughput; on these small models its
intra-op threads made it slower: 1 thread 1,892 sentences/s, 2 intra-op threads 847, 2 inter 2,475).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import tempfile
import time
from pathlib import Path

import torch

from _common import load_average, measured_on, publish, table  # noqa: E402  (puts the checkout on sys.path)
from transformer.decoding.translation import Translator
from transformer.evaluation.scoring import lc_bleu, sacrebleu_scores

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "multi30k"
HEADING = "## Teacher and students: quality and decoding speed"


def parameters(translator: Translator) -> float:
    return sum(p.numel() for p in translator.model.parameters()) / 1e6


def timed(translator: Translator, sources: list[str]) -> tuple[list[str], float]:
    translator.translate(sources[:50])  # warm-up: allocations, oneDNN's kernels for these shapes
    started = time.perf_counter()
    hypotheses = translator.translate(sources)
    return hypotheses, len(sources) / (time.perf_counter() - started)


def ctranslate2_timed(translator: Translator, sources: list[str], directory: Path, threads: int):
    """(translations, sentences/s) of `translator`'s model exported to CTranslate2 int8, greedy."""
    import ctranslate2
    import sentencepiece as spm

    from transformer.interop.ct2_export import export_ctranslate2

    if not (directory / "model.bin").is_file():
        export_ctranslate2(translator.model, translator.vocab, directory, quantization="int8")
    engine = ctranslate2.Translator(str(directory), device="cpu", compute_type="int8", intra_threads=1,
                                    inter_threads=threads)
    target = spm.SentencePieceProcessor(model_file=str(directory / "target.spm"))
    pieces = [translator.vocab.pieces(row) for row in translator.vocab.encode(sources)]

    def translate(batch):
        results = engine.translate_batch(batch, beam_size=1, max_batch_size=64,
                                         suppress_sequences=[["<pad>"], ["<s>"]])
        return [target.decode_pieces(r.hypotheses[0]) for r in results]

    translate(pieces[:50])  # warm-up, as `timed`
    started = time.perf_counter()
    hypotheses = translate(pieces)
    return hypotheses, len(sources) / (time.perf_counter() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, nargs="+",
                   help="a run directory or checkpoint, or several: an ensemble (as distill.teacher=[...])")
    p.add_argument("--student", action="append", nargs="+", default=[],
                   help="a distilled student, or several: an ensemble (repeat for more rows)")
    p.add_argument("--baseline", action="append", nargs="+", default=[],
                   help="a student shape trained on the original data (as --student)")
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.en")
    p.add_argument("--ref", type=Path, default=DATA / "test_2016_flickr.de")
    p.add_argument("--tok-ref", type=Path, default=DATA / "tok" / "test_2016_flickr.lc.norm.tok.de")
    p.add_argument("--lang", default="de")
    p.add_argument("--lines", type=int, default=None, help="the first N lines only")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--smoke", action="store_true", help="int8 skipped: every step once, for the test suite")
    p.add_argument("--student-beam", type=int, nargs="+", default=[], metavar="BEAM",
                   help="the students and baselines also with these beams (1: greedy; α 0.6, the paper's), each a "
                        "row beside their run's own search")
    p.add_argument("--ctranslate2", action="store_true",
                   help="the greedy one-checkpoint models in CTranslate2 int8 too")
    p.add_argument("--write", type=Path, help="Markdown file whose section to replace")
    args = p.parse_args()
    sources = args.src.read_text(encoding="utf-8").splitlines()[: args.lines]
    references = args.ref.read_text(encoding="utf-8").splitlines()[: args.lines]
    tokenized = (args.tok_ref.read_text(encoding="utf-8").splitlines()[: args.lines]
                 if args.tok_ref and args.tok_ref.is_file() else None)
    models = [("teacher", args.teacher)] + [("student", s) for s in args.student] + [  # each a list of checkpoints
        ("student, original data", b) for b in args.baseline]
    precisions = ["fp32"] if args.smoke else ["fp32", "int8"]
    thread_counts = [int(t) for t in args.threads.split(",")]
    load_before = load_average()
    rows, teacher_speed = [], {}
    exports = Path(tempfile.mkdtemp(prefix="distill-ct2-"))
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for number, (role, path) in enumerate(models):
            in_ct2 = ["int8, CTranslate2"] if args.ctranslate2 and len(path) == 1 else []
            beams = [None] + (list(dict.fromkeys(args.student_beam)) if role != "teacher" else [])  # None: its own
            own = None  # the run's own beam, read from the first row's translator
            for beam, precision in itertools.product(beams, precisions + in_ct2):
                if beam is not None and beam == own:
                    continue  # the rows of the run's own search
                translator = Translator.load(path, "cpu")  # a fresh one: its weights packed for this precision
                if beam is None:
                    own = translator.decode.beam
                else:
                    translator = translator.with_decode(beam=beam, lenpen=0.0 if beam == 1 else 0.6)
                if precision == "int8, CTranslate2":
                    if translator.decode.beam != 1:  # CTranslate2's length penalty is not ours: greedy models only
                        continue
                    hypotheses, speed = ctranslate2_timed(translator, sources, exports / str(number), threads)
                else:
                    translator = translator.with_decode(precision=precision)
                    hypotheses, speed = timed(translator, sources)
                if role == "teacher" and precision == "fp32":
                    teacher_speed[threads] = speed
                quality = ["", ""]
                if threads == thread_counts[0]:  # quality: each precision once (its output is the same at any count)
                    bleu = next(s for s in sacrebleu_scores(hypotheses, references, lang=args.lang) if s.name == "BLEU")
                    quality = [f"{bleu.score:.2f}",
                               f"{lc_bleu(hypotheses, tokenized, args.lang).score:.2f}" if tokenized else "-"]
                decode = translator.decode
                search = "greedy" if decode.beam == 1 else f"beam {decode.beam}, α {decode.lenpen:g}"
                rows.append([role, " + ".join(f"`{name}`" for name in path), f"{parameters(translator):.1f}M",
                             search, precision, threads, f"{speed:.1f}", f"{speed / teacher_speed[threads]:.2f}×",
                             *quality])
    shutil.rmtree(exports)
    section = "\n".join([
        HEADING, "",
        measured_on("distill.py", threads=max(thread_counts), load_before=load_before)
        + f" Test set: {args.src} ({len(sources)} lines).", "",
        table(["model", "run", "parameters", "search", "precision", "threads", "sentences/s", "× teacher fp32",
               "BLEU", "lcBLEU"], rows), ""])
    publish(section, args.write, HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
