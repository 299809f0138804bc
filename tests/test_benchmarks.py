"""The benchmark scripts run: benchmarks/gpu_check.py --smoke takes every step of the GPU check on the CPU
with a tiny model, so the script is ready the day a GPU is lent (its figures mean nothing here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_step(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
                                 "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tests"]["ok"] and "skipped" in report["tests"]["summary"]  # no CUDA here: collected, skipped
    assert {(row["batch"], row["compile"]) for row in report["training"]} == {
        ("per GPU at 8 GPUs", False), ("25k on one GPU", False), ("per GPU at 8 GPUs", True), ("25k on one GPU", True)}
    assert all(row["tokens_per_s"] > 0 and 0 < row["mfu"] for row in report["training"])
    assert [row["engine"] for row in report["decoding"]] == ["ours fp32", "ours bf16", "CTranslate2"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("## GPU check") and "| per GPU at 8 GPUs | on |" in markdown
    assert not (ROOT / "docs" / "BENCHMARKS.md").read_text().count("python benchmarks/gpu_check.py --smoke")
