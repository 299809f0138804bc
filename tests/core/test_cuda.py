"""What only a CUDA device can show: training through train.py in bf16 and fp16 on the GPU agrees with the
CPU's fp32 run, and a resumed GPU run continues the same run. Skipped without CUDA; benchmarks/gpu_check.py
runs them (with test_search.py's CUDA test) where a GPU is lent. Not yet run on a GPU: the tolerances are
estimates for the first run to confirm or correct.

Runs are compared by their losses and their first update's gradients, never by their weights after
several updates: Adam moves a weight by up to the learning rate whatever its gradient's size, so a rounding
difference in a near-zero gradient can move a weight by a whole step, in a run that is otherwise the same.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import train
from helpers import first_update_gradients, run, tensorboard_scalars
from transformer import checkpoint as ckpt

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Relative differences from the CPU's fp32 run. fp32 on the GPU uses TF32 matmuls (10-bit mantissas).
LOSS_TOLERANCE = {"fp32": 2e-3, "bf16": 2e-2, "fp16": 1e-2}  # per logged update's training loss
GRADIENT_TOLERANCE = {"fp32": 1e-2, "bf16": 5e-2, "fp16": 3e-2}  # ‖g_gpu - g_cpu‖ / ‖g_cpu‖ per tensor


def losses(run_dir) -> dict[int, float]:
    """The training loss (label-smoothed) of each update, as the run logged it (log_every_steps=1)."""
    return tensorboard_scalars(run_dir, "train/loss")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_on_cuda_follows_the_cpu_run(corpus, tmp_path, precision):
    changes = {"train.max_steps": 6, "model.dropout": 0.0, "train.save_every_steps": 1}
    cpu = run(corpus, tmp_path / "cpu", changes)
    gpu = run(corpus, tmp_path / "gpu", {**changes, "device": "cuda", "train.precision": precision})

    assert gpu["step"] == cpu["step"] == 6 and gpu["device"] == "cuda"
    assert torch.backends.cuda.matmul.allow_tf32 == (precision != "fp32")  # fp32: float32 matmuls, no TF32
    assert gpu["data_state"] == cpu["data_state"]
    cpu_losses, gpu_losses = losses(tmp_path / "cpu"), losses(tmp_path / "gpu")
    assert sorted(gpu_losses) == sorted(cpu_losses) == list(range(1, 7))
    for step, expected in cpu_losses.items():
        assert abs(gpu_losses[step] - expected) <= LOSS_TOLERANCE[precision] * abs(expected), \
            f"{precision}, update {step}: loss {gpu_losses[step]} on the GPU, {expected} on the CPU"
    first_cpu, first_gpu = (first_update_gradients(ckpt.load(ckpt.numbered_path(tmp_path / name, 1)))
                            for name in ("cpu", "gpu"))
    names = list(cpu["model"])  # the parameters' order (no buffers are saved)
    assert len(first_gpu) == len(first_cpu) == len(names)
    for name, g_gpu, g_cpu in zip(names, first_gpu, first_cpu):
        assert g_gpu.shape == g_cpu.shape == cpu["model"][name].shape, name
        error = (g_gpu - g_cpu).norm() / g_cpu.norm().clamp_min(1e-30)
        assert error <= GRADIENT_TOLERANCE[precision], f"{precision}: the gradient of {name} differs by {error:.2%}"


def test_resume_on_cuda_continues_the_same_run(corpus, tmp_path):
    """Bit-identical on the CPU (test_train.py); on CUDA the backward of the fused attention kernels is not
    deterministic, so the resumed run's losses equal the uninterrupted one's within rounding."""
    changes = {"device": "cuda", "train.precision": "bf16", "train.save_every_steps": 2, "train.max_steps": 5}
    whole = run(corpus, tmp_path / "whole", changes)
    run(corpus, tmp_path / "resumed", {**changes, "train.max_steps": 2})
    resumed = run(corpus, tmp_path / "resumed", changes)
    assert resumed["step"] == whole["step"] == 5 and resumed["data_state"] == whole["data_state"]
    assert resumed["scheduler"] == whole["scheduler"]
    whole_losses, resumed_losses = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert sorted(resumed_losses) == sorted(whole_losses) == list(range(1, 6))
    for step, expected in whole_losses.items():
        assert abs(resumed_losses[step] - expected) <= 1e-3 * abs(expected), (step, resumed_losses[step], expected)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_an_update_makes_the_host_wait_for_the_gpu_once(corpus, tmp_path, monkeypatch, precision):
    """docs/DESIGN.md's claim, counted by torch's sync debug mode: after the first updates (which warm the
    pinned-memory cache), each update of train.py waits for the device exactly once, at `settle`'s read.
    (fp16 adds GradScaler.step's own read of its overflow check.)"""
    counts, original = [], train.train_step

    def counted(run_, window, stop):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return original(run_, window, stop)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchroniz" in str(w.message) for w in caught))

    monkeypatch.setattr(train, "train_step", counted)
    run(corpus, tmp_path / "run", {"device": "cuda", "train.precision": precision, "train.max_steps": 8,
                                   "train.log_every_steps": 100, "train.valid_every_steps": 100,
                                   "train.save_every_steps": 100})
    assert len(counts) == 8 and counts[2:] == [1] * 6, counts
