"""train.py end to end: the learning rate it uses, how it deals batches to ranks, resume, checkpoints,
non-finite updates and stop signals.

Every run trains a 1+1-layer, d_model=16 model on a few hundred generated pairs (quickstart/corpus.py)
that share one vocabulary and one encoded-data cache (the `corpus` fixture), in-process through
`train.main(overrides)` unless the property needs another process. Weights are compared only between
runs at the same thread count (one: torchrun gives each rank one thread, and on a shared 2-core machine
one thread is also the fastest).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf
from torch.optim.optimizer import register_optimizer_step_pre_hook

from helpers import (D_MODEL, PIECES, ROOT, assert_training_states_equal, first_update_gradients, run,
                     subprocess_env, tensorboard_scalars, train_main)

import train
from data.batching import Prefetcher
from transformer import checkpoint as ckpt
from transformer.cli import ConfigError
from transformer.model import Transformer
from transformer.training import update


def noam(n: int, *, d_model: int, warmup: int, scale: float) -> float:
    return scale * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)


# ---------------------------------------------------------------------------------------------- the update


def test_each_pass_tells_the_model_whether_its_sources_hold_padding(corpus, tmp_path, monkeypatch):
    """train.py says it from the batch's own counts, so that the model need not look at the tokens (a host
    sync on GPU) to leave out the attention mask of a batch without padding."""
    told, encode = [], Transformer.encode

    def spy(model, src_tokens, *, padded=None):
        if model.training:
            told.append((padded, bool((src_tokens == model.config.pad_id).any())))
        return encode(model, src_tokens, padded=padded)

    monkeypatch.setattr(Transformer, "encode", spy)
    assert train_main(corpus.overrides(tmp_path, {"train.max_steps": 6, "train.max_tokens": 96})) == 0
    assert len(told) == 6 and all(said is not None for said, _ in told)
    assert [said for said, _ in told] == [holds for _, holds in told], told


def test_the_first_updates_gradients_are_read_back_from_adams_first_moment(corpus, tmp_path):
    """What tests/core/test_cuda.py compares between GPU and CPU (`first_update_gradients`): checked here
    against the gradients the optimizer was given."""
    given = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: given.append([p.grad.clone() for group in optimizer.param_groups
                                                      for p in group["params"]]))
    try:
        run(corpus, tmp_path, {"train.max_steps": 2, "train.save_every_steps": 1, "model.dropout": 0.0})
    finally:
        hook.remove()
    state = ckpt.load(ckpt.numbered_path(tmp_path, 1))
    read = first_update_gradients(state)
    assert len(given) == 2 and len(read) == len(given[0])
    assert [g.shape for g in read] == [w.shape for w in state["model"].values()]  # the weights' order: names
    for ours, theirs in zip(read, given[0]):
        torch.testing.assert_close(ours, theirs)
    assert any(not torch.allclose(a, b) for a, b in zip(given[0], given[1]))  # not the second update's


# ---------------------------------------------------------------------------------------------- schedule


def test_logged_learning_rate_follows_noam_formula(corpus, tmp_path):
    warmup, scale, steps = 4, 2.0, 8
    last = run(corpus, tmp_path, {"train.warmup_steps": warmup, "train.lr_scale": scale,
                                  "train.max_steps": steps})

    logged = tensorboard_scalars(tmp_path, "train/lr")
    expected = {n: noam(n, d_model=D_MODEL, warmup=warmup, scale=scale) for n in range(1, steps + 1)}
    assert sorted(logged) == list(expected)
    for n, lr in expected.items():
        assert logged[n] == pytest.approx(lr, rel=1e-6), f"update {n}"
    assert max(logged, key=logged.get) == warmup  # the peak: lr_scale · (d_model · warmup)^-0.5
    # The saved schedule stands at the next update: a resumed run continues with lr(steps + 1).
    assert last["scheduler"]["last_epoch"] == steps
    assert last["optimizer"]["param_groups"][0]["lr"] == pytest.approx(
        noam(steps + 1, d_model=D_MODEL, warmup=warmup, scale=scale), rel=1e-12)


def test_a_schedule_changed_on_resume_sets_the_lr_of_the_first_resumed_update(corpus, tmp_path):
    """train.lr_scale and warmup_steps may change when a run resumes: update 4 already takes the new schedule's
    lr (the optimizer held the old one's lr(4), and LambdaLR saves no functions)."""
    run(corpus, tmp_path, {"train.warmup_steps": 4, "train.lr_scale": 1.0, "train.max_steps": 3})
    last = run(corpus, tmp_path, {"train.warmup_steps": 2, "train.lr_scale": 3.0, "train.max_steps": 5})
    logged = tensorboard_scalars(tmp_path, "train/lr")
    for n in (4, 5):
        assert logged[n] == pytest.approx(noam(n, d_model=D_MODEL, warmup=2, scale=3.0), rel=1e-6), f"update {n}"
    assert last["optimizer"]["param_groups"][0]["lr"] == pytest.approx(noam(6, d_model=D_MODEL, warmup=2, scale=3.0))


# ------------------------------------------------------------------------------------ update size, DDP


@pytest.mark.parametrize(("tokens_per_update", "update_freq", "expected", "budget"), [
    (1400, "null", 3, 466),  # ceil(1400 / 512) passes of 1400 // 3 tokens
    (1200, "null", 3, 400),
    (100, "null", 1, 256),   # one pass, at least MIN_TOKENS (with a warning: the update is 2.6× the asked)
    (1400, 2, 2, 512),       # given explicitly: max_tokens as it is, tokens_per_update not used
])
def test_update_plan_derived_from_tokens_per_update(corpus, tmp_path, capsys, tokens_per_update, update_freq,
                                                   expected, budget):
    last = run(corpus, tmp_path, {"train.max_tokens": 512, "train.tokens_per_update": tokens_per_update,
                                  "train.update_freq": update_freq, "train.max_steps": 1})

    record = json.loads((tmp_path / "provenance.json").read_text())
    assert record["world_size"] == 1
    assert record["update_freq"] == expected
    assert record["max_tokens_per_update"] == expected * budget
    assert (last["update_freq"], last["max_tokens"]) == (expected, budget)
    err = capsys.readouterr().err
    assert f"update_freq {expected} × max_tokens {budget} = {expected * budget} tokens" in err
    assert ("train.tokens_per_update=256 and scale the learning rate" in err) == (tokens_per_update == 100)
    # One update consumed exactly `expected` batches of the stream.
    assert last["data_state"]["epoch"] * last["data_state"]["batches_per_epoch"] + last["data_state"]["offset"] \
        == expected


# -------------------------------------------------------------------------------------------------- resume


def test_resume_is_bit_identical(corpus, tmp_path):
    changes = {"train.update_freq": 2, "train.save_every_steps": 2, "train.average_last": 2,
               "train.valid_every_steps": 2, "train.max_steps": 7}
    whole = run(corpus, tmp_path / "whole", changes)

    resumed_dir = tmp_path / "resumed"
    first = run(corpus, resumed_dir, {**changes, "train.max_steps": 3})
    assert first["step"] == 3
    assert ckpt.averaged_path(resumed_dir).is_file()  # written at the stop: resume must not read it
    resumed = run(corpus, resumed_dir, changes)

    assert_training_states_equal(resumed, whole)


def test_resume_with_other_architecture_is_one_line_error(corpus, tmp_path):
    run(corpus, tmp_path, {"train.max_steps": 1})
    before = ckpt.last_path(tmp_path).read_bytes()

    with pytest.raises(ConfigError) as error:
        train_main(corpus.overrides(tmp_path, {"model.d_model": 24, "model.decoder_layers": 2}))

    message = str(error.value)
    assert "\n" not in message
    assert f"model.d_model: {D_MODEL} → 24" in message
    assert "model.decoder_layers: 1 → 2" in message
    assert "model.heads" not in message and "model.encoder_layers" not in message
    assert ckpt.last_path(tmp_path).read_bytes() == before


@pytest.mark.slow
def test_sigterm_saves_and_resume_continues(corpus, tmp_path):
    interrupted = tmp_path / "interrupted"
    log_path = tmp_path / "stderr.log"
    command = [sys.executable, str(ROOT / "train.py"), *corpus.overrides(interrupted, {"train.max_steps": 100000})]
    with open(log_path, "w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 180
            while "| update " not in log_path.read_text(errors="replace"):
                assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "no training log line within 180 s"
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            returncode = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = log_path.read_text(errors="replace")
    assert returncode == 0, text[-3000:]
    assert "SIGTERM received" in text and "stopped by a signal" in text
    stopped = ckpt.load(ckpt.last_path(interrupted))
    k = stopped["step"]
    assert 1 <= k < 100000

    resumed = run(corpus, interrupted, {"train.max_steps": k + 3})
    whole = run(corpus, tmp_path / "whole", {"train.max_steps": k + 3})
    assert_training_states_equal(resumed, whole)


# ----------------------------------------------------------------------------------------------- checkpoints


def test_checkpoints_named_pruned_and_averaged(corpus, tmp_path):
    last = run(corpus, tmp_path, {"train.max_steps": 7, "train.save_every_steps": 2, "train.keep_last": 3,
                                  "train.average_last": 2, "train.valid_every_steps": 3})
    directory = tmp_path / "checkpoints"

    # Saved at updates 2, 4, 6 (save_every_steps) and 7 (the end); keep_last=3 pruned step-2.
    numbered = sorted(p.name for p in directory.glob("step-*.pt"))
    assert numbered == ["step-00000004.pt", "step-00000006.pt", "step-00000007.pt"]
    assert [ckpt.load(directory / name)["step"] for name in numbered] == [4, 6, 7]
    assert last["step"] == 7 and last["kind"] == "train"
    seven = ckpt.load(directory / "step-00000007.pt")["model"]
    assert all(torch.equal(last["model"][name], seven[name]) for name in seven)

    averaged = ckpt.load(directory / "averaged.pt")
    assert averaged["kind"] == "averaged" and averaged["averaged_steps"] == [6, 7]
    assert "optimizer" not in averaged
    six = ckpt.load(directory / "step-00000006.pt")["model"]
    for name, tensor in averaged["model"].items():
        mean = (six[name].double() + seven[name].double()) / 2
        torch.testing.assert_close(tensor.double(), mean, rtol=0, atol=1e-7, msg=name)
    assert any(not torch.equal(six[name], seven[name]) for name in six)  # the mean is not of equal tensors

    # best.pt: the validation (updates 3, 6, 7) with the lowest loss.
    valid_loss = tensorboard_scalars(tmp_path, "valid/loss")
    assert sorted(valid_loss) == [3, 6, 7]
    best = ckpt.load(directory / "best.pt")
    assert best["step"] == min(valid_loss, key=valid_loss.get)

    config = OmegaConf.load(tmp_path / "config.yaml")
    assert config.run_dir == str(tmp_path) and config.train.max_steps == 7 and config.model.d_model == D_MODEL
    record = json.loads((tmp_path / "provenance.json").read_text())
    assert {"command", "versions", "git_commit", "world_size", "update_freq"} <= record.keys()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "spm.model").is_file()


def test_nonfinite_updates_are_skipped_then_abort(corpus, tmp_path, capsys, monkeypatch):
    poisoned = {2, 4, 5, 6}  # updates whose loss (hence gradient) is NaN; 4, 5, 6 are 3 in a row
    calls = []
    real_loss = update.label_smoothed_nll

    def loss_with_nans(logits, target, **kwargs):
        loss, nll = real_loss(logits, target, **kwargs)
        calls.append(None)  # one forward pass per update (update_freq=1, no validation before the abort)
        if len(calls) in poisoned:
            loss = loss * float("nan")
        return loss, nll

    monkeypatch.setattr(update, "label_smoothed_nll", loss_with_nans)
    with pytest.raises(ConfigError) as error:
        train_main(corpus.overrides(tmp_path, {"train.max_steps": 20, "train.max_nonfinite": 3,
                                               "train.save_every_steps": 1, "train.keep_last": 0}))

    assert "\n" not in str(error.value) and "3 updates in a row" in str(error.value)
    err = capsys.readouterr().err
    assert "update 2: non-finite gradient norm, skipped (1 in a row)" in err
    assert "update 6: non-finite gradient norm, skipped (3 in a row)" in err
    assert "update 7" not in err

    directory = tmp_path / "checkpoints"
    saved = {s: ckpt.load(directory / f"step-{s:08d}.pt") for s in (1, 2, 3)}
    diagnostic = ckpt.load(directory / "diagnostic-00000006.pt")
    assert diagnostic["kind"] == "diagnostic" and diagnostic["step"] == 6

    def same_weights(a, b):
        return all(torch.equal(a["model"][name], b["model"][name]) for name in a["model"])

    def adam_steps(state):
        return {float(s["step"]) for s in state["optimizer"]["state"].values()}

    assert same_weights(saved[1], saved[2])  # update 2 was skipped
    assert not same_weights(saved[2], saved[3])  # update 3 trained
    assert same_weights(saved[3], diagnostic)  # updates 4-6 were skipped
    assert adam_steps(saved[2]) == {1.0} and adam_steps(diagnostic) == {2.0}


def test_fp16_overflows_calibrate_the_loss_scale_and_redo_the_update(corpus, tmp_path, capsys, monkeypatch):
    """fp16: an overflow is GradScaler finding its scale: it halves the scale and the update is made again
    from the same batches (no update number, no lr step, not towards max_nonfinite)."""
    calls, real_loss = [], update.label_smoothed_nll

    def overflowing_loss(logits, target, **kwargs):
        loss, nll = real_loss(logits, target, **kwargs)
        calls.append(None)
        return (loss * float("inf") if len(calls) <= 3 else loss), nll

    monkeypatch.setattr(update, "label_smoothed_nll", overflowing_loss)
    last = run(corpus, tmp_path, {"train.precision": "fp16", "train.max_steps": 2, "train.max_nonfinite": 1})

    err = capsys.readouterr().err
    assert "update 1: fp16 overflow, loss scale 65536 → 32768; the update is made again" in err
    assert "update 1: fp16 overflow, loss scale 16384 → 8192" in err and "non-finite" not in err
    assert last["step"] == 2 and last["scheduler"]["last_epoch"] == 2
    assert last["scaler"]["scale"] == 8192.0
    assert last["data_state"]["epoch"] * last["data_state"]["batches_per_epoch"] + last["data_state"]["offset"] == 2
    fp32 = run(corpus, tmp_path / "fp32", {"train.max_steps": 2})
    assert last["data_state"] == fp32["data_state"]  # the same batches as a run without overflows
    assert {float(s["step"]) for s in last["optimizer"]["state"].values()} == {2.0}


def test_fp32_run_resumes_in_fp16_with_a_fresh_loss_scale(corpus, tmp_path, capsys):
    run(corpus, tmp_path, {"train.max_steps": 2})
    resumed = run(corpus, tmp_path, {"train.max_steps": 3, "train.precision": "fp16"})
    assert resumed["step"] == 3 and resumed["scaler"]["scale"] > 0
    assert "has no fp16 loss scale (it was trained in another precision): starting at 65536" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_learns_and_resumes_bit_identically(corpus, tmp_path, precision):
    """bf16 autocast and fp16 with GradScaler through train.py on the CPU: the loss falls, and a run stopped
    at update 4 and resumed ends where an uninterrupted one does, weights, Adam and loss scale alike."""
    changes = {"train.precision": precision, "train.max_steps": 8, "train.save_every_steps": 4,
               "train.lr_scale": 2.0}
    whole = run(corpus, tmp_path / "whole", changes)
    losses = tensorboard_scalars(tmp_path / "whole", "train/loss")
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.5, losses
    first = run(corpus, tmp_path / "resumed", {**changes, "train.max_steps": 4})
    resumed = run(corpus, tmp_path / "resumed", changes)
    assert first["step"] == 4
    assert_training_states_equal(resumed, whole)
    assert resumed["scaler"] == whole["scaler"]
    fp32 = run(corpus, tmp_path / "fp32", {**changes, "train.precision": "fp32"})
    assert any(not torch.equal(whole["model"][n], fp32["model"][n]) for n in fp32["model"])  # autocast was on
    assert (whole["scaler"].get("scale"), whole["scaler"].get("_growth_tracker")) == \
           ((65536.0, 8) if precision == "fp16" else (None, None))  # GradScaler on for fp16 only, all 8 finite


# --------------------------------------------------------------------------------------------- convergence


@pytest.mark.slow
def test_tiny_model_overfits_a_small_real_batch(shared_data, tmp_path):
    """64 real WMT pairs in one batch: the training NLL falls near zero; the smoothed loss cannot."""
    text = shared_data / "text"
    src = (text / "train.en-de.en").read_text(encoding="utf-8").splitlines()
    tgt = (text / "train.en-de.de").read_text(encoding="utf-8").splitlines()
    pairs = [(s, t) for s, t in zip(src, tgt) if 4 <= len(s.split()) <= 10 and 4 <= len(t.split()) <= 10][:64]
    assert len(pairs) == 64
    prefix = tmp_path / "pairs"
    for side, lang in enumerate(("en", "de")):
        prefix.with_suffix(f".{lang}").write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")

    run_dir = tmp_path / "run"
    steps, epsilon = 150, 0.1
    overrides = [
        f"run_dir={run_dir}", "device=cpu", "model=tiny", "model.d_model=64", "model.heads=4", "model.d_ff=128",
        "model.encoder_layers=1", "model.decoder_layers=1", "model.dropout=0",
        "data.dataset=null", "data.subset=null", f"data.train_prefix={prefix}", f"data.valid_prefix={prefix}",
        f"data.vocab_size={PIECES}", "data.max_len_ratio=null", "data.num_workers=1",
        "train.max_tokens=8192", "train.update_freq=1",  # all 64 pairs in one batch, every update
        "train.warmup_steps=30", "train.lr_scale=0.5", f"train.label_smoothing={epsilon}",
        f"train.max_steps={steps}", "train.log_every_steps=10", f"train.valid_every_steps={steps}",
        f"train.save_every_steps={steps}", "train.average_last=1", "train.valid_bleu_lines=0", "train.best_metric=loss",
        "train.best_metric=loss",
    ]
    assert train_main(overrides) == 0

    tokens = tensorboard_scalars(run_dir, "train/tokens_per_update")
    assert len(set(tokens.values())) == 1  # one fixed batch: the same target tokens every update
    # Validation runs on the same 64 pairs in eval mode: the NLL and loss of the final weights.
    nll = tensorboard_scalars(run_dir, "valid/nll")[steps]
    loss = tensorboard_scalars(run_dir, "valid/loss")[steps]
    train_nll = tensorboard_scalars(run_dir, "train/nll")
    print(f"train NLL {train_nll[10]:.3f} -> {train_nll[steps]:.3f}; valid NLL {nll:.3f}, loss {loss:.3f}")
    assert train_nll[10] > 3.0, train_nll  # updates 1-10: far from it at the start
    assert train_nll[steps] < 0.3, train_nll  # updates 141-150, in training mode
    assert nll < 0.3, nll
    # The smoothed loss is bounded below by the entropy of the smoothed target q (ε/V to every class).
    q_true = 1 - epsilon + epsilon / PIECES
    floor = -(q_true * math.log(q_true) + (PIECES - 1) * (epsilon / PIECES) * math.log(epsilon / PIECES))
    assert loss > floor > nll


# -------------------------------------------------------------------------------------------- the hot loop


class HostWaits(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, in order, every point at which the host waits for the device: reading a value (`.item()`,
    `bool()`, `int()`), ops whose output shape depends on the data (nonzero, masked_select), and
    `Tensor.tolist()` / `.numpy()`, which on a CPU tensor read memory without an op. (A copy to the CPU,
    the other kind of wait, cannot happen in a CPU-only run.)"""

    WAITS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select,
             torch.ops.aten.is_nonzero, torch.ops.aten.equal, torch.ops.aten.unique_consecutive,
             torch.ops.aten._unique2}

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.WAITS:
            self.events.append(f"wait:{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def test_an_update_waits_for_the_device_once_after_collating_the_next(corpus, tmp_path, monkeypatch):
    updates: list[list[str]] = []  # what happened in each train_step
    inside = []
    real_step, real_collate = train.train_step, Prefetcher._collate

    def recorded(method_name, real):
        def wrapper(self, *args, **kwargs):
            if inside:
                updates[-1].append(method_name)
            return real(self, *args, **kwargs)
        return wrapper

    def step(run, window, stop):
        updates.append([])
        inside.append(True)
        try:
            with HostWaits(updates[-1]):
                return real_step(run, window, stop)
        finally:
            inside.pop()

    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(Prefetcher, "_collate", lambda self, update: (updates[-1].append("collate"),
                                                                            real_collate(self, update))[1])
    monkeypatch.setattr(torch.Tensor, "tolist", recorded("wait:tolist", torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "numpy", recorded("wait:numpy", torch.Tensor.numpy))
    run(corpus, tmp_path, {"train.max_steps": 4, "train.log_every_steps": 100, "train.update_freq": 2})

    assert len(updates) == 4
    # The first update collates its own batches; every update collates the next one's before its one wait.
    assert updates[0] == ["collate", "collate", "wait:tolist"]
    assert updates[1:] == [["collate", "wait:tolist"]] * 3
