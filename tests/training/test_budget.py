"""train.max_time as the run's wall-clock budget (transformer/training/budget.py): the rule that decides whether the
next update fits, the clock carried over restarts, and the end of the run held to the deadline. The
two-rank run that ends inside its budget is tests/training/test_multirank.py's; torchrun's restarts, test_reliability.py's."""

from __future__ import annotations

import re
import time

import pytest
import torch

from helpers import VOCAB, FakeClock, run, run_on_fake_clock, tiny_model
from transformer import checkpoint as ckpt
from transformer.training import budget as budget_module
from transformer.training.budget import Budget, Costs, another_update_fits, process_age
from transformer.config import DecodeConfig
from transformer.decoding.translation import DeadlinePassed, translate_ids


def test_another_update_fits_only_with_room_for_it_a_validation_the_last_save_and_the_end():
    costs = Costs(update=2.0, validation=3.0, save=1.0, finish=4.0)  # 10 s after this update's own work
    assert another_update_fits(10.0, costs, now=0.0)
    assert not another_update_fits(9.9, costs, now=0.0)
    assert not another_update_fits(12.0, costs, now=2.5)  # this update's validation and save come first
    assert another_update_fits(12.5, costs, now=2.5)
    assert another_update_fits(0.0, Costs(), now=0.0) and not another_update_fits(-0.1, Costs(), now=0.0)


def test_the_budget_counts_earlier_processes_and_prices_the_end_of_the_run(monkeypatch):
    clock = FakeClock(update=0.0, validation=0.0, save=0.0)
    monkeypatch.setattr(time, "monotonic", clock)
    budget = Budget(spent_before=100.0, started=clock() - 5.0)
    assert budget.spent() == 105.0
    assert budget.deadline(160.0) == clock() + 55.0
    clock.now += 2.5
    assert budget.spent() == 107.5 and budget.deadline(160.0) == clock() + 52.5
    for seconds in (0.2, 0.5, 0.3):
        budget.add_update(seconds)
    budget.save, budget.decode_line = 2.0, 0.01
    budget.validations.extend([7.0, 4.0])
    costs = budget.costs(average_last=5, test_lines=3000)
    # the slowest recent update and validation (their times vary with the load), the latest save
    assert costs == Costs(update=0.5, validation=7.0, save=2.0, finish=2.0 * 6 + 30.0)
    for _ in range(4):  # the 7 s validation leaves the window of the five most recent
        with budget.timing("validation"):
            clock.now += 1.0
    with budget.timing("save"):
        clock.now += 0.25
    assert budget.validation == 4.0 and budget.save == 0.25
    budget.validations.clear()
    with budget.timing("validation"):
        clock.now += 0.5
    assert budget.validation == 0.5
    with pytest.raises(ValueError, match="unknown kind 'valid'"):
        with budget.timing("valid"):
            pass


def test_process_age_is_this_processs_age():
    assert 0.0 <= process_age() < time.monotonic()  # 0.0 where /proc/uptime is virtualised (lxcfs containers)


def test_a_later_job_of_a_multirun_counts_its_budget_from_its_own_start(monkeypatch):
    monkeypatch.setattr(budget_module, "_CLOCK_STARTED", False)
    monkeypatch.setattr(budget_module, "process_age", lambda: 100.0)
    monkeypatch.setattr(budget_module.time, "monotonic", lambda: 1000.0)
    assert budget_module.run_clock_start() == 900.0  # the first run: start-up and imports are part of it
    assert budget_module.run_clock_start() == 1000.0  # the next job in the same process: not the first's hour


def test_the_wall_clock_is_saved_in_every_checkpoint_and_carried_over_a_resume(corpus, tmp_path):
    run_dir = tmp_path / "run"
    first = run(corpus, run_dir, {"train.max_steps": 2, "train.save_every_steps": 1})
    resumed = run(corpus, run_dir, {"train.max_steps": 4, "train.save_every_steps": 1})
    assert 0 < first["wall_seconds"] < resumed["wall_seconds"]
    assert resumed["wall_seconds"] > first["wall_seconds"] + resumed["train_seconds"] - first["train_seconds"]
    assert first["wall_seconds"] >= first["train_seconds"]  # start-up, validation and saving count as well


def test_a_resumed_run_whose_budget_is_spent_stops_before_another_update(corpus, tmp_path, capfd):
    run_dir = tmp_path / "run"
    first = run(corpus, run_dir, {"train.max_steps": 2, "train.save_every_steps": 1})
    assert resume_line(capfd.readouterr().err).count("train.max_steps=") == 1  # the limit that ended it, raised
    again = run(corpus, run_dir, {"train.max_steps": 10, "train.max_time": first["wall_seconds"] * 0.9})
    assert again["step"] == 2
    err = capfd.readouterr().err
    assert "training stopped at update 2: max_time=" in err
    # The summary's resume command raises max_time, the limit that ended the run, in place of its old value.
    resume = resume_line(err)
    assert resume.count("train.max_time=") == 1 and "train.max_time=<more seconds>" in resume, resume


def resume_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.endswith("# resumes where this run stopped"))


def test_a_finished_max_time_run_started_again_prices_its_work_from_the_checkpoint_and_trains_no_more(corpus,
                                                                                                     tmp_path,
                                                                                                     monkeypatch):
    """On a clock where an update costs 0.5 s, a validation 1 s and a checkpoint write 0.25 s, a run with
    max_time=8 uses its budget and ends inside it. The costs measured are in the checkpoint: a requeued run
    does not spend the end of its budget on updates priced at 0 and then finish past it."""
    costs = dict(update=0.5, validation=1.0, save=0.25)
    clock = FakeClock(**costs)
    run_on_fake_clock(clock, monkeypatch.setattr)
    run_dir, changes = tmp_path / "run", {"train.max_steps": 100000, "train.max_time": 8,
                                          "train.save_every_steps": 5, "train.valid_every_steps": 5,
                                          "train.average_last": 1}
    started = clock()
    first = run(corpus, run_dir, changes)
    assert clock() - started <= 8  # the whole run, its averaging included
    assert (first["update_seconds"], first["validation_seconds"], first["save_seconds"]) == tuple(costs.values())
    assert first["wall_seconds"] <= 8  # the rule held: the last update, validation and save fitted
    # ... and stopped only when one more update, with the validation and save that end a run, would not have
    # fitted (the end of the run costs an averaging, priced as average_last + 1 checkpoint writes).
    end = costs["validation"] + costs["save"] + costs["save"] * (changes["train.average_last"] + 1)
    assert first["wall_seconds"] + costs["update"] + end > 8, first["wall_seconds"]
    again = run(corpus, run_dir, changes)
    assert again["step"] == first["step"] and again["wall_seconds"] == first["wall_seconds"]


def test_a_checkpoint_from_before_the_wall_clock_counts_its_training_time():
    from transformer.checkpoint import TrainState

    assert TrainState.read({"step": 3, "train_seconds": 42.0}).wall_seconds == 42.0
    assert TrainState.read({"step": 3, "train_seconds": 42.0, "wall_seconds": 50.0}).wall_seconds == 50.0


def test_the_search_stops_between_batches_at_its_deadline_and_is_unchanged_before_it():
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    sources = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 5, 12, 7, 4)]
    decode = DecodeConfig(beam=2, max_tokens=20, max_len_b=6)  # several batches
    plain = translate_ids(model, sources, decode)
    assert translate_ids(model, sources, decode, deadline=time.monotonic() + 3600) == plain
    with pytest.raises(DeadlinePassed, match="6 of 6 lines were not translated"):
        translate_ids(model, sources, decode, deadline=time.monotonic() - 1)


def test_the_test_translation_that_would_overrun_max_time_is_skipped_and_said(corpus, tmp_path, capfd,
                                                                                monkeypatch):
    from transformer.training.budget import Budget

    monkeypatch.setattr(Budget, "deadline", lambda self, max_time: time.monotonic() - 1)  # already passed
    run(corpus, tmp_path / "run", {"train.max_steps": 2, "train.max_time": 3600, "train.test_at_end": "true",
                                   "data.test_prefix": corpus.prefixes["valid"]})
    err = capfd.readouterr().err
    assert "no test BLEU: the test translation would overrun train.max_time=3600s" in err, err[-2000:]
    assert not (tmp_path / "run" / "eval" / "test").exists()
    assert ckpt.averaged_path(tmp_path / "run").is_file()


def progress_etas(text: str) -> list[tuple[int, int, str]]:
    """(update, eta in seconds, the limit named) of each progress line in a train.py log."""
    found = re.findall(r"update (\d+) \|.*\| eta (\d+):(\d\d):(\d\d) \((\S+?)[)=]", text)
    return [(int(u), int(h) * 3600 + int(m) * 60 + int(s), limit) for u, h, m, s, limit in found]


def test_the_progress_line_eta_counts_down_max_time_when_it_ends_the_run_first(corpus, tmp_path, monkeypatch,
                                                                                  capfd):
    """On a clock where an update costs 10 s (and validations and saves nothing), a max_time=100 run with
    max_steps far away logs after update n an ETA of max_time minus what it spent, 100 − 10·n seconds, and
    names max_time; a run whose max_steps comes first names max_steps and counts the updates left."""
    clock = FakeClock(update=10.0, validation=0.0, save=0.0)
    run_on_fake_clock(clock, monkeypatch.setattr)
    changes = {"train.max_steps": 100000, "train.max_time": 100, "train.log_every_steps": 1,
               "train.save_every_steps": 1000, "train.valid_every_steps": 1000}
    run(corpus, tmp_path / "by_time", changes)
    log = capfd.readouterr().err
    etas = progress_etas(log)
    assert len(etas) >= 5 and "the run ends at the first of max_steps=100000, max_time=100s" in log
    assert all(limit == "max_time" and eta == 100 - 10 * update for update, eta, limit in etas), etas

    run(corpus, tmp_path / "by_steps", {**changes, "train.max_steps": 4, "train.max_time": 1000})
    assert progress_etas(capfd.readouterr().err) == [
        (1, 30, "max_steps"), (2, 20, "max_steps"), (3, 10, "max_steps"), (4, 0, "max_steps")]
