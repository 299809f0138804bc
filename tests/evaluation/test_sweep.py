"""`evaluate.py checkpoint=<run_dir> checkpoints=all` (transformer/evaluation/sweep.py): every kept checkpoint, best.pt,
averaged.pt and every last-k average scored; each row equals a single evaluation of that model, identical
models are decoded once, and a rerun decodes nothing. The run is `tiny_run` (tests/conftest.py: numbered
checkpoints at 250, 500, ..., 1500, averaged.pt = the last two), on the first lines of its test split."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
from helpers import run_evaluate, user_error  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer.evaluation.scoring import lc_norm_tok  # noqa: E402
from transformer.evaluation.testsets import read_lines  # noqa: E402
from transformer.decoding.translation import Translator  # noqa: E402

LINES = 8  # test lines decoded per model: enough for scores that move between checkpoints, and fast


@pytest.fixture
def run(tiny_run, tmp_path) -> tuple[Path, Path, Path, list[int]]:
    """(a copy of the tiny run, source, reference, the updates of its numbered checkpoints): the source and
    reference are the first LINES lines of its test split."""
    run_dir = tmp_path / "tiny"
    shutil.copytree(tiny_run.run_dir / "checkpoints", run_dir / "checkpoints")
    src, ref = tiny_run.files("test")
    for path, name in ((src, "dev.en"), (ref, "dev.de")):
        (tmp_path / name).write_text("".join(line + "\n" for line in read_lines(path)[:LINES]), encoding="utf-8")
    steps = [step for step, _ in ckpt.list_numbered(run_dir)]
    assert len(steps) >= 3 and ckpt.best_path(run_dir).is_file() and ckpt.averaged_path(run_dir).is_file()
    return run_dir, tmp_path / "dev.en", tmp_path / "dev.de", steps


@pytest.mark.slow
def test_sweep_rows_equal_single_evaluations_and_a_rerun_decodes_nothing(run, tmp_path, capsys, monkeypatch,
                                                                        one_torch_thread):
    run_dir, src, ref, steps = run
    before = sorted(p.name for p in ckpt.checkpoint_dir(run_dir).iterdir())
    stdout = run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", "checkpoints=all"], capsys)
    out = run_dir / "eval" / "dev"
    result = json.loads((out / "checkpoints.json").read_text())
    rows = {row["label"]: row for row in result["rows"]}
    windows = [f"last {k}" for k in range(1, len(steps) + 1)]
    assert list(rows) == [f"step-{s:08d}.pt" for s in steps] + ["best.pt", "averaged.pt"] + windows
    assert [rows[w]["averaged_steps"] for w in windows] == [steps[-k:] for k in range(1, len(steps) + 1)]
    assert rows["averaged.pt"]["averaged_steps"] == steps[-2:]

    # identical models are decoded once: the newest checkpoint = its own average, averaged.pt = the last 2
    assert rows["last 1"]["digest"] == rows[f"step-{steps[-1]:08d}.pt"]["digest"]
    assert rows["averaged.pt"]["digest"] == rows["last 2"]["digest"]
    assert result["decoded"] == len({row["digest"] for row in rows.values()}) < len(rows)

    # each row is a single evaluation of that model: the files as they are, the averages as
    # `python -m transformer.checkpoint average` writes them
    for label, row in rows.items():
        if row["kind"] == "window":
            path = tmp_path / f"{label.replace(' ', '-')}.pt"
            ckpt.save(ckpt.average([ckpt.numbered_path(run_dir, s) for s in row["averaged_steps"]]), path)
        else:
            path = ckpt.checkpoint_dir(run_dir) / label
        single = tmp_path / "single" / label.replace(" ", "-")
        run_evaluate([f"checkpoint={path}", f"src={src}", f"ref={ref}", f"out={single}",
                      f"table={tmp_path / 'table.md'}"], capsys)
        scores = json.loads((single / "scores.json").read_text())["scores"]
        assert [row["bleu"], row["chrf"], row["tokbleu"]] == \
            [scores["BLEU"]["score"], scores["chrF2"]["score"], scores["tokBLEU"]["score"]], label
    assert len({row["chrf"] for row in rows.values()}) > 1  # the checkpoints do differ on these lines

    # the table, the best window, what the sweep cannot see; the plot; checkpoints/ untouched
    best = max((rows[w] for w in windows), key=lambda r: (r["bleu"], -r["window"]))
    assert result["best_window"] == best["window"]
    text = "\n".join(stdout)
    assert f"Best averaging window: the last {best['window']} " in text
    assert "train.keep_last=10" in text and f"the {len(steps)} numbered checkpoints" in text
    assert (out / "checkpoints.md").read_text(encoding="utf-8") == text + "\n"
    assert sum(line.startswith("| ") for line in stdout) == 2 + len(rows)
    from matplotlib.image import imread

    pixels = imread(out / "checkpoints.png")
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400 and pixels.std() > 0.05
    assert sorted(p.name for p in ckpt.checkpoint_dir(run_dir).iterdir()) == before

    # a rerun decodes nothing: no model is even loaded for translation
    def refuse(*args, **kwargs):
        raise AssertionError("the rerun decoded")

    monkeypatch.setattr(Translator, "translate", refuse)
    assert run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", "checkpoints=all"], capsys) == stdout[:-1] \
        + [f"Decoded 0 of {len(rows)} rows now; the others came from {run_dir / 'eval' / 'cache'} or from an "
           "identical model above."]
    rerun = json.loads((out / "checkpoints.json").read_text())
    assert rerun["decoded"] == 0 and all(row["cached"] for row in rerun["rows"])
    assert [r["bleu"] for r in rerun["rows"]] == [r["bleu"] for r in result["rows"]]


@pytest.mark.slow
def test_other_decode_settings_or_another_test_set_are_decoded_again(run, tmp_path, capsys, one_torch_thread):
    run_dir, src, ref, steps = run
    args = [f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", "checkpoints=all", f"out={tmp_path / 'out'}"]
    run_evaluate(args, capsys)
    unique = json.loads((tmp_path / "out" / "checkpoints.json").read_text())["decoded"]
    run_evaluate(args + ["decode.beam=1", "decode.lenpen=0"], capsys)
    assert json.loads((tmp_path / "out" / "checkpoints.json").read_text())["decoded"] == unique
    (tmp_path / "src3.en").write_text("".join(line + "\n" for line in read_lines(src)[:3]), encoding="utf-8")
    (tmp_path / "ref3.de").write_text("".join(line + "\n" for line in read_lines(ref)[:3]), encoding="utf-8")
    run_evaluate([f"checkpoint={run_dir}", f"src={tmp_path / 'src3.en'}", f"ref={tmp_path / 'ref3.de'}",
                  "checkpoints=all", f"out={tmp_path / 'out'}"], capsys)
    assert json.loads((tmp_path / "out" / "checkpoints.json").read_text())["decoded"] == unique


@pytest.mark.slow
def test_a_pruned_run_is_swept_over_what_it_kept(run, capsys, one_torch_thread):
    run_dir, src, ref, steps = run
    for step in steps[:-2]:
        ckpt.numbered_path(run_dir, step).unlink()
    stdout = run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", "checkpoints=all"], capsys)
    result = json.loads((run_dir / "eval" / "dev" / "checkpoints.json").read_text())
    assert [row["label"] for row in result["rows"] if row["kind"] == "window"] == ["last 1", "last 2"]
    assert f"the 2 numbered checkpoints in {ckpt.checkpoint_dir(run_dir)} (updates {steps[-2]}–{steps[-1]}" \
        in "\n".join(stdout)


@pytest.mark.parametrize("problem, words", [
    ("pt", "is not a run directory: give checkpoint=<run_dir>"),
    ("bogus", "checkpoints=some is not all"),
    ("hyp", "checkpoints=all decodes with every checkpoint of a run: drop hyp="),
    ("empty", "no numbered checkpoints"),
    ("twice", "names a run twice: an ensemble's runs must differ"),
    ("file in a list", "is not a run directory: give checkpoint=<run_dir>, or [<run_dir>,<run_dir>] for an ensemble"),
])
def test_bad_use_of_checkpoints_all_is_a_one_line_error(problem, words, tmp_path, capsys, monkeypatch):
    (tmp_path / "src.en").write_text("a\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("b\n", encoding="utf-8")
    run_dir = tmp_path / "run"
    ckpt.checkpoint_dir(run_dir).mkdir(parents=True)
    checkpoint = ckpt.last_path(run_dir)
    checkpoint.write_bytes(b"not read")
    args = [f"src={tmp_path / 'src.en'}", f"ref={tmp_path / 'ref.de'}", "checkpoints=all"]
    if problem in ("twice", "file in a list"):  # runs with a numbered checkpoint, given as an ensemble
        ckpt.numbered_path(run_dir, 100).write_bytes(b"not read")
    args += {"pt": [f"checkpoint={checkpoint}"], "bogus": [f"checkpoint={run_dir}", "checkpoints=some"],
             "hyp": [f"checkpoint={run_dir}", f"hyp={tmp_path / 'ref.de'}"],
             "twice": [f"checkpoint=[{run_dir},{run_dir}]"],
             "file in a list": [f"checkpoint=[{run_dir},{ckpt.numbered_path(run_dir, 100)}]"],
             }.get(problem, [f"checkpoint={run_dir}"])
    if problem == "empty":
        checkpoint.unlink()
    line = user_error(evaluate, args, capsys, monkeypatch)
    assert words in line, line


@pytest.fixture
def two_runs(run, tmp_path) -> tuple[Path, Path, Path, Path, Path]:
    """(the tiny run, a second run of the same vocabulary, source, reference, the reference lowercased and
    tokenised for tok_ref=). The second run is the first with every checkpoint's weights perturbed by seeded
    noise (0.3 of each tensor's spread): other models, which translate these lines differently."""
    run_a, src, ref, _ = run
    run_b = tmp_path / "tiny_b"
    shutil.copytree(run_a / "checkpoints", run_b / "checkpoints")
    generator = torch.Generator().manual_seed(7)
    for path in sorted(ckpt.checkpoint_dir(run_b).glob("*.pt")):
        state = ckpt.load(path)
        for name, tensor in state["model"].items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
                state["model"][name] = tensor + 0.3 * tensor.std() * noise
        ckpt.save(state, path)
    tok_ref = tmp_path / "dev.lc.tok.de"
    tok_ref.write_text("".join(line + "\n" for line in lc_norm_tok(read_lines(ref), "de")), encoding="utf-8")
    return run_a, run_b, src, ref, tok_ref


@pytest.mark.slow
def test_an_ensemble_of_two_runs_is_swept_by_window_and_each_row_equals_that_ensembles_evaluation(
        two_runs, tmp_path, capsys, monkeypatch, one_torch_thread):
    run_a, run_b, src, ref, tok_ref = two_runs
    # run b kept fewer checkpoints: the windows go as far as both runs can
    for _, path in ckpt.list_numbered(run_b)[:2]:
        path.unlink()
    steps_a = [step for step, _ in ckpt.list_numbered(run_a)]
    steps_b = [step for step, _ in ckpt.list_numbered(run_b)]
    assert len(steps_b) >= 3  # the rows checked below: last 1 to last 3
    ensemble = f"checkpoint=[{run_a},{run_b}]"
    args = [ensemble, f"src={src}", f"ref={ref}", f"tok_ref={tok_ref}", "checkpoints=all", f"out={tmp_path / 'out'}"]
    stdout = run_evaluate(args, capsys)
    result = json.loads((tmp_path / "out" / "checkpoints.json").read_text())
    rows = {row["label"]: row for row in result["rows"]}
    windows = [f"last {k}" for k in range(1, len(steps_b) + 1)]
    assert list(rows) == ["best.pt", "averaged.pt"] + windows  # no single numbered checkpoints
    assert [r["run"] for r in result["runs"]] == [str(run_a), str(run_b)]
    for k, window in enumerate(windows, start=1):
        assert [m["averaged_steps"] for m in rows[window]["members"]] == [steps_a[-k:], steps_b[-k:]]
        assert rows[window]["step"] is None and rows[window]["averaged_steps"] is None

    # each row is `evaluate.py 'checkpoint=[a,b]'` of those two models: files as they are, windows as
    # `python -m transformer.checkpoint average` writes them; lcBLEU scored against tok_ref
    alone = {}
    for label in ("averaged.pt", "last 1", "last 3"):
        members = []
        for run_dir, member in zip((run_a, run_b), rows[label]["members"]):
            if label == "averaged.pt":
                members.append(ckpt.averaged_path(run_dir))
                continue
            members.append(tmp_path / f"{run_dir.name}-{label.replace(' ', '-')}.pt")
            ckpt.save(ckpt.average([ckpt.numbered_path(run_dir, s) for s in member["averaged_steps"]]), members[-1])
        single = tmp_path / "single" / label.replace(" ", "-")
        run_evaluate([f"checkpoint=[{members[0]},{members[1]}]", f"src={src}", f"ref={ref}", f"tok_ref={tok_ref}",
                      f"out={single}", f"table={tmp_path / 'table.md'}"], capsys)
        scores = json.loads((single / "scores.json").read_text())["scores"]
        row = rows[label]
        assert [row["bleu"], row["chrf"], row["tokbleu"], row["lcbleu"]] == [
            scores[name]["score"] for name in ("BLEU", "chrF2", "tokBLEU", "lcBLEU")], label
        run_evaluate([f"checkpoint={members[0]}", f"src={src}", f"ref={ref}", f"out={single}-a",
                      f"table={tmp_path / 'table.md'}"], capsys)
        alone[label] = ((single / "hyp.txt").read_text(), (tmp_path / "single" / f"{label.replace(' ', '-')}-a"
                                                            / "hyp.txt").read_text())
    assert any(both != first for both, first in alone.values())  # the second model does change translations

    # lcBLEU picks the window; the table shows each run's updates
    best = max((rows[w] for w in windows), key=lambda r: (r["lcbleu"], -r["window"]))
    assert result["best_window"] == best["window"] and result["best_by"] == "lcBLEU"
    text = "\n".join(stdout)
    assert stdout[0].endswith("| tokBLEU | lcBLEU |")
    assert f"Best averaging window: the last {best['window']} checkpoint" in text and " of each run " in text
    assert f"| last 2 | {steps_a[-1]} + {steps_b[-1]} | {steps_a[-2]}–{steps_a[-1]} (2) + " \
           f"{steps_b[-2]}–{steps_b[-1]} (2) |" in text
    assert f"the {len(steps_a)} numbered checkpoints in {ckpt.checkpoint_dir(run_a)}" in text
    assert f"the {len(steps_b)} numbered checkpoints in {ckpt.checkpoint_dir(run_b)}" in text

    from matplotlib.image import imread

    pixels = imread(tmp_path / "out" / "checkpoints.png")  # the window panel alone
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400 and pixels.std() > 0.05

    # a rerun decodes nothing; by default its files go beside run a's own sweep, not over it
    monkeypatch.setattr(Translator, "translate", lambda *a, **k: pytest.fail("the rerun decoded"))
    run_evaluate(args[:-1], capsys)
    default = run_a / "eval" / "dev" / f"ensemble_{run_a.name}+{run_b.name}"
    assert json.loads((default / "checkpoints.json").read_text())["decoded"] == 0
    assert not (run_a / "eval" / "dev" / "checkpoints.json").exists()
