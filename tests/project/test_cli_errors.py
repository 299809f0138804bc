"""What the command lines say about a wrong device, a bare path or an unknown key: one line on their raw
stderr that names the fix, read from the real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from helpers import subprocess_env  # noqa: E402
from transformer import distributed  # noqa: E402
from transformer.cli import ConfigError  # noqa: E402


def raw_stderr(script: str, *args: str) -> tuple[int, list[str]]:
    """The exit status and the non-empty stderr lines of `python <script> args` (stdin empty)."""
    result = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    return result.returncode, [line for line in result.stderr.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ devices


@pytest.mark.slow
@pytest.mark.parametrize(("script", "device", "expect"), [
    ("translate.py", "gpu", ["device=gpu is not one of", "device=cuda is the GPU"]),
    ("evaluate.py", "gpu", ["device=gpu is not one of", "device=cuda is the GPU"]),
    ("translate.py", "cuda:x", ["device=cuda:x is not one of", "e.g. cuda:0"]),
    ("evaluate.py", "cuda:7", ["device=cuda:7", "device=cpu"]),  # no CUDA here; out-of-range below
    ("translate.py", "mps", ["device=mps", "use device=cpu"]),
])
def test_a_bad_device_is_one_line_on_the_command_lines_raw_stderr(script, device, expect, tmp_path):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS: device=mps translates")
    if device == "cuda:7" and torch.cuda.is_available():
        pytest.skip("with CUDA, test_pick_device_refuses_an_out_of_range_gpu checks the range")
    status, lines = raw_stderr(script, f"checkpoint={tmp_path}", f"device={device}", "hyp=x" if
                               script == "evaluate.py" else "quiet=true")
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "Traceback" not in lines[0]
    for fragment in expect:
        assert fragment in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "expect"), [
    ("translate.py", ["runs/quickstart"], ["'runs/quickstart' is not a key=value override", "write checkpoint=runs/quickstart"]),
    ("translate.py", ["checkpoint=x", "decode.beams=5"], ["'decode.beams': translate.py has no such key",
                                                           "TranslateJob", "python translate.py --help"]),
    ("evaluate.py", ["hyp=x", "train.max_steps=5"], ["'train.max_steps': evaluate.py has no such key", "EvaluateJob"]),
])
def test_a_bare_path_or_an_unknown_key_names_the_fix_on_raw_stderr(script, args, expect):
    status, lines = raw_stderr(script, *args)
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in expect:
        assert fragment in lines[0], lines[0]


def test_pick_device_refuses_an_out_of_range_gpu_and_mps_for_training(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"device=cuda:2 but this machine has 2 CUDA device\(s\) \(cuda:0 to "
                                          r"cuda:1\): choose one of them"):
        distributed.pick_device("cuda:2")
    with pytest.raises(ConfigError, match="device=mps is not supported for training .* use device=cpu"):
        distributed.pick_device("mps", training=True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device=mps but this torch has no MPS device .* use device=cpu"):
        distributed.pick_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert distributed.pick_device("mps") == torch.device("mps")  # decoding on Apple silicon (untested: no such machine)
