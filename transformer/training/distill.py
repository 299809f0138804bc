"""Sequence-level knowledge distillation (Kim & Rush 2016): a student trained on its teacher's translations.

    python train.py experiment=distill_multi30k_en_de_deep_shallow distill.teacher=runs/multi30k_en_de

With `distill.teacher` (a checkpoint, a run directory, or a list of them: an ensemble), train.py first has the
teacher translate the source side of the training corpus (`data.train_prefix.<src_lang>`) with beam search,
into run_dir/distilled/train.<tgt_lang>, beside a copy of the sources (train.<src_lang>): a corpus whose line i
is the teacher's translation of source line i (an empty translation stays an empty line, which the data's
cleaning then drops as a pair). The student trains on it; `distill.original_weight` > 0 adds the original pairs
as a second corpus with that weight (data.extra_train's rules).

The translation is transformer/decoding/corpus_translation.py's: chunk by chunk, each written atomically, sharded
over the run's processes (rank r translates chunks r, r + W, ...), so a run killed while its teacher translates
starts again from the chunks already written, and a run killed while training resumes from its checkpoint
without translating again: run_dir/distilled/request.json records the finished translation (the teacher's files
and the source file by their bytes, the search), and a run whose teacher, source or search differs from it is
refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch

from data.config import ExtraCorpus
from data.errors import ConfigError, DataError
from data.files import atomic_write, file_identity
from data.lines import count_lines
from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.config import TrainJob
from transformer.decoding.corpus_translation import Shard, translate_file
from transformer.decoding.translation import Translator

log = logging.getLogger("train")

FOLDER = "distilled"


def teachers(job: TrainJob) -> list[str]:
    teacher = job.distill.teacher
    return [str(t) for t in teacher] if isinstance(teacher, (list, tuple)) else [str(teacher)]


def with_distilled_data(job: TrainJob, run_dir: Path, *, rank: int, world_size: int,
                        device: torch.device) -> TrainJob:
    """`job` unchanged without a teacher; else the job whose training corpus is the teacher's translation of
    its sources (made here first where it is not finished), plus the original pairs at distill.original_weight."""
    d, data = job.distill, job.data
    if d.teacher is None:
        return job
    if not data.train_prefix:
        raise ConfigError("distill.teacher translates a text corpus: give data.train_prefix (<prefix>."
                          f"{data.src_lang} is what the teacher translates) instead of data.dataset")
    source = Path(f"{data.train_prefix}.{data.src_lang}").expanduser()
    folder = run_dir / FOLDER
    target, copied = folder / f"train.{data.tgt_lang}", folder / f"train.{data.src_lang}"
    record = folder / "request.json"
    request = {"teacher": [file_identity(ckpt.resolve(name)) for name in teachers(job)], "beam": d.beam,
               "source": file_identity(source), "chunk_lines": d.chunk_lines}
    if not _finished(record, request):
        translator = Translator.load(teachers(job), device)
        if d.beam is not None:
            translator = translator.with_decode(beam=d.beam)
        log.info("distill: the teacher (%s; beam %d) translates %s into %s", ", ".join(teachers(job)),
                 translator.decode.beam, source, target)
        render = lambda texts, results, first: "".join(row[0].text + "\n" for row in results)  # noqa: E731
        translate_file(translator, source, target, render, chunk_lines=d.chunk_lines, request=request,
                       shard=Shard(rank=rank, world_size=world_size), progress=rank == 0)
        del translator
        distributed.barrier()  # the rank that wrote the last chunk has joined them into `target`
        if rank == 0:
            atomic_write(copied, lambda f: _copy(source, f), what="distilled corpus")
            atomic_write(record, json.dumps(request, indent=1, sort_keys=True) + "\n", what="distilled corpus")
        distributed.barrier()
    lines = count_lines(target)
    if lines != count_lines(source) or count_lines(copied) != lines:
        raise DataError(f"{target} has {lines} lines but {source} has {count_lines(source)}: the distilled corpus "
                        f"is not line-aligned with its sources; delete {folder} to translate again")
    log.info("distill: training on %s.{%s,%s} (%d pairs, the teacher's translations)%s", folder / "train",
             data.src_lang, data.tgt_lang, lines,
             f" and the original pairs at weight {d.original_weight:g}" if d.original_weight else "")
    extra = [ExtraCorpus(prefix=str(data.train_prefix), weight=d.original_weight)] if d.original_weight else []
    return dataclasses.replace(job, data=dataclasses.replace(data, train_prefix=str(folder / "train"),
                                                             extra_train=[*data.extra_train, *extra]))


def _finished(record: Path, request: dict) -> bool:
    """Whether run_dir/distilled holds this request's finished translation; a different one is an error."""
    if not record.is_file():
        return False
    try:
        before = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if before != json.loads(json.dumps(request)):
        changed = sorted(k for k in {*request, *before} if before.get(k) != request.get(k))
        raise ConfigError(f"{record.parent} holds the translation of another request (different: {', '.join(changed)}"
                          f"): a run keeps its distilled corpus; use a new run_dir, or delete {record.parent}")
    return True


def _copy(source: Path, out) -> None:
    with open(source, "rb") as f:
        shutil.copyfileobj(f, out)
