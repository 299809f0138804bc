"""What only a CUDA device can show: training through train.py in bf16 and fp16 on the GPU agrees with the
CPU's fp32 run, and a resumed GPU run continues the same run. Skipped without CUDA; benchmarks/gpu_check.py
runs them (with test_search.py's CUDA test) where a GPU is lent. Not yet run on a GPU: the tolerances are
estimates for the first run to confirm or correct."""

from __future__ import annotations

import pytest
import torch

from helpers import run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_on_cuda_follows_the_cpu_run(corpus, tmp_path, precision):
    changes = {"train.max_steps": 6, "model.dropout": 0.0}
    cpu = run(corpus, tmp_path / "cpu", changes)
    gpu = run(corpus, tmp_path / "gpu", {**changes, "device": "cuda", "train.precision": precision})

    assert gpu["step"] == cpu["step"] == 6 and gpu["device"] == "cuda"
    assert gpu["data_state"] == cpu["data_state"]
    # TF32 matmuls and reduced precision round differently; the weights must still be the same run's.
    tolerance = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}[precision]
    worst = max((gpu["model"][n].cpu().float() - cpu["model"][n].float()).abs().max().item() for n in cpu["model"])
    assert worst < tolerance, f"{precision}: {worst}"


def test_resume_on_cuda_continues_the_same_run(corpus, tmp_path):
    """Bit-identical on the CPU (test_train.py); on CUDA the backward of the fused attention kernels is not
    deterministic, so the resumed run equals the uninterrupted one within rounding."""
    changes = {"device": "cuda", "train.precision": "bf16", "train.save_every_steps": 2, "train.max_steps": 5}
    whole = run(corpus, tmp_path / "whole", changes)
    run(corpus, tmp_path / "resumed", {**changes, "train.max_steps": 2})
    resumed = run(corpus, tmp_path / "resumed", changes)
    assert resumed["step"] == whole["step"] == 5 and resumed["data_state"] == whole["data_state"]
    assert resumed["scheduler"] == whole["scheduler"]
    for name, tensor in whole["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=0, atol=1e-3, msg=name)
