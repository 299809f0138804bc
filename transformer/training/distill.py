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
and the source file by their bytes, the search; request.pending.json the one under way, so that a run killed
between the join of the chunks and that record finds the joined corpus), and a run whose source or search
differs from it is refused in one line (teacher files that changed since are warned of: the corpus stays).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch

from data.config import ExtraCorpus, language_tags
from data.errors import ConfigError, DataError
from data.files import atomic_write, file_identity
from data.lines import count_lines
from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.config import TrainJob
from transformer.decoding.corpus_translation import Shard, parts_dir, translate_file
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
    request = {"teacher": [_identity(name) for name in teachers(job)], "beam": d.beam,
               "source": file_identity(source), "chunk_lines": d.chunk_lines}
    if not _finished(record, request):
        if None in request["teacher"]:
            gone = teachers(job)[request["teacher"].index(None)]
            raise ConfigError(f"distill.teacher={gone} does not exist and {folder} holds no finished translation of "
                              "this corpus: give an existing teacher checkpoint or run directory")
        pending = folder / "request.pending.json"  # the request being translated, until `record` says it is done
        if not _joined(target, pending, request):  # every rank sees the same files, so takes the same branch
            if rank == 0:
                target.unlink(missing_ok=True)  # a translation of another request, joined and never recorded
                atomic_write(pending, _dumps(request), what="distilled corpus")
            distributed.barrier()  # before any rank joins chunks (all may be written already) into `target`
            _translate(job, source, target, request, rank=rank, world_size=world_size, device=device)
        distributed.barrier()  # the rank that wrote the last chunk has joined them into `target`
        if rank == 0:
            atomic_write(copied, lambda f: _copy(source, f), what="distilled corpus")
            atomic_write(record, _dumps(request), what="distilled corpus")
            pending.unlink(missing_ok=True)
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


def _translate(job: TrainJob, source: Path, target: Path, request: dict, *, rank: int, world_size: int,
               device: torch.device) -> None:
    """The teacher's translation of `source` into `target`: this rank's chunks, joined by the rank that ends last."""
    _check_pair(job)
    translator = Translator.load(teachers(job), device, tgt_lang=job.data.tgt_lang)
    if job.distill.beam is not None:
        translator = translator.with_decode(beam=job.distill.beam)
    log.info("distill: the teacher (%s; beam %d) translates %s into %s", ", ".join(teachers(job)),
             translator.decode.beam, source, target)
    render = lambda texts, results, first: "".join(row[0].text + "\n" for row in results)  # noqa: E731
    translate_file(translator, source, target, render, chunk_lines=job.distill.chunk_lines, request=request,
                   shard=Shard(rank=rank, world_size=world_size), progress=rank == 0)


def _check_pair(job: TrainJob) -> None:
    """Each teacher translates the student's pair (a multilingual one: into data.tgt_lang, whose tag it is then
    given); read from the checkpoints' configs before any model is built. A model that does not record its
    languages (an imported one) is taken at its word."""
    src, tgt = job.data.src_lang, job.data.tgt_lang
    for name in teachers(job):
        path = ckpt.resolve(name)
        data = (ckpt.load(path, mmap=True).get("config") or {}).get("data") or {}
        into = list(language_tags(data)) or [data.get("tgt_lang")]
        if data.get("src_lang") not in (None, src) or None not in into and tgt not in into:
            raise ConfigError(f"distill.teacher {path} translates {data.get('src_lang')}→{'/'.join(map(str, into))} "
                              f"and the student learns {src}→{tgt}: give a teacher of {src}→{tgt} (or set "
                              "data.src_lang/data.tgt_lang to the teacher's pair)")


def _joined(target: Path, pending: Path, request: dict) -> bool:
    """Whether `target` is this request's finished translation whose record was not yet written (a run killed
    between the join and the record): the chunks are joined (target there, its parts folder gone) for the
    request the pending record names. Anything else translates (resuming from the chunks written)."""
    if not target.is_file() or parts_dir(target).exists() or not pending.is_file():
        return False
    try:
        return json.loads(pending.read_text(encoding="utf-8")) == json.loads(json.dumps(request))
    except (OSError, ValueError):
        return False


def _dumps(request: dict) -> str:
    return json.dumps(request, indent=1, sort_keys=True) + "\n"


def _finished(record: Path, request: dict) -> bool:
    """Whether run_dir/distilled holds this request's finished translation; another source or beam is an error.
    Teacher files that changed since (a teacher run that trained on, re-averaged) leave the finished corpus as it
    is, with a warning: the student resumes on the translation it started with. The chunk size is how the
    translation was cut, not what it is."""
    if not record.is_file():
        return False
    try:
        before = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    after = json.loads(json.dumps(request))
    changed = sorted(k for k in {*after, *before} - {"chunk_lines"} if before.get(k) != after.get(k))
    if changed == ["teacher"]:
        log.warning("distill: the teacher's files %s since they translated the corpus in %s; the student goes on "
                    "with that translation (delete %s to have the teacher translate again)",
                    "are gone" if None in after["teacher"] else "changed", record.parent, record.parent)
    elif changed:
        raise ConfigError(f"{record.parent} holds the translation of another request (different: {', '.join(changed)}"
                          f"): a run keeps its distilled corpus; use a new run_dir, or delete {record.parent}")
    return True


def _identity(teacher: str) -> dict | None:
    """A teacher file's `file_identity`, or None where it is gone (a student resumes on its finished corpus)."""
    try:
        return file_identity(ckpt.resolve(teacher))
    except (ckpt.CheckpointError, OSError):
        return None


def _copy(source: Path, out) -> None:
    with open(source, "rb") as f:
        shutil.copyfileobj(f, out)
