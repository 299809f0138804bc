"""What the command lines say about a wrong device, a bare path or an unknown key: one line on their raw
stderr that names the fix, read from the real processes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
import train  # noqa: E402
import translate  # noqa: E402
from helpers import subprocess_env, train_main, user_error  # noqa: E402
from transformer import distributed  # noqa: E402
from transformer.decoding import translation  # noqa: E402
from transformer.cli import ConfigError  # noqa: E402


def raw_stderr(script: str, *args: str, env: dict | None = None) -> tuple[int, list[str]]:
    """The exit status and the non-empty stderr lines of `python <script> args` (stdin empty; `env` added to
    the environment)."""
    result = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=subprocess_env(**(env or {})),
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


def gpus(monkeypatch, count: int) -> list[int]:
    """Pretend this process sees `count` GPUs, at the one place the device rule asks: the GPUs it claims."""
    claimed = []
    monkeypatch.setattr(distributed, "_claim_gpu", lambda index: claimed.append(index) or count)
    return claimed


def under_torchrun(monkeypatch, *, world_size: int, local_rank: int) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_under_torchrun_auto_and_cuda_are_the_gpu_local_rank_names(monkeypatch):
    under_torchrun(monkeypatch, world_size=4, local_rank=2)
    claimed = gpus(monkeypatch, 4)
    for name in ("auto", "cuda"):
        assert distributed.pick_device(name) == torch.device("cuda", 2)
        assert distributed.pick_device(name, training=True) == torch.device("cuda", 2)
    assert claimed == [2, 2, 2, 2]
    assert distributed.pick_device("cpu") == torch.device("cpu") and claimed == [2, 2, 2, 2]
    gpus(monkeypatch, 2)  # more processes on the node than GPUs
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 \(device=auto\) but this machine has 2 CUDA device\(s\) "
                                          r".*torchrun --nproc_per_node"):
        distributed.pick_device("auto")
    gpus(monkeypatch, 0)
    assert distributed.pick_device("auto") == torch.device("cpu")  # CPU ranks (gloo)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    claimed = gpus(monkeypatch, 4)
    assert distributed.pick_device("auto") == torch.device("cuda", 0)
    assert distributed.pick_device("cuda:3") == torch.device("cuda", 3) and claimed == [0, 3]  # one process: any GPU


class Stop(Exception):
    """Raised where a test has seen what it needed, before real hardware would be used."""


@pytest.mark.parametrize("entry", ["train", "translate", "evaluate", "Translator.load"])
def test_every_entry_point_decodes_or_trains_on_the_gpu_local_rank_names(entry, monkeypatch, tmp_path):
    under_torchrun(monkeypatch, world_size=2, local_rank=1)
    claimed = gpus(monkeypatch, 2)
    chosen = []

    def stop(device, *args, **kwargs):
        chosen.append(torch.device(device))
        raise Stop

    monkeypatch.setattr(distributed, "init_from_env", stop)  # train.py: the process group is joined next
    monkeypatch.setattr(translation, "int8_linear_maps", lambda decode, device: stop(device))  # Translator.load
    with pytest.raises(Stop):
        if entry == "train":
            train_main([f"run_dir={tmp_path / 'run'}"])
        elif entry == "translate":
            translate.main([f"checkpoint={tmp_path}", "quiet=true"])
        elif entry == "evaluate":
            for name in ("src", "ref"):
                (tmp_path / name).write_text("a sentence\n", encoding="utf-8")
            evaluate.main([f"checkpoint={tmp_path}", f"src={tmp_path / 'src'}", f"ref={tmp_path / 'ref'}"])
        else:
            translation.Translator.load(tmp_path)
    assert claimed == [1]  # GPU 1 made current: the one the process group (train.py) then binds
    assert chosen == ([torch.device("cuda")] if entry == "train" else [torch.device("cuda", 1)])


RULE = ("device=cuda:1 with WORLD_SIZE=2: under torchrun each process uses the GPU its LOCAL_RANK names "
        "(cuda:LOCAL_RANK); give device=cuda or device=auto")


@pytest.mark.parametrize("module", [train, translate, evaluate])
def test_an_explicit_gpu_under_torchrun_is_one_line_before_any_hardware_is_asked(module, monkeypatch, capsys,
                                                                                 tmp_path):
    under_torchrun(monkeypatch, world_size=2, local_rank=0)
    monkeypatch.setattr(distributed, "_claim_gpu", lambda index: pytest.fail("the hardware was asked"))
    monkeypatch.setattr(distributed, "init_from_env", lambda *a, **k: pytest.fail("a process group was joined"))
    args = {train: [f"run_dir={tmp_path / 'run'}"], translate: [f"checkpoint={tmp_path}"],
            evaluate: [f"checkpoint={tmp_path}", "hyp=x", "ref=y"]}[module]
    line = user_error(module, [*args, "device=cuda:1"], capsys, monkeypatch)
    assert RULE in line, line
    with pytest.raises(ConfigError, match=re.escape(RULE)):
        translation.Translator.load(tmp_path, "cuda:1")


@pytest.mark.slow
def test_an_explicit_gpu_under_torchrun_is_the_same_line_on_a_machine_without_cuda(tmp_path):
    status, lines = raw_stderr("translate.py", f"checkpoint={tmp_path}", "device=cuda:1", "quiet=true",
                               env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert status == 2 and lines == [f"error: {RULE}, and choose the GPUs with CUDA_VISIBLE_DEVICES"], lines


def test_pick_device_refuses_an_out_of_range_gpu_and_mps_for_training(monkeypatch):
    gpus(monkeypatch, 2)
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
