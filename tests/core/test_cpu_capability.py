"""Every CPU precision path works on AVX2-only CPUs as on AVX-512/AMX ones (issue #19).

The AVX2 CPU is made on any machine by capping oneDNN and ATen in a subprocess
(`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`): under that cap oneDNN refuses bf16 primitives
exactly as on an AVX2-only AMD EPYC ("bf16 path needs the cpu support avx_ne_convert or avx512bw, ...").
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from helpers import subprocess_env

AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def run_precision_paths(tmp_path, name: str, cap: dict[str, str]) -> tuple[dict, str]:
    out = tmp_path / f"{name}.pt"
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "precision_paths.py"), str(out)],
                          env=subprocess_env(**cap),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False), done.stderr


@pytest.fixture(scope="module")
def native_and_avx2(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("precision")
    return run_precision_paths(tmp_path, "native", {}), run_precision_paths(tmp_path, "avx2", AVX2)


def test_the_avx2_cap_reproduces_onednns_bf16_refusal():
    """The cap is a faithful AVX2 CPU: without our kernel choice, packing a bf16 weight fails under it."""
    code = ("import torch; w = torch.randn(8, 8).bfloat16()\n"
            "try:\n    torch.ops.mkldnn._reorder_linear_weight(w, None); print('packed')\n"
            "except RuntimeError as e:\n    print('refused', str(e)[:60])\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **AVX2}, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.startswith("refused"), done.stdout + done.stderr


def test_every_precision_path_works_capped_to_avx2_with_the_native_results(native_and_avx2):
    (native, _), (avx2, avx2_log) = native_and_avx2
    assert avx2["capability"] == "AVX2" and not avx2["native_bf16"]
    assert avx2["emulated"] == {"bf16": True, "fp16": True}
    assert avx2_log.count("bf16 on this CPU (AVX2, no native bf16 kernels) is emulated") == 1  # once a process
    assert "about 15× slower than fp32" in avx2_log  # the measured figure, not "several times"
    for precision, tol in (("fp32", 1e-5), ("bf16", 0.05), ("fp16", 0.01)):
        for key in ("loss", "grad_norm"):
            got, want = avx2["train"][precision][key], native["train"][precision][key]
            assert abs(got - want) <= tol * max(1.0, abs(want)), (precision, key, got, want)
    assert avx2["decode"]["fp32"] == native["decode"]["fp32"]
    assert len(avx2["decode"]["bf16"]) == 3 and all(avx2["decode"]["bf16"])
    for dtype, tol in (("torch.float32", 1e-4), ("torch.bfloat16", 0.1)):
        assert (avx2["linear"][dtype] - native["linear"][dtype]).abs().max() <= tol


def test_native_precision_logs_no_emulation_warning(native_and_avx2):
    (native, native_log), _ = native_and_avx2
    if native["capability"] == "AVX2":
        pytest.skip("this CPU is AVX2-only: its native run is the capped one")
    assert native["emulated"]["bf16"] == (not native["native_bf16"])
    if native["native_bf16"]:
        assert "bf16 on this CPU" not in native_log


def test_bf16_on_a_gpu_before_ampere_is_warned_of_once(monkeypatch, caplog):
    """No GPU here: the GPU's answers are stood in for. bf16 on a GPU without bf16 tensor cores (a V100, a T4) is
    emulated by torch, slowly: one warning naming the GPU and the fast choices; none on Ampere and later."""
    from transformer import kernels

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    kernels._warn_emulated_on_gpu.cache_clear()
    with caplog.at_level("WARNING", logger=kernels.log.name):
        assert kernels.warn_if_emulated("bf16", "cuda") and kernels.warn_if_emulated("bf16", "cuda")
        assert not kernels.warn_if_emulated("fp16", "cuda") and not kernels.warn_if_emulated("fp32", "cuda")
    warnings = [r.getMessage() for r in caplog.records if "Tesla V100" in r.getMessage()]
    assert len(warnings) == 1 and "train.precision=fp16" in warnings[0], caplog.text
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100, H100
    assert not kernels.warn_if_emulated("bf16", "cuda")
    kernels._warn_emulated_on_gpu.cache_clear()
