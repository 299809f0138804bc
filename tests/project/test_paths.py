"""Every user-given path, whatever is wrong with it, is one line and exit status 2 before anything is read or
written (data/paths.py); and the cases of issue #50 that were not: text readers (BOM, bare CR, invalid UTF-8),
a missing extra, Hydra's quoting.

The class test reads the path keys from the config schema (the `path_field` roles of transformer/config.py and
data/config.py) and `python -m transformer.hf`'s CLI_PATHS, so a new path key is covered without a new test.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import typing
from pathlib import Path

import pytest

from helpers import ROOT, run_evaluate, score_of, user_error  # noqa: F401  (ROOT: the checkout on sys.path)
import evaluate  # noqa: E402
import train  # noqa: E402
import translate  # noqa: E402
from data import paths  # noqa: E402
from data.errors import ConfigError, WriteError  # noqa: E402
from data.lines import read_text_lines  # noqa: E402
from transformer import config as schema  # noqa: E402
from transformer import hf  # noqa: E402
from transformer.cli import compose_config, to_job  # noqa: E402
from transformer.decoding.corpus_translation import join  # noqa: E402

ENTRY_POINTS = {"config": train, "translate": translate, "evaluate": evaluate}
UNWRITABLE = Path("/proc/transformer-test/out")  # no process, root included, creates anything in /proc


def schema_path_keys(cls, prefix: str = "") -> typing.Iterator[tuple[str, str]]:
    """(command-line key, role) of every path_field of a job's dataclasses, read from the types (a list of
    dataclasses, e.g. data.extra_train, as its first element)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_path_keys(hints[f.name], f"{prefix}{f.name}.")
        elif inner:
            yield from schema_path_keys(inner[0], f"{prefix}{f.name}[0].")
        elif "path" in f.metadata:
            yield f"{prefix}{f.name}", f.metadata["path"]


def overrides(values: dict) -> list[str]:
    """key=value overrides; the fields of a list's first element (data.extra_train[0].prefix, ...valid_prefix)
    together as one element."""
    plain = [f"{key}='{value}'" for key, value in values.items() if "[0]." not in key]
    elements: dict[str, list[str]] = {}
    for key, value in values.items():
        if "[0]." in key:
            head, field = key.split("[0].")
            elements.setdefault(head, []).append(f"{field}:'{value}'")
    return plain + [f"{head}=[{{{', '.join(fields)}}}]" for head, fields in elements.items()]


class Baseline:
    """Valid values for every path key of a job: existing inputs, fresh outputs; and the files to break them."""

    def __init__(self, root: Path, job: str):
        self.root, self.job = root, job
        root.mkdir(parents=True)
        self.keys = dict(schema_path_keys(schema.JOBS[job]))
        self.afile = root / "a-file"
        self.afile.write_text("x\n")
        self.adir = root / "a-dir"
        self.adir.mkdir()
        (root / "corpus").mkdir()
        self.values: dict[str, Path] = {}
        for n, (key, role) in enumerate(self.keys.items()):
            if role == paths.READ_PREFIX:
                prefix = root / "corpus" / f"p{n}"
                for lang in ("en", "de"):
                    Path(f"{prefix}.{lang}").write_text("a\n")
                self.values[key] = prefix
            elif role in (paths.READ_FILE, paths.READ):
                self.values[key] = root / f"input-{n}.txt"
                self.values[key].write_text("a\n")
            else:
                self.values[key] = root / "fresh" / f"output-{n}"

    def args(self, **changed) -> list[str]:
        fixed = {"config": ["data.dataset=null", "data.subset=null", "device=cpu", "data.src_lang=en",
                            "data.tgt_lang=de"],
                 "translate": ["device=cpu", "quiet=true"], "evaluate": ["device=cpu", "lang=de"]}[self.job]
        values = {**self.values, **changed}
        return [*fixed, *overrides(values)]

    def first_input(self) -> tuple[str, Path]:
        key = next(k for k, role in self.keys.items() if role in (paths.READ_FILE, paths.READ))
        return key, self.values[key]


FAULTS = ("missing parent", "a directory", "a file where a directory is expected", "unwritable", "same as an input")


def fault_value(base: Baseline, key: str, role: str, fault: str):
    """(the value that makes `key` faulty, extra changes, whether it must be refused); None: not applicable."""
    reading = role in (paths.READ_FILE, paths.READ, paths.READ_PREFIX)
    if fault == "missing parent":
        return base.root / "missing" / "deeper" / "x", {}, reading  # an output's folders are created
    if fault == "a directory":
        return base.adir, {}, role in (paths.READ_FILE, paths.READ_PREFIX, paths.WRITE_FILE)
    if fault == "a file where a directory is expected":
        return base.afile / "x", {}, True
    if fault == "unwritable":
        return (UNWRITABLE, {}, True) if not reading else None
    if fault == "same as an input":
        if role == paths.WRITE_FILE:
            in_key, in_value = base.first_input()
            return in_value, {}, True
        writes = dataclasses.fields(schema.EvaluateJob)  # WRITE_DIR: an input named like a file it writes
        writes = next((f.metadata.get("writes", ()) for f in writes if f.name == key), ())
        if role == paths.WRITE_DIR and writes:
            in_key, _ = base.first_input()
            folder = base.root / "collide"
            folder.mkdir(exist_ok=True)
            (folder / writes[0]).write_text("a\n")
            return folder, {in_key: folder / writes[0]}, True
    return None


CASES = [(job, key, role, fault) for job in ENTRY_POINTS for key, role in schema_path_keys(schema.JOBS[job])
         for fault in FAULTS]


def test_the_schema_names_the_path_keys_the_class_test_covers():
    """A guard on the enumeration itself: the keys users know as paths are all marked in the schema."""
    keys = {job: dict(schema_path_keys(schema.JOBS[job])) for job in ENTRY_POINTS}
    assert {"run_dir", "init_from", "data.spm_model", "data.train_prefix", "data.valid_prefix", "data.test_prefix",
            "data.cache_dir", "data.extra_train[0].prefix"} <= set(keys["config"])
    assert {"checkpoint", "input", "output"} <= set(keys["translate"])
    assert {"checkpoint", "src", "ref", "tok_ref", "hyp", "out", "table"} <= set(keys["evaluate"])


def test_every_path_key_of_every_entry_point_is_one_line_and_exit_2_for_every_fault(tmp_path, capsys, monkeypatch):
    """Every entry point × every path key of its schema × {missing parent, a directory, a file where a
    directory is expected, an unwritable location, the same file as an input}: refused with exit status 2 and
    exactly one line on stderr (no traceback), or, where the fault is no error (an output's missing folders
    are created, a run_dir that exists is resumed), accepted by the path check."""
    refused = accepted = 0
    for n, (job, key, role, fault) in enumerate(CASES):
        base = Baseline(tmp_path / f"case-{n}", job)
        made = fault_value(base, key, role, fault)
        if made is None:
            continue
        value, changes, refuse = made
        args = base.args(**{key: value, **changes})
        if refuse:
            message = user_error(ENTRY_POINTS[job], args, capsys, monkeypatch)
            assert key.split("[")[0] in message or "data.extra_train" in message, (job, key, fault, message)
            assert "Traceback" not in message
            refused += 1
        else:
            paths.check_job_paths(to_job(compose_config(args, config_name=job), job))
            accepted += 1
    assert refused >= 50 and accepted >= 5, (refused, accepted)


@pytest.mark.parametrize("command", sorted(hf.CLI_PATHS))
@pytest.mark.parametrize("fault", FAULTS)
def test_every_path_of_the_hf_command_line_is_one_line_and_exit_2(command, fault, tmp_path, capsys):
    """`python -m transformer.hf`: its path arguments (hf.CLI_PATHS) under the same faults, checked before
    transformers is imported."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    adir = tmp_path / "a-dir"
    adir.mkdir()
    for name, role in hf.CLI_PATHS[command].items():
        values = {n: (afile if r == paths.READ else tmp_path / f"out-{n}") for n, r in hf.CLI_PATHS[command].items()}
        bad = {"missing parent": tmp_path / "missing" / "x", "a directory": None,
               "a file where a directory is expected": afile / "x",
               "unwritable": UNWRITABLE if role == paths.WRITE_DIR else None,
               "same as an input": afile if role == paths.WRITE_DIR else None}[fault]
        if bad is None or (fault == "missing parent" and role == paths.WRITE_DIR):
            continue
        values[name] = bad
        argv = [command]
        for n, v in values.items():
            argv += [f"--{n}", str(v)] if n == "ctranslate2" else [str(v)]
        capsys.readouterr()
        assert hf.main(argv) == 2, argv
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err


# ------------------------------------------------------------------------------- the cases of issue #50


def test_case2_translate_from_stdin_into_an_unwritable_output_is_one_line(disagreeing_checkpoints, tmp_path,
                                                                            capsys, monkeypatch):
    checkpoint = disagreeing_checkpoints[0]
    for output in (tmp_path, tmp_path / "a-file" / "out.txt", UNWRITABLE):
        (tmp_path / "a-file").write_text("x")
        message = user_error(translate, [f"checkpoint={checkpoint}", "device=cpu", f"output={output}"], capsys,
                             monkeypatch)
        assert "output=" in message, message
    # a missing folder is created, as with input=
    out = tmp_path / "new" / "folder" / "out.txt"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a\nb\n"), encoding="utf-8"))
    assert translate.main([f"checkpoint={checkpoint}", "device=cpu", "quiet=true", f"output={out}"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2


def text(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_case3_a_table_that_is_a_directory_is_one_line(tmp_path, capsys, monkeypatch):
    ref = text(tmp_path, "ref.de", b"ein Haus\n")
    message = user_error(evaluate, [f"hyp={ref}", f"ref={ref}", f"table={tmp_path}"], capsys, monkeypatch)
    assert f"table={tmp_path} is a directory" in message


def test_case4_hf_without_transformers_names_the_extra_to_install(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    capsys.readouterr()  # the checkpoint is read first (a multilingual one is refused without the extra)
    assert hf.main(["export", str(tiny_run.run_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "pip install -e '.[hf]'" in err[0] and "transformers" in err[0], err


def test_case4b_a_quantization_without_its_ctranslate2_model_is_refused_before_the_checkpoint_is_read(tmp_path,
                                                                                                       capsys):
    checkpoint = text(tmp_path, "model.pt", b"x")  # not a checkpoint: reading it first would be another error
    capsys.readouterr()
    assert hf.main(["export", str(checkpoint), str(tmp_path / "out"), "--quantization", "int8"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--quantization applies to the CTranslate2 model" in err[0], err


def test_case5_a_byte_order_mark_does_not_change_the_score(tmp_path, capsys):
    sentence = "Das ist ein kleines Haus am See .\n".encode()
    hyp = text(tmp_path, "hyp.de", b"\xef\xbb\xbf" + sentence)
    ref = text(tmp_path, "ref.de", sentence)
    lines = run_evaluate([f"hyp={hyp}", f"ref={ref}"], capsys)
    bleu = next(line for line in lines if line.startswith("BLEU|"))
    assert score_of(bleu) == 100.0, bleu
    assert read_text_lines(hyp, "hyp") == read_text_lines(ref, "ref") == [sentence.decode().strip()]


def test_case6_a_reference_with_invalid_utf8_is_refused_naming_the_line(tmp_path, capsys, monkeypatch):
    hyp = text(tmp_path, "hyp.de", b"ein Haus\nein Boot\n")
    ref = text(tmp_path, "ref.de", b"ein Haus\nein B\xf6ot\n")
    message = user_error(evaluate, [f"hyp={hyp}", f"ref={ref}"], capsys, monkeypatch)
    assert "line 2: invalid UTF-8" in message and "ref=" in message, message
    # a hypothesis with invalid UTF-8 is scored (the system wrote those bytes) with a warning naming the line
    with pytest.raises(ConfigError):
        read_text_lines(ref, "ref", strict=True)


def test_case7_input_and_output_the_same_file_is_refused_and_the_source_kept(disagreeing_checkpoints, tmp_path,
                                                                            capsys, monkeypatch):
    source = text(tmp_path, "src.en", b"the cat sees a dog\n")
    for output in (source, tmp_path / "." / "src.en"):
        message = user_error(translate, [f"checkpoint={disagreeing_checkpoints[0]}", "device=cpu",
                                         f"input={source}", f"output={output}"], capsys, monkeypatch)
        assert "is the same file as input=" in message, message
    assert source.read_bytes() == b"the cat sees a dog\n"


def test_case8_an_unbalanced_quote_says_how_to_quote(capsys, monkeypatch):
    message = user_error(translate, ["checkpoint=x", "input='my file.txt"], capsys, monkeypatch)
    assert "cannot parse the override input='my file.txt" in message and "quote the value" in message, message


def test_case8_bare_cr_line_ends_are_lines(tmp_path):
    from data.corpus import _read_parallel, count_lines

    src = text(tmp_path, "c.en", b"a b\rc d\re f\r")
    tgt = text(tmp_path, "c.de", b"A B\r\nC D\r\nE F\r\n")
    assert [row["src"] for row in _read_parallel(str(src), str(tgt))] == ["a b", "c d", "e f"]
    assert [row["tgt"] for row in _read_parallel(str(src), str(tgt))] == ["A B", "C D", "E F"]
    assert count_lines(src) == count_lines(tgt) == 3


def test_case8_a_stray_carriage_return_in_a_newline_file_is_part_of_its_line(tmp_path):
    """A bare "\\r" inside the first line of a "\\n" file (or "\\r\\r\\n" from a CRLF file converted twice) leaves
    the file's lines where its "\\n" are: counted, read for training and for translation alike."""
    from data.corpus import _read_parallel, count_lines
    from data.lines import read_text_lines

    src = text(tmp_path, "c.en", b"a\rb\nc d\ne f\n")
    tgt = text(tmp_path, "c.de", b"A B\r\r\nC D\r\r\nE F\r\r\n")
    assert count_lines(src) == count_lines(tgt) == 3
    assert [row["src"][-1] for row in _read_parallel(str(src), str(tgt))] == ["b", "d", "f"]
    assert [line.rstrip("\r") for line in read_text_lines(tgt, "tgt")] == ["A B", "C D", "E F"]


def test_case8_an_unreadable_input_is_one_line_before_anything_reads_it(tmp_path, monkeypatch):
    """A corpus file of another user (mode 600): one line naming the key and the fix, not a PermissionError
    traceback from the first reader. (os.access is faked: this suite may run as root, which reads anything.)"""
    from data import paths

    text(tmp_path, "train.en", b"a\n")
    monkeypatch.setattr(paths.os, "access", lambda path, mode: not str(path).endswith("train.en"))
    with pytest.raises(ConfigError, match=r"data.train_prefix=.*train.en cannot be read by this user \(permission "
                                          r"denied\): fix its permissions"):
        paths.check_input(tmp_path / "train.en", "data.train_prefix")
    assert paths.check_input(tmp_path, "out", directory=True) == tmp_path  # a readable one passes


def test_case8_a_data_path_that_is_a_directory_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "train.en").mkdir()
    text(tmp_path, "train.de", b"a\n")
    message = user_error(train, ["data.dataset=null", "data.subset=null", f"data.train_prefix={tmp_path / 'train'}",
                                 f"run_dir={tmp_path / 'run'}", "device=cpu"], capsys, monkeypatch)
    assert f"{tmp_path / 'train.en'} is a directory" in message, message


def test_case8_a_failed_output_write_names_the_output_key_not_run_dir(tmp_path):
    parts = tmp_path / "out.txt.parts"
    parts.mkdir()
    with pytest.raises(WriteError) as error:
        join(parts, UNWRITABLE, 0)
    assert "give another output=" in str(error.value) and "run_dir" not in str(error.value)
