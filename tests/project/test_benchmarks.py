"""The benchmark scripts run: benchmarks/gpu_check.py --smoke takes every step of the GPU check on the CPU
with a tiny model, so the script is ready the day a GPU is lent; benchmarks/decode_real.py --smoke decodes a
few real lines with the session's tiny trained model in every engine (decode_batch.py --smoke sweeps our
decoding batch on them), and benchmarks/translate_corpus.py --smoke
translates a few lines as a file in ours and CTranslate2 (the figures mean nothing here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_step(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
                                 "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tests"]["ok"] and "skipped" in report["tests"]["summary"]  # no CUDA here: collected, skipped
    training = report["training"]  # train.py's own update (train_step on build_run's Run), every row named
    assert [(row["setup"], row["compile"]) for row in training["rows"]] == [
        ("paper max_tokens", False), ("GPU-sized", False), ("GPU-sized", True)]
    assert training["rows"][0]["passes"] > 1  # the planner's passes
    for row in training["rows"]:
        assert 0 < row["tgt_tokens_per_s"] < row["src_tgt_tokens_per_s"] and row["mfu_measured"] > 0
        assert row["mfu_datasheet"] is None and row["peak_gib"] is None and row["first_update_s"] > 0  # CPU: n/a
    assert training["loss"]["bf16"] > 0 and training["loss"]["fp32"] > 0 and training["loss"]["within_1_percent"]
    engines = [row["engine"] for row in report["decoding"]]
    assert engines[:2] == ["ours fp32", "ours bf16"] and engines[2] in ("CTranslate2 fp32", "CTranslate2")
    assert all(row["tokens_per_s"] for row in report["decoding"]) or "not importable" in report["decoding"][-1]["note"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("## GPU check")
    for words in ("| GPU-sized | 1,200 × 1 | on |", "tgt tokens/s", "src+tgt tokens/s", "MFU (datasheet)",
                  "MFU (measured peak)", "peak memory", "first update", "bf16 against fp32", "CTranslate2"):
        assert words in markdown
    assert not (ROOT / "docs" / "BENCHMARKS.md").read_text().count("python benchmarks/gpu_check.py --smoke")


def test_gpu_check_cut_by_its_time_cap_keeps_the_steps_it_finished(tmp_path, monkeypatch):
    """run.sh caps the check with SIGINT: the steps done are in gpu_check.json and .md, the interrupted one says
    so, the later ones are not run, and the exit status is a failure."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "benchmarks" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, check)  # its dataclasses look their module up
    spec.loader.exec_module(check)

    row = {"setup": "paper max_tokens", "compile": False, "precision": "bf16", "max_tokens": 4096, "passes": 7,
           "tgt_tokens_per_update": 24000.0, "ms_per_update": 812.5, "tgt_tokens_per_s": 29538.0,
           "src_tgt_tokens_per_s": 58000.0, "mfu_datasheet": 0.31, "mfu_measured": 0.4, "peak_gib": 21.0,
           "first_update_s": 3.2}

    def capped(device, smoke, workdir, progress):  # the cap comes during the second row: the first one stays
        progress({"rows": [row], "matmul_peak_tflops": 700.0, "datasheet": None, "loss": None, "vocab": 37000,
                  "tokens_per_update": 25000})
        raise KeyboardInterrupt

    def never(*args):
        raise AssertionError("a step after the interrupted one ran")

    monkeypatch.setattr(check, "check_tests", lambda smoke: {"command": "-m cuda tests", "summary": "3 passed",
                                                             "ok": True})
    monkeypatch.setattr(check, "check_training", capped)
    monkeypatch.setattr(check, "check_decoding", never)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--smoke", "--out", str(tmp_path)])
    assert check.main() == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tests"] == {"command": "-m cuda tests", "summary": "3 passed", "ok": True}
    assert "interrupted" in report["training"]["error"] and "not run" in report["decoding"]["error"]
    assert report["training"]["rows"] == [row] and not report["training"]["ok"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "3 passed" in markdown and "| 812.5 | 29,538 |" in markdown and "bf16 against fp32: not measured" in markdown


@pytest.mark.slow
@pytest.mark.extras("transformers", "ctranslate2")  # the peers it measures
def test_decode_real_smoke_reports_every_engine_and_parity(tiny_run, tmp_path):
    """The tiny model's test lines through ours, generate and CTranslate2: a row per engine, and greedy
    output that is the same string as ours in generate and CTranslate2 float32 (issue #16's parity)."""
    source, reference = tiny_run.files("test")
    markdown = tmp_path / "BENCHMARKS.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_real.py"), "--smoke", "--run-dir",
                             str(tiny_run.run_dir), "--src", str(source), "--ref", str(reference), "--write",
                             str(markdown), "--heading", "## Decoding real text on this CPU"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
                                 "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = markdown.read_text(encoding="utf-8").split("## Decoding real text on this CPU\n", 1)[1]
    assert "**Smoke run** (10 lines" in section and "--heading '## Decoding real text on this CPU'" in section
    ours = ["ours fp32", "ours fp32, rows kept", "ours fp32, patience", "ours int8", "ours fp32, patience 1"]
    engines = ours + ["Marian generate fp32", "CTranslate2 float32", "CTranslate2 int8",
                      "CTranslate2 float32, patience 1"]
    for engine in engines:  # sentences/s, pieces/s, median seconds, their spread, BLEU
        assert re.search(rf"^\| 1 \| {engine} \| [\d,.]+ \| [\d,]+ \| [\d.]+ \| [\d.]+–[\d.]+ \| [\d.]+ \|", section,
                         re.M), engine
    for engine in ours:  # what its pass computed: steps, computed, open and useful row-steps, their ratio
        assert re.search(rf"^\| 1 \| {engine} \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d.]+ \| \d+ \|", section,
                         re.M), engine
    parity = {row[0]: row[1:] for row in re.findall(r"^\| ([^|]+?) \| (\d+) / 10 \(.*?\) \| (\d+) / 10 ", section,
                                                   re.M)}
    assert list(parity) == engines[1:]  # greedy and beam-4 counts of every other engine
    assert parity["Marian generate fp32"][0] == parity["CTranslate2 float32"][0] == "10"
    assert parity["CTranslate2 float32, patience 1"][0] == "10"  # against ours with the same rule
    assert parity["ours fp32, rows kept"] == ("10", "10")


@pytest.mark.slow
def test_decode_real_profile_prints_where_one_engines_time_goes(tiny_run, tmp_path):
    """--profile runs one of our engines under torch.profiler and prints its ops and what the pass computed,
    without the peers (the tool for a missed goal)."""
    source, reference = tiny_run.files("test")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_real.py"), "--run-dir",
                             str(tiny_run.run_dir), "--src", str(source), "--ref", str(reference), "--lines", "5",
                             "--threads", "1", "--profile", "ours int8", "--rows", "5"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "=== ours int8, 5 lines of" in result.stdout and "Self CPU time total" in result.stdout
    assert re.search(r"decoder steps \d+, computed row-steps [\d,]+, useful [\d,]+", result.stdout)


@pytest.mark.slow
def test_decode_batch_smoke_sweeps_the_batch_the_compaction_share_and_the_encoder_group(tiny_run, tmp_path):
    """benchmarks/decode_batch.py times the default decoding batch and the others in turns, with what each pass
    computed and how many lines equal the default's; a batch's size does not change the translations here
    (the 20 lines are one batch: groups of 4 sources are encoded apart, the whole batch as one)."""
    source, reference = tiny_run.files("test")
    markdown = tmp_path / "BENCHMARKS.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_batch.py"), "--smoke", "--run-dir",
                             str(tiny_run.run_dir), "--src", str(source), "--ref", str(reference), "--max-tokens", "60",
                             "--shares", "1.5", "--groups", "4", "0", "--write", str(markdown)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = markdown.read_text(encoding="utf-8").split("## Decoding batch\n", 1)[1]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| (\d+|whole batch) \| [\d.]+ \| [\d.]+ \| [\d.]+–[\d.]+ \| "
                      r"([\d,]+) \| ([\d,]+) \| [\d.]+ \| [\d.]+ \| (\d+) / 20 \|$", section, re.M)
    assert [row[:3] for row in rows] == [("8000", "0.25", "32"), ("60", "0.25", "32"), ("8000", "1.5", "32"),
                                         ("8000", "0.25", "4"), ("8000", "0.25", "whole batch")]
    rows = [(row[0], row[1], *row[3:]) for row in rows]
    default, small, kept = rows[:3]
    assert int(small[2].replace(",", "")) > int(default[2].replace(",", ""))  # more batches, more decoder steps
    assert int(kept[3].replace(",", "")) > int(default[3].replace(",", ""))  # no compaction: more row-steps
    assert all(row[4] == "20" for row in rows)


@pytest.mark.slow
@pytest.mark.extras("ctranslate2")  # the peer it measures
def test_translate_corpus_smoke_times_both_searches_in_both_engines(tiny_run, tmp_path):
    """benchmarks/translate_corpus.py runs translate.py's file path and CTranslate2's translate_file on a few
    lines, beam and sampling, and writes a row per engine and search."""
    source, _ = tiny_run.files("test")
    markdown = tmp_path / "BENCHMARKS.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "translate_corpus.py"), "--smoke", "--run-dir",
                             str(tiny_run.run_dir), "--input", str(source), "--lines", "8", "--write", str(markdown)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
                                 "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = markdown.read_text(encoding="utf-8").split("## Translating a monolingual corpus\n", 1)[1]
    assert "**Smoke run**" in section and "the first 8 lines" in section
    for search in ("beam 4", "sampling"):
        for engine in ("ours", "CTranslate2 float32"):
            assert re.search(rf"^\| {search} \| {engine} \| [\d,.]+ \| [\d.]+ \| [\d.]+–[\d.]+ \| [\d.]+× \|", section,
                             re.M), (search, engine)


@pytest.mark.parametrize("script,args", [("decode.py", []), ("decode_batch.py", ["--run-dir", "r", "--src", "s",
                                                                                  "--ref", "t"])])
def test_a_heading_that_is_not_a_section_is_refused_in_one_line(script, args):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--heading", "Decoding"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and "give a Markdown section heading, '## ...'" in result.stderr.splitlines()[-1]


@pytest.mark.slow
def test_loss_memory_smoke_measures_both_losses_in_both_precisions(tmp_path):
    """benchmarks/loss_memory.py with a tiny model: a row per loss and precision, "before" read from git."""
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", "42eec8b^{commit}"], cwd=ROOT,
                      capture_output=True).returncode != 0:
        pytest.skip("the checkout lacks the revision of the old loss (a shallow clone)")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_memory.py"), "--smoke", "--tokens", "256",
                             "--write", str(tmp_path / "BENCHMARKS.md")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = (tmp_path / "BENCHMARKS.md").read_text(encoding="utf-8").split("## Loss memory\n", 1)[1]
    for precision in ("fp32", "bf16"):
        for loss in ("before (42eec8b)", "after (chunked)", "after − before"):
            assert re.search(rf"^\| {precision} \| {re.escape(loss)} \|", section, re.M), (precision, loss)


@pytest.mark.slow
def test_attention_mask_smoke_counts_unpadded_batches_and_times_the_encoder(shared_data, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_mask.py"), "--smoke", "--write",
                             str(tmp_path / "BENCHMARKS.md")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = (tmp_path / "BENCHMARKS.md").read_text(encoding="utf-8").split("## Attention masks\n", 1)[1]
    today = re.search(r"^\| Multi30k EN-DE train \| 2,000 \| .* \| today .* \| [\d.]+% \| [\d.]+% \|$", section, re.M)
    finer = re.search(r"^\| Multi30k EN-DE train \| 2,000 \| .* \| one source length .* \| 100\.0% \| 100\.0% \| 0\.0% "
                      r"\| [\d.]+% \|$", section, re.M)
    assert today and finer, section
    assert re.search(r"^\| training: forward \+ backward \| [\d,]+ ms \| [\d,]+ ms \| [\d.]+× \|$", section, re.M)


def test_distill_smoke_rows_teacher_and_students_with_speed_ratio_and_quality(tiny_run, tmp_path):
    """benchmarks/distill.py: a row per model (an ensemble of the tiny run twice as teacher, the tiny run as
    student) with its parameters (the ensemble's: both members'), its search, sentences/s, the ratio to the
    teacher at the same thread count (1.00× for the teacher) and BLEU."""
    source, reference = tiny_run.files("test")
    markdown = tmp_path / "DISTILLATION.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distill.py"), "--smoke", "--teacher",
                             str(tiny_run.run_dir), str(tiny_run.run_dir), "--student", str(tiny_run.run_dir),
                             "--student-beam", "1", "4", "--src", str(source), "--ref", str(reference), "--tok-ref", "",
                             "--lines", "10",
                             "--threads", "1", "--write", str(markdown)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
                                 "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = markdown.read_text(encoding="utf-8")
    assert "## Teacher and students: quality and decoding speed" in section and "(10 lines)" in section
    rows = re.findall(r"^\| (teacher|student) \| `[^`]+`(?: \+ `[^`]+`)* \| ([\d.]+)M \| ([^|]+) \| fp32 \| 1 \| "
                      r"([\d.]+) \| ([\d.]+)× \| ([\d.]+) \| - \|$", section, re.M)
    assert [row[0] for row in rows] == ["teacher", "student", "student"] and rows[0][4] == "1.00", section
    assert f"`{tiny_run.run_dir}` + `{tiny_run.run_dir}`" in section, section  # the teacher: one ensemble row
    assert float(rows[0][1]) == pytest.approx(2 * float(rows[1][1]), abs=0.15), rows
    # --student-beam 1 4: the tiny run's own search is beam 4, so one more row, greedy
    assert [row[2].strip() for row in rows] == ["beam 4, α 0.6", "beam 4, α 0.6", "greedy"], rows


def test_step_profile_smoke_splits_an_update_into_its_phases_and_operator_kinds(tiny_run, tmp_path):
    """benchmarks/step_profile.py on the tiny run's own batches: the five phases of an update, their shares
    summing to the whole, and the profiler's time by kind of operator, matmuls among them."""
    markdown = tmp_path / "BENCHMARKS.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--run-dir",
                             str(tiny_run.run_dir), "--updates", "2", "--warmup", "1", "--write", str(markdown)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = markdown.read_text(encoding="utf-8").split("## Where a Multi30k training update's time goes\n", 1)[1]
    phases = re.findall(r"^\| ([A-Za-z ,_]+) \| ([\d.]+) \| ([\d.]+) % \|$", section, re.M)
    assert [p[0] for p in phases] == ["encoder", "decoder and output projection", "loss", "backward",
                                      "clip, Adam, zero_grad"], section
    assert sum(float(p[2]) for p in phases) == pytest.approx(100, abs=0.3)
    kinds = dict(re.findall(r"^\| ([^|`]+?) \| ([\d.]+) % \|$", section, re.M))
    assert float(kinds["matmul (linear maps, attention products)"]) > 0, kinds
    assert sum(float(v) for v in kinds.values()) == pytest.approx(100, abs=0.5), kinds


@pytest.mark.slow
def test_compile_step_smoke_times_eager_and_compiled(tmp_path):
    """benchmarks/compile_step.py --smoke: a row with both engines' step times, the speed-up, the compiling first
    pass and its graph count, and no recompilation after it (compile_for_batches' promise). In bf16 only, the
    precision training takes where the hardware has it: each precision is a whole inductor compile (about a
    minute on a 2-core EPYC), and the benchmark's loop over precisions is the same code for both."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_step.py"), "--smoke",
                             "--precision", "bf16", "--write", str(tmp_path / "BENCHMARKS.md")],
                            cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    section = (tmp_path / "BENCHMARKS.md").read_text(encoding="utf-8").split("## torch.compile on CPU\n", 1)[1]
    rows = re.findall(r"^\| tiny \| (fp32|bf16) \| [\d,]+ ms \| [\d,]+ ms \| [\d.]+× \| \d+ s, (\d+) graphs? \| (\d+) \|$",
                      section, re.M)
    assert [row[0] for row in rows] == ["bf16"], section
    assert all(int(graphs) >= 1 and recompiled == "0" for _, graphs, recompiled in rows), rows


@pytest.mark.extras("ctranslate2")
def test_distill_ctranslate2_rows_translate_as_our_greedy_search(tiny_run, tmp_path, one_torch_thread,
                                                                  monkeypatch):
    """benchmarks/distill.py --ctranslate2: the student exported to CTranslate2 int8 in a folder of the run and
    timed there; its greedy translations are ours, but for what int8 changes (most lines the same: on
    2026-12-07 on an AMD EPYC with AVX-512, 40 of 40 lines, and 39 of 40 with oneDNN, which runs CTranslate2's int8
    products, capped to AVX2 or SSE4.1 by ONEDNN_MAX_CPU_ISA, i.e. without VNNI, as on an AVX2-only EPYC)."""
    import importlib.util

    from transformer.decoding.translation import Translator

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as running the script does: its _common beside it
    spec = importlib.util.spec_from_file_location("distill_benchmark", ROOT / "benchmarks" / "distill.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    source, _ = tiny_run.files("test")
    lines = source.read_text(encoding="utf-8").splitlines()[:40]
    greedy = Translator.load(tiny_run.run_dir, "cpu").with_decode(beam=1, lenpen=0.0)
    hypotheses, speed = benchmark.ctranslate2_timed(greedy, lines, tmp_path / "ct2", threads=2)
    assert (tmp_path / "ct2" / "model.bin").is_file() and speed > 0
    same = sum(a == b for a, b in zip(hypotheses, greedy.translate(lines)))
    assert len(hypotheses) == 40 and same >= 30, same
