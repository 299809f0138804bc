"""Bad inputs: every one ends in a one-line message that names the problem and what to do (or, where the
input is merely odd, in the documented handling), with no traceback and no damaged checkpoint.

Each case below is one row of the table in docs/RELIABILITY.md; `python tests/project/test_bad_inputs.py` runs them
all and prints that table. Error cases run as the command line runs them, `main_with_user_errors` around
`train.main`, `translate.main` or `evaluate.main`, in this process with stdout and stderr captured down to
the file descriptors (`user_error`): the raw stderr is checked, not a message the code shortened. Every case
names a fragment of the problem and one of the fix (or of the handling), written here by hand. The
subprocess tests at the end prove the same for real processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from helpers import ROOT, Corpus, subprocess_env, train_main  # noqa: E402

import evaluate  # noqa: E402
import translate  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer.cli import main_with_user_errors  # noqa: E402

# ------------------------------------------------------------------------------------------ the workspace


class Workspace:
    """The generated corpus with its vocabulary (tests/helpers.py's Corpus), a short trained run to
    translate with and to damage copies of, a second vocabulary, and fresh folders on demand."""

    def __init__(self, root: Path, corpus: Corpus):
        self.root, self.corpus = root, corpus
        self._fresh = itertools.count()
        self.run = root / "trained"
        assert train_main(corpus.overrides(self.run, {"train.max_steps": 2, "train.save_every_steps": 1,
                                                      "train.average_last": 2})) == 0
        self.last = ckpt.last_path(self.run)
        self.state = ckpt.load(self.last)
        from data.vocab import train_vocab

        sentences = (corpus.prefixes["train"].with_suffix(".en")).read_text(encoding="utf-8").splitlines()
        self.other_spm = root / "other.model"
        train_vocab(sentences, self.other_spm, 330)

    def fresh(self) -> Path:
        path = self.root / f"case-{next(self._fresh)}"
        path.mkdir()
        return path

    def train_args(self, changes: dict | None = None, run_dir: Path | None = None) -> list[str]:
        return self.corpus.overrides(run_dir or self.fresh() / "run", changes)

    def damaged(self, name: str, change: Callable[[dict], dict]) -> Path:
        """A copy of last.pt with `change` applied to the checkpoint dict."""
        path = self.fresh() / name
        ckpt.save(change(dict(self.state)), path)
        return path

    def text_file(self, name: str, data: bytes) -> Path:
        path = self.fresh() / name
        path.write_bytes(data)
        return path

    def parallel(self, src: bytes, tgt: bytes) -> Path:
        prefix = self.fresh() / "corpus"
        prefix.with_suffix(".en").write_bytes(src)
        prefix.with_suffix(".de").write_bytes(tgt)
        return prefix


def quietly(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """Run an entry point in this process; returns (status, what it logged). Puts back what the entry points
    set for the whole process (train_main does that for train.py)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            status = train_main(argv) if main is train_main else main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return status, err.getvalue()


@contextlib.contextmanager
def raw_output():
    """Everything written to stdout and stderr inside the block, by Python or below it (file descriptors 1
    and 2): yields a dict whose "out" and "err" are filled on the way out."""
    captured: dict[str, str] = {}
    python_out, python_err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile() as fd_out, tempfile.TemporaryFile() as fd_err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(fd_out.fileno(), 1)
        os.dup2(fd_err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(python_out), contextlib.redirect_stderr(python_err):
                yield captured
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            for name, python, fd in (("out", python_out, fd_out), ("err", python_err, fd_err)):
                fd.seek(0)
                captured[name] = fd.read().decode("utf-8", errors="replace") + python.getvalue()


def user_error(main, argv: list[str]) -> str:
    """The message of `main(argv)` run as its command line runs it (`main_with_user_errors`, in this
    process): it must exit with status 2, write nothing on stdout and exactly one non-empty line on stderr,
    `error: ` and the message, with no traceback. Returns the message."""
    root = logging.getLogger()
    handlers, level, argv0 = root.handlers[:], root.level, sys.argv
    sys.argv = ["entry-point", *map(str, argv)]
    try:
        with raw_output() as raw, pytest.raises(SystemExit) as exit_info:
            main_with_user_errors(train_main if main is train_main else main)()
    finally:
        sys.argv = argv0
        root.handlers[:] = handlers
        root.setLevel(level)
    lines = [line for line in raw["err"].splitlines() if line.strip()]
    assert exit_info.value.code == 2, raw["err"][-2000:]
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], raw["err"][-2000:]
    # An error found once the run has started follows the run's progress: INFO records and progress bars.
    assert all(RUN_PROGRESS.match(line) for line in lines[:-1]), raw["err"][-2000:]
    assert "Traceback" not in raw["err"] and raw["out"] == "", raw
    return lines[-1].removeprefix("error: ")


RUN_PROGRESS = re.compile(r"\d\d:\d\d:\d\d \| INFO \| |.*(/s\]|\(\d\d:\d\d\))$")


def translate_file(ws: Workspace, data: bytes, *args: str) -> tuple[list[bytes], str]:
    """translate.py on `data` with the trained run (greedy, short outputs): (output lines, log)."""
    directory = ws.fresh()
    source, out = directory / "in.txt", directory / "out.txt"
    source.write_bytes(data)
    status, log = quietly(translate.main, [f"checkpoint={ws.run}", "device=cpu", f"input={source}",
                                           f"output={out}", "decode.beam=1", "decode.max_len_a=0", "decode.max_len_b=4",
                                           *args])
    assert status == 0
    return out.read_bytes().split(b"\n")[:-1] if out.read_bytes() else [], log


# ---------------------------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    group: str
    name: str
    run: Callable[[Workspace], str]  # returns the message (error) or what happened (handled input)
    expect: str                      # the problem: a fragment the message must contain
    fix: str                         # what to do (or, for a handled input, what was done): another fragment

    def __str__(self) -> str:
        return self.name


CASES: list[Case] = []


def case(group: str, name: str, expect: str, fix: str):
    def add(run):
        CASES.append(Case(group, name, run, expect, fix))
        return run
    return add


def config_case(name: str, changes: dict, expect: str, fix: str) -> None:
    case("config", name, expect, fix)(lambda ws: user_error(train_main, ws.train_args(changes)))


def plus_override_case(ws: Workspace) -> str:
    return user_error(train_main, [*ws.train_args(), "+train.max_stepz=5"])


# Configuration (train.py; translate.py and evaluate.py share the composition and the decode.* checks)
config_case("unknown key", {"train.max_stepz": 5}, "Could not override 'train.max_stepz'", "check the spelling")
case("config", "unknown key added with +", "unknown config key 'train.max_stepz'", "check the spelling")(plus_override_case)
config_case("unknown group option", {"model": "huge"}, "Could not find 'model/huge'", "options in 'model': base big tiny")
config_case("wrong type: train.max_steps=abc", {"train.max_steps": "abc"},
            "train.max_steps=abc is invalid: Value 'abc' of type 'str' could not be converted to Integer", "give a value of the key's type")
config_case("wrong type: model.d_model=x", {"model.d_model": "x"}, "model.d_model=x is invalid", "give a value of the key's type")
config_case("wrong type: train.lr_scale=fast", {"train.lr_scale": "fast"}, "train.lr_scale=fast is invalid", "give a value of the key's type")
config_case("wrong type: seed=abc", {"seed": "abc"}, "seed=abc is invalid: Value 'abc' of type 'str'", "give a value of the key's type")
config_case("wrong type: data.max_len=abc", {"data.max_len": "abc"}, "data.max_len=abc is invalid", "give a value of the key's type")
config_case("wrong type: data.dedup=maybe", {"data.dedup": "maybe"}, "data.dedup=maybe is invalid: Value 'maybe' is not a valid bool", "give a value of the key's type")
config_case("negative train.max_steps=-1", {"train.max_steps": -1}, "train.max_steps=-1 is invalid", "set it to a number >= 0 or null")
config_case("impossible shape: d_model 16, heads 3", {"model.heads": 3},
            "model.d_model=16 is not divisible by model.heads=3", "choose d_model a multiple of heads")
config_case("impossible value: model.dropout=1.5", {"model.dropout": 1.5}, "model.dropout=1.5 is invalid", "choose a probability in [0, 1)")
config_case("zero token budget: train.max_tokens=0", {"train.max_tokens": 0}, "train.max_tokens=0 must be a positive", "must be a positive integer")
config_case("averaging more than is kept", {"train.average_last": 20, "train.keep_last": 5},
            "train.average_last=20 exceeds train.keep_last=5", "keep at least as many checkpoints as you average")
config_case("unknown precision: train.precision=fp8", {"train.precision": "fp8"}, "train.precision=fp8 is not one of", "one of auto, fp32, bf16, fp16")
config_case("unknown device: device=tpu", {"device": "tpu"}, "device=tpu is not one of auto, cpu, cuda", "one of auto, cpu, cuda, cuda:N")
config_case("vocabulary too small: data.vocab_size=10", {"data.vocab_size": 10, "data.spm_model": "null"},
            "data.vocab_size must be an integer >= 300", "or null, got 10")
config_case("two corpus sources", {"data.dataset": "wmt/wmt14"}, "both data.dataset and data.train_prefix are set", "set one of them to null")
config_case("no corpus source", {"data.train_prefix": "null"}, "neither data.dataset nor data.train_prefix is set", "set one (the other stays null)")
config_case("a hub dataset with a validation prefix", {"data.dataset": "wmt/wmt14", "data.subset": "de-en", "data.train_prefix": "null"},
            "reads its valid split from the hub (data.valid_split), and data.valid_prefix would be ignored", "set data.valid_prefix=null")
config_case("two target languages with one tag", {"data.train_tag": '"<2de>"', "data.extra_train": '[{prefix: fr, tgt_lang: fr, tag: "<2de>"}]'},
            "data.extra_train[0] translates into fr with tag <2de>, the tag of de", "give each target language its own tag")
config_case("a second target language without tags", {"data.extra_train": "[{prefix: fr, tgt_lang: fr}]"},
            "data.extra_train[0] translates into fr, the main corpus into de", "set data.train_tag=<2de> and give that corpus tag: <2fr>")
config_case("negative seed", {"seed": -1}, "seed=-1 must be an integer >= 0", "take no negative seed")


@case("config", "run_dir under a regular file", "cannot create", "choose another run_dir")
def _(ws):
    blocker = ws.text_file("a-file", b"x")
    return user_error(train_main, ws.train_args(run_dir=blocker / "run"))


@case("config", "run_dir/checkpoints is a regular file", "checkpoints: File exists; choose another run_dir", "choose another run_dir")
def _(ws):
    run_dir = ws.fresh()
    (run_dir / "checkpoints").write_text("not a directory")
    return user_error(train_main, ws.train_args(run_dir=run_dir))


@case("config", "resume with another architecture", "run_dir holds a different run (model.d_model: 16 → 24)", "use another run_dir or the saved values")
def _(ws):
    before = ws.last.read_bytes()
    message = user_error(train_main, ws.train_args({"model.d_model": 24}, run_dir=ws.run))
    assert ws.last.read_bytes() == before
    return message


@case("config", "resume with another vocabulary (data.spm_model)", "run_dir holds a different run (data.spm_model:", "use another run_dir or the saved values")
def _(ws):
    return user_error(train_main, ws.train_args({"data.spm_model": ws.other_spm}, run_dir=ws.run))


@case("config", "init_from whose vocabulary is not data.spm_model", "is not the vocabulary of init_from", "set data.vocab=transfer to use it")
def _(ws):
    return user_error(train_main, ws.train_args({"init_from": ws.last, "data.spm_model": ws.other_spm}))


@case("config", "decode.lenpen=x (translate.py)", "decode.lenpen=x is invalid: Value 'x' of type 'str' could not be converted to Float", "give a value of the key's type")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.run}", "decode.lenpen=x"])


@case("config", "decode.nbest=5 with decode.beam=4", "decode.nbest=5 exceeds decode.beam=4", "raise the beam")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.run}", "decode.nbest=5"])


@case("config", "no checkpoint= (translate.py)", "give checkpoint=<run_dir or .pt>", "or checkpoint=[a.pt,b.pt] for an ensemble")
def _(ws):
    return user_error(translate.main, [])


# Training data
def data_args(ws: Workspace, prefix, changes: dict | None = None) -> list[str]:
    return ws.train_args({"data.train_prefix": prefix, "data.cache_dir": ws.fresh(), "train.max_steps": 1,
                          **(changes or {})})


@case("data", "training file missing", "nothing.en does not exist", "give an existing file")
def _(ws):
    return user_error(train_main, data_args(ws, ws.fresh() / "nothing"))


@case("data", "validation file missing", "data.valid_prefix=", "does not exist: give an existing file")
def _(ws):
    return user_error(train_main, ws.train_args({"data.valid_prefix": ws.fresh() / "nothing"}))


@case("data", "misaligned files (3 vs 2 lines)", "misaligned parallel files:", "must be the translation of line n of the other: fix the files")
def _(ws):
    return user_error(train_main, data_args(ws, ws.parallel(b"a\nb\nc\n", b"x\ny\n")))


@case("data", "empty files", "have no lines", "give files with one sentence a line")
def _(ws):
    return user_error(train_main, data_args(ws, ws.parallel(b"", b"")))


@case("data", "only empty lines", "the training corpus is empty after cleaning", "check the files, or relax data.max_len / data.max_len_ratio")
def _(ws):
    return user_error(train_main, data_args(ws, ws.parallel(b"\n \n\n", b"\n\n\t\n")))


@case("data", "binary file (gzip bytes)", "invalid UTF-8 (byte 0x8b at column 2)", "fix or remove that line in both files")
def _(ws):
    return user_error(train_main, data_args(ws, ws.parallel(b"\x1f\x8b\x08\x00binary\n", b"x\n")))


def normal_pairs(ws: Workspace, n: int = 40) -> tuple[bytes, bytes]:
    src = ws.corpus.prefixes["train"].with_suffix(".en").read_bytes().split(b"\n")[:n]
    tgt = ws.corpus.prefixes["train"].with_suffix(".de").read_bytes().split(b"\n")[:n]
    return b"\n".join(src) + b"\n", b"\n".join(tgt) + b"\n"


@case("data", "a 1 MB line (200k words) among normal ones", "1 over max_len", "41 pairs read, 40 kept")
def _(ws):
    src, tgt = normal_pairs(ws)
    status, log = quietly(train_main, data_args(ws, ws.parallel(src + b"word " * 200_000 + b"\n", tgt + b"wort\n")))
    assert status == 0
    return next(line for line in log.splitlines() if "data: train:" in line).split("data: ")[1]


@case("data", "a 1 MB line with data.max_len=null", "longer than a pass's budget (512 tokens; train.max_tokens=512) and are skipped", "are skipped")
def _(ws):
    src, tgt = normal_pairs(ws)
    prefix = ws.parallel(src + b"word " * 200_000 + b"\n", tgt + b"wort " * 200_000 + b"\n")
    status, log = quietly(train_main, data_args(ws, prefix, {"data.max_len": "null", "data.max_len_ratio": "null"}))
    assert status == 0
    return next(line for line in log.splitlines() if "skipped" in line).split("WARNING | ")[1]


@case("data", "a pair with an empty side", "1 with an empty side", "41 pairs read, 40 kept")
def _(ws):
    src, tgt = normal_pairs(ws)
    status, log = quietly(train_main, data_args(ws, ws.parallel(src + b"only a source\n", tgt + b"\n")))
    assert status == 0
    return next(line for line in log.splitlines() if "data: train:" in line).split("data: ")[1]


@case("data", "data.spm_model is not a SentencePiece model", "is not a readable SentencePiece model", "(a .model file from spm_train)")
def _(ws):
    return user_error(train_main, ws.train_args({"data.spm_model": ws.text_file("fake.model", b"\x00garbage")}))


@case("data", "data.spm_model missing", "missing.model does not exist", "or data.spm_model=null to train one")
def _(ws):
    return user_error(train_main, ws.train_args({"data.spm_model": ws.fresh() / "missing.model"}))


# Text to translate (translate.py; evaluate.py decodes through the same function)
@case("text", "empty input", "no output lines", "exit 0")
def _(ws):
    lines, _ = translate_file(ws, b"")
    assert lines == []
    return "exit 0, no output lines"


@case("text", "empty lines", "one empty output line per empty input line", "exit 0")
def _(ws):
    lines, _ = translate_file(ws, b"\n\n\n")
    assert lines == [b"", b"", b""]
    return "exit 0, one empty output line per empty input line"


@case("text", "invalid UTF-8", "line 2 is not valid UTF-8: the bad bytes were replaced by U+FFFD", "exit 0, warning")
def _(ws):
    lines, log = translate_file(ws, b"good line\nbad \xff\xfe line\n")
    assert len(lines) == 2
    return "exit 0, warning: " + next(line for line in log.splitlines() if "UTF-8" in line).split("WARNING | ")[1]


@case("text", "a 10k-token line", "pieces: cropped to decode.max_input_len=1024", "exit 0, warning")
def _(ws):
    lines, log = translate_file(ws, b"a b\n" + b"x " * 10_000 + b"\nc d\n")
    assert len(lines) == 3
    return "exit 0, warning: " + next(line for line in log.splitlines() if "cropped" in line).split("WARNING | ")[1]


@case("text", "control characters (NUL, ESC, BEL, VT, FF, CR, U+0085, U+2028)", "one output line per input line", "exit 0")
def _(ws):
    data = "a\x00b \x1b[31mred\x07\n\x0bvt\x0cff\rcr\n\u0085nel \u2028ls\n".encode()
    lines, _ = translate_file(ws, data)
    assert len(lines) == 3 and all(b"\r" not in line and "\u2028".encode() not in line for line in lines)
    return "exit 0, one output line per input line"


@case("text", "a translation that spells a line break (byte-fallback pieces)", "stays one line", "line breaks become spaces")
def _(ws):
    from data.vocab import Vocab

    real = Vocab.decode
    Vocab.decode = lambda self, ids: [text + "\nmore\u2028lines" for text in real(self, ids)]
    try:
        lines, _ = translate_file(ws, b"one\ntwo\n")
    finally:
        Vocab.decode = real
    assert len(lines) == 2 and all(line.endswith(b" more lines") for line in lines)
    return "exit 0, the translation stays one line (line breaks become spaces)"


@case("text", "input file missing", "missing.txt does not exist", "give an existing file")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.run}", f"input={ws.fresh() / 'missing.txt'}"])


# Checkpoints (translate.py unless noted)
class RunsCode:
    """Unpickling this calls os.system: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_checkpoint(ws: Workspace) -> tuple[Path, Path]:
    """A checkpoint whose unpickling would run code (creating `marker`), written as torch.save writes."""
    directory = ws.fresh()
    marker, path = directory / "code-ran", directory / "crafted.pt"
    torch.save({"format_version": 1, "model": {}, "payload": RunsCode(marker)}, path)
    return path, marker


@case("checkpoint", "pickled code in the checkpoint", "refused to load", "only load checkpoints you trust")
def _(ws):
    path, marker = crafted_checkpoint(ws)
    message = user_error(translate.main, [f"checkpoint={path}"])
    assert not marker.exists()
    return message


@case("checkpoint", "pickled code in last.pt of a run being resumed (train.py)", "refused to load", "resuming from")
def _(ws):
    run_dir = ws.fresh() / "run"
    shutil.copytree(ws.run, run_dir)
    path, marker = crafted_checkpoint(ws)
    shutil.copyfile(path, ckpt.last_path(run_dir))
    status, log = quietly(train_main, ws.train_args({"train.max_steps": 3}, run_dir=run_dir))
    assert status == 0 and not marker.exists()
    assert ckpt.load(ckpt.last_path(run_dir))["step"] == 3  # resumed from step-2, trained update 3
    return "exit 0, warning: " + next(line for line in log.splitlines() if "refused" in line).split("WARNING | ")[1]


@case("checkpoint", "truncated file", "the file is truncated, corrupted or not written by torch.save", "use another checkpoint")
def _(ws):
    data = ws.last.read_bytes()
    return user_error(translate.main, [f"checkpoint={ws.text_file('half.pt', data[: len(data) // 2])}"])


@case("checkpoint", "empty file", "could not read checkpoint", "use another checkpoint")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.text_file('empty.pt', b'')}"])


@case("checkpoint", "text file named .pt", "could not read checkpoint", "use another checkpoint")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.text_file('notes.pt', b'hello')}"])


def wider(state: dict) -> dict:
    state["model_config"] = dict(state["model_config"], d_model=24)
    return state


@case("checkpoint", "weights of another shape than its model_config",
      "do not fit the model (embedding.weight is [400, 16] in the checkpoint but [400, 24] here", "use another checkpoint")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.damaged('wider.pt', wider)}"])


@case("checkpoint", "model_config vocabulary size differs from its vocabulary",
      "its model has 500 token embeddings but its vocabulary 400 pieces", "use another")
def _(ws):
    path = ws.damaged("v500.pt", lambda s: {**s, "model_config": dict(s["model_config"], vocab_size=500)})
    return user_error(translate.main, [f"checkpoint={path}"])


@case("checkpoint", "no model_config", "has no model_config", "use another checkpoint")
def _(ws):
    path = ws.damaged("nocfg.pt", lambda s: {k: v for k, v in s.items() if k != "model_config"})
    return user_error(translate.main, [f"checkpoint={path}"])


@case("checkpoint", "no vocabulary (spm_model)", "holds no SentencePiece model", "use a checkpoint written by this framework's train.py")
def _(ws):
    path = ws.damaged("nospm.pt", lambda s: {**s, "spm_model": torch.zeros(0, dtype=torch.uint8)})
    return user_error(translate.main, [f"checkpoint={path}"])


@case("checkpoint", "a plain state_dict (another framework's file)", "is a foreign checkpoint", "use one written by its train.py")
def _(ws):
    path = ws.fresh() / "state_dict.pt"
    torch.save(ws.state["model"], path)
    return user_error(translate.main, [f"checkpoint={path}"])


@case("checkpoint", "newer format_version", "newer than this code reads", "upgrade the framework")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.damaged('v99.pt', lambda s: {**s, 'format_version': 99})}"])


@case("checkpoint", "path does not exist", "missing.pt does not exist", "give an existing file or directory")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.fresh() / 'missing.pt'}"])


@case("checkpoint", "directory without checkpoints", "no checkpoint in", "pass a run directory that has trained, or a .pt file")
def _(ws):
    return user_error(translate.main, [f"checkpoint={ws.fresh()}"])


@case("checkpoint", "ensemble of models with different vocabularies", "has another vocabulary than", "an ensemble needs models that share one SentencePiece model")
def _(ws):
    from data.vocab import Vocab

    proto = Vocab.load(ws.other_spm).model_proto
    other = ws.damaged("other-vocab.pt", lambda s: {**s, "spm_model": ckpt.spm_tensor(proto)})
    return user_error(translate.main, [f"checkpoint=[{ws.last},{other}]"])


# Scoring (evaluate.py)
@case("evaluate", "hypothesis and reference of different lengths",
      "the translation has 2 lines but the reference has 16", "score a translation of this test set")
def _(ws):
    hyp = ws.text_file("hyp.de", b"a\nb\n")
    return user_error(evaluate.main, [f"hyp={hyp}", f"ref={ws.corpus.prefixes['valid'].with_suffix('.de')}",
                                      f"out={ws.fresh()}", f"table={ws.fresh() / 'table.md'}"])


@case("evaluate", "source and reference of different lengths", "src=", "give a source and reference of the same test set")
def _(ws):
    src = ws.text_file("src.en", b"a\nb\n")
    return user_error(evaluate.main, [f"checkpoint={ws.run}", f"src={src}",
                                      f"ref={ws.corpus.prefixes['valid'].with_suffix('.de')}"])


@case("evaluate", "unknown sacreBLEU test set", "unknown sacreBLEU test set 'wmt99'", "`sacrebleu --list` shows them")
def _(ws):
    return user_error(evaluate.main, [f"checkpoint={ws.run}", "testset=wmt99"])


@case("evaluate", "reference file missing", "ref=", "does not exist: give an existing file")
def _(ws):
    return user_error(evaluate.main, [f"hyp={ws.text_file('h.de', b'a')}", f"ref={ws.fresh() / 'missing.de'}"])


@case("evaluate", "a test set's langpair that is not the model's", "langpair=en-fr is not the model's language pair (en-de)",
      "leave langpair out, or give a checkpoint that translates en-fr")
def _(ws):
    return user_error(evaluate.main, [f"checkpoint={ws.run}", "testset=wmt14/full", "langpair=en-fr"])


def without_mecab() -> None:
    """The BLEU of Japanese needs sacreBLEU's MeCab tokenizer, which the project does not install."""
    if importlib.util.find_spec("MeCab") is not None:
        pytest.skip("MeCab is installed here: BLEU into Japanese works")


@case("evaluate", "BLEU into Japanese without its tokenizer", "BLEU into ja tokenizes with sacreBLEU's ja-mecab tokenizer",
      "pip install 'sacrebleu[ja]'")
def _(ws):
    without_mecab()
    out, valid = ws.fresh(), ws.corpus.prefixes["valid"]
    ref = ws.text_file("test.ja", valid.with_suffix(".de").read_bytes())
    with pytest.MonkeyPatch.context() as patch:  # refused before the decoding, not after it
        patch.setattr(evaluate.Translator, "translate", lambda *a, **k: pytest.fail("decoded a test set it can't score"))
        return user_error(evaluate.main, [f"checkpoint={ws.run}", f"src={valid.with_suffix('.en')}", f"ref={ref}",
                                          "lang=ja", f"out={out}"])


@case("config", "validation BLEU into Japanese without its tokenizer", "BLEU into ja tokenizes with sacreBLEU's",
      "pip install 'sacrebleu[ja]'")
def _(ws):
    without_mecab()
    src, tgt = normal_pairs(ws)
    prefix = ws.fresh() / "corpus"
    prefix.with_suffix(".en").write_bytes(src)
    prefix.with_suffix(".ja").write_bytes(tgt)
    run_dir = ws.fresh() / "run"
    message = user_error(train_main, [*data_args(ws, prefix, {"data.tgt_lang": "ja", "data.valid_prefix": prefix,
                                                              "train.valid_bleu_lines": 4}), f"run_dir={run_dir}"])
    assert not (run_dir / "checkpoints").exists()  # refused at the start, not at the first validation
    return message


# ------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def workspace(corpus, tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("bad_inputs"), corpus)


@pytest.mark.parametrize("bad", CASES, ids=str)
def test_bad_input_gets_its_one_line_message(workspace, bad):
    message = bad.run(workspace)
    assert bad.expect in message and bad.fix in message, message
    assert "\n" not in message and "Traceback" not in message


def test_at_least_30_bad_inputs_and_each_is_in_the_table():
    assert len(CASES) >= 30
    table = (ROOT / "docs" / "RELIABILITY.md").read_text(encoding="utf-8")
    missing = [c.name for c in CASES if f"| {c.name} |" not in table]
    assert not missing, f"docs/RELIABILITY.md lacks rows for {missing} (python tests/project/test_bad_inputs.py prints them)"


def command(ws: Workspace, script: str, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300, **kwargs)


def assert_one_line_exit_2(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.slow
def test_command_line_wrong_type_is_one_line_and_exit_2(workspace):
    result = command(workspace, "train.py", workspace.train_args({"train.max_steps": "abc"}))
    assert_one_line_exit_2(result, "train.max_steps=abc is invalid")


@pytest.mark.slow
def test_command_line_crafted_checkpoint_runs_nothing_and_exits_2(workspace):
    path, marker = crafted_checkpoint(workspace)
    result = command(workspace, "translate.py", [f"checkpoint={path}"], input="hello\n")
    assert_one_line_exit_2(result, "refused to load")
    assert not marker.exists()


@pytest.mark.slow
def test_command_line_mismatched_reference_is_one_line_and_exit_2(workspace):
    hyp = workspace.text_file("hyp.de", b"a\nb\n")
    result = command(workspace, "evaluate.py", [f"hyp={hyp}", f"ref={workspace.corpus.prefixes['valid']}.de",
                                                f"out={workspace.fresh()}", f"table={workspace.fresh() / 't.md'}"])
    assert_one_line_exit_2(result, "the translation has 2 lines but the reference has 16")


@pytest.mark.slow
def test_evaluate_checks_what_it_scores_against_before_it_loads_the_model(workspace):
    """A wrong source/reference pair or test-set name is the only line on stderr: found before the checkpoint
    is loaded (and logged), not after."""
    src = workspace.text_file("two-lines.en", b"a\nb\n")
    for args in ([f"src={src}", f"ref={workspace.corpus.prefixes['valid']}.de"], ["testset=wmt99"]):
        result = command(workspace, "evaluate.py", [f"checkpoint={workspace.run}", "device=cpu", *args])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]


@pytest.mark.slow
def test_file_size_limit_during_a_checkpoint_write_keeps_earlier_ones_and_exits_2(workspace):
    """A real limit (RLIMIT_FSIZE, as `ulimit -f` sets): the resumed run's first checkpoint cannot be written."""
    run_dir = workspace.fresh() / "run"
    shutil.copytree(workspace.run, run_dir)
    before = {p.name: p.read_bytes() for p in ckpt.checkpoint_dir(run_dir).glob("*.pt")}
    limit = min(len(data) for data in before.values()) // 2

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = command(workspace, "train.py", workspace.train_args({"train.max_steps": 3, "train.save_every_steps": 1},
                                                                  run_dir=run_dir), preexec_fn=limit_file_size)
    # The first write of the resumed run: best.pt (validation at the last update) or step-00000003.pt.
    assert_one_line_exit_2(result, ".pt: File too large; raise the file size limit (ulimit -f)")
    after = {p.name: p.read_bytes() for p in ckpt.checkpoint_dir(run_dir).glob("*.pt")}
    assert after == before  # byte for byte
    assert not list(ckpt.checkpoint_dir(run_dir).glob(".*.tmp"))


# ---------------------------------------------------------------------------------------------- the table


def render_table(ws: Workspace) -> str:
    """The Markdown table of docs/RELIABILITY.md: every case with the message it gets now."""
    rows = ["| # | bad input | what the user sees (`error: ...` on stderr, exit 2, unless it says exit 0) |",
            "| --- | --- | --- |"]
    for number, bad in enumerate(CASES, start=1):
        message = bad.run(ws).replace(str(ws.root), "…").replace(str(ws.corpus.directory), "…")
        message = message.replace("|", "\\|")
        rows.append(f"| {number} | {bad.name} | {message} |")
    return "\n".join(rows)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        from quickstart.corpus import write_corpus

        corpus = Corpus(Path(directory) / "corpus")
        write_corpus(corpus.directory / "corpus", train=300, valid=16, test=0, seed=1)
        assert train_main(corpus.overrides(corpus.directory / "prep", {"prepare_only": "true"}, vocab=False)) == 0
        print(render_table(Workspace(Path(directory) / "work", corpus)))
