"""Loss, learning-rate schedule, checkpoints and the world-size-1 distributed helpers."""

import logging
import math
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transformer import checkpoint, distributed
from transformer.checkpoint import CheckpointError
from transformer.loss import label_smoothed_nll
from transformer.schedule import make_optimizer, make_scheduler, noam_lambda

ROOT = Path(__file__).resolve().parent.parent
PAD = 0
EPS = 0.1


# ------------------------------------------------------------------------------------------------ loss


def _smoothed_loss_by_hand(logits, target, epsilon, pad):
    """Cross-entropy against the explicit smoothed distribution q, in float64, summed over non-pad."""
    logits, vocab = logits.double().reshape(-1, logits.size(-1)), logits.size(-1)
    target = target.reshape(-1)
    log_p = logits - logits.exp().sum(-1, keepdim=True).log()
    loss = nll = 0.0
    for row, y in zip(log_p, target.tolist()):
        if y == pad:
            continue
        q = torch.full((vocab,), epsilon / vocab, dtype=torch.float64)
        q[y] += 1.0 - epsilon
        loss += float(-(q * row).sum())
        nll += float(-row[y])
    return loss, nll


def test_loss_matches_explicit_smoothed_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    target = torch.randint(1, 11, (3, 5))
    target[0, 3:] = PAD
    target[2, 1:] = PAD
    loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    want_loss, want_nll = _smoothed_loss_by_hand(logits, target, EPS, PAD)
    assert loss.dtype == nll.dtype == torch.float32
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    assert nll.item() == pytest.approx(want_nll, rel=1e-5)


def test_loss_equals_torch_cross_entropy_with_label_smoothing():
    torch.manual_seed(1)
    logits = torch.randn(17, 23, requires_grad=True)
    target = torch.randint(0, 23, (17,))
    target[::4] = PAD
    loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    reference = F.cross_entropy(logits, target, label_smoothing=EPS, ignore_index=PAD, reduction="sum")
    plain = F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, plain.detach())
    (grad,) = torch.autograd.grad(loss, logits)
    (grad_reference,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, grad_reference)
    assert not nll.requires_grad


def test_no_smoothing_gives_the_plain_nll():
    torch.manual_seed(2)
    logits, target = torch.randn(6, 9, requires_grad=True), torch.randint(1, 9, (6,))
    loss, nll = label_smoothed_nll(logits, target, epsilon=0.0, ignore_index=PAD)
    reference = F.cross_entropy(logits, target, reduction="sum")
    torch.testing.assert_close(loss, nll)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(reference, logits)[0])


def test_bf16_logits_get_a_bf16_gradient_of_the_float32_loss():
    torch.manual_seed(6)
    logits = torch.randn(5, 4, 31).bfloat16().requires_grad_()
    target = torch.randint(0, 31, (5, 4))
    loss, _ = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    (grad,) = torch.autograd.grad(2.0 * loss, logits)  # an upstream factor, as the token normalisation
    wide = logits.detach().float().requires_grad_()
    reference = F.cross_entropy(wide.view(-1, 31), target.view(-1), label_smoothing=EPS, ignore_index=PAD,
                                reduction="sum")
    (grad_reference,) = torch.autograd.grad(2.0 * reference, wide)
    assert grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference)
    assert (grad.float() - grad_reference).abs().max() <= 0.01


def test_padding_does_not_change_loss():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 13)
    target = torch.randint(1, 13, (2, 4))
    padded_logits = torch.cat([logits, torch.randn(2, 3, 13) * 10], dim=1).requires_grad_()  # [2, 7, 13]
    padded_target = torch.cat([target, torch.full((2, 3), PAD)], dim=1)
    loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    padded_loss, padded_nll = label_smoothed_nll(padded_logits, padded_target, epsilon=EPS, ignore_index=PAD)
    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(padded_nll, nll)
    (grad,) = torch.autograd.grad(padded_loss, padded_logits)
    assert torch.all(grad[:, 4:] == 0)


def test_smoothed_loss_minimum_is_the_entropy_of_the_smoothed_target():
    vocab, y = 7, 4
    q = torch.full((vocab,), EPS / vocab, dtype=torch.float64)
    q[y] += 1 - EPS
    entropy = float(-(q * q.log()).sum())
    assert entropy > 0  # the smoothed loss can never reach zero
    best_logits = q.log().float().unsqueeze(0).requires_grad_()  # predicts q exactly
    loss, nll = label_smoothed_nll(best_logits, torch.tensor([y]), epsilon=EPS, ignore_index=PAD)
    assert loss.item() == pytest.approx(entropy, rel=1e-5)
    assert nll.item() == pytest.approx(-math.log(1 - EPS + EPS / vocab), rel=1e-5)
    (grad,) = torch.autograd.grad(loss, best_logits)
    assert grad.abs().max().item() < 1e-6  # a stationary point: the minimum of a convex function
    torch.manual_seed(4)
    for _ in range(5):
        other = best_logits.detach() + torch.randn(1, vocab)
        assert label_smoothed_nll(other, torch.tensor([y]), epsilon=EPS, ignore_index=PAD)[0].item() > entropy
    confident = torch.full((1, vocab), -30.0)
    confident[0, y] = 30.0  # the unsmoothed optimum is penalised
    assert label_smoothed_nll(confident, torch.tensor([y]), epsilon=EPS, ignore_index=PAD)[0].item() > entropy


def test_loss_is_float32_under_autocast():
    torch.manual_seed(5)
    logits = torch.randn(4, 3, 29).bfloat16()
    target = torch.randint(1, 29, (4, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, nll = label_smoothed_nll(logits, target, epsilon=EPS, ignore_index=PAD)
    assert loss.dtype == nll.dtype == torch.float32
    want_loss, _ = _smoothed_loss_by_hand(logits.float(), target, EPS, PAD)
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)


# -------------------------------------------------------------------------------------------- schedule


def _noam(n, d_model, warmup, scale):
    return scale * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)


def test_lr_used_by_optimizer_follows_the_noam_formula():
    d_model, warmup, scale = 512, 4000, 2.0
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = make_optimizer([weight], fused=False)
    scheduler = make_scheduler(optimizer, d_model=d_model, warmup_steps=warmup, lr_scale=scale)
    seen = []  # the lr of each update, read when optimizer.step() runs
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    weight.grad = torch.ones(2)
    for _ in range(4001):
        optimizer.step()
        scheduler.step()
    for _ in range(4002, 100000):  # fast-forward the schedule alone to update 100000
        scheduler.step()
    optimizer.step()
    lr = dict(enumerate(seen[:4001], start=1)) | {100000: seen[-1]}
    for n in (1, 2, 100, 3999, 4000, 4001, 100000):
        assert lr[n] == pytest.approx(_noam(n, d_model, warmup, scale), rel=1e-12), n
    assert lr[1] == pytest.approx(scale * 512**-0.5 * 4000**-1.5)
    assert max(lr.values()) == lr[4000] == pytest.approx(scale * 512**-0.5 * 4000**-0.5)


def test_noam_lambda_indexes_updates_from_one():
    fn = noam_lambda(d_model=1024, warmup_steps=10, lr_scale=1.0)
    assert [fn(i) for i in (0, 9, 99)] == [pytest.approx(_noam(n, 1024, 10, 1.0)) for n in (1, 10, 100)]
    with pytest.raises(ValueError, match="warmup_steps"):
        noam_lambda(d_model=512, warmup_steps=0, lr_scale=1.0)


def test_schedule_resumes_from_state_dicts():
    def build():
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = make_optimizer([weight], fused=False)
        return weight, optimizer, make_scheduler(optimizer, d_model=64, warmup_steps=5, lr_scale=1.0)

    weight, optimizer, scheduler = build()
    for _ in range(7):
        weight.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    weight2, optimizer2, scheduler2 = build()
    optimizer2.load_state_dict(state["optimizer"])
    scheduler2.load_state_dict(state["scheduler"])
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(_noam(8, 64, 5, 1.0))
    scheduler.step()
    scheduler2.step()
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(_noam(9, 64, 5, 1.0))


def test_optimizer_is_the_papers_adam():
    optimizer = make_optimizer([torch.nn.Parameter(torch.zeros(1))], fused=False)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.Adam)
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["lr"] == 1.0
    assert group["weight_decay"] == 0


# ------------------------------------------------------------------------------------------ checkpoints


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
    with pytest.raises(CheckpointError, match="could not write checkpoint .*last.pt: No space left on device"):
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
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            checkpoint.save({{"format_version": 1, "model": {{"w": torch.zeros(100000)}}, "step": 200}}, {str(path)!r})
        except checkpoint.CheckpointError as e:
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


def test_unwritable_location_is_a_checkpoint_error(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a regular file where the run directory should be")
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
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
        checkpoint.link_or_copy(numbered, checkpoint.last_path(tmp_path))
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


# ---------------------------------------------------------------------------------------- distributed


def test_world_size_one_runs_without_a_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = distributed.init_from_env("cpu")
    assert (info.rank, info.world_size, info.local_rank, info.is_main) == (0, 1, 0, True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.init_from_env("cpu", timeout_s=5) == info
    assert not torch.distributed.is_initialized()
    tensor = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce_sum(tensor) is tensor and tensor.tolist() == [1.0, 2.0]
    distributed.barrier()
    distributed.cleanup()


@pytest.mark.parametrize("fused", [True, False])
def test_adam_steps_follow_the_adam_formula(fused):
    """Two updates of both implementations against Adam written out (Kingma & Ba, bias-corrected)."""
    weight = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    optimizer = make_optimizer([weight], fused=fused)
    group = optimizer.param_groups[0]
    assert group["fused"] if fused else group["foreach"]  # fused Adam runs on CPU since torch 2.4
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    value, m, v = [0.5, -1.0, 2.0], [0.0] * 3, [0.0] * 3
    for n, grad in enumerate(([0.3, -0.2, 1.0], [-0.1, 0.4, 0.5]), start=1):
        weight.grad = torch.tensor(grad)
        optimizer.step()
        for i, g in enumerate(grad):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.98 * v[i] + 0.02 * g * g
            m_hat, v_hat = m[i] / (1 - 0.9**n), v[i] / (1 - 0.98**n)
            value[i] -= 0.1 * m_hat / (math.sqrt(v_hat) + 1e-9)
        assert weight.tolist() == pytest.approx(value, rel=1e-6)
