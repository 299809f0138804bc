"""Translate raw text: `python translate.py checkpoint=<run_dir or .pt> < src.txt > hyp.txt`.

Exactly one output line per input line, in order (k lines with `decode.nbest=k`, Moses n-best style);
stdout carries translations only, everything else goes to stderr. The work is done by
transformer/translation.py (`Translator`); this file is its command line.

    python translate.py checkpoint=runs/quickstart < src.txt > hyp.txt
    python translate.py checkpoint=[a.pt,b.pt] input=src.txt output=hyp.txt   # an ensemble
    python translate.py checkpoint=runs/quickstart decode=greedy decode.precision=bf16
    python translate.py checkpoint=runs/quickstart alignment=true   # "translation ||| 0-0 1-2 ..." (word links)
    python translate.py checkpoint=runs/quickstart interactive=true            # a line in, its translation out
    python translate.py --help                                                 # every key
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence, TextIO

from omegaconf import DictConfig

from transformer.alignment import Aligner, default_alignment_layer, format_alignment
from transformer.cli import ConfigError, compose_config, decode_request, hydra_app, pick_device, setup_logging
from transformer.config import TranslateJob, to_job
from transformer.kernels import keep_freed_memory
from transformer.search import Ensemble
from transformer.translation import Translation, Translator, arriving_lines, decode_line, split_lines

log = logging.getLogger("translate")


def run(cfg: DictConfig) -> int:
    job: TranslateJob = to_job(cfg, "translate")
    setup_logging(quiet=job.quiet)
    if job.alignment and job.decode.nbest > 1:
        raise ConfigError("alignment=true aligns the best translation only: set decode.nbest=1")
    if job.alignment and job.interactive:
        raise ConfigError("alignment=true and interactive=true do not go together yet: set one of them to false")
    if job.input is not None and not Path(job.input).is_file():
        raise ConfigError(f"input={job.input} is not a file: give a text file, one sentence a line")
    decode, settings = decode_request(cfg, job.decode)  # the run's own search, but for decode.* given here
    translator = Translator.load(job.checkpoint, pick_device(job.device), decode=decode, **settings)
    if job.alignment and translator.decode.nbest > 1:
        raise ConfigError("alignment=true aligns the best translation only: set decode.nbest=1")
    aligner = alignment_of(job, translator) if job.alignment else None
    if job.interactive:
        return interactive(translator, job)
    if job.input is None:
        raw, source = sys.stdin.buffer.read(), "stdin"
    else:
        raw, source = Path(job.input).read_bytes(), job.input
    texts = split_lines(raw, source)
    results = translator.translate_nbest(texts, progress=not job.quiet, source=source)
    if aligner is not None:
        text = "".join(f"{row[0].text} ||| {format_alignment(aligner.align(src, row[0].text))}\n"
                       for src, row in zip(texts, results))
    else:
        text = output_lines(results, nbest=translator.decode.nbest)
    if job.output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(job.output).write_text(text, encoding="utf-8")
    return 0


def alignment_of(job: TranslateJob, translator: Translator) -> Aligner:
    """The aligner of `alignment=true`: the cross-attention of `alignment_layer` (of an ensemble's first model)."""
    model = translator.model.models[0] if isinstance(translator.model, Ensemble) else translator.model
    layers = model.config.decoder_layers
    layer = default_alignment_layer(layers) if job.alignment_layer is None else job.alignment_layer
    if not 0 <= layer < layers:
        raise ConfigError(f"alignment_layer={layer} is not a decoder layer of this model (0..{layers - 1}): "
                          "give one of those, or null for the default (docs/EVALUATION.md)")
    return Aligner(model=model, vocab=translator.vocab, layer=layer)


def interactive(translator: Translator, job: TranslateJob) -> int:
    """Translate each input line as soon as it arrives and flush its translation, so that a pipe or a
    service can wait for it; lines that arrive together are translated together (`interactive_batch`)."""
    source = job.input or "stdin"
    stream = sys.stdin.buffer if job.input is None else open(job.input, "rb")
    out: TextIO = sys.stdout if job.output is None else open(job.output, "w", encoding="utf-8")
    log.info("interactive: one translation per line of %s, flushed as it is done (end with Ctrl-D)", source)
    done = 0
    try:
        for batch in arriving_lines(stream, job.interactive_batch):
            texts = [decode_line(line, source, done + i) for i, line in enumerate(batch, start=1)]
            results = translator.translate_nbest(texts, source=source, first_line=done + 1)
            out.write(output_lines(results, nbest=translator.decode.nbest, first=done))
            out.flush()
            done += len(batch)
    except KeyboardInterrupt:
        log.info("interrupted after %d lines", done)
        return 130
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
        if out is not sys.stdout:
            out.close()
    return 0


def output_lines(results: Sequence[Sequence[Translation]], *, nbest: int, first: int = 0) -> str:
    """The translations as output text: the best one per line, or with nbest > 1 every hypothesis as
    `<0-based input line> ||| <translation> ||| <score>` (Moses n-best), counting input lines from `first`."""
    if nbest > 1:
        lines = [f"{first + i} ||| {h.text} ||| {h.score:.6f}" for i, row in enumerate(results) for h in row]
    else:
        lines = [row[0].text for row in results]
    return "".join(line + "\n" for line in lines)


def main(argv: list[str]) -> int:
    """In-process entry (tests, notebooks): `main(["checkpoint=...", ...])`."""
    return run(compose_config(argv, config_name="translate"))


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    hydra_app("translate", run)
