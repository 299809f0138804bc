"""What keeps the ranks of a multi-rank run in step: the update plan at any world size, stop decisions every
rank takes at the same update, and a start every rank agrees on.

The torchrun tests use gloo ranks on this CPU (one thread each) and the tiny runs of test_train.py. A rank
that leaves the loop alone would wait forever in its next collective: TRANSFORMER_DIST_TIMEOUT_S turns that
hang into a failure within seconds, and every launch has a timeout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import test_train
from test_train import ROOT, run, subprocess_env
from data.batching import BatchStream
from data.vocab import Vocab
from transformer import checkpoint as ckpt
from transformer.checkpoint import TrainState
from transformer.config import TrainJob
from transformer.schedule import make_optimizer
from transformer.training import MIN_TOKENS, plan_update, start_fingerprint

corpus = test_train.corpus  # test_train.py's module-scoped fixture, registered in this module as well

# train.py, reporting on exit the update at which each rank's loop made its last stop decision.
REPORTING_TRAIN = textwrap.dedent("""
    import atexit, os, sys
    sys.path.insert(0, {root!r})
    import train
    from transformer.cli import main_with_user_errors

    seen = {{}}
    real_stop_reason = train.stop_reason

    def stop_reason(run):
        reason = real_stop_reason(run)
        seen.update(update=run.state.step, reason=reason)
        return reason

    train.stop_reason = stop_reason
    atexit.register(lambda: print(f"rank {{os.environ['RANK']}} ended at update {{seen.get('update')}}: "
                                  f"{{seen.get('reason')}}", flush=True))
    sys.argv[0] = os.path.join({root!r}, "train.py")
    main_with_user_errors(train.main)()
""")


def torchrun(tmp_path: Path, overrides: list[str], *, nproc: int = 2, timeout: float = 300) -> tuple[int, str]:
    """(exit status, output) of train.py under torchrun with `nproc` gloo ranks, hangs cut at 20 s."""
    script = tmp_path / "reporting_train.py"
    script.write_text(REPORTING_TRAIN.format(root=str(ROOT)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(script), *overrides]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**subprocess_env(), "TRANSFORMER_DIST_TIMEOUT_S": "20"})
    return result.returncode, result.stdout + result.stderr


def final_updates(output: str) -> dict[int, int]:
    return {int(rank): int(update) for rank, update in re.findall(r"rank (\d+) ended at update (\d+)", output)}


# ---------------------------------------------------------------------------------------- the update plan


@pytest.mark.parametrize("world_size", range(1, 129))
def test_update_plan_keeps_the_update_size_at_any_world_size(world_size):
    plan, warning = plan_update(tokens_per_update=25000, world_size=world_size, max_tokens=4096)

    assert plan.world_size == world_size
    assert MIN_TOKENS <= plan.max_tokens <= 4096
    assert plan.update_freq == max(1, -(-25000 // (world_size * 4096)))  # the fewest passes within max_tokens
    if world_size <= 64:
        assert abs(plan.tokens - 25000) <= 0.1 * 25000 and warning is None
    # Beyond 25000 / MIN_TOKENS ranks the floor holds and the update grows: said once, with the way out.
    assert (warning is not None) == (plan.tokens > 1.1 * 25000)
    if warning:
        assert plan.max_tokens == MIN_TOKENS and f"update of {plan.tokens} tokens" in warning
        assert "train.lr_scale" in warning and f"train.tokens_per_update={plan.tokens}" in warning


def test_update_plan_of_a_resumed_run_keeps_its_batches():
    saved = TrainState(world_size=8, update_freq=1, max_tokens=3125)
    same, warning = plan_update(tokens_per_update=25000, world_size=8, max_tokens=4096, saved=saved)
    assert (same.update_freq, same.max_tokens, warning) == (1, 3125, None)
    # On 4 ranks: the same budget per pass (the saved data position stays valid), twice the passes.
    half, warning = plan_update(tokens_per_update=25000, world_size=4, max_tokens=4096, saved=saved)
    assert (half.update_freq, half.max_tokens, half.tokens, warning) == (2, 3125, 25000, None)
    # On 3 ranks the update cannot stay the same size: said.
    odd, warning = plan_update(tokens_per_update=25000, world_size=3, max_tokens=4096, saved=saved)
    assert odd.max_tokens == 3125 and "8×1 → 3×3" in warning
    # A checkpoint written before the budget was recorded (max_tokens 0): the configured budget, as then.
    old, _ = plan_update(tokens_per_update=25000, world_size=1, max_tokens=4096,
                         saved=TrainState(world_size=1, update_freq=6))
    assert (old.update_freq, old.max_tokens) == (6, 4096)


def test_update_plan_with_update_freq_given_uses_max_tokens_as_it_is():
    plan, warning = plan_update(tokens_per_update=25000, world_size=8, max_tokens=4096, update_freq=2)
    assert (plan.update_freq, plan.max_tokens, plan.tokens, warning) == (2, 4096, 65536, None)


@pytest.mark.slow
def test_eight_ranks_log_the_effective_update_and_equal_one_process(corpus, tmp_path):
    changes = {"train.update_freq": "null", "train.tokens_per_update": 2048, "train.max_tokens": 512,
               "train.max_steps": 2, "train.log_every_steps": 1}
    status, output = torchrun(tmp_path, corpus.overrides(tmp_path / "eight", changes), nproc=8, timeout=400)
    assert status == 0, output[-4000:]
    assert "update: 8 rank(s) × update_freq 1 × max_tokens 256 = 2048 tokens" in output
    assert set(final_updates(output).values()) == {2} and len(final_updates(output)) == 8
    # One process making the same update of 8 passes of 256 tokens (update_freq given, max_tokens as given).
    one = run(corpus, tmp_path / "one", {**changes, "train.update_freq": 8, "train.max_tokens": 256})
    eight = ckpt.load(ckpt.last_path(tmp_path / "eight"))
    assert eight["data_state"] == one["data_state"] and eight["step"] == one["step"] == 2
    worst = max((eight["model"][name] - one["model"][name]).abs().max().item() for name in one["model"])
    assert worst <= 1e-6


# ---------------------------------------------------------------------------------- decisions every rank takes


@pytest.mark.slow
def test_patience_on_bleu_stops_every_rank_at_the_same_update(corpus, tmp_path):
    """Only rank 0 computes BLEU; the others must still stop when its patience runs out."""
    status, output = torchrun(tmp_path, corpus.overrides(tmp_path / "run", {
        "train.max_steps": 40, "train.valid_every_steps": 1, "train.best_metric": "bleu",
        "train.valid_bleu_lines": 4, "train.patience": 1}))

    assert status == 0, output[-4000:]
    ends = final_updates(output)
    assert len(ends) == 2 and len(set(ends.values())) == 1, output[-4000:]
    assert "(patience)" in output and ends[0] < 40


@pytest.mark.slow
def test_max_time_stops_every_rank_at_the_same_update(corpus, tmp_path):
    """The other ranks' clocks run on while rank 0 alone computes BLEU: rank 0's clock decides for all."""
    status, output = torchrun(tmp_path, corpus.overrides(tmp_path / "run", {
        "train.max_steps": 100000, "train.max_time": 3, "train.valid_every_steps": 1,
        "train.best_metric": "bleu", "train.valid_bleu_lines": 16}))

    assert status == 0, output[-4000:]
    ends = final_updates(output)
    assert len(ends) == 2 and len(set(ends.values())) == 1, output[-4000:]
    assert "max_time=3" in output


# ------------------------------------------------------------------------------------------ an agreed start


@pytest.mark.slow
def test_ranks_that_start_from_different_checkpoints_stop_with_one_line(corpus, tmp_path):
    """Rank 0's run_dir holds a checkpoint of update 2, rank 1's is empty (a node without the shared
    filesystem): both must stop at once, naming rank 1, instead of training on from different states."""
    run(corpus, tmp_path / "rank0", {"train.max_steps": 2})
    run_dir = str(tmp_path / "rank") + "${oc.env:RANK}"
    status, output = torchrun(tmp_path, corpus.overrides(run_dir, {"train.max_steps": 4}), timeout=120)

    assert status != 0
    message = [line for line in output.splitlines() if "did not start from the same state" in line]
    assert message, output[-4000:]
    assert "rank 1: update, batch, weights, optimizer state differ from rank 0" in message[0]
    assert "same run_dir" in message[0] and "update 2" in message[0]
    # torchrun prints its own traceback of ChildFailedError; no rank prints one through our code.
    assert f'File "{ROOT}' not in output and f'File "{tmp_path}' not in output, output[-4000:]
    assert not ckpt.list_numbered(tmp_path / "rank1") and ckpt.load(ckpt.last_path(tmp_path / "rank0"))["step"] == 2


def test_start_fingerprint_sees_every_part_of_the_state(corpus, tmp_path):
    """The fingerprint changes when any one of the parts the ranks must share changes."""
    model = torch.nn.Linear(3, 2)
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    stream = BatchStream([3] * 40, [3] * 40, max_tokens=12, seed=1)
    vocab, job = Vocab.load(corpus.spm_model), TrainJob()

    def fingerprint(state=TrainState(), stream=stream, job=job):
        return start_fingerprint(job, model, optimizer, scaler, state, stream, vocab)

    base = fingerprint()
    assert fingerprint() == base  # a function of the state
    assert fingerprint(TrainState(step=1))["update"] != base["update"]
    assert fingerprint(TrainState(max_tokens=12))["update plan"] != base["update plan"]
    assert fingerprint(job=TrainJob(seed=2))["seed"] != base["seed"]
    other = BatchStream([3] * 40, [3] * 40, max_tokens=24, seed=1)  # other batches, the same position
    assert fingerprint(stream=other)["batches per epoch"] != base["batches per epoch"]
    with torch.no_grad():
        model.weight[0, 0] += 1e-6
    moved = fingerprint()
    assert moved["weights"] != base["weights"] and moved["optimizer state"] == base["optimizer state"]
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    stepped = fingerprint()
    assert stepped["optimizer state"] != moved["optimizer state"]
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    scaler.update(1024.0)
    assert fingerprint()["loss scale"] != stepped["loss scale"]
    stream.next_update()
    assert fingerprint()["batch"] != base["batch"]


def test_start_fingerprint_tells_swapped_tensors_apart(corpus):
    pair = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
    args = (make_optimizer(pair.parameters()), torch.amp.GradScaler("cpu", enabled=False), TrainState(),
            BatchStream([3] * 4, [3] * 4, max_tokens=12, seed=1), Vocab.load(corpus.spm_model))
    before = start_fingerprint(TrainJob(), pair, *args)["weights"]
    with torch.no_grad():
        first = pair[0].weight.clone()
        pair[0].weight.copy_(pair[1].weight)
        pair[1].weight.copy_(first)
    assert start_fingerprint(TrainJob(), pair, *args)["weights"] != before


# ------------------------------------------------------------------------------ resuming on another world size


@pytest.mark.slow
def test_a_two_rank_run_resumed_in_one_process_continues_from_the_same_position(corpus, tmp_path):
    """2 ranks × 1 pass for 2 updates, then 1 process: it takes 2 passes per update (the same update),
    continues from the saved data position and ends where an uninterrupted 2-rank run ends."""
    changes = {"train.max_steps": 4, "train.save_every_steps": 2}
    status, output = torchrun(tmp_path, corpus.overrides(tmp_path / "whole", changes))
    assert status == 0, output[-4000:]
    status, output = torchrun(tmp_path, corpus.overrides(tmp_path / "moved", {**changes, "train.max_steps": 2}))
    assert status == 0, output[-4000:]
    stopped = ckpt.load(ckpt.last_path(tmp_path / "moved"))

    # The same command, train.update_freq=1 included: the saved 2 × 1 passes become 1 × 2 here.
    resumed = run(corpus, tmp_path / "moved", changes)
    whole = ckpt.load(ckpt.last_path(tmp_path / "whole"))
    assert (stopped["world_size"], stopped["update_freq"]) == (2, 1)
    assert (resumed["world_size"], resumed["update_freq"], resumed["step"]) == (1, 2, 4)
    assert resumed["data_state"] == whole["data_state"] != stopped["data_state"]
    worst = max((resumed["model"][n] - whole["model"][n]).abs().max().item() for n in whole["model"])
    assert worst <= 1e-5
