"""The config schema (transformer/config.py) and the entry points as Hydra apps: --help, --cfg job, -m."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from transformer.cli import ConfigError, compose_config, to_job
from transformer.config import ARCH_KEYS, DecodeConfig, ModelConfig, TrainConfig, TrainJob, model_preset


def job(*overrides: str) -> TrainJob:
    return to_job(compose_config(list(overrides)))


# The paper's Table 3 rows and §5/§6.1 settings; big EN-FR uses P_drop 0.1 (§6.1), big EN-DE 0.3.
PAPER = {
    "paper_base_en_de": dict(d_model=512, d_ff=2048, heads=8, dropout=0.1, steps=100_000, average=5, vocab=37000),
    "paper_base_en_fr": dict(d_model=512, d_ff=2048, heads=8, dropout=0.1, steps=100_000, average=5, vocab=32000),
    "paper_big_en_de": dict(d_model=1024, d_ff=4096, heads=16, dropout=0.3, steps=300_000, average=20, vocab=37000),
    "paper_big_en_fr": dict(d_model=1024, d_ff=4096, heads=16, dropout=0.1, steps=300_000, average=20, vocab=32000),
}


@pytest.mark.parametrize("preset", sorted(PAPER))
def test_every_paper_preset_composes_to_the_papers_values(preset):
    paper, j = PAPER[preset], job(f"experiment={preset}")
    m, t, d = j.model, j.train, j.decode
    assert (m.encoder_layers, m.decoder_layers, m.d_model, m.d_ff, m.heads) == (6, 6, paper["d_model"], paper["d_ff"],
                                                                                paper["heads"])
    assert m.dropout == paper["dropout"] and not m.norm_first
    assert (t.warmup_steps, t.label_smoothing, t.tokens_per_update) == (4000, 0.1, 25000)
    assert (t.max_steps, t.average_last) == (paper["steps"], paper["average"]) and t.keep_last >= t.average_last
    assert (d.beam, d.lenpen, d.lenpen_style, d.max_len_a, d.max_len_b) == (4, 0.6, "gnmt", 1, 50)
    assert j.data.vocab_size == paper["vocab"]


def test_the_multi30k_presets_stop_near_their_validation_best_within_two_hours_and_leave_the_test_set_alone():
    """experiment=multi30k_en_de / _en_fr (docs/RESULTS.md, issue #45): a member of the two-seed ensemble trains
    for 8,500 updates (where validation perplexity was lowest) or two hours of wall clock, whichever ends first,
    averages its last 15 checkpoints, and does not translate the test set (evaluate.py scores the ensemble once).
    The presets built on them keep their own budgets, averaging windows and test translation."""
    for name in ("multi30k_en_de", "multi30k_en_fr"):
        t = job(f"experiment={name}").train
        assert (t.max_time, t.max_steps, t.max_epochs, t.test_at_end) == (7200, 8500, None, False), name
        assert (t.save_every_steps, t.keep_last, t.average_last) == (200, 15, 15), name  # 5,700-8,500
    for name, steps in (("multi30k_multilingual", 10_000), ("multi30k_multilingual_add_cs", 5_000),
                        ("bt_multi30k_de_en", 2_000)):
        t = job(f"experiment={name}").train
        assert (t.max_steps, t.max_time) == (steps, None), name
        assert (t.keep_last, t.average_last) == (5, 5), name  # the EN→DE preset's window of 15 is its own
        assert t.test_at_end == (name != "bt_multi30k_de_en"), name
    for name, hours in (("distill_multi30k_en_de_deep_shallow", 2), ("distill_multi30k_en_de_narrow", 2)):
        distilled = job(f"experiment={name}")
        t, m = distilled.train, distilled.model
        assert (t.max_time, t.test_at_end, t.average_last) == (3600 * hours, True, 5), name
        assert (m.decoder_layers, m.norm_first) == (1, True), name  # a deep post-norm encoder barely learnt here
    member = job("experiment=distill_multi30k_en_de_member")  # the teacher's shape, from one of its members
    assert member.model == job("experiment=multi30k_en_de").model and member.decode.beam == 1
    assert (member.init_from, member.data.vocab) == ("runs/multi30k_en_de_seed2", "keep")
    assert list(member.distill.teacher) == ["runs/multi30k_en_de", "runs/multi30k_en_de_seed2"]
    assert (member.train.max_time, member.train.average_last, member.train.test_at_end) == (3900, 10, True)


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "configs" / "model").glob("*.yaml")))
def test_every_model_preset_is_a_yaml_file_the_schema_checks(preset, tmp_path):
    """configs/model/<preset>.yaml composes through ModelConfig (Hydra, `model=<preset>`) and reads the same from
    Python (`model_preset`); a key the schema does not have is refused."""
    assert job(f"model={preset}").model == model_preset(preset)
    assert preset != "base" or model_preset("base") == ModelConfig()  # the schema's defaults are the paper's base
    bad = tmp_path / "configs"
    (bad / "model").mkdir(parents=True)
    (bad / "config.yaml").write_text("")
    (bad / "model" / f"{preset}.yaml").write_text((ROOT / "configs" / "model" / f"{preset}.yaml").read_text()
                                                  + "d_modle: 3\n")
    import transformer.config as schema

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schema, "config_dir", lambda: bad)
        with pytest.raises(ConfigError, match="d_modle"):
            model_preset(preset)


def test_the_default_is_the_base_model_and_the_quickstart_uses_model_tiny():
    assert job().model == ModelConfig() and job().train == TrainConfig() and job().decode == DecodeConfig()
    tiny = {"d_model": 128, "heads": 4, "d_ff": 512, "encoder_layers": 2, "decoder_layers": 2}
    # the tiny architecture; of the model group only dropout (a training choice) is the quickstart's own
    assert dataclasses.asdict(job("experiment=quickstart").model) == {**dataclasses.asdict(ModelConfig()), **tiny,
                                                                      "dropout": 0.0}
    assert yaml.safe_load((ROOT / "configs" / "experiment" / "quickstart.yaml").read_text())["model"] == {"dropout": 0.0}


def test_the_architecture_keys_are_the_model_dataclass_fields():
    assert set(ARCH_KEYS) == {f.name for f in dataclasses.fields(ModelConfig)} - {"dropout", "attention_dropout",
                                                                                 "activation_dropout"}


@pytest.mark.parametrize(("override", "message"), [
    ("train.max_steps=abc", "train.max_steps=abc is invalid: Value 'abc' of type 'str' could not be converted"),
    ("model.d_modle=8", "Could not override 'model.d_modle'"),
    ("decode.beam=0", "decode.beam=0 must be a positive integer"),
    ("train.precision=fp8", "train.precision=fp8 is not one of auto, fp32, bf16, fp16"),
    ("train.valid_bleu_lines=0", "train.best_metric=bleu needs BLEU at validation"),
    ("quickstart", "'quickstart' is not a key=value override: e.g. experiment=quickstart"),
])
def test_a_wrong_type_an_unknown_key_or_a_bad_value_is_refused_naming_the_key(override, message):
    from data.errors import one_line

    with pytest.raises(Exception) as error:
        job(override)
    assert message in one_line(error.value)


def test_the_group_dataclasses_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DecodeConfig().beam = 5
    with pytest.raises(TypeError):
        DecodeConfig(4)  # the positional form is refused
    with pytest.raises(ConfigError, match="decode.nbest=5 exceeds decode.beam=4"):
        DecodeConfig(nbest=5)


def app(script: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("script", ["train.py", "translate.py", "evaluate.py"])
def test_help_prints_the_config_groups_and_how_to_override(script, tmp_path):
    result = app(script, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "== Configuration groups ==" in result.stdout and "decode: greedy, paper" in result.stdout
    assert "key=value" in result.stdout and script in result.stdout
    assert list(tmp_path.iterdir()) == []  # no outputs/, .hydra/ or log file


def test_cfg_job_prints_the_resolved_config_and_creates_nothing(tmp_path):
    result = app("train.py", "experiment=paper_big_en_de", "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["model"]["d_model"] == 1024 and printed["model"]["dropout"] == 0.3
    assert printed["train"]["average_last"] == 20
    assert list(tmp_path.iterdir()) == [] and not (ROOT / "runs" / "paper_big_en_de-wmt14-en-de").exists()


@pytest.mark.slow
def test_multirun_runs_one_job_per_value_each_in_its_own_run_dir(corpus, tmp_path):
    """`train.py -m key=a,b`: one job per value, each in its own numbered run dir under run_dir, and nothing
    written where the command was started. On the suite's small corpus (its prepared vocabulary): the
    quickstart's generated 30k pairs, made and encoded once a job, cost 20 s here."""
    run_dir = tmp_path / "sweep"
    result = app("train.py", "-m", *corpus.overrides(run_dir, {"train.max_steps": 1, "train.save_every_steps": 1,
                                                               "train.valid_every_steps": 1,
                                                               "data.cache_dir": "null"}),  # each job's own
                 "train.lr_scale=0.5,1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # nothing in the working directory
    assert not list(tmp_path.rglob(".hydra")) and not list(tmp_path.rglob("*.log"))  # nor in the run dirs
    for number, lr_scale in ((0, 0.5), (1, 1.0)):
        saved = yaml.safe_load((run_dir / str(number) / "config.yaml").read_text())
        assert saved["train"]["lr_scale"] == lr_scale and saved["run_dir"] == str(run_dir / str(number))
        assert (run_dir / str(number) / "checkpoints" / "averaged.pt").is_file()
        assert (run_dir / str(number) / "data").is_dir()  # the encoded corpus, in the job's run dir
    assert (run_dir / "multirun.yaml").is_file()


def test_precision_auto_is_bf16_only_on_gpus_with_native_bf16(monkeypatch):
    import torch

    from transformer.training.run import resolve_precision

    assert job().train.precision == "auto" and job("experiment=paper_big_en_de").train.precision == "auto"
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    for capability, expected in (((8, 0), "bf16"), ((9, 0), "bf16"), ((7, 0), "fp32"), ((6, 0), "fp32")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert resolve_precision("auto", torch.device("cuda", 0)) == expected, capability
    assert resolve_precision("fp16", torch.device("cuda", 0)) == "fp16"  # an explicit choice stays


def test_fp32_training_on_a_gpu_turns_tf32_matmuls_off():
    """train.precision=fp32 is the paper's arithmetic: float32 matmuls, not the TF32 the entry points turn on."""
    import torch

    from transformer.training.run import set_tf32

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # put back after
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as pick_device leaves them
        for precision, device, tf32 in (("bf16", "cuda", True), ("fp32", "cpu", True), ("fp32", "cuda", False),
                                        ("fp16", "cuda", True)):
            set_tf32(precision, torch.device(device))
            assert torch.backends.cuda.matmul.allow_tf32 == torch.backends.cudnn.allow_tf32 == tf32, (precision, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_a_bare_path_for_translate_or_evaluate_says_to_write_checkpoint():
    for config_name in ("translate", "evaluate"):
        with pytest.raises(ConfigError, match="write checkpoint=runs/quickstart"):
            compose_config(["runs/quickstart"], config_name=config_name)
