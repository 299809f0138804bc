"""`evaluate.py hyp=[base,new,...]`: each system scored and sacreBLEU's paired test against the first
(transformer/evaluation/significance.py), checked on the two published newstest2014 systems of ../shared/data/systems
against evaluate.py's own single-system scores and sacreBLEU's command line (`--paired-bs`, same seed)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
from helpers import output_lines, run_evaluate, score_of, user_error  # noqa: E402
from transformer.evaluation.significance import paired_significance  # noqa: E402

FAIR = "fairseq_wmt19_en_de.newstest2014.de"  # systems/SOURCES.md: BLEU 34.97, chrF2 63.75
OPUS = "opus-mt_eng-deu.newstest2014.de"  # 29.03 (published as 29.0), chrF2 59.71
SAMPLES = 200  # resamples in these tests: the smallest p-value is 1/(SAMPLES + 1) ≈ 0.005, below 0.01

# sacreBLEU's LaTeX table cell: "29.0274 (29.0774 ± 0.7352) (p = 0.0050)*"
CLI_CELL = re.compile(r"(\d+\.\d+) \((\d+\.\d+) ± (\d+\.\d+)\)(?: \(p = (\d+\.\d+)\))?")


def table_rows(lines: list[str]) -> list[list[str]]:
    """The body rows of the Markdown table evaluate.py prints, as lists of cells."""
    rows = [line for line in lines if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


@pytest.fixture(scope="module")
def published(shared_data, tmp_path_factory):
    """The paired test of FAIR (baseline) against OPUS-MT through evaluate.py: (stdout lines, significance.json,
    the files)."""
    systems, ref = shared_data / "systems", shared_data / "text" / "newstest2014.en-de.de"
    out = tmp_path_factory.mktemp("significance")
    capture = _Capture()
    with capture:
        assert evaluate.main(["device=cpu", f"hyp=[{systems / FAIR},{systems / OPUS}]", f"ref={ref}",
                              f"paired_samples={SAMPLES}", f"out={out}"]) == 0
    return output_lines(capture.out), json.loads((out / "significance.json").read_text()), \
        (systems / FAIR, systems / OPUS, ref, out)


class _Capture:
    """stdout of a module-scoped run (capsys is per test)."""

    def __enter__(self):
        import io

        self._stdout, self._buffer = sys.stdout, io.StringIO()
        root = logging.getLogger()
        self._handlers, self._level = root.handlers[:], root.level
        sys.stdout = self._buffer
        return self

    def __exit__(self, *exc):
        sys.stdout = self._stdout
        root = logging.getLogger()
        root.handlers[:] = self._handlers
        root.setLevel(self._level)
        self.out = self._buffer.getvalue()


@pytest.mark.slow
def test_fair_wmt19_differs_from_opus_mt_with_p_below_001_at_evaluates_own_scores(published, capsys):
    lines, result, (fair, opus, ref, out) = published
    rows = table_rows(lines)
    assert [row[0] for row in rows] == [f"baseline: {fair}", str(opus)]
    assert result["test"] == "bs" and result["samples"] == SAMPLES
    assert result["systems"][0]["bleu"]["p_value"] is None
    for metric in ("bleu", "chrf"):
        assert result["systems"][1][metric]["p_value"] < 0.01
    assert rows[1][3].endswith("*") and float(rows[1][3].rstrip("*")) < 0.01
    # the scores are evaluate.py's own single-system scores of each file, to the last digit
    for number, hyp in enumerate((fair, opus)):
        single = run_evaluate([f"hyp={hyp}", f"ref={ref}", "lang=de"], capsys)
        system = result["systems"][number]
        assert system["lines"] == single
        assert f"{system['bleu']['score']:.2f}" == rows[number][1] == f"{score_of(single[0]):.2f}"
        assert f"{system['chrf']['score']:.2f}" == rows[number][4] == f"{score_of(single[1]):.2f}"
        assert f"{system['tokbleu']:.2f}" == rows[number][7] == f"{score_of(single[2]):.2f}"
    assert [rows[0][1], rows[1][1]] == ["34.97", "29.03"]  # systems/SOURCES.md: 35.0 and 29.0 published
    assert (out / "significance.md").read_text(encoding="utf-8").endswith("".join(line + "\n" for line in lines))


@pytest.mark.slow
def test_means_intervals_and_p_values_equal_sacrebleus_paired_bs_command_line(published):
    _, result, (fair, opus, ref, _) = published
    cli = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref), "-i", str(fair), str(opus), "-m", "bleu",
                          "chrf", "--paired-bs", "--paired-bs-n", str(SAMPLES), "-w", "4", "-f", "latex",
                          "--no-color"], capture_output=True, text=True, check=True).stdout
    rows = [line for line in cli.splitlines() if CLI_CELL.search(line)]
    assert len(rows) == 2, cli
    for system, row in zip(result["systems"], rows):
        cells = CLI_CELL.findall(row)
        assert len(cells) == 2, row
        for metric, (score, mean, ci, p) in zip(("bleu", "chrf"), cells):
            ours = system[metric]
            assert [f"{ours[k]:.4f}" for k in ("score", "mean", "ci")] == [score, mean, ci], (metric, row)
            assert (ours["p_value"] is None and p == "") or f"{ours['p_value']:.4f}" == p


def write_systems(directory: Path) -> tuple[Path, Path, Path]:
    """A 6-line reference and two small systems: (ref, base, new)."""
    ref = ["the cat sat on the mat", "a dog ran in the park", "we like green tea", "it rains today",
           "the house is red", "she reads a book"]
    base = ["the cat sat on a mat", "a dog ran in a park", "we like tea", "it rains", "the house red", "she reads"]
    new = ["the cat sat on the mat", "a dog ran in the park", "we like green tea", "it rains today",
           "the house is red", "she reads a book"]
    paths = []
    for name, lines in (("ref.en", ref), ("base.en", base), ("new.en", new)):
        (directory / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        paths.append(directory / name)
    return tuple(paths)


def test_the_default_number_of_resamples_is_sacrebleus_1000(tmp_path, capsys):
    ref, base, new = write_systems(tmp_path)
    lines = run_evaluate([f"hyp=[{base},{new}]", f"ref={ref}"], capsys)
    signatures = [line for line in lines if line.startswith("- ")]
    assert len(signatures) == 2 and all("|bs:1000|seed:12345|" in line for line in signatures), signatures
    assert "1000 resamples" in "\n".join(lines)


def test_approximate_randomization_reports_p_values_and_intervals(tmp_path):
    ref, base, new = write_systems(tmp_path)
    lines = [p.read_text(encoding="utf-8").splitlines() for p in (ref, base, new)]
    result = paired_significance([("base", lines[1]), ("new", lines[2])], lines[0], lang="en", test="ar",
                                 samples=100)
    assert result.samples == 100 and "ar:100" in result.signatures["BLEU"]
    new_bleu = result.systems[1].bleu
    assert new_bleu.score == pytest.approx(100.0) and 0 < new_bleu.p_value <= 1 and new_bleu.ci >= 0


def test_one_hyp_in_a_list_is_the_single_system_evaluation(tmp_path, capsys):
    ref, base, _ = write_systems(tmp_path)
    assert run_evaluate([f"hyp=[{base}]", f"ref={ref}"], capsys) == run_evaluate([f"hyp={base}", f"ref={ref}"],
                                                                                   capsys)


@pytest.mark.parametrize("problem, words", [
    ("missing", "nope.en does not exist"),
    ("short", "has 2 lines but the reference has 6"),
    ("twice", "given twice"),
    ("checkpoint", "drop checkpoint="),
    ("test", "paired_test=xx is not one of bs, ar"),
    ("empty", "hyp=[] names no translation"),
])
def test_a_bad_system_list_is_a_one_line_error(problem, words, tmp_path, capsys, monkeypatch):
    ref, base, new = write_systems(tmp_path)
    short = tmp_path / "short.en"
    short.write_text("a\nb\n", encoding="utf-8")
    systems = {"missing": f"[{base},{tmp_path / 'nope.en'}]", "short": f"[{base},{short}]",
               "twice": f"[{base},{base}]", "checkpoint": f"[{base},{new}]", "test": f"[{base},{new}]",
               "empty": "[]"}[problem]
    args = [f"hyp={systems}", f"ref={ref}", f"out={tmp_path / 'out'}"]
    args += {"checkpoint": [f"checkpoint={tmp_path}"], "test": ["paired_test=xx"]}.get(problem, [])
    line = user_error(evaluate, args, capsys, monkeypatch)
    assert words in line, line
    if problem in ("missing", "short"):
        assert str(tmp_path / ("nope.en" if problem == "missing" else "short.en")) in line
    assert not (tmp_path / "out").exists()
