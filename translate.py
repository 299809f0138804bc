"""Translate raw text: `python translate.py checkpoint=<run_dir or .pt> < src.txt > hyp.txt`.

Exactly one output line per input line, in order (k lines with `decode.nbest=k`, Moses n-best style);
stdout carries translations only, everything else goes to stderr. The work is done by
transformer/translation.py (`Translator`); this file is its command line.

    python translate.py checkpoint=runs/quickstart < src.txt > hyp.txt
    python translate.py checkpoint=[a.pt,b.pt] input=src.txt output=hyp.txt   # an ensemble
    python translate.py checkpoint=runs/quickstart decode=greedy decode.precision=bf16
    python translate.py checkpoint=runs/quickstart alignment=true   # "translation ||| 0-0 1-2 ..." (word links)
    python translate.py --help                                                 # every key
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from transformer.alignment import Aligner, default_alignment_layer, format_alignment
from transformer.cli import ConfigError, compose_config, hydra_app, pick_device, setup_logging
from transformer.config import TranslateJob, to_job
from transformer.kernels import keep_freed_memory
from transformer.search import Ensemble
from transformer.translation import Translator, split_lines


def run(cfg: DictConfig) -> int:
    job: TranslateJob = to_job(cfg, "translate")
    setup_logging(quiet=job.quiet)
    if job.alignment and job.decode.nbest > 1:
        raise ConfigError("alignment=true aligns the best translation only: set decode.nbest=1")
    translator = Translator.load(job.checkpoint, pick_device(job.device))
    aligner = alignment_of(job, translator) if job.alignment else None
    if job.input is None:
        raw, source = sys.stdin.buffer.read(), "stdin"
    else:
        if not Path(job.input).is_file():
            raise ConfigError(f"input={job.input} is not a file: give a text file, one sentence a line")
        raw, source = Path(job.input).read_bytes(), job.input
    texts = split_lines(raw, source)
    results = translator.translate(texts, job.decode, progress=not job.quiet, source=source)
    if job.decode.nbest > 1:
        lines = [f"{i} ||| {text} ||| {score:.6f}" for i, row in enumerate(results) for text, score in row]
    elif aligner is not None:
        lines = [f"{row[0][0]} ||| {format_alignment(aligner.align(text, row[0][0]))}"
                 for text, row in zip(texts, results)]
    else:
        lines = [row[0][0] for row in results]
    text = "".join(line + "\n" for line in lines)
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


def main(argv: list[str]) -> int:
    """In-process entry (tests, notebooks): `main(["checkpoint=...", ...])`."""
    return run(compose_config(argv, config_name="translate"))


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    hydra_app("translate", run)
