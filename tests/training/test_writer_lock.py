"""One writer per directory (data/lock.py, transformer/training/run_lock.py): a second training into a busy run_dir,
a second evaluation into a busy out=, a second translation of the same share of an output= are refused at
once in one line naming the holder; the lock of a SIGKILLed run is gone with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, main_with_user_errors, subprocess_env, train_main, user_error
import evaluate  # noqa: E402
import train  # noqa: E402
import translate  # noqa: E402
from data.lock import LOCK_NAME, DirectoryInUse, releasing_locks  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer import distributed  # noqa: E402
from transformer.training import run_lock  # noqa: E402


def holder_record(directory: Path, name: str = LOCK_NAME) -> dict | None:
    try:
        return json.loads((directory / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def wait_for(condition, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process is None or process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def hold_in_another_process(directory: Path, name: str = LOCK_NAME) -> subprocess.Popen:
    """A process that holds the lock `directory/name` until it is killed."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from data.lock import hold
        hold({str(directory)!r}, name={name!r}, what="x", fix="y")
        print("held", flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=subprocess_env(), text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def start_training(corpus, run_dir: Path, changes: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *corpus.overrides(run_dir, changes)], cwd=ROOT,
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_training_into_a_busy_run_dir_refuses_at_once_and_the_first_keeps_its_checkpoints(corpus, tmp_path):
    """Two real train.py processes on one run_dir, with different settings: the second exits 2 with one line
    naming the first (PID), writing nothing; the first trains on, and every checkpoint is the first's."""
    run_dir = tmp_path / "run"
    long_run = {"train.max_steps": 100000, "train.save_every_steps": 5, "train.lr_scale": 1.0}
    first = start_training(corpus, run_dir, long_run)
    try:
        wait_for(lambda: (holder_record(run_dir) or {}).get("pid") == first.pid and ckpt.list_numbered(run_dir), 120,
                 first)
        started = time.monotonic()
        second = subprocess.run([sys.executable, str(ROOT / "train.py"),
                                 *corpus.overrides(run_dir, {**long_run, "train.lr_scale": 2.0})],
                                cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - started
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"is in use by PID {first.pid} on host" in lines[0] and "choose another run_dir" in lines[0], lines
        assert first.poll() is None, "the first run stopped"
        print(f"the second train.py was refused after {seconds:.1f} s, its interpreter's start-up included")
    finally:
        first.send_signal(signal.SIGTERM)  # saves last.pt at the end of the update, exits 0
        status, err = first.wait(timeout=120), first.communicate()[1]
    assert status == 0, err[-2000:]
    for _, path in ckpt.list_numbered(run_dir):
        assert ckpt.load(path)["config"]["train"]["lr_scale"] == 1.0, path
    assert ckpt.load(ckpt.last_path(run_dir))["config"]["train"]["lr_scale"] == 1.0


def test_the_refusal_comes_before_anything_is_read_or_written(corpus, tmp_path, capsys, monkeypatch):
    """In process: a held run_dir is refused before the run looks for a checkpoint or reads its corpus (either
    would fail this test here), and no checkpoints/ folder, vocabulary or cache appears in it. That order is
    what makes the refusal quick, on any machine; no clock is read."""
    def never(*args, **kwargs):
        raise AssertionError("a refused run read its checkpoint or its corpus")

    monkeypatch.setattr(train, "resume_or_initialise", never)
    monkeypatch.setattr(train, "prepare_data", never)
    run_dir = tmp_path / "run"
    holder = hold_in_another_process(run_dir)
    try:
        message = user_error(train, corpus.overrides(run_dir, {"data.cache_dir": run_dir / "data"}), capsys,
                             monkeypatch)
    finally:
        holder.kill()
        holder.wait()
    assert f"is in use by PID {holder.pid}" in message, message
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]


@pytest.mark.slow
def test_the_lock_of_a_sigkilled_training_is_gone_and_the_next_run_resumes(corpus, tmp_path):
    run_dir = tmp_path / "run"
    first = start_training(corpus, run_dir, {"train.max_steps": 100000, "train.save_every_steps": 3})
    wait_for(lambda: (holder_record(run_dir) or {}).get("pid") == first.pid and ckpt.list_numbered(run_dir), 120,
             first)
    first.kill()
    first.wait()
    assert (run_dir / LOCK_NAME).exists()  # the file stays; the kernel released the lock with the process
    saved = ckpt.list_numbered(run_dir)[-1][0]
    assert train_main(corpus.overrides(run_dir, {"train.max_steps": saved + 1})) == 0
    assert ckpt.load(ckpt.last_path(run_dir))["step"] == saved + 1


def test_in_process_runs_release_the_lock_when_they_return_or_raise(corpus, tmp_path, capsys, monkeypatch):
    """`releasing_locks`: a notebook or test that trains twice into one run_dir is not refused by itself, and
    another process may take the lock afterwards."""
    run_dir = tmp_path / "run"
    user_error(train, corpus.overrides(run_dir, {"train.max_steps": -1}), capsys, monkeypatch)  # fails at to_job
    assert train_main(corpus.overrides(run_dir, {"train.max_steps": 1})) == 0
    assert train_main(corpus.overrides(run_dir, {"train.max_steps": 2})) == 0
    holder = hold_in_another_process(run_dir)  # would block if this process still held it
    holder.kill()
    holder.wait()


def test_other_ranks_learn_of_rank_0s_refusal_from_the_first_collective(tmp_path, monkeypatch):
    """Under torchrun only rank 0 asks for the lock; its answer is broadcast, so rank 1 refuses too (before
    anything is written) instead of training into the directory or waiting in a collective."""
    monkeypatch.setattr(distributed, "broadcast_from_main", lambda values, device: [1.0])  # rank 0 was refused
    rank1 = distributed.DistInfo(rank=1, world_size=2, local_rank=1)
    with pytest.raises(DirectoryInUse, match="rank 1: rank 0 could not take run_dir"):
        releasing_locks(run_lock.hold_run_dir)(tmp_path / "run", rank1, torch.device("cpu"))
    assert not (tmp_path / "run").exists()
    answers = []
    monkeypatch.setattr(distributed, "broadcast_from_main", lambda values, device: answers.append(values) or values)
    holder = hold_in_another_process(tmp_path / "run")
    try:
        rank0 = distributed.DistInfo(rank=0, world_size=2, local_rank=0)
        with pytest.raises(DirectoryInUse, match=f"PID {holder.pid}"):
            releasing_locks(run_lock.hold_run_dir)(tmp_path / "run", rank0, torch.device("cpu"))
        assert answers == [[1.0]]  # rank 0 told the others before it raised
    finally:
        holder.kill()
        holder.wait()


def test_a_second_evaluation_into_a_busy_out_folder_is_refused(tmp_path, capsys, monkeypatch):
    ref = tmp_path / "ref.de"
    ref.write_text("ein Haus\n", encoding="utf-8")
    out = tmp_path / "out"
    holder = hold_in_another_process(out)
    try:
        message = user_error(evaluate, [f"hyp={ref}", f"ref={ref}", f"out={out}", "device=cpu"], capsys, monkeypatch)
    finally:
        holder.kill()
        holder.wait()
    assert f"out={out} is in use by PID {holder.pid}" in message, message
    assert not (out / "scores.json").exists()


def test_a_sweep_into_the_busy_default_folder_of_its_run_is_refused(disagreeing_checkpoints, tmp_path, capsys,
                                                                   monkeypatch):
    """evaluate.py checkpoints=all without out= writes to run_dir/eval/<set>/: held there like any out= (refused
    once the model that resolves the settings and the set's folder is loaded: its log line comes first)."""
    run_dir, ref = tmp_path / "run", tmp_path / "ref.de"
    ref.write_text("ein Haus\n", encoding="utf-8")
    state = {**ckpt.load(disagreeing_checkpoints[0]), "step": 1}  # a run of one update, sweepable but for the lock
    for path in (ckpt.numbered_path(run_dir, 1), ckpt.last_path(run_dir)):
        ckpt.save(state, path)
    out = run_dir / "eval" / "ref"
    holder = hold_in_another_process(out)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", f"checkpoint={run_dir}", f"src={ref}", f"ref={ref}",
                                      "checkpoints=all", "device=cpu"])
    try:
        with pytest.raises(SystemExit) as exit_info:
            main_with_user_errors(evaluate.main)()
    finally:
        holder.kill()
        holder.wait()
    message = capsys.readouterr().err.splitlines()[-1]
    assert exit_info.value.code == 2 and f"error: out={out} is in use by PID {holder.pid}" in message, message
    assert not (out / "checkpoints.md").exists()


def test_a_second_translation_of_the_same_share_of_an_output_is_refused(disagreeing_checkpoints, tmp_path, capsys,
                                                                       monkeypatch):
    source, output = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("the cat sees a dog\n", encoding="utf-8")
    holder = hold_in_another_process(tmp_path / "out.de.parts", ".writer-rank0.lock")
    try:
        message = user_error(translate, [f"checkpoint={disagreeing_checkpoints[0]}", "device=cpu", "quiet=true",
                                         f"input={source}", f"output={output}"], capsys, monkeypatch)
    finally:
        holder.kill()
        holder.wait()
    assert f"rank 0's share of output={output} is in use by PID {holder.pid}" in message, message
    assert not output.exists()
    monkeypatch.delenv("RANK", raising=False)
    assert translate.main([f"checkpoint={disagreeing_checkpoints[0]}", "device=cpu", "quiet=true",
                           f"input={source}", f"output={output}"]) == 0
    assert len(output.read_text(encoding="utf-8").splitlines()) == 1
    assert not os.path.exists(tmp_path / "out.de.parts")
