"""Sequence-level knowledge distillation through train.py (transformer/training/distill.py): the teacher's
translations as the student's corpus, line for line; a run killed while its teacher translates resumes from the
chunks written, and one killed while training never translates again."""

from __future__ import annotations

import json
import os

import pytest

import evaluate
from data.errors import ConfigError, DataError
from helpers import run, train_main
from transformer.decoding.translation import Translator

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    """A tiny teacher trained for 6 updates on the generated corpus (what it says matters less than that the
    student's corpus is exactly what it says)."""
    directory = tmp_path_factory.mktemp("teacher") / "run"
    run(corpus, directory, {"train.max_steps": 6})
    return directory


# The teacher of 6 updates writes long, repetitive translations: the student keeps them all (no length-ratio
# filter), so that every test sees all 300 pairs.
KEEP_ALL = {"data.max_len_ratio": "null"}


def source_lines(corpus) -> list[str]:
    return (corpus.prefixes["train"].with_suffix(".en")).read_text(encoding="utf-8").splitlines()


def translations_seen(monkeypatch) -> list[int]:
    """The number of source lines each call of the teacher's search was given, from here on."""
    seen, original = [], Translator.translate_nbest

    def counting(self, texts, *args, **kwargs):
        seen.append(len(texts))
        return original(self, texts, *args, **kwargs)

    monkeypatch.setattr(Translator, "translate_nbest", counting)
    return seen


def test_the_student_trains_on_the_teachers_translations_line_for_line(corpus, teacher, tmp_path, monkeypatch):
    """run_dir/distilled/train.de holds the teacher's translation of train.en line i at line i (its own search,
    the same batches as one call of Translator.translate over the whole file), train.en a copy of the sources,
    and a second run of the command trains on without translating again."""
    seen = translations_seen(monkeypatch)
    student = tmp_path / "student"
    first = run(corpus, student, {**KEEP_ALL, "distill.teacher": teacher, "model.encoder_layers": 2,
                                  "train.max_steps": 3})
    sources = source_lines(corpus)
    distilled = (student / "distilled" / "train.de").read_text(encoding="utf-8").splitlines()
    assert sum(seen) == len(sources) == len(distilled) == 300
    assert (student / "distilled" / "train.en").read_text(encoding="utf-8").splitlines() == sources
    expected = Translator.load(teacher, "cpu").translate(sources)
    assert distilled == expected
    assert first["step"] == 3
    # step c: the student scored as any model is (its end-of-pipeline evaluation)
    valid = corpus.prefixes["valid"]
    assert evaluate.main([f"checkpoint={student}", f"src={valid.with_suffix('.en')}", f"ref={valid.with_suffix('.de')}",
                          "decode.max_len_b=5"]) == 0
    assert "BLEU" in json.loads((student / "eval" / "valid" / "scores.json").read_text())["scores"]
    seen.clear()
    # The source and the teacher's files with a new modification time, the same bytes (a corpus mounted again,
    # checkpoints restored from a backup): still the finished translation.
    files = [corpus.prefixes["train"].with_suffix(".en"), *sorted(teacher.glob("checkpoints/*.pt"))]
    times = [(f.stat().st_atime_ns, f.stat().st_mtime_ns) for f in files]
    try:
        for f, (accessed, modified) in zip(files, times):
            os.utime(f, ns=(accessed, modified + 86_400 * 10**9))
        again = run(corpus, student, {**KEEP_ALL, "distill.teacher": teacher, "model.encoder_layers": 2,
                                      "train.max_steps": 5})
    finally:
        for f, t in zip(files, times):
            os.utime(f, ns=t)
    assert again["step"] == 5 and seen == []
    # The run moved to another folder (its saved data.train_prefix names the old one): it resumes there, its
    # corpus still the finished translation.
    (tmp_path / "moved").mkdir()
    moved = student.rename(tmp_path / "moved" / "student")
    last = run(corpus, moved, {**KEEP_ALL, "distill.teacher": teacher, "model.encoder_layers": 2,
                               "train.max_steps": 6})
    assert last["step"] == 6 and seen == []


def test_an_empty_translation_stays_an_empty_line_and_alignment_is_checked(corpus, teacher, tmp_path, monkeypatch,
                                                                           capfd):
    """A teacher whose translation of line 3 is empty: line 3 of the distilled corpus is empty (the pair is then
    cleaned out, not shifted onto the next source); a distilled corpus that lost a line is refused in one line."""
    original = Translator.translate_nbest

    def empty_third(self, texts, *args, first_line=1, **kwargs):
        rows = original(self, texts, *args, first_line=first_line, **kwargs)
        if first_line <= 3 < first_line + len(texts):
            rows[3 - first_line] = [type(rows[0][0])(text="", score=0.0)]
        return rows

    monkeypatch.setattr(Translator, "translate_nbest", empty_third)
    student = tmp_path / "student"
    run(corpus, student, {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1, "train.max_steps": 1})
    distilled = (student / "distilled" / "train.de").read_text(encoding="utf-8").split("\n")
    assert len(distilled) == 301 and distilled[2] == "" and distilled[3] != ""  # 300 lines and the final newline
    capfd.readouterr()

    (student / "distilled" / "train.de").write_text("\n".join(distilled[:150] + distilled[151:]), encoding="utf-8")
    with pytest.raises(DataError, match="not line-aligned"):
        run(corpus, student, {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1, "train.max_steps": 2})


def test_a_run_killed_while_its_teacher_translates_resumes_from_the_chunks_written(corpus, teacher, tmp_path,
                                                                                    monkeypatch):
    """Chunks of 100 lines; the teacher dies in its third chunk: the same command translates only that chunk,
    and the corpus equals an uninterrupted run's."""
    original, calls = Translator.translate_nbest, []

    def dies_in_third_chunk(self, texts, *args, **kwargs):
        calls.append(len(texts))
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a SIGINT mid-chunk would
        return original(self, texts, *args, **kwargs)

    monkeypatch.setattr(Translator, "translate_nbest", dies_in_third_chunk)
    changes = {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1, "distill.chunk_lines": 100,
               "train.max_steps": 1}
    with pytest.raises(KeyboardInterrupt):
        run(corpus, tmp_path / "killed", changes)
    monkeypatch.setattr(Translator, "translate_nbest", original)
    seen = translations_seen(monkeypatch)
    run(corpus, tmp_path / "killed", changes)
    assert seen == [100]
    run(corpus, tmp_path / "whole", changes)
    assert ((tmp_path / "killed" / "distilled" / "train.de").read_bytes()
            == (tmp_path / "whole" / "distilled" / "train.de").read_bytes())


def test_a_run_killed_after_the_join_and_before_the_record_does_not_translate_again(corpus, teacher, tmp_path,
                                                                                    monkeypatch):
    """Killed after the chunks are joined into the corpus and before the record of it is written (its window:
    the copy of the sources): the same command finds the joined corpus of the pending request and translates
    nothing; a run with another request in that state translates afresh, not taking the other's corpus."""
    from transformer.training import distill

    def killed(source, out):
        raise KeyboardInterrupt

    changes = {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1, "train.max_steps": 1}
    student = tmp_path / "student"
    monkeypatch.setattr(distill, "_copy", killed)
    with pytest.raises(KeyboardInterrupt):
        run(corpus, student, changes)
    corpus_file = student / "distilled" / "train.de"
    joined = corpus_file.read_bytes()
    assert not (student / "distilled" / "request.json").exists()
    monkeypatch.undo()
    seen = translations_seen(monkeypatch)
    run(corpus, student, changes)
    assert seen == [] and corpus_file.read_bytes() == joined
    assert not (student / "distilled" / "request.pending.json").exists()

    other = tmp_path / "other"
    monkeypatch.setattr(distill, "_copy", killed)
    with pytest.raises(KeyboardInterrupt):
        run(corpus, other, changes)
    monkeypatch.undo()
    seen = translations_seen(monkeypatch)
    run(corpus, other, {**changes, "distill.beam": 2})
    assert sum(seen) == 300


def test_a_teacher_that_changed_since_its_translation_leaves_the_students_corpus_with_a_warning(
        corpus, teacher, tmp_path, monkeypatch, capfd):
    """A teacher run trained on (its checkpoint's bytes changed) after the student's corpus was finished: the
    student resumes on that corpus, translating nothing, and the log says so; another beam is still refused."""
    import shutil

    from transformer import checkpoint as ckpt

    moving = tmp_path / "teacher"
    shutil.copytree(teacher, moving)
    changes = {**KEEP_ALL, "distill.teacher": moving, "distill.beam": 1, "train.max_steps": 1}
    student = tmp_path / "student"
    run(corpus, student, changes)
    corpus_file = student / "distilled" / "train.de"
    made = corpus_file.read_bytes()
    path = ckpt.resolve(str(moving))
    state = ckpt.load(path)
    ckpt.save({**state, "step": state["step"] + 1}, path)
    capfd.readouterr()
    seen = translations_seen(monkeypatch)
    assert run(corpus, student, {**changes, "train.max_steps": 2})["step"] == 2
    assert seen == [] and corpus_file.read_bytes() == made
    assert "the teacher's files changed since they translated the corpus" in capfd.readouterr().err
    with pytest.raises(ConfigError, match="different: beam"):
        run(corpus, student, {**changes, "distill.beam": 2, "train.max_steps": 3})


def test_a_student_resumes_on_its_finished_corpus_after_its_teacher_is_gone(corpus, teacher, tmp_path, monkeypatch,
                                                                          capfd):
    """The teacher is read to translate the corpus, once: a student whose teacher was deleted or archived since
    resumes on its finished corpus, translating nothing; a new student without the teacher gets one line."""
    import shutil

    gone = tmp_path / "teacher"
    shutil.copytree(teacher, gone)
    changes = {**KEEP_ALL, "distill.teacher": gone, "distill.beam": 1, "train.max_steps": 1}
    student = tmp_path / "student"
    run(corpus, student, changes)
    shutil.rmtree(gone)
    capfd.readouterr()
    seen = translations_seen(monkeypatch)
    assert run(corpus, student, {**changes, "train.max_steps": 2})["step"] == 2
    assert seen == [] and "the teacher's files are gone since they translated" in capfd.readouterr().err
    with pytest.raises(ConfigError, match="distill.teacher=.*teacher.*does not exist"):
        run(corpus, tmp_path / "new", changes)


def test_the_teachers_translation_is_not_counted_in_the_students_max_time(corpus, teacher, tmp_path, monkeypatch):
    """train.max_time budgets the student's training: the teacher's translation before it (the pipeline's first
    step) does not count. On a fake clock the translation takes a day; an hour's budget still trains every update."""
    import time

    real, offset = time.monotonic, [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: real() + offset[0])
    original = Translator.translate_nbest

    def a_day_each(self, texts, *args, **kwargs):
        offset[0] += 86400.0
        return original(self, texts, *args, **kwargs)

    monkeypatch.setattr(Translator, "translate_nbest", a_day_each)
    trained = run(corpus, tmp_path / "student", {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1,
                                                 "train.max_time": 3600, "train.max_steps": 3})
    assert offset[0] >= 86400 and trained["step"] == 3


def test_another_beam_for_the_same_run_a_teacher_of_another_pair_and_a_hub_corpus_are_one_line_errors(
        corpus, teacher, tmp_path):
    student = tmp_path / "student"
    run(corpus, student, {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1, "train.max_steps": 1})
    with pytest.raises(ConfigError, match="holds the translation of another request .different: beam"):
        run(corpus, student, {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 2, "train.max_steps": 2})
    with pytest.raises(ConfigError, match="translates en→de and the student learns de→en: give a teacher of "
                                          "de→en"):
        run(corpus, tmp_path / "reversed", {**KEEP_ALL, "distill.teacher": teacher, "data.src_lang": "de",
                                            "data.tgt_lang": "en", "train.max_steps": 1})
    with pytest.raises(ConfigError, match="distill.original_weight=0.5 with data.temperature: the temperature sets"):
        run(corpus, tmp_path / "tempered", {**KEEP_ALL, "distill.teacher": teacher, "distill.original_weight": 0.5,
                                            "data.temperature": 5, "train.max_steps": 1})
    with pytest.raises(ConfigError, match="give data.train_prefix"):
        train_main(corpus.overrides(tmp_path / "hub", {**KEEP_ALL, "distill.teacher": teacher,
                                                       "data.train_prefix": "null", "data.valid_prefix": "null",
                                                       "data.dataset": str(tmp_path)}))


def test_original_pairs_join_the_distilled_ones_at_their_weight(corpus, teacher, tmp_path, capfd):
    """distill.original_weight=0.5: an epoch is the 300 distilled pairs and 150 of the original ones."""
    run(corpus, tmp_path / "mixed", {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1,
                                     "distill.original_weight": 0.5, "train.max_steps": 1})
    log = capfd.readouterr().err
    assert "and the original pairs at weight 0.5" in log
    assert "training corpus data.train_prefix/dataset: 300 pairs × weight 1 = 300 pairs an epoch" in log
    assert "training corpus data.extra_train[0]: 300 pairs × weight 0.5 = 150 pairs an epoch" in log


def test_a_student_started_from_a_teacher_member_keeps_its_vocabulary(corpus, teacher, tmp_path, capfd):
    """init_from=<a teacher member> beside distill.teacher (experiment=distill_multi30k_en_de_member): the student
    starts from the member's weights with the member's vocabulary (data.vocab=keep), not one trained on the
    distilled corpus, and trains on the teacher's translations."""
    student = tmp_path / "member"
    run(corpus, student, {**KEEP_ALL, "distill.teacher": teacher, "distill.beam": 1, "init_from": teacher,
                          "data.spm_model": "null", "train.max_steps": 1})  # no vocabulary given: the member's
    log = capfd.readouterr().err
    assert f"initialised from {teacher}" in log and f"distill: training on {student / 'distilled' / 'train'}" in log
    assert (student / "spm.model").read_bytes() == (teacher / "spm.model").read_bytes()
    assert len((student / "distilled" / "train.de").read_text(encoding="utf-8").splitlines()) == 300
