"""transformer/checkpoint.py: atomic saves, safe loads, averaging, resolving, pruning, its command line."""

import logging
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from transformer import checkpoint
from data.errors import WriteError
from data.files import link_or_copy
from transformer.checkpoint import CheckpointError
from transformer.training.schedule import make_optimizer, make_scheduler

ROOT = Path(__file__).resolve().parents[2]


def _tiny_model(seed=0, width=4):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.BatchNorm1d(width))


def _ckpt(step, seed=0, width=4, **extra):
    return {
        "format_version": checkpoint.FORMAT_VERSION,
        "kind": "train",
        "model_config": {"d_model": width, "vocab_size": 11},
        "model": _tiny_model(seed, width).state_dict(),
        "spm_model": torch.frombuffer(bytearray(b"spm-proto"), dtype=torch.uint8),
        "config": {"train": {"lr_scale": 1.0}, "seed": 1},
        "step": step,
        **extra,
    }


def _assert_same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_numbered_paths_have_eight_digits(tmp_path):
    assert checkpoint.numbered_path(tmp_path, 12000) == tmp_path / "checkpoints" / "step-00012000.pt"
    assert checkpoint.last_path(tmp_path).name == "last.pt"
    assert checkpoint.averaged_path(tmp_path).name == "averaged.pt"
    assert checkpoint.best_path(tmp_path).name == "best.pt"


def test_training_checkpoint_round_trips_under_weights_only(tmp_path):
    model = _tiny_model()
    optimizer = make_optimizer(model.parameters(), fused=False)
    scheduler = make_scheduler(optimizer, d_model=4, warmup_steps=3, lr_scale=1.0)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = _ckpt(
        1,
        optimizer=optimizer.state_dict(),
        scheduler=scheduler.state_dict(),
        scaler=torch.amp.GradScaler("cpu", enabled=False).state_dict(),
        data_state={"epoch": 0, "offset": 12},
        rng={"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": []},
        best=None,
        finished=False,
        lengths=(1.5, "x", [None, True]),
    )
    path = checkpoint.numbered_path(tmp_path, 1)
    checkpoint.save(state, path)
    loaded = checkpoint.load(path)
    _assert_same(state, loaded)
    random.setstate(loaded["rng"]["python"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.pt"
    checkpoint.save(_ckpt(100), path)

    def disk_full(obj, f):  # what torch.save does on ENOSPC: a partial file, then a RuntimeError
        f.write(b"PK\x03\x04 half a checkpoint")
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(WriteError, match="could not write checkpoint .*last.pt: No space left on device"):
        checkpoint.save(_ckpt(200), path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 100
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt"]  # no temporary file left


def test_write_beyond_the_file_size_limit_keeps_the_previous_checkpoint(tmp_path):
    """A real failing write (RLIMIT_FSIZE stands in for a full disk), in a child process."""
    path = tmp_path / "last.pt"
    checkpoint.save(_ckpt(100), path)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, torch
        from transformer import checkpoint
        from data.errors import WriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            checkpoint.save({{"format_version": 1, "model": {{"w": torch.zeros(100000)}}, "step": 200}}, {str(path)!r})
        except WriteError as e:
            print(e)
            sys.exit(3)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stderr
    assert "could not write checkpoint" in result.stdout and "File too large" in result.stdout
    assert checkpoint.load(path)["step"] == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_unwritable_location_is_a_write_error(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a regular file where the run directory should be")
    with pytest.raises(WriteError, match="could not write checkpoint"):
        checkpoint.save(_ckpt(1), blocker / "checkpoints" / "last.pt")
    assert blocker.read_text().startswith("a regular file")


class _Payload:
    """Unpickling this creates a marker file: stands for arbitrary code in a malicious checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.pt"
    torch.save({"format_version": 1, "model": {}, "step": 1, "x": _Payload(marker)}, crafted)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps({"format_version": 1, "model": _Payload(marker)}, protocol=2))
    for path in (crafted, raw):
        with pytest.raises(CheckpointError, match="refused .*only load checkpoints you trust") as error:
            checkpoint.load(path)
        assert "\n" not in str(error.value)
        assert not marker.exists()
    torch.load(crafted, weights_only=False)  # the control: loading it unsafely does run the payload
    assert marker.exists()


def test_truncated_or_garbage_file_is_a_checkpoint_error(tmp_path):
    good = tmp_path / "good.pt"
    checkpoint.save(_ckpt(5), good)
    data = good.read_bytes()
    for name, content in [("half", data[: len(data) // 2]), ("empty", b""), ("tail", data[:-20]),
                          ("head", data[:12]), ("garbage", b"not a checkpoint at all")]:
        bad = tmp_path / f"{name}.pt"
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match="could not read checkpoint") as error:
            checkpoint.load(bad)
        assert "\n" not in str(error.value) and str(bad) in str(error.value)


def test_foreign_missing_and_newer_checkpoints_are_rejected(tmp_path):
    for name, obj in [("foreign.pt", {"state_dict": {"w": torch.zeros(2)}}), ("tensor.pt", torch.zeros(2))]:
        torch.save(obj, tmp_path / name)
        with pytest.raises(CheckpointError, match="foreign checkpoint"):
            checkpoint.load(tmp_path / name)
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.load(tmp_path / "absent.pt")
    torch.save(_ckpt(1) | {"format_version": checkpoint.FORMAT_VERSION + 1}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="newer"):
        checkpoint.load(tmp_path / "future.pt")


def test_average_is_the_mean_of_the_weights(tmp_path):
    paths, models = [], []
    for i, step in enumerate((100, 200, 300)):
        state = _ckpt(step, seed=i)
        state["model"]["1.num_batches_tracked"] = torch.tensor(step)
        state["model"]["half"] = torch.randn(4).half()
        state["optimizer"] = {"state": {}, "param_groups": []}
        models.append(state["model"])
        paths.append(checkpoint.numbered_path(tmp_path, step))
        checkpoint.save(state, paths[-1])
    averaged = checkpoint.average(paths)
    for name, tensor in models[-1].items():
        if tensor.is_floating_point():
            want = sum(m[name].double() for m in models) / 3
            assert averaged["model"][name].dtype == tensor.dtype
            torch.testing.assert_close(averaged["model"][name].double(), want, rtol=1e-3, atol=1e-6)
    assert averaged["model"]["1.num_batches_tracked"].item() == 300  # integer buffers: the last one's
    assert averaged["kind"] == "averaged" and averaged["step"] == 300
    assert averaged["averaged_steps"] == [100, 200, 300]
    assert "optimizer" not in averaged
    _assert_same(averaged["spm_model"], _ckpt(0)["spm_model"])
    checkpoint.save(averaged, checkpoint.averaged_path(tmp_path))
    _assert_same(checkpoint.load(checkpoint.averaged_path(tmp_path)), averaged)


def test_average_rejects_different_architectures(tmp_path):
    checkpoint.save(_ckpt(1, width=4), tmp_path / "a.pt")
    checkpoint.save(_ckpt(2, width=5), tmp_path / "b.pt")
    extra = _ckpt(3)
    extra["model"]["extra.weight"] = torch.zeros(1)
    checkpoint.save(extra, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match="different architectures"):
        checkpoint.average([tmp_path / "a.pt", tmp_path / "b.pt"])
    with pytest.raises(CheckpointError, match="different architectures"):
        checkpoint.average([tmp_path / "a.pt", tmp_path / "c.pt"])


def test_resolve_prefers_averaged_when_at_least_as_new_as_last(tmp_path):
    with pytest.raises(CheckpointError, match="averaged.pt.*last.pt"):
        checkpoint.resolve(tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.resolve(tmp_path / "nothing")
    last, averaged = checkpoint.last_path(tmp_path), checkpoint.averaged_path(tmp_path)
    checkpoint.save(_ckpt(100), last)
    assert checkpoint.resolve(tmp_path) == last
    checkpoint.save(_ckpt(100) | {"kind": "averaged"}, averaged)
    assert checkpoint.resolve(tmp_path) == averaged
    assert checkpoint.resolve(tmp_path / "checkpoints") == averaged
    checkpoint.save(_ckpt(150), last)
    assert checkpoint.resolve(tmp_path) == last
    assert checkpoint.resolve(averaged) == averaged  # a file is taken as given


def test_prune_keeps_the_newest_numbered_checkpoints(tmp_path):
    for step in (5000, 1000, 3000, 2000, 4000):
        checkpoint.save(_ckpt(step), checkpoint.numbered_path(tmp_path, step))
    checkpoint.save(_ckpt(5000), checkpoint.last_path(tmp_path))
    assert [s for s, _ in checkpoint.list_numbered(tmp_path)] == [1000, 2000, 3000, 4000, 5000]
    assert checkpoint.prune(tmp_path, keep_last=0) == []
    removed = checkpoint.prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step-00001000.pt", "step-00002000.pt", "step-00003000.pt"]
    assert [s for s, _ in checkpoint.list_numbered(tmp_path)] == [4000, 5000]
    assert checkpoint.last_path(tmp_path).exists()


@pytest.mark.parametrize("hard_links", [True, False])
def test_last_checkpoint_mirrors_the_numbered_one_and_survives_pruning(tmp_path, monkeypatch, hard_links):
    if not hard_links:
        monkeypatch.setattr(checkpoint.os, "link", lambda src, dst: (_ for _ in ()).throw(OSError(1, "no links")))
    for step in (1, 2, 3):
        numbered = checkpoint.numbered_path(tmp_path, step)
        checkpoint.save(_ckpt(step), numbered)
        link_or_copy(numbered, checkpoint.last_path(tmp_path))
        checkpoint.prune(tmp_path, keep_last=1)
    assert [s for s, _ in checkpoint.list_numbered(tmp_path)] == [3]
    assert checkpoint.load(checkpoint.last_path(tmp_path))["step"] == 3
    checkpoint.save(_ckpt(4), checkpoint.last_path(tmp_path))  # replacing last.pt leaves the numbered one alone
    assert checkpoint.load(checkpoint.numbered_path(tmp_path, 3))["step"] == 3
    assert sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir()) == ["last.pt", "step-00000003.pt"]


def test_sentencepiece_model_round_trips_as_bytes(tmp_path):
    proto = bytes(range(256)) * 3
    checkpoint.save(_ckpt(1) | {"spm_model": checkpoint.spm_tensor(proto)}, tmp_path / "a.pt")
    assert checkpoint.spm_bytes(checkpoint.load(tmp_path / "a.pt")) == proto
    with pytest.raises(CheckpointError, match="SentencePiece"):
        checkpoint.spm_bytes({"spm_model": None})


def test_run_dir_of_a_checkpoint(tmp_path):
    assert checkpoint.run_dir_of(checkpoint.last_path(tmp_path)) == tmp_path.resolve()
    assert checkpoint.run_dir_of(tmp_path / "loose.pt") is None


def test_latest_resumable_skips_a_corrupt_last_checkpoint(tmp_path, caplog):
    assert checkpoint.latest_resumable(tmp_path) is None
    checkpoint.save(_ckpt(100), checkpoint.numbered_path(tmp_path, 100))
    assert checkpoint.latest_resumable(tmp_path) is None  # resume iff last.pt exists
    checkpoint.save(_ckpt(200), checkpoint.last_path(tmp_path))
    assert checkpoint.latest_resumable(tmp_path) == checkpoint.last_path(tmp_path)
    checkpoint.last_path(tmp_path).write_bytes(b"\0" * 100)
    checkpoint.numbered_path(tmp_path, 200).write_bytes(b"corrupt too")
    with caplog.at_level(logging.WARNING):
        assert checkpoint.latest_resumable(tmp_path) == checkpoint.numbered_path(tmp_path, 100)
    assert "last.pt" in caplog.text and "step-00000100.pt" in caplog.text
    checkpoint.numbered_path(tmp_path, 100).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no readable numbered checkpoint"):
        checkpoint.latest_resumable(tmp_path)


def test_average_command_line(tmp_path, capsys):
    for step in (10, 20, 30):
        checkpoint.save(_ckpt(step, seed=step), checkpoint.numbered_path(tmp_path, step))
    out = tmp_path / "avg.pt"
    assert checkpoint.main(["average", str(out), "--last", "2", "--run-dir", str(tmp_path)]) == 0
    assert checkpoint.load(out)["averaged_steps"] == [20, 30]
    inputs = [str(checkpoint.numbered_path(tmp_path, s)) for s in (10, 30)]
    assert checkpoint.main(["average", str(out), *inputs]) == 0
    assert checkpoint.load(out)["averaged_steps"] == [10, 30]
    capsys.readouterr()
    assert checkpoint.main(["average", str(out), str(tmp_path / "missing.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint not found") and err.count("\n") == 1
    assert checkpoint.main(["average", str(out)]) == 2
    blocker = tmp_path / "a-file"  # an output folder that cannot be made: one line, not a traceback
    blocker.write_text("x")
    capsys.readouterr()
    assert checkpoint.main(["average", str(blocker / "avg.pt"), *inputs]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
