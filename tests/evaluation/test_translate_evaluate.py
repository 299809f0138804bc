"""translate.py and evaluate.py as a user meets them: text in, text out (docs/CONTRACT.md "Text in, text out"), the
scores and tables ("BLEU" there), which checkpoint a run directory means ("Checkpoints") and one-line
errors ("Bad input").

The model is `tiny_run` (tests/conftest.py): 2+2 layers, d_model 64, trained once per session on a
made-up pair whose target is the source's words reversed and upper-cased. The entry points run in this
process through `translate.main(argv)` / `evaluate.main(argv)`, except where the property is about the
process (what reaches stdout, the exit status and stderr of a user error). Scores are checked against
sacreBLEU's own command line and the published figures of a real system (../shared/data/systems).
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
import translate  # noqa: E402
from conftest import TINY_STEPS, TINY_SAVE_EVERY  # noqa: E402
from data.vocab import Vocab, train_vocab  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer import kernels  # noqa: E402
from transformer.decoding import translation  # noqa: E402
from transformer.cli import main_with_user_errors  # noqa: E402
from transformer.model import Transformer, TransformerConfig  # noqa: E402
from transformer.evaluation.scoring import sacrebleu_scores  # noqa: E402
from transformer.evaluation.testsets import read_lines  # noqa: E402
from helpers import (DISAGREEING_SOURCES, SMALL, output_lines, run_evaluate, run_translate, score_of,  # noqa: E402
                     tiny_model, user_error)

FAIR = "fairseq_wmt19_en_de.newstest2014.de"  # systems/SOURCES.md: BLEU 34.97, chrF2 63.75, tokBLEU 35.75
NBEST = re.compile(r"(\d+) \|\|\| (.*) \|\|\| (-?\d+\.\d+)")


# ------------------------------------------------------------------------------------------------ helpers


def bleu(hyps: list[str], refs: list[str]) -> float:
    return next(s.score for s in sacrebleu_scores(hyps, refs, lang="de") if s.name == "BLEU")


def first_lines(tiny_run, count: int) -> tuple[list[str], list[str]]:
    """The first `count` (source, reference) lines of the tiny task's test set."""
    src, ref = tiny_run.files("test")
    return read_lines(src)[:count], read_lines(ref)[:count]


def stdin_of(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def copy_run(tiny_run, destination: Path) -> Path:
    """A copy of the tiny run's checkpoints, for tests that write into (or change) a run directory."""
    shutil.copytree(tiny_run.run_dir / "checkpoints", destination / "checkpoints")
    return destination


# ------------------------------------------------------------------------------ translate: text in, text out


@pytest.mark.slow
def test_one_output_line_per_input_line_in_order_with_empty_and_blank_lines(tiny_run, capsys, monkeypatch):
    sources, references = first_lines(tiny_run, 12)
    lines = sources[:4] + [""] + sources[4:8] + [" \t  "] + sources[8:] + [""]
    out, _ = run_translate([f"checkpoint={tiny_run.run_dir}"], capsys, monkeypatch, stdin_of(lines))
    assert len(out) == len(lines)
    assert out[4] == out[9] == out[-1] == ""  # empty and whitespace-only lines give empty lines
    translations = out[:4] + out[5:9] + out[10:-1]
    assert all(translations)
    # In order: the same lines read backwards come out backwards ...
    backwards, _ = run_translate([f"checkpoint={tiny_run.run_dir}"], capsys, monkeypatch, stdin_of(lines[::-1]))
    assert backwards == out[::-1]
    # ... and each output line is the translation of its own input line (the model knows the task).
    assert sum(t == r for t, r in zip(translations, references)) >= 10


@pytest.mark.slow
def test_a_line_over_max_input_len_is_cropped_with_a_warning_naming_it(tiny_run, capsys, monkeypatch):
    sources, _ = first_lines(tiny_run, 6)
    vocab = Vocab.from_bytes(ckpt.spm_bytes(ckpt.load(ckpt.resolve(tiny_run.run_dir))))
    limit = len(vocab.encode([sources[0]])[0])
    long_line = " ".join(sources)  # its first `limit` pieces are sources[0]
    assert len(vocab.encode([long_line])[0]) > limit
    out, err = run_translate([f"checkpoint={tiny_run.run_dir}", f"decode.max_input_len={limit}"], capsys,
                             monkeypatch, stdin_of([sources[0], long_line, ""]))
    assert len(out) == 3
    assert out[1] == out[0] and out[2] == ""  # the long line was translated as its first `limit` pieces
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, err
    assert "stdin line 2 " in warnings[0] and f"cropped to decode.max_input_len={limit}" in warnings[0]


@pytest.mark.slow
def test_invalid_utf8_is_replaced_with_a_warning_naming_the_line_and_exit_status_0(tiny_run, capsys, monkeypatch):
    sources, _ = first_lines(tiny_run, 2)
    raw = (sources[0] + "\n").encode() + b"ab \xff\xfe cd\n" + (sources[1] + "\n").encode()
    monkeypatch.setattr(sys, "argv", ["translate.py", f"checkpoint={tiny_run.run_dir}", "device=cpu"])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main_with_user_errors(translate.main)()
    captured = capsys.readouterr()
    assert exit_info.value.code == 0
    out = output_lines(captured.out)
    assert len(out) == 3
    clean, _ = run_translate([f"checkpoint={tiny_run.run_dir}"], capsys, monkeypatch, stdin_of(sources))
    assert [out[0], out[2]] == clean  # the lines around it are untouched
    warnings = [line for line in captured.err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "stdin line 2 " in warnings[0] and "UTF-8" in warnings[0], captured.err


@pytest.mark.slow
def test_stdout_carries_only_translations_and_diagnostics_go_to_stderr(tiny_run, capsys, monkeypatch):
    sources, _ = first_lines(tiny_run, 8)
    raw = stdin_of(sources[:4]).encode() + b"bad \xff byte\n" + stdin_of(sources[4:]).encode()
    process = subprocess.run([sys.executable, "translate.py", f"checkpoint={tiny_run.run_dir}", "device=cpu"],
                             input=raw, capture_output=True, cwd=ROOT, timeout=300)
    stderr = process.stderr.decode("utf-8", errors="replace")
    assert process.returncode == 0, stderr
    expected, _ = run_translate([f"checkpoint={tiny_run.run_dir}"], capsys, monkeypatch, raw)
    assert output_lines(process.stdout.decode("utf-8")) == expected
    assert "loaded" in stderr and "line 5 is not valid UTF-8" in stderr  # the log and the warning: stderr


@pytest.mark.slow
def test_input_and_output_files_replace_stdin_and_stdout(tiny_run, tmp_path, capsys, monkeypatch):
    sources, _ = first_lines(tiny_run, 6)
    lines = sources[:3] + [""] + sources[3:]
    (tmp_path / "in.txt").write_text(stdin_of(lines), encoding="utf-8")
    out, _ = run_translate([f"checkpoint={tiny_run.run_dir}", f"input={tmp_path / 'in.txt'}",
                            f"output={tmp_path / 'out.txt'}"], capsys, monkeypatch)
    assert out == []
    from_stdin, _ = run_translate([f"checkpoint={tiny_run.run_dir}"], capsys, monkeypatch, stdin_of(lines))
    assert output_lines((tmp_path / "out.txt").read_text(encoding="utf-8")) == from_stdin


@pytest.mark.slow
def test_nbest_writes_k_moses_lines_per_input_line_best_first(tiny_run, capsys, monkeypatch):
    sources, _ = first_lines(tiny_run, 5)
    lines = sources[:2] + [""] + sources[2:]
    k = 3
    out, _ = run_translate([f"checkpoint={tiny_run.run_dir}", f"decode.nbest={k}"], capsys, monkeypatch,
                           stdin_of(lines))
    assert len(out) == k * len(lines)
    for index, line in enumerate(lines):
        group = [NBEST.fullmatch(entry) for entry in out[k * index : k * index + k]]
        assert all(group), out[k * index : k * index + k]
        assert [int(m.group(1)) for m in group] == [index] * k  # 0-based input line index
        scores = [float(m.group(3)) for m in group]
        assert scores == sorted(scores, reverse=True)  # best first
        texts = [m.group(2) for m in group]
        if line:
            assert len(set(texts)) == k and all(score < 0 for score in scores)
        else:
            assert texts == [""] * k


@pytest.mark.slow
def test_a_run_directory_means_averaged_pt_unless_last_pt_is_newer(tiny_run, tmp_path, capsys, monkeypatch):
    checkpoints = tiny_run.run_dir / "checkpoints"
    averaged, early = checkpoints / "averaged.pt", tiny_run.numbered(TINY_SAVE_EVERY)
    assert ckpt.load(averaged)["step"] == ckpt.load(checkpoints / "last.pt")["step"] == TINY_STEPS
    sources, _ = first_lines(tiny_run, 10)

    def translations(checkpoint: Path) -> tuple[list[str], str]:
        # Outputs at most 2 pieces longer than the source: the early model would otherwise ramble for 50.
        return run_translate([f"checkpoint={checkpoint}", "decode.max_len_b=2"], capsys, monkeypatch,
                             stdin_of(sources))

    by_averaged, _ = translations(averaged)
    by_early, _ = translations(early)
    assert by_averaged != by_early  # the two models can be told apart by their translations
    # averaged.pt's step equals last.pt's: the run directory means averaged.pt.
    out, err = translations(tiny_run.run_dir)
    assert out == by_averaged and str(averaged) in err
    # last.pt newer than averaged.pt (training went on after the average): the run directory means last.pt.
    newer = tmp_path / "run" / "checkpoints"
    newer.mkdir(parents=True)
    shutil.copyfile(averaged, newer / "averaged.pt")
    state = ckpt.load(early)
    state["step"] = TINY_STEPS + 1
    ckpt.save(state, newer / "last.pt")
    out, err = translations(tmp_path / "run")
    assert out == by_early and str(newer / "last.pt") in err


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_reduced_precision_decoding_translates_as_well_as_fp32(precision, tiny_run, capsys, monkeypatch):
    if precision == "int8" and kernels.why_no_int8():
        pytest.skip(kernels.why_no_int8())
    sources, references = first_lines(tiny_run, 40)
    fp32, _ = run_translate([f"checkpoint={tiny_run.run_dir}"], capsys, monkeypatch, stdin_of(sources))
    reduced, _ = run_translate([f"checkpoint={tiny_run.run_dir}", f"decode.precision={precision}"], capsys,
                               monkeypatch, stdin_of(sources))
    assert len(reduced) == len(sources)
    assert sum(a == b for a, b in zip(fp32, reduced)) >= 0.9 * len(sources)
    assert bleu(reduced, references) >= 90


def test_int8_decoding_where_it_cannot_run_is_a_one_line_error(tiny_run, capsys, monkeypatch):
    monkeypatch.setattr(kernels, "_INT8_ENGINES", ("armv9",))
    line = user_error(translate, [f"checkpoint={tiny_run.run_dir}", "device=cpu", "decode.precision=int8"],
                      capsys, monkeypatch)
    assert "decode.precision=int8" in line and "no int8 kernel" in line and "decode.precision=fp32" in line


# -------------------------------------------------------------------------------------------- ensembles


@pytest.mark.slow
def test_an_ensemble_of_two_checkpoints_translates(tiny_run, capsys, monkeypatch):
    sources, references = first_lines(tiny_run, 40)
    a, b = tiny_run.numbered(TINY_STEPS - TINY_SAVE_EVERY), tiny_run.numbered(TINY_STEPS)
    out, err = run_translate([f"checkpoint=[{a},{b}]"], capsys, monkeypatch, stdin_of(sources))
    assert len(out) == len(sources)
    assert str(a) in err and str(b) in err  # both models were loaded
    assert bleu(out, references) >= 90


def loaded_models(paths) -> tuple[list[Transformer], Vocab]:
    states = [ckpt.load(path) for path in paths]
    models = []
    for state in states:
        models.append(Transformer(TransformerConfig(**state["model_config"])))
        models[-1].load_state_dict(state["model"])
        models[-1].eval()
    return models, Vocab.from_bytes(ckpt.spm_bytes(states[0]))


DISAGREEING_DECODE = ["decode.beam=2", "decode.nbest=2", "decode.max_len_a=0", "decode.max_len_b=6"]


def test_translate_decodes_an_ensemble_with_every_member(disagreeing_checkpoints, capsys, monkeypatch,
                                                         one_torch_thread):
    """Beam search over the mean of both members' log-probabilities, here step by step by hand: a
    translate.py that used one member only, or summed instead of averaging, writes other n-best lists."""
    a, b = disagreeing_checkpoints
    ensemble, _ = run_translate([f"checkpoint=[{a},{b}]", *DISAGREEING_DECODE], capsys, monkeypatch,
                                stdin_of(DISAGREEING_SOURCES))
    alone = [run_translate([f"checkpoint={path}", *DISAGREEING_DECODE], capsys, monkeypatch,
                           stdin_of(DISAGREEING_SOURCES))[0] for path in (a, b)]
    assert ensemble != alone[0] and ensemble != alone[1]
    models, vocab = loaded_models([a, b])
    config = models[0].config
    expected = []
    for number, source in enumerate(vocab.encode(DISAGREEING_SOURCES)):
        src = torch.tensor([source + [config.eos_id]])
        # The pruned search of test_search.py's enumeration, on the mean of the members' log-probabilities.
        live, finished = [((), 0.0)], []
        for t in range(6 + 1):
            candidates = []
            for prefix, score in live:
                with torch.no_grad():
                    log_probs = torch.stack([torch.log_softmax(m(src, torch.tensor([[config.bos_id, *prefix]]))[0, -1]
                                                               .double(), dim=-1) for m in models]).mean(dim=0)
                allowed = [config.eos_id] if t == 6 else [i for i in range(config.vocab_size)
                                                          if i not in (config.pad_id, config.bos_id)]
                candidates += [(score + log_probs[token].item(), prefix, token) for token in allowed]
            kept = sorted(candidates, key=lambda c: -c[0])[:4]
            finished += [(prefix, score / ((5 + len(prefix) + 1) / 6) ** 0.6)
                         for score, prefix, token in kept[:2] if token == config.eos_id]
            live = [(prefix + (token,), score) for score, prefix, token in kept if token != config.eos_id][:2]
        for prefix, score in sorted(finished, key=lambda pair: -pair[1])[:2]:
            expected.append((number, vocab.decode([list(prefix)])[0], score))
    got = [NBEST.fullmatch(line).groups() for line in ensemble]
    # Untrained models write byte pieces too; translate.py keeps each translation on one line (line breaks
    # and other separators become spaces), so the texts are compared word by word.
    assert [(int(n), text.split()) for n, text, _ in got] == [(n, text.split()) for n, text, _ in expected]
    assert [float(score) for _, _, score in got] == pytest.approx([score for _, _, score in expected], abs=1e-3)


def test_evaluate_reports_the_perplexity_of_the_ensemble(disagreeing_checkpoints, tmp_path, capsys,
                                                         one_torch_thread):
    """An ensemble's perplexity is that of its members' mean log-probabilities renormalised (the geometric
    mean of their distributions): not the first member's, nor the mean of their perplexities."""
    a, b = disagreeing_checkpoints
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text(stdin_of(DISAGREEING_SOURCES), encoding="utf-8")
    ref.write_text(stdin_of(DISAGREEING_SOURCES[1:] + DISAGREEING_SOURCES[:1]), encoding="utf-8")
    run_evaluate([f"checkpoint=[{a},{b}]", f"src={src}", f"ref={ref}", f"out={tmp_path / 'out'}",
                  f"table={tmp_path / 'table.md'}", *DISAGREEING_DECODE[:1]], capsys)
    ppl = json.loads((tmp_path / "out" / "scores.json").read_text())["ppl"]
    models, vocab = loaded_models([a, b])
    config = models[0].config
    nll, count, member_nll = 0.0, 0, [0.0, 0.0]
    with torch.no_grad():
        for source, target in zip(vocab.encode(DISAGREEING_SOURCES), vocab.encode(read_lines(ref))):
            src_t = torch.tensor([source + [config.eos_id]])
            tgt_in, tgt_out = torch.tensor([[config.bos_id] + target]), torch.tensor(target + [config.eos_id])
            members = [torch.log_softmax(m(src_t, tgt_in)[0].double(), dim=-1) for m in models]
            mixed = torch.log_softmax(torch.stack(members).mean(dim=0), dim=-1)
            nll -= mixed.gather(1, tgt_out[:, None]).sum().item()
            for i, member in enumerate(members):
                member_nll[i] -= member.gather(1, tgt_out[:, None]).sum().item()
            count += len(target) + 1
    assert ppl == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert all(ppl != pytest.approx(math.exp(m / count), rel=1e-3) for m in member_nll)


@pytest.mark.slow
def test_an_ensemble_of_a_model_with_itself_is_that_model(tiny_run, capsys, monkeypatch):
    sources, _ = first_lines(tiny_run, 8)
    b = tiny_run.numbered(TINY_STEPS)
    single, _ = run_translate([f"checkpoint={b}", "decode.nbest=2"], capsys, monkeypatch, stdin_of(sources))
    doubled, _ = run_translate([f"checkpoint=[{b},{b}]", "decode.nbest=2"], capsys, monkeypatch, stdin_of(sources))
    assert doubled == single  # the same translations and the same scores


@pytest.mark.slow
def test_an_ensemble_of_models_with_different_vocabularies_is_a_one_line_error(tiny_run, tmp_path):
    state = ckpt.load(tiny_run.numbered(TINY_STEPS))
    src, ref = tiny_run.files("valid")
    other = train_vocab(read_lines(src) + read_lines(ref), None, 350)  # another vocabulary
    assert other.model_proto != ckpt.spm_bytes(state)
    state["spm_model"] = ckpt.spm_tensor(other.model_proto)
    ckpt.save(state, tmp_path / "other.pt")
    process = subprocess.run(
        [sys.executable, "translate.py", f"checkpoint=[{tiny_run.numbered(TINY_STEPS)},{tmp_path / 'other.pt'}]"],
        input=b"a sentence\n", capture_output=True, cwd=ROOT, timeout=300)
    stderr = process.stderr.decode("utf-8", errors="replace")
    assert process.returncode == 2
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    assert "vocabulary" in lines[0] and "other.pt" in lines[0]
    assert process.stdout == b""


# ------------------------------------------------------------------------------------------- bad input


def _truncated_checkpoint(path: Path) -> Path:
    model = tiny_model(vocab_size=300, **SMALL)
    whole = path.with_name("whole.pt")
    ckpt.save({"format_version": ckpt.FORMAT_VERSION, "kind": "train", "step": 1, "model": model.state_dict(),
               "model_config": {}, "spm_model": ckpt.spm_tensor(b"")}, whole)
    path.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return path


@pytest.mark.parametrize("entry", [translate, evaluate], ids=["translate", "evaluate"])
@pytest.mark.parametrize("problem, words", [
    ("missing", "does not exist"),
    ("foreign", "foreign checkpoint"),
    ("truncated", "truncated"),
])
def test_a_missing_foreign_or_truncated_checkpoint_is_a_one_line_error(entry, problem, words, tmp_path, capsys,
                                                                        monkeypatch):
    path = tmp_path / f"{problem}.pt"
    if problem == "foreign":
        torch.save({"a": 1}, path)
    elif problem == "truncated":
        _truncated_checkpoint(path)
    (tmp_path / "src.en").write_text("a\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("b\n", encoding="utf-8")
    args = [f"checkpoint={path}", "device=cpu"]
    if entry is evaluate:
        args += [f"src={tmp_path / 'src.en'}", f"ref={tmp_path / 'ref.de'}"]
    line = user_error(entry, args, capsys, monkeypatch)
    assert words in line and str(path) in line


@pytest.mark.parametrize("given", ["src", "hyp"])
def test_evaluate_refuses_a_source_or_translation_and_reference_of_different_lengths(given, tmp_path, capsys,
                                                                                     monkeypatch):
    (tmp_path / "three.txt").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("a\nb\n", encoding="utf-8")
    (tmp_path / "hyp.de").write_text("a\nb\n", encoding="utf-8")
    args = [f"ref={tmp_path / 'ref.de'}", f"hyp={tmp_path / 'hyp.de'}", f"out={tmp_path / 'out'}"]
    args += [f"src={tmp_path / 'three.txt'}"] if given == "src" else [f"hyp={tmp_path / 'three.txt'}"]
    line = user_error(evaluate, args, capsys, monkeypatch)
    assert "3" in line and "2" in line
    assert not (tmp_path / "out").exists()  # nothing written


def test_evaluate_refuses_the_filtered_wmt14_in_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "hyp.de").write_text("a\n", encoding="utf-8")
    line = user_error(evaluate, [f"hyp={tmp_path / 'hyp.de'}", "testset=wmt14", "langpair=en-de"], capsys,
                      monkeypatch)
    assert "wmt14/full" in line


# --------------------------------------------------------------------------------- evaluate: the scores


@pytest.mark.slow
def test_evaluate_prints_the_sacrebleu_cli_lines_and_the_published_figures_of_a_real_system(
        shared_data, tmp_path, capsys):
    hyp, ref = shared_data / "systems" / FAIR, shared_data / "text" / "newstest2014.en-de.de"
    table = tmp_path / "table.md"
    lines = run_evaluate([f"hyp={hyp}", f"ref={ref}", "lang=de", f"table={table}"], capsys)
    assert len(lines) == 3
    cli = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-m", "bleu", "chrf",
                          "-w", "2", "-f", "text"], capture_output=True, text=True, check=True).stdout
    assert lines[:2] == [line.strip() for line in cli.splitlines() if line.strip()]  # the CLI pads to align
    assert lines[0].startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|") and score_of(lines[0]) == 34.97
    assert lines[1].startswith("chrF2|") and score_of(lines[1]) == 63.75
    assert lines[2].startswith("tokBLEU|tok:moses-de|split:compound|") and score_of(lines[2]) in (35.75, 35.76)
    rows = [line for line in table.read_text(encoding="utf-8").splitlines() if line.startswith(f"| {FAIR} |")]
    assert len(rows) == 1
    assert rows[0].startswith(f"| {FAIR} | newstest2014.en-de | 34.97 | {score_of(lines[2]):.2f} | – | – |")


@pytest.mark.slow
def test_testset_wmt14_full_scores_the_same_3003_lines_as_the_local_files(shared_data, tmp_path, capsys,
                                                                          monkeypatch):
    assert "sacrebleu" in sys.modules  # imported before $SACREBLEU is set: the late change must still count
    monkeypatch.setenv("SACREBLEU", str(shared_data / "sacrebleu"))
    hyp = shared_data / "systems" / FAIR
    by_name = run_evaluate([f"hyp={hyp}", "testset=wmt14/full", "langpair=en-de", f"out={tmp_path / 'name'}"],
                           capsys)
    by_file = run_evaluate([f"hyp={hyp}", f"ref={shared_data / 'text' / 'newstest2014.en-de.de'}", "lang=de",
                            f"out={tmp_path / 'file'}"], capsys)
    assert by_name == by_file and score_of(by_name[0]) == 34.97
    for out in ("name", "file"):
        assert json.loads((tmp_path / out / "scores.json").read_text())["lines"] == 3003


# ------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_the_tiny_model_reaches_bleu_90_through_translate_and_evaluate(tiny_run, tmp_path, capsys, monkeypatch):
    run_dir = copy_run(tiny_run, tmp_path / "tiny")
    src, ref = tiny_run.files("test")
    references = read_lines(ref)
    # translate.py, then evaluate.py scoring its output
    hyps, _ = run_translate([f"checkpoint={run_dir}"], capsys, monkeypatch, src.read_bytes())
    (tmp_path / "hyp.de").write_text(stdin_of(hyps), encoding="utf-8")
    scored = run_evaluate([f"hyp={tmp_path / 'hyp.de'}", f"ref={ref}"], capsys)
    assert score_of(scored[0]) >= 90
    # evaluate.py decoding by itself: the same translation, its files, a Table 2 row
    lines = run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}"], capsys)
    assert lines == scored
    out = run_dir / "eval" / "test"
    assert output_lines((out / "hyp.txt").read_text(encoding="utf-8")) == hyps
    assert round(bleu(hyps, references), 2) == score_of(lines[0])
    scores = json.loads((out / "scores.json").read_text())
    assert scores["testset"] == "test" and scores["lines"] == len(references) and scores["step"] == TINY_STEPS
    assert {name: s["line"] for name, s in scores["scores"].items()} == dict(zip(["BLEU", "chrF2", "tokBLEU"], lines))
    table = (run_dir / "eval" / "table.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| tiny |")]
    # Table 2 (a test set): EN-DE columns (the checkpoint's target language), steps, no GPU-hours on a CPU,
    # and 6 · non-embedding parameters · target tokens, the tokens counted by the training checkpoint of the
    # averaged model's newest step (averaged.pt holds weights only)
    trained = ckpt.load(run_dir / "checkpoints" / "last.pt")
    m = trained["model_config"]
    flops = 6 * (sum(t.numel() for t in trained["model"].values()) - m["vocab_size"] * m["d_model"]) \
        * trained["train_tokens"]
    mantissa, exponent = f"{flops:.1e}".split("e")
    assert rows == [f"| tiny | test | {score_of(lines[0]):.2f} | {score_of(lines[2]):.2f} | – | – | {TINY_STEPS} | "
                    f"– | {mantissa} · 10^{int(exponent)} |"]


@pytest.mark.slow
def test_a_dev_set_adds_a_table3_row_with_the_model_shape_and_its_perplexity(tiny_run, tmp_path, capsys):
    run_dir = copy_run(tiny_run, tmp_path / "tiny")
    src, ref = tiny_run.files("valid")
    lines = run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", "split=dev"], capsys)
    scores = json.loads((run_dir / "eval" / "valid" / "scores.json").read_text())
    # Perplexity, computed here sentence by sentence: exp(total NLL of reference pieces + EOS / their count)
    state = ckpt.load(ckpt.resolve(run_dir))
    model = Transformer(TransformerConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    model.eval()
    vocab, config = Vocab.from_bytes(ckpt.spm_bytes(state)), model.config
    nll, count = 0.0, 0
    with torch.no_grad():
        for source, target in zip(vocab.encode(read_lines(src)), vocab.encode(read_lines(ref))):
            logits = model(torch.tensor([source + [config.eos_id]]), torch.tensor([[config.bos_id] + target]))
            nll += F.cross_entropy(logits[0], torch.tensor(target + [config.eos_id]), reduction="sum").item()
            count += len(target) + 1
    assert scores["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    m = state["model_config"]
    params = sum(t.numel() for t in model.state_dict().values())
    expected = [f"| tiny | valid | 2 | 64 | 128 | 4 | 16 | 16 | 0 | 0 | sinusoidal | {TINY_STEPS} | "
                f"{scores['ppl']:.2f} | {score_of(lines[2]):.2f} | {params / 1e6:.0f} |"]
    assert (m["encoder_layers"], m["d_model"], m["d_ff"], m["heads"]) == (2, 64, 128, 4)
    table = (run_dir / "eval" / "table.md").read_text(encoding="utf-8").split("## Table 3")
    assert [line for line in table[1].splitlines() if line.startswith("| tiny |")] == expected
    assert "| tiny |" not in table[0]  # a dev set is not a Table 2 (test) row


@pytest.mark.slow
def test_evaluate_names_the_row_of_a_loose_checkpoint_after_its_file(tiny_run, tmp_path, capsys):
    loose = tmp_path / "my-model.pt"
    shutil.copyfile(tiny_run.numbered(TINY_STEPS), loose)
    src, ref = tiny_run.files("test")
    table = tmp_path / "table.md"
    run_evaluate([f"checkpoint={loose}", f"hyp={ref}", f"ref={ref}", f"table={table}"], capsys)
    rows = [line for line in table.read_text(encoding="utf-8").splitlines() if line.startswith("| my-model |")]
    assert len(rows) == 1 and rows[0].startswith(f"| my-model | test | 100.00 | 100.00 | – | – | {TINY_STEPS} |")
    assert not (tmp_path / "eval").exists()  # no run directory: files only where out= says


# ------------------------------------------------------------------ one checkpoint, one test set: one BLEU


@pytest.mark.slow
def test_a_runs_own_evaluation_decodes_as_its_end_of_training_test(tmp_path, capsys, monkeypatch):
    """train.py's end-of-run test and evaluate.py on the same averaged.pt and test set give the same
    hypotheses and the same scores: both decode with the run's search settings (here a 3-token cap that the
    paper's |src| + 50 would not impose) from the test set's text. A decode.* key given to evaluate.py or
    translate.py still wins over the run's: the cap the search receives is the command line's. (What the
    model outputs once the cap is lifted is not asserted: it depends on what 150 updates learned, which
    differs between CPUs.)"""
    from conftest import write_reversal_corpus
    from helpers import train_main

    prefixes = write_reversal_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    assert train_main([
        f"run_dir={run_dir}", "device=cpu", "data.dataset=null", f"data.train_prefix={prefixes['train']}",
        f"data.valid_prefix={prefixes['valid']}", f"data.test_prefix={prefixes['test']}", "data.src_lang=en",
        "data.tgt_lang=de", "data.vocab_size=400", "data.max_len_ratio=null", "data.num_workers=1",
        "model.d_model=32", "model.heads=2", "model.d_ff=64", "model.encoder_layers=1", "model.decoder_layers=1",
        "train.max_tokens=1024", "train.tokens_per_update=1024", "train.warmup_steps=50", "train.max_steps=150",
        "train.save_every_steps=50", "train.save_every_minutes=0", "train.average_last=2", "train.valid_bleu_lines=0",
        "train.best_metric=loss", "train.test_at_end=true", "decode.max_len_a=0", "decode.max_len_b=3"]) == 0
    trained = (run_dir / "eval" / "test" / "hyp.txt").read_text(encoding="utf-8").splitlines()
    trained_bleu = json.loads((run_dir / "eval" / "test" / "scores.json").read_text())["BLEU"]["score"]
    assert max(len(h.split()) for h in trained) <= 3  # the run's cap reached the end-of-run test

    caps = []  # (max_len_a, max_len_b) of every batch the search is given from here on
    real_beam_search = translation.beam_search
    monkeypatch.setattr(translation, "beam_search", lambda model, src, **settings: (
        caps.append((settings["max_len_a"], settings["max_len_b"])), real_beam_search(model, src, **settings))[1])

    def caps_of(run_entry, args, **kwargs):
        caps.clear()
        result = run_entry([f"checkpoint={run_dir}", *args], capsys, **kwargs)
        assert caps, "the search was not called"
        return set(caps), result

    source, reference = prefixes["test"].with_suffix(".en"), prefixes["test"].with_suffix(".de")
    scoring = [f"src={source}", f"ref={reference}", "report=false"]
    seen, lines = caps_of(run_evaluate, [*scoring, f"out={tmp_path / 'eval'}"])
    assert seen == {(0, 3)}  # the run's own settings
    assert (tmp_path / "eval" / "hyp.txt").read_text(encoding="utf-8").splitlines() == trained
    assert score_of(lines[0]) == pytest.approx(trained_bleu, abs=1e-9)

    assert caps_of(run_evaluate, [*scoring, f"out={tmp_path / 'wider'}", "decode.max_len_b=50"])[0] == {(0, 50)}
    stdin = source.read_text(encoding="utf-8")
    assert caps_of(run_translate, ["quiet=true"], monkeypatch=monkeypatch, stdin=stdin)[0] == {(0, 3)}
    assert caps_of(run_translate, ["decode.max_len_b=50", "decode.max_len_a=1.5", "quiet=true"],
                   monkeypatch=monkeypatch, stdin=stdin)[0] == {(1.5, 50)}


def test_evaluate_adds_the_multi30k_papers_bleu_against_a_tokenized_reference(shared_data, tmp_path, capsys,
                                                                              monkeypatch):
    """tok_ref= adds an lcBLEU line (lowercased, normalised, tokenised hypotheses against the official
    lc.norm.tok file): the raw German reference as the translation scores 100 there, as it does in cased BLEU;
    a tok_ref of another length is a one-line error."""
    multi30k = shared_data / "multi30k"
    raw, tokenized = multi30k / "test_2016_flickr.de", multi30k / "tok" / "test_2016_flickr.lc.norm.tok.de"
    lines = run_evaluate([f"hyp={raw}", f"ref={raw}", f"tok_ref={tokenized}", f"out={tmp_path}"], capsys)
    assert [line.split("|", 1)[0] for line in lines] == ["BLEU", "chrF2", "tokBLEU", "lcBLEU"]
    assert lines[3].startswith("lcBLEU|case:lc|norm:moses-de|tok:moses-de|ref:tokenized|")
    assert score_of(lines[3]) == pytest.approx(100.0)
    assert json.loads((tmp_path / "scores.json").read_text())["scores"]["lcBLEU"]["score"] == pytest.approx(100.0)
    short = tmp_path / "short.tok.de"
    short.write_text("ein mann .\n", encoding="utf-8")
    error = user_error(evaluate, [f"hyp={raw}", f"ref={raw}", f"tok_ref={short}"], capsys, monkeypatch)
    assert "tok_ref=" in error and "has 1 lines but the reference has 1000" in error
