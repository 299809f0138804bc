"""tools/recipe_sweep.py and tools/multilingual_study.py, the scripts behind docs/RESULTS.md's sweep and
docs/MULTILINGUAL.md's table (not run here: they train for hours): what they read from a train.py log, and that
every step they would run composes into a valid config. tools/stress_suite.py (the whole suite, an hour or more):
one of its runs on a one-test file, as an AVX2-only CPU would run it; and how the suite's own workers share the
cores (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import conftest
from conftest import ROOT
from transformer.cli import compose_config, to_job


def tool(name: str):
    """A script of tools/ as a module (tools/ is a folder of scripts, not a package)."""
    for folder in ("tools", "benchmarks"):
        if str(ROOT / folder) not in sys.path:
            sys.path.insert(0, str(ROOT / folder))
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECIPE_SWEEP, STUDY, STRESS = tool("recipe_sweep"), tool("multilingual_study"), tool("stress_suite")


MULTILINGUAL_LOG = """\
10:00:00 | INFO | update 100 | lr 0.0003 | loss 7.1 | nll 6.9 | ppl 900.1 | gnorm 1.8 | 3000 tgt tok/s | 1950 tgt tok/update
10:01:00 | INFO | validation at update 100 | en-de | loss 4.2 | nll 3.3 | ppl 11.02
10:01:00 | INFO | validation at update 100 | en-fr | loss 2.9 | nll 1.8 | ppl 5.77
10:01:00 | INFO | validation at update 100 | loss 3.1 | nll 2.1 | ppl 8.39 (the mean of 2 pairs)
10:02:00 | INFO | update 200 | lr 0.0006 | loss 5.1 | nll 4.9 | ppl 120.0 | gnorm 0.9 | 4000 tgt tok/s | 1950 tgt tok/update
10:03:00 | INFO | validation at update 200 | en-de | loss 4.0 | nll 3.1 | ppl 10.50
10:03:00 | INFO | validation at update 200 | en-fr | loss 2.8 | nll 1.7 | ppl 5.20
10:03:00 | INFO | validation at update 200 | loss 3.0 | nll 2.0 | ppl 8.50 (the mean of 2 pairs)
10:04:00 | INFO | peak resident memory 4763 MiB (this process)
"""


def test_the_best_validation_of_a_multilingual_log_is_the_mean_over_its_pairs(tmp_path):
    """best.pt follows the mean over the pairs, so the sweep's and the study's 'best valid ppl' does too; a pair's
    own line (a lower perplexity into French) is not the run's best."""
    log = tmp_path / "multi.log"
    log.write_text(MULTILINGUAL_LOG)
    assert RECIPE_SWEEP.read_log(log) == {"updates": 200, "tok_per_s": 3500, "best_valid_ppl": 8.39,
                                                  "best_at": 100, "peak_rss_mib": 4763}


@pytest.mark.parametrize("step", sorted(STUDY.STEPS))
def test_every_step_of_the_multilingual_study_composes_and_averages_as_measured(step):
    """The command each step runs composes, and its averaged.pt is the last 5 checkpoints, as docs/MULTILINGUAL.md's
    table was measured (the bilingual presets' own window is wider now)."""
    config = compose_config(STUDY.step_overrides(step, ROOT / "runs/multilingual_study", 960, "bf16"))
    to_job(config)
    assert (config.train.keep_last, config.train.average_last, config.train.max_time) == (5, 5, 960)


@pytest.mark.parametrize("candidate", sorted(RECIPE_SWEEP.CANDIDATES))
def test_every_candidate_of_the_recipe_sweep_composes_with_the_sweeps_budget(candidate, tmp_path):
    """The command recipe_sweep.py runs for each candidate is a valid config; the budget ends it unless the
    candidate sets its own step limit (Hydra refuses a key given twice)."""
    import argparse

    args = argparse.Namespace(experiment="multi30k_en_de", extra=[], out=tmp_path, budget=7200, precision="bf16")
    overrides = RECIPE_SWEEP.train_command(candidate, RECIPE_SWEEP.CANDIDATES[candidate], args)[2:]
    job = to_job(compose_config(overrides))
    assert job.train.max_time == 7200 and not job.train.test_at_end
    own = next((o for o in RECIPE_SWEEP.CANDIDATES[candidate] if o.startswith("train.max_steps=")), None)
    assert job.train.max_steps == (int(own.split("=")[1]) if own else 10_000_000)


def test_a_stress_run_capped_to_avx2_runs_the_tests_on_avx2_kernels_and_counts_what_failed(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("import torch\n\n"
                     "def test_kernels():\n    assert torch.backends.cpu.get_cpu_capability() == 'AVX2'\n\n"
                     "def test_fails():\n    assert False\n")
    row = STRESS.run_suite(1, False, ["-n", "0", str(probe)], tmp_path / "avx2.log", isa="avx2")
    assert (row["passed"], row["failed"], row["exit"]) == (1, 1, 1), (tmp_path / "avx2.log").read_text()
    assert len(row["failures"]) == 1 and row["failures"][0].endswith("test_probe.py::test_fails")
    assert "test_fails" in (tmp_path / "avx2.log").read_text()


@pytest.mark.parametrize(("workers", "cores", "given", "threads"), [
    (2, 2, {}, "1"), (4, 16, {}, "4"), (4, 2, {}, "1"), (0, 2, {}, None), (1, 2, {}, None),
    (2, 2, {"OMP_NUM_THREADS": "2"}, "2"), (2, 2, {"MKL_NUM_THREADS": "2"}, None)])
def test_xdist_workers_share_the_cores_as_threads_unless_the_thread_variables_are_set(workers, cores, given,
                                                                                    threads, monkeypatch):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    if workers:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    conftest.share_cores_between_workers()
    assert os.environ.get("OMP_NUM_THREADS") == threads
    assert os.environ.get("MKL_NUM_THREADS") == (given.get("MKL_NUM_THREADS") if given else threads)
