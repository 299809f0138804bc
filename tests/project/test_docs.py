"""Every command in README.md and docs/*.md is checked: the fenced commands are extracted and each one is
run (translate.py, evaluate.py: on a tiny model standing in for `runs/quickstart`), composed into its
resolved config (train.py, torchrun, and evaluate.py on models and test sets that exist only after hours of
training: what `--cfg job` would print, with the schema's checks), or skipped for a reason listed in SKIPPED.
A command that fits none of these fails the test, so a new command in the docs needs a decision here.

The README's Quickstart is checked as a newcomer runs it, in a fresh venv built from the README's own lines
(`test_the_readme_quickstart_works_in_a_fresh_venv`, under CI=true: installing takes minutes).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from helpers import subprocess_env, train_main  # noqa: E402
from transformer.cli import compose_config, to_job  # noqa: E402

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("python ", "torchrun ", "pip ", "tensorboard ", "echo ", "export ")

# Commands not run, each with the reason (matched against the start of the command after variables are
# expanded). Every one of them is still composed where it is a train.py / evaluate.py command.
SKIPPED = {
    "pip install torch==2.13.0 -e . && python train.py experiment=quickstart":
        "the Quickstart: .ci/run runs it as written in a fresh venv; tests/data_layer/test_pipeline_e2e.py trains the "
        "quickstart",
    "python -m pytest": "the test suite itself",
    "tensorboard --logdir": "starts a server; test_documented_commands_run_on_a_tiny_model checks that the "
                            "directory holds TensorBoard's event files",
    "export OMP_NUM_THREADS": "an environment setting",
    "python tools/crash_soak.py": "20 SIGKILLed training runs (tests/training/test_reliability.py runs the soak's pieces)",
    "pip install torch==2.13.0": "an install from the network; test_the_readme_quickstart_works_in_a_fresh_venv "
                                 "runs the Quickstart's install line",
    "python -m transformer.checkpoint average": "needs trained checkpoints; tests/core/test_checkpoint.py runs the "
                                                "averaging command line (checkpoint.main)",
    "python benchmarks/": "a benchmark (minutes to hours, some need a GPU): its figures are in docs/BENCHMARKS.md; "
                          "tests/project/test_benchmarks.py runs gpu_check's steps",
    "python -m transformer.evaluation.scoring lc-norm-tok": "reads the Multi30k validation set; "
                                                           "tests/evaluation/test_scoring.py runs the command on the "
                                                           "raw test reference and compares it with the official file",
    "python -m transformer.evaluation.table3": "needs a sweep of trained runs; tests/evaluation/test_table3.py runs the command on run "
                                    "directories it writes",
    "python tools/wheelhouse.py": "downloads from a package index (minutes); tests/project/test_wheelhouse.py checks "
                                  "its refusals offline, tools/gpu_node/rehearse.sh runs it and the offline install",
    "python tests/project/test_bad_inputs.py": "prints the bad-input table; pytest runs the same cases",
    "python tools/recipe_sweep.py": "trains each candidate for its wall-clock budget (2 hours in docs/RESULTS.md); "
                                    "the suite does not run it; the options it sweeps are tested in tests/core and tests/data_layer",
    "python tools/multilingual_study.py": "trains seven models for their wall-clock budgets (~2.5 h on one thread "
                                          "in docs/MULTILINGUAL.md); tests/training/test_multilingual.py runs a tiny "
                                          "multilingual model end to end and pins the Czech preset the study runs",
    "python tools/stress_suite.py": "runs the whole suite several times under load (an hour or more); running it "
                                    "inside the suite would be the suite within itself",
    "python tools/table3_small.py": "trains a sweep of Table 3 rows on Multi30k (~1.5 h on one thread); "
                                    "tests/evaluation/test_table3.py composes every row's scaled overrides",
    "torchrun --nnodes 2": "a fragment of docs/RELIABILITY.md's two-node commands, which are composed in full",
    "python -m transformer.hf ": "needs an OPUS-MT model or the run it names; tests/interop/test_hf.py runs import and "
                                 "export on random MarianMTModels and on the tiny trained model",
    "pip install -e '.[hf]'": "an install into this environment (CI installs the test extra, which holds it)",
    "pip install -e '.[test]'": "an install into this environment; .ci/run installs it and runs the tests that "
                                "need it",
    "pip install .": "an install into this environment; tests/project/test_console_scripts.py installs a wheel elsewhere and runs the "
                     "console scripts from another directory",
}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # continuation lines joined, comments removed, $VARIABLES of the same block expanded


def fenced_commands(path: Path) -> list[Command]:
    """The commands of every fenced block of `path`: lines starting with a program in PROGRAMS, joined over
    `\\` continuations, a trailing `&` dropped; `NAME="..."` lines are shell variables, expanded in the block's
    later commands."""
    commands, variables, block = [], {}, None
    lines = path.read_text(encoding="utf-8").splitlines()
    logical, first = "", 0
    for number, raw in enumerate(lines, start=1):
        if raw.startswith("```"):
            block = None if block is not None else raw[3:].strip()
            variables = {}
            continue
        if block is None or block == "python":
            continue
        if not logical:
            first = number
        logical += raw.rstrip("\\").rstrip() + " " if raw.rstrip().endswith("\\") else raw
        if raw.rstrip().endswith("\\"):
            continue
        text, logical = logical.strip(), ""
        assignment = re.fullmatch(r'([A-Z0-9_]+)="(.*)"(\s+#.*)?', text)
        if assignment:
            variables[assignment[1]] = re.sub(r"\s+", " ", assignment[2])
            continue
        text = re.sub(r"\s+#.*$", "", text) if not text.startswith("#") else ""
        text = re.sub(r"\s+&$", "", text)  # a job in the background (two runs side by side) is the same command
        for name, value in variables.items():
            text = text.replace(f"${name}", value)
        if text.startswith(PROGRAMS):
            commands.append(Command(doc=path.relative_to(ROOT).as_posix(), line=first, text=" ".join(text.split())))
    return commands


def inline_commands(path: Path) -> list[Command]:
    """The commands quoted inline in the prose and tables of `path` (`python train.py ...`), fenced blocks
    left out."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m[0].count("\n"), path.read_text(encoding="utf-8"), flags=re.S)
    return [Command(doc=path.relative_to(ROOT).as_posix(), line=text.count("\n", 0, m.start()) + 1,
                    text=" ".join(m[1].split()))
            for m in re.finditer(r"`((?:python|torchrun|pip|tensorboard) [^`]*)`", text)]


ALL = [c for doc in DOCS for c in (*fenced_commands(doc), *inline_commands(doc))]


def skip_reason(command: Command) -> str | None:
    return next((why for start, why in SKIPPED.items() if command.text.startswith(start)), None)


def entry_point(command: Command) -> tuple[str, list[str]] | None:
    """(train | translate | evaluate, its key=value overrides) for a command that runs one of them."""
    words = shlex.split(command.text.split("|")[-1])
    script = next((w for w in words if w in ("train.py", "translate.py", "evaluate.py")), None)
    if script is None:
        return None
    args = words[words.index(script) + 1:]
    overrides = []
    for i, arg in enumerate(args):
        if i and args[i - 1] in ("--cfg", "-c", "--package", "-p"):  # the flag's value: `--cfg job`
            continue
        if arg in ("<", ">") or (overrides and overrides[-1] in ("<", ">")):
            overrides.append(arg)
            continue
        if arg == "..." or arg.startswith("-"):  # `...`: "the rest as above"; Hydra's flags change no key
            continue
        overrides.append(arg.split(",")[0] if "," in arg and "[" not in arg else arg)  # a sweep's first value
    keys = [o for i, o in enumerate(overrides) if o not in ("<", ">") and (i == 0 or overrides[i - 1] not in ("<", ">"))]
    return script.removesuffix(".py"), keys


def test_every_documented_command_is_run_composed_or_skipped_for_a_reason():
    assert len(ALL) >= 20, [c.text for c in ALL]  # the extraction finds the docs' commands
    unclassified = [f"{c.doc}:{c.line}: {c.text}" for c in ALL if skip_reason(c) is None and entry_point(c) is None]
    assert not unclassified, "run, compose or add to SKIPPED with a reason:\n" + "\n".join(unclassified)


@pytest.mark.parametrize("command", [c for c in ALL if entry_point(c) is not None],
                         ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_command_composes_into_a_valid_config(command):
    """What `--cfg job` checks, and the schema's range checks: every key exists, every value fits."""
    script, overrides = entry_point(command)
    cfg = compose_config(overrides, config_name="config" if script == "train" else script)
    to_job(cfg, "config" if script == "train" else script)


# ------------------------------------------------------------------------------- run on a tiny model


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A directory where `runs/quickstart` is a one-update, d_model=16 run on a small sample of the
    quickstart's generated corpus (its files where the quickstart writes them), as the README's commands
    expect."""
    from quickstart.corpus import write_corpus

    work = tmp_path_factory.mktemp("docs")
    run_dir = work / "runs" / "quickstart"
    write_corpus(run_dir / "corpus", train=300, valid=8, test=8, seed=1)
    overrides = ["experiment=quickstart", f"run_dir={run_dir}", "data.generate=null", "data.vocab_size=400",
                 "device=cpu", "model.d_model=16", "model.heads=2", "model.d_ff=32", "model.encoder_layers=1",
                 "model.decoder_layers=1", "train.max_steps=1", "train.average_last=1", "train.valid_bleu_lines=8"]
    assert train_main(overrides) == 0
    return work


def first_of_each(commands: list[Command]) -> list[Command]:
    """Each command text once, where it first appears (the quickstart's evaluate.py line is in several docs)."""
    first: dict[str, Command] = {}
    for command in commands:
        first.setdefault(command.text, command)
    return list(first.values())


RUN_ON_TINY = first_of_each([c for c in ALL if "runs/quickstart" in c.text and skip_reason(c) is None
                             and entry_point(c) is not None and entry_point(c)[0] != "train"])


@pytest.mark.slow
@pytest.mark.parametrize("command", RUN_ON_TINY, ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_commands_run_on_a_tiny_model(command, workspace):
    shell = command.text
    for script in ("translate.py", "evaluate.py"):
        shell = shell.replace(f"python {script}", f"{shlex.quote(sys.executable)} {ROOT / script}")
    result = subprocess.run(shell, shell=True, cwd=workspace, env={**subprocess_env(), "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    if "nbest=4" in shell:
        lines = (workspace / "nbest.txt").read_text(encoding="utf-8").splitlines()
        assert len(lines) == 4 * 8 and all(line.count(" ||| ") == 2 for line in lines)
    elif "output=" in shell:
        assert len((workspace / "hyp.de").read_text(encoding="utf-8").splitlines()) == 8
    elif "checkpoints=all" in shell:  # the sweep's table, and its files beside the set's scores
        assert "averaged.pt" in result.stdout and (workspace / "runs/quickstart/eval/valid/checkpoints.md").is_file()
    elif "evaluate.py" in shell:
        assert result.stdout.startswith("BLEU|") and (workspace / "runs/quickstart/eval/test/scores.json").is_file()
    else:
        assert len(result.stdout.splitlines()) == 1
    assert list((workspace / "runs/quickstart/tensorboard").glob("events.out.tfevents.*"))  # what tensorboard reads


def test_readme_runs_the_translate_examples_on_the_quickstart_model():
    assert len(RUN_ON_TINY) >= 4, [c.text for c in RUN_ON_TINY]
    texts = " ".join(c.text for c in RUN_ON_TINY)
    assert "echo " in texts and "input=" in texts and "decode.nbest=" in texts and "evaluate.py" in texts


# ---------------------------------------------------------------------------------- what docs say


def paragraphs(path: Path) -> list[str]:
    return re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))


def test_no_doc_points_outside_the_repository_except_to_the_test_data():
    outside = [f"{doc.relative_to(ROOT)}: {p.strip()[:120]}" for doc in DOCS for p in paragraphs(doc)
               if "../" in p and "test data" not in p]
    assert not outside, "\n".join(outside)


def test_list_overrides_in_commands_are_quoted_for_zsh():
    unquoted = [f"{c.doc}:{c.line}: {w}" for c in ALL for w in c.text.split()
                if re.match(r"[\w.]+=\[", w)]  # zsh globs an unquoted [..] and stops with "no matches found"
    assert not unquoted, "\n".join(unquoted)
    assert "'train.freeze=[encoder]'" in (ROOT / "README.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------ the newcomer's Quickstart


def quickstart_commands() -> list[str]:
    """The shell lines of the README's `## Quickstart` fenced block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    return [line for line in block.splitlines() if line.strip()]


def test_the_quickstart_is_two_commands_and_its_test_runner_is_installed_by_the_first():
    install, tests = quickstart_commands()
    assert install.startswith("pip install ") and " -e ." in install and tests.startswith("python -m pytest")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert any(re.match(r"pytest\b", dep) for dep in project["dependencies"]), (
        "the second Quickstart command needs pytest from the first one's install")


@pytest.mark.slow
def test_the_readme_quickstart_works_in_a_fresh_venv(tmp_path):
    """As a newcomer: a fresh venv (no system packages), the README's install line as written, its training
    command with a one-update override (the quickstart itself trains in tests/data_layer/test_pipeline_e2e.py), and its
    test command on one cheap file. Minutes of installing: runs with TRANSFORMER_TEST_FRESH_VENV=1. CI does
    more, outside the suite: .ci/run runs both commands as written, the whole suite in the fresh venv."""
    if os.environ.get("TRANSFORMER_TEST_FRESH_VENV") != "1":
        pytest.skip("installs every dependency into a fresh venv (minutes): runs with TRANSFORMER_TEST_FRESH_VENV=1 "
                    "(.ci/run runs the README's commands in a fresh venv itself)")
    install_and_train, test = quickstart_commands()
    install, train_command = (part.strip() for part in install_and_train.split("&&"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    env = {k: v for k, v in subprocess_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(env_dir))

    def sh(command: str, timeout: int) -> None:
        result = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"{command}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"

    sh(install, 1200)
    tiny = (f"run_dir={tmp_path / 'quickstart'} model.d_model=16 model.heads=2 model.d_ff=32 train.max_steps=1 "
            "train.average_last=1 train.test_at_end=false train.valid_bleu_lines=0 train.best_metric=loss")
    sh(f"{train_command} {tiny}", 600)
    assert test.endswith(" tests")  # the whole suite: here one cheap file of it, with the venv's pytest
    sh(f"{test.removesuffix(' tests')} tests/core/test_config.py -x -p no:cacheprovider", 600)
