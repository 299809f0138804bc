"""The Python API (`from transformer import Translator`, docs/CONTRACT.md "Python API") and interactive
translation (`translate.py interactive=true`), each checked against translate.py's own batch output, so both
are shown to decode exactly as the command line does. The model is `tiny_run` (tests/conftest.py).
"""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import translate  # noqa: E402
from transformer import Translation, Translator  # noqa: E402
from transformer.config import DecodeConfig  # noqa: E402
from transformer import kernels  # noqa: E402
from transformer.decoding import translation  # noqa: E402
from data.lines import arriving_lines  # noqa: E402
from helpers import subprocess_env, tiny_run_sources, translate_py  # noqa: E402

NBEST = re.compile(r"(\d+) \|\|\| (.*) \|\|\| (-?\d+\.\d+)")
ANSWER_TIMEOUT = 120  # seconds to wait for one interactive answer on a loaded 2-core machine: a hang fails


# --------------------------------------------------------------------------------------- the Python API


@pytest.mark.slow
def test_translator_translates_as_translate_py_does(tiny_run, capsys, monkeypatch, one_torch_thread):
    lines = tiny_run_sources(tiny_run, 12)
    translator = Translator.load(tiny_run.run_dir, device="cpu", beam=4)
    assert translator.translate(lines) == translate_py([f"checkpoint={tiny_run.run_dir}"], lines, capsys,
                                                       monkeypatch)

    greedy = translator.with_decode(beam=1, lenpen=0.0)
    assert greedy.model is translator.model and greedy.decode == DecodeConfig(beam=1, lenpen=0.0)
    assert translator.decode == DecodeConfig(beam=4)
    assert greedy.translate(lines) == translate_py([f"checkpoint={tiny_run.run_dir}", "decode=greedy"], lines,
                                                   capsys, monkeypatch)

    nbest = translator.translate_nbest(lines[:4], nbest=3)
    moses = translate_py([f"checkpoint={tiny_run.run_dir}", "decode.nbest=3"], lines[:4], capsys, monkeypatch)
    assert [len(row) for row in nbest] == [3] * 4 and all(isinstance(h, Translation) for h in nbest[0])
    assert all(row[0].score >= row[1].score >= row[2].score for row in nbest)  # best first
    assert [f"{i} ||| {h.text} ||| {h.score:.6f}" for i, row in enumerate(nbest) for h in row] == moses
    assert [row[0].text for row in nbest] == translator.translate(lines[:4])


@pytest.mark.slow
def test_a_bf16_translator_copies_its_weights_once_not_per_call(tiny_run, capsys, monkeypatch, one_torch_thread):
    """Interactive mode translates line by line: a bfloat16 copy per call would cost a model copy per line."""
    lines = tiny_run_sources(tiny_run, 6)
    translator = Translator.load(tiny_run.run_dir, device="cpu", precision="bf16")
    copies, bfloat16_copy = [], translation.bfloat16_copy

    def counted(model):
        result = bfloat16_copy(model)
        if result is not model:
            copies.append(result)
        return result

    monkeypatch.setattr(translation, "bfloat16_copy", counted)
    first = [translator.translate([line])[0] for line in lines]
    translator.with_decode(beam=2).translate(lines[:1])  # a copy with other settings shares the bf16 weights
    assert len(copies) == 1
    one_line_batches = ["decode.precision=bf16", "decode.max_tokens=1"]  # the same shapes, the same rounding
    assert first == translate_py([f"checkpoint={tiny_run.run_dir}", *one_line_batches], lines, capsys, monkeypatch)


def test_an_int8_translator_quantises_its_weights_once_not_per_call(tiny_run, capsys, monkeypatch,
                                                                     one_torch_thread):
    """The same for int8: quantising per call would quantise the whole model for every line of interactive mode
    (kernels.WeightCache; oneDNN's packed float32 weights are kept the same way, tests/core/test_kernels.py)."""
    if kernels.why_no_int8():
        pytest.skip(kernels.why_no_int8())
    lines = tiny_run_sources(tiny_run, 4)
    translator = Translator.load(tiny_run.run_dir, device="cpu", precision="int8")
    quantised, quantize_per_channel = [], torch.quantize_per_channel

    def counted(*args, **kwargs):
        quantised.append(args[0].shape)
        return quantize_per_channel(*args, **kwargs)

    monkeypatch.setattr(torch, "quantize_per_channel", counted)
    first = [translator.translate([lines[0]])[0]]
    per_model = len(quantised)
    first += [translator.translate([line])[0] for line in lines[1:]]
    translator.with_decode(beam=2).translate(lines[:1])  # a copy with other settings shares the int8 weights
    assert per_model > 0 and len(quantised) == per_model
    one_line_batches = ["decode.precision=int8", "decode.max_tokens=1"]
    assert first == translate_py([f"checkpoint={tiny_run.run_dir}", *one_line_batches], lines, capsys, monkeypatch)


def test_translator_refuses_unknown_settings_and_a_bare_string_in_one_line(tmp_path):
    with pytest.raises(TypeError, match=r"unknown search setting\(s\) bem: .*beam"):
        Translator.load(tmp_path / "not-even-loaded", device="cpu", bem=2)
    translator = Translator(model=None, vocab=None, decode=DecodeConfig(), src_lang=None, tgt_lang=None,
                            device=None, checkpoints=[])
    with pytest.raises(TypeError, match=r"translate\(\[text\]\)"):
        translator.translate("A sentence.")


@pytest.mark.slow
def test_importing_the_model_does_not_import_the_translator():
    """`from transformer import Translator` is lazy: transformer.model stays a light, self-contained import."""
    code = ("import sys, transformer.model\n"
            "assert 'transformer.decoding.translation' not in sys.modules and 'hydra' not in sys.modules\n"
            "from transformer import Translator, Translation\n"
            "assert Translator.__module__ == 'transformer.decoding.translation'\n"
            "import transformer\n"
            "try:\n    transformer.Nothing\nexcept AttributeError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=subprocess_env(buffered=True, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "has no attribute 'Nothing'" in result.stdout


# -------------------------------------------------------------------------------------- interactive mode


def next_within(batches, seconds: float = 10.0):
    """next(batches) in a thread: a generator that waits for more input than a line fails, not hangs."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(next(batches)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"no batch within {seconds} s although a whole line was waiting"
    return result[0]


def test_arriving_lines_groups_what_is_waiting_and_never_waits_for_more():
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb", buffering=0) as stream:
        batches = arriving_lines(stream, max_lines=2)
        os.write(write_fd, b"one\n")
        assert next_within(batches) == [b"one"]  # alone: answered while the pipe stays open
        os.write(write_fd, b"two\nthree\r\nfour\nfi")
        assert next_within(batches) == [b"two", b"three\r"]  # a burst: in batches of max_lines
        assert next_within(batches) == [b"four"]
        os.write(write_fd, b"ve\n\n")
        assert next_within(batches) == [b"five", b""]
        os.write(write_fd, b"no newline at the end")
        os.close(write_fd)
        assert next_within(batches) == [b"no newline at the end"]
        assert list(batches) == []


@pytest.mark.slow
def test_interactive_answers_each_line_before_the_next_is_written(tiny_run, capsys, monkeypatch):
    """A process behind a pipe: each line is answered (and flushed) while stdin stays open."""
    lines = tiny_run_sources(tiny_run, 4)
    expected = translate_py([f"checkpoint={tiny_run.run_dir}"], lines, capsys, monkeypatch)
    process = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), f"checkpoint={tiny_run.run_dir}",
                                "device=cpu", "interactive=true"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=tiny_run.run_dir.parent, env=subprocess_env(buffered=True))
    try:
        answers = []
        for line in lines:
            process.stdin.write(line.encode("utf-8") + b"\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], ANSWER_TIMEOUT)
            assert ready, f"no translation of {line!r} within {ANSWER_TIMEOUT} s"
            answers.append(process.stdout.readline().decode("utf-8").rstrip("\n"))
        process.stdin.close()
        assert process.wait(timeout=ANSWER_TIMEOUT) == 0, process.stderr.read().decode()
    finally:
        process.kill()
    assert answers == expected
    assert process.stdout.read() == b""


@pytest.mark.slow
def test_interactive_batches_number_nbest_lines_as_batch_mode_does(tiny_run, capsys, monkeypatch):
    lines = tiny_run_sources(tiny_run, 4)
    lines[2:2] = ["", "bad \udcff utf-8"]  # an empty line gives an empty translation; bad bytes are replaced
    args = [f"checkpoint={tiny_run.run_dir}", "decode.nbest=2"]
    raw = [line.encode("utf-8", errors="surrogateescape") for line in lines]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n".join(raw) + b"\n"), encoding="utf-8"))
    capsys.readouterr()
    assert translate.main(["device=cpu", "quiet=true", *args]) == 0
    batch = capsys.readouterr().out.splitlines()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n".join(raw) + b"\n"), encoding="utf-8"))
    assert translate.main(["device=cpu", *args, "interactive=true", "interactive_batch=4"]) == 0
    captured = capsys.readouterr()
    # Lines, numbers and translations equal; the scores to rounding only: the interactive batches group other
    # sentences, and a float32 matmul may sum in another order for another batch shape (MKL's sgemm does).
    interactive = [NBEST.fullmatch(line) for line in captured.out.splitlines()]
    expected = [NBEST.fullmatch(line) for line in batch]
    assert [m.group(1, 2) for m in interactive] == [m.group(1, 2) for m in expected]
    assert [float(m.group(3)) for m in interactive] == pytest.approx([float(m.group(3)) for m in expected], abs=1e-5)
    assert [int(m.group(1)) for m in expected] == [i for i in range(6) for _ in range(2)]
    assert "stdin line 4 is not valid UTF-8" in captured.err
