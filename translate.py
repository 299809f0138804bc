"""Translate raw text: `python translate.py checkpoint=<run_dir or .pt> < src.txt > hyp.txt`.

Exactly one output line per input line, in order (k lines with `decode.nbest=k`, Moses n-best style);
stdout carries translations only, everything else goes to stderr. The input is read and translated
`chunk_lines` lines at a time (transformer/decoding/corpus_translation.py: into a file, resumable and shardable). The
work is done by transformer/decoding/translation.py (`Translator`); this file is its command line.

    python translate.py checkpoint=runs/quickstart < src.txt > hyp.txt
    python translate.py checkpoint=[a.pt,b.pt] input=src.txt output=hyp.txt   # an ensemble
    python translate.py checkpoint=runs/quickstart decode=greedy decode.precision=bf16
    python translate.py checkpoint=runs/quickstart alignment=true   # "translation ||| 0-0 1-2 ..." (word links)
    python translate.py checkpoint=runs/quickstart interactive=true            # a line in, its translation out
    python translate.py checkpoint=RUN input=mono.txt output=bt.txt   # any size; killed, the same command resumes
    torchrun --nproc_per_node 8 translate.py checkpoint=RUN input=mono.txt output=bt.txt   # 8 shards, one output
    python translate.py --help                                                 # every key
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import IO, Iterator, Sequence, TextIO

from omegaconf import DictConfig, ListConfig

from transformer.evaluation.alignment import Aligner, default_alignment_layer, format_alignment
from transformer.cli import ConfigError, compose_config, decode_request, hydra_app, setup_logging, to_job
from transformer.config import TranslateJob
from transformer.decoding.corpus_translation import Render, Shard, translate_file, translate_stream
from transformer.distributed import pick_device
from transformer.kernels import keep_freed_memory
from transformer.search import Ensemble
from data.files import file_identity
from data.lines import arriving_lines, decode_line
from data.paths import check_job_paths, open_input, open_output
from transformer import checkpoint as ckpt
from transformer.decoding.translation import Translation, Translator

log = logging.getLogger("translate")


def run(cfg: DictConfig) -> int:
    job: TranslateJob = to_job(cfg, "translate")
    setup_logging(quiet=job.quiet)
    check_job_paths(job)  # input, output and the checkpoints, before the model is loaded (data/paths.py)
    decode, settings = decode_request(cfg, job.decode)  # the run's own search, but for decode.* given here
    translator = Translator.load(job.checkpoint, pick_device(job.device), decode=decode, tgt_lang=job.tgt_lang,
                                 **settings)
    if job.alignment and translator.decode.nbest > 1:
        raise ConfigError("alignment=true aligns the best translation only: set decode.nbest=1")
    aligner = alignment_of(job, translator) if job.alignment else None
    if job.interactive:
        return interactive(translator, job)
    render = renderer(translator, aligner)
    shard = Shard.from_env()
    if job.input is not None and job.output is not None:
        request = {"checkpoints": [file_identity(ckpt.resolve(str(name))) for name in checkpoint_names(job)],
                   "decode": dataclasses.asdict(translator.decode), "alignment": job.alignment,
                   "alignment_layer": None if aligner is None else aligner.layer}
        if translator.chosen_language:  # a multilingual model: chunks into French are not chunks into German
            request["tgt_lang"] = translator.chosen_language
        translate_file(translator, Path(job.input), Path(job.output), render, chunk_lines=job.chunk_lines,
                       request=request, shard=shard, progress=not job.quiet)
        return 0
    if shard.world_size > 1:
        raise ConfigError(f"WORLD_SIZE={shard.world_size}: processes share a translation through files; give "
                          "input=<file> and output=<file>")
    with input_and_output(job) as (stream, out):
        translate_stream(translator, stream, out, render, chunk_lines=job.chunk_lines, source=job.input or "stdin",
                         progress=not job.quiet)
    return 0


@contextlib.contextmanager
def input_and_output(job: TranslateJob) -> Iterator[tuple[IO[bytes], TextIO]]:
    """The input (stdin, or the file `input=`) and the output (stdout, or the file `output=`); the files are
    closed at the end, the standard streams are left open."""
    with contextlib.ExitStack() as files:
        stream = sys.stdin.buffer if job.input is None else files.enter_context(open_input(job.input, "input"))
        out = sys.stdout if job.output is None else files.enter_context(open_output(job.output, "output"))
        yield stream, out


def renderer(translator: Translator, aligner: Aligner | None) -> Render:
    """How translations become output text: best lines, Moses n-best lines, or `translation ||| links`."""
    if aligner is not None:
        return lambda texts, results, first: "".join(
            f"{row[0].text} ||| {format_alignment(aligner.align(src, row[0].text))}\n"
            for src, row in zip(texts, results))
    nbest = translator.decode.nbest
    return lambda texts, results, first: output_lines(results, nbest=nbest, first=first)


def checkpoint_names(job: TranslateJob) -> list:
    return list(job.checkpoint) if isinstance(job.checkpoint, (list, tuple, ListConfig)) else [job.checkpoint]


def alignment_of(job: TranslateJob, translator: Translator) -> Aligner:
    """The aligner of `alignment=true`: the cross-attention of `alignment_layer` (of an ensemble's first model)."""
    model = translator.model.models[0] if isinstance(translator.model, Ensemble) else translator.model
    layers = model.config.decoder_layers
    layer = default_alignment_layer(layers) if job.alignment_layer is None else job.alignment_layer
    if not 0 <= layer < layers:
        raise ConfigError(f"alignment_layer={layer} is not a decoder layer of this model (0..{layers - 1}): "
                          "give one of those, or null for the default (docs/EVALUATION.md)")
    return Aligner(model=model, vocab=translator.vocab, layer=layer, source_prefix=translator.source_prefix)


def interactive(translator: Translator, job: TranslateJob) -> int:
    """Translate each input line as soon as it arrives and flush its translation, so that a pipe or a
    service can wait for it; lines that arrive together are translated together (`interactive_batch`)."""
    source = job.input or "stdin"
    done = 0
    with input_and_output(job) as (stream, out):
        log.info("interactive: one translation per line of %s, flushed as it is done (end with Ctrl-D)", source)
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
