"""Fine-tuning (`init_from`, `data.vocab`, `train.freeze`, `train.train_top_layers`): what it loads, what it
carries over between vocabularies, what it keeps fixed, and that it beats training from scratch.

A 2+2-layer, d_model=32 parent is trained once on a generated English → German corpus (`setup`). Children
fine-tune it in this process through `train.main` on: another sample of the same generator (a new domain,
the parent's vocabulary) or a "new language" whose target words are spelled backwards (a vocabulary trained
on it, `data.vocab=transfer`). The weights a run starts from are read when train.py builds the optimizer.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from data.vocab import Vocab  # noqa: E402
from helpers import (  # noqa: E402
    PIECES, SMALL, Corpus, assert_training_states_equal, subprocess_env, tensorboard_scalars, tiny_model,
    train_main)
from transformer import checkpoint as ckpt  # noqa: E402
from transformer.training import finetune  # noqa: E402
from transformer.training import run as training_run  # noqa: E402
from transformer.checkpoint import CheckpointError  # noqa: E402
from transformer.cli import ConfigError, compose_config  # noqa: E402
from transformer.model import Transformer, TransformerConfig  # noqa: E402

MODEL = {"model.d_model": 32, "model.heads": 2, "model.d_ff": 64, "model.encoder_layers": 2, "model.decoder_layers": 2}
# The parent: short sentences, a gentle learning rate for d_model=32, no dropout: in 80 updates its validation
# loss falls well below what any unigram model reaches (~4.8 here), which 6 updates from scratch cannot.
PARENT = {**MODEL, "model.dropout": 0.0, "data.max_len": 10, "train.max_tokens": 1024, "train.lr_scale": 0.2,
          "train.warmup_steps": 10, "train.max_steps": 80}


# ------------------------------------------------------------------------------------ helpers, fixtures


class Setup:
    """The parent's corpus and run, and the two corpora children fine-tune on."""

    def __init__(self, directory: Path, corpus: Corpus, parent_dir: Path):
        self.corpus, self.parent_dir = corpus, parent_dir
        self.domain = {"train": directory / "domain" / "train", "valid": directory / "domain" / "valid"}
        self.reversed = {"train": directory / "reversed" / "train", "valid": directory / "reversed" / "valid"}

    @property
    def parent(self) -> dict:
        """The checkpoint `init_from=<parent run_dir>` reads (averaged.pt, here the average of one)."""
        return ckpt.load(ckpt.resolve(self.parent_dir))

    def child(self, run_dir: Path, changes: dict | None = None, *, data: str = "domain") -> list[str]:
        """Overrides of a fine-tuning run from the parent (no vocabulary given: data.vocab decides)."""
        prefixes = self.domain if data == "domain" else self.reversed
        values = {**MODEL, "init_from": self.parent_dir, "data.cache_dir": "null",
                  "data.train_prefix": prefixes["train"], "data.valid_prefix": prefixes["valid"],
                  "data.tgt_lang": "de" if data == "domain" else "rd", "train.max_steps": 3}
        return self.corpus.overrides(run_dir, {**values, **(changes or {})}, vocab=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    """A parent trained for 80 updates; a new-domain corpus (another sample); a reversed-target corpus."""
    from quickstart.corpus import write_corpus

    directory = tmp_path_factory.mktemp("finetune")
    corpus = Corpus(directory)
    write_corpus(directory / "corpus", train=300, valid=16, test=0, seed=1)
    assert train_main(corpus.overrides(directory / "prep", {"prepare_only": "true"}, vocab=False)) == 0
    s = Setup(directory, corpus, directory / "parent")
    assert train_main(corpus.overrides(s.parent_dir, PARENT)) == 0

    write_corpus(directory / "domain", train=300, valid=16, test=0, seed=2)
    for split in ("train", "valid"):
        source = corpus.prefixes[split]
        s.reversed[split].parent.mkdir(parents=True, exist_ok=True)
        s.reversed[split].with_suffix(".en").write_text(source.with_suffix(".en").read_text(encoding="utf-8"),
                                                        encoding="utf-8")
        lines = source.with_suffix(".de").read_text(encoding="utf-8").splitlines()
        s.reversed[split].with_suffix(".rd").write_text(
            "".join(" ".join(word[::-1] for word in line.split()) + "\n" for line in lines), encoding="utf-8")
    return s


@pytest.fixture
def start(monkeypatch) -> dict:
    """Filled, when train.py builds the optimizer, with the model's weights at that moment (a copy) and
    the parameters handed to the optimizer."""
    seen: dict = {}
    real_transformer, real_optimizer = training_run.Transformer, training_run.make_optimizer

    def transformer(config):
        seen["model"] = real_transformer(config)
        return seen["model"]

    def optimizer(params, **kwargs):
        params = list(params)
        seen["weights"] = {k: v.detach().clone() for k, v in seen["model"].state_dict().items()}
        seen["optimized"] = {id(p) for p in params}
        return real_optimizer(params, **kwargs)

    monkeypatch.setattr(training_run, "Transformer", transformer)
    monkeypatch.setattr(training_run, "make_optimizer", optimizer)
    return seen


def fresh_model(model_config: dict, seed: int = 1) -> dict:
    """The weights train.py's model starts with before anything is loaded (it seeds with `seed`)."""
    torch.manual_seed(seed)
    return Transformer(TransformerConfig(**model_config)).state_dict()


# ------------------------------------------------------------------------------------------- loading


def test_init_from_loads_every_tensor_exactly(setup, tmp_path, start):
    assert train_main(setup.child(tmp_path)) == 0

    parent = setup.parent
    assert start["weights"].keys() == parent["model"].keys()
    for name, tensor in parent["model"].items():
        assert torch.equal(start["weights"][name], tensor), name
    # It means something: a freshly initialised model differs in every tensor but the LayerNorm ones.
    fresh = fresh_model(parent["model_config"])
    assert not torch.equal(fresh["embedding.weight"], parent["model"]["embedding.weight"])
    # data.vocab=keep (the default): the run uses the parent's vocabulary.
    assert (tmp_path / "spm.model").read_bytes() == ckpt.spm_bytes(parent)
    assert ckpt.load(ckpt.last_path(tmp_path))["optimizer"]["state"]  # a fresh Adam that has now stepped


def test_transfer_keeps_shared_piece_embeddings_bit_identical(setup, tmp_path, start, capsys):
    assert train_main(setup.child(tmp_path, {"data.vocab": "transfer"}, data="reversed")) == 0

    parent = setup.parent
    old, new = Vocab.from_bytes(ckpt.spm_bytes(parent)), Vocab.load(tmp_path / "spm.model")
    old_pieces = {old.pieces([i])[0]: i for i in range(old.size)}
    embedding = start["weights"]["embedding.weight"]
    fresh = fresh_model({**parent["model_config"], "vocab_size": new.size})["embedding.weight"]
    shared = 0
    for i in range(new.size):
        piece = new.pieces([i])[0]
        if i < 4 or piece in old_pieces:  # PAD, UNK, BOS, EOS by id; the rest by piece
            assert torch.equal(embedding[i], parent["model"]["embedding.weight"][i if i < 4 else old_pieces[piece]])
            shared += 1
        else:
            assert torch.equal(embedding[i], fresh[i]), piece  # the model's own N(0, d^-0.5) initialisation
    assert 4 < shared < new.size  # some pieces carried over (English, bytes), some new (reversed words)
    for name, tensor in parent["model"].items():
        if name != "embedding.weight":
            assert torch.equal(start["weights"][name], tensor), name
    assert f"carried over {shared} of {new.size} pieces" in capsys.readouterr().err


def test_shared_pieces_maps_specials_by_id_and_the_rest_by_string():
    old = ["<pad>", "<unk>", "<s>", "</s>", "▁a", "b", "c"]
    new = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "c", "▁a", "d", "<s>"]
    assert finetune.shared_pieces(old, new, (0, 1, 2, 3)) == ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 4])


def test_load_pretrained_names_missing_and_misshapen_tensors():
    model = tiny_model(vocab_size=40, **SMALL, dropout=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["embedding.weight"] += 1.0  # so that a load that went through would show
    name = next(k for k in state if k.startswith("decoder.layers.0.") and state[k].dim() == 2)
    with pytest.raises(CheckpointError, match=r"^init_from=x does not fit this model \(shapes: ") as error:
        finetune.load_pretrained(model, {**state, name: torch.zeros(3, 3)}, source="init_from=x")
    assert "\n" not in str(error.value) and f"{name} (3, 3) vs {tuple(state[name].shape)}" in str(error.value)
    gone = next(k for k in state if k.startswith("encoder.layers.0."))
    with pytest.raises(CheckpointError, match=f"missing {gone}"):
        finetune.load_pretrained(model, {k: v for k, v in state.items() if k != gone}, source="init_from=x")
    assert not torch.equal(model.embedding.weight, state["embedding.weight"])  # failed loads changed nothing
    assert finetune.load_pretrained(model, state, source="init_from=x") is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


# ------------------------------------------------------------------------------------------- freezing


@pytest.mark.parametrize(("changes", "frozen_prefixes"), [
    ({"train.freeze": "[encoder]"}, ("encoder.",)),
    ({"train.freeze": "[embeddings]"}, ("embedding.",)),
    ({"train.train_top_layers": 1}, ("encoder.layers.0.", "decoder.layers.0.")),
])
def test_frozen_parameters_do_not_change(setup, tmp_path, start, changes, frozen_prefixes):
    steps = {"train.max_steps": 4, "train.save_every_steps": 2, "train.average_last": 2}
    assert train_main(setup.child(tmp_path, {**steps, **changes})) == 0

    parent = setup.parent["model"]
    model = start["model"]
    for checkpoint in (ckpt.last_path(tmp_path), ckpt.averaged_path(tmp_path)):
        weights = ckpt.load(checkpoint)["model"]
        for name, tensor in weights.items():
            if name.startswith(frozen_prefixes):
                assert torch.equal(tensor, parent[name]), f"{checkpoint.name}: frozen {name} changed"
            else:
                assert not torch.equal(tensor, parent[name]), f"{checkpoint.name}: trainable {name} did not train"
    for name, param in model.named_parameters():  # the optimizer never even held the frozen ones
        assert (id(param) in start["optimized"]) != name.startswith(frozen_prefixes), name


def test_freeze_names_the_shared_embedding_and_top_layers():
    model = tiny_model(vocab_size=40, **{**SMALL, "encoder_layers": 3, "decoder_layers": 2}, norm_first=True)
    frozen = finetune.freeze(model, parts=["embeddings"], train_top_layers=1)
    stems = sorted({".".join(name.split(".")[:3]) if ".layers." in name else name for name in frozen})
    assert stems == ["decoder.layers.0", "embedding.weight", "encoder.layers.0", "encoder.layers.1"]
    assert model.encoder.final_norm.weight.requires_grad  # the top of a pre-norm stack trains
    assert finetune.describe_frozen(model, frozen).startswith(
        "frozen: embedding, encoder.layers.0, encoder.layers.1, decoder.layers.0; training ")


# ------------------------------------------------------------------------------------------- it helps


def test_finetuning_reaches_lower_validation_loss_than_scratch(setup, tmp_path):
    same = {"train.max_steps": 6, "train.valid_every_steps": 6, "train.warmup_steps": 4, "train.lr_scale": 0.2}
    assert train_main(setup.child(tmp_path / "finetuned", same)) == 0
    scratch = setup.child(tmp_path / "scratch", same)
    scratch = [o for o in scratch if not o.startswith("init_from=")]
    assert train_main(scratch + [f"data.spm_model={setup.corpus.spm_model}"]) == 0

    finetuned_loss = tensorboard_scalars(tmp_path / "finetuned", "valid/loss")[6]
    scratch_loss = tensorboard_scalars(tmp_path / "scratch", "valid/loss")[6]
    assert finetuned_loss < scratch_loss - 0.2, (finetuned_loss, scratch_loss)
    assert scratch_loss > 0.75 * math.log(PIECES)  # 6 updates from scratch: not far below uniform


# ------------------------------------------------------------------------------------------- resume, DDP


def test_resumed_transfer_run_matches_uninterrupted_and_does_not_transfer_again(setup, tmp_path, capsys):
    changes = {"data.vocab": "transfer", "train.freeze": "[encoder]", "train.max_steps": 5,
               "train.save_every_steps": 2, "train.average_last": 2}
    whole = tmp_path / "whole"
    assert train_main(setup.child(whole, changes, data="reversed")) == 0
    resumed = tmp_path / "resumed"
    assert train_main(setup.child(resumed, {**changes, "train.max_steps": 3}, data="reversed")) == 0
    capsys.readouterr()
    assert train_main(setup.child(resumed, changes, data="reversed")) == 0

    err = capsys.readouterr().err
    assert "is ignored: resuming" in err and "carried over" not in err
    assert_training_states_equal(ckpt.load(ckpt.last_path(resumed)), ckpt.load(ckpt.last_path(whole)))
    assert (resumed / "spm.model").read_bytes() == (whole / "spm.model").read_bytes()


def test_a_finetuned_run_resumes_after_its_parent_is_gone(setup, tmp_path):
    """init_from is read when the run starts: a resumed child needs neither its file (archived, or not on this
    node) nor model.* keys, whose values it adopted from the parent then and keeps in its own checkpoint."""
    parent = tmp_path / "parent"
    shutil.copytree(setup.parent_dir, parent)

    def child(run_dir: Path, steps: int) -> list[str]:
        changes = {"init_from": parent, "data.vocab": "transfer", "train.max_steps": steps,
                   "train.save_every_steps": 2, "train.average_last": 2}
        return [o for o in setup.child(run_dir, changes, data="reversed") if o.split("=")[0].split(".")[0] != "model"]

    assert train_main(child(tmp_path / "whole", 5)) == 0
    assert train_main(child(tmp_path / "resumed", 3)) == 0
    shutil.rmtree(parent)
    assert train_main(child(tmp_path / "resumed", 5)) == 0
    resumed, whole = (ckpt.load(ckpt.last_path(tmp_path / name)) for name in ("resumed", "whole"))
    assert resumed["model_config"]["d_model"] == 32 and resumed["config"]["model"] == whole["config"]["model"]
    assert_training_states_equal(resumed, whole)
    with pytest.raises(ConfigError, match="init_from=.*parent.*does not exist"):  # a new child still needs it
        train_main(child(tmp_path / "new", 5))


def test_resume_with_other_freezing_is_one_line_error(setup, tmp_path):
    assert train_main(setup.child(tmp_path, {"train.max_steps": 1})) == 0
    with pytest.raises(ConfigError) as error:
        train_main(setup.child(tmp_path, {"train.max_steps": 2, "train.freeze": "[decoder]"}))
    assert "\n" not in str(error.value) and "train.freeze: [] → ['decoder']" in str(error.value)


@pytest.mark.slow
def test_finetuning_two_ranks_equal_one_rank_and_keep_frozen_weights(setup, tmp_path):
    changes = {"train.max_steps": 3, "train.train_top_layers": 1, "data.cache_dir": tmp_path / "cache"}
    two = tmp_path / "two"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "train.py"), *setup.child(two, {**changes, "train.update_freq": 1})]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_main(setup.child(tmp_path / "one", {**changes, "train.update_freq": 2})) == 0

    ddp, one = ckpt.load(ckpt.last_path(two)), ckpt.load(ckpt.last_path(tmp_path / "one"))
    parent = setup.parent["model"]
    for name in parent:
        assert (ddp["model"][name] - one["model"][name]).abs().max().item() <= 1e-5, name
        if ".layers.0." in name:
            assert torch.equal(ddp["model"][name], parent[name]), name


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("changes", "message"), [
    ({"model.d_model": 24}, "has another architecture (model.d_model: 32 → 24)"),
    ({"data.vocab": "new"}, "data.vocab=new is not one of keep, transfer"),
    ({"init_from": "null", "data.vocab": "transfer"}, "data.vocab=transfer needs init_from="),
    ({"train.freeze": "[encoder,lm_head]"}, "train.freeze names 'lm_head': the parts that can be frozen are"),
    ({"train.train_top_layers": 3}, "train.train_top_layers=3 must be null (train every layer) or an integer from 0 to 2"),
    ({"train.freeze": "[encoder,decoder,embeddings]"}, "freeze every parameter: nothing would train"),
])
def test_bad_finetuning_settings_are_one_line_errors(setup, tmp_path, changes, message):
    with pytest.raises(ConfigError) as error:
        train_main(setup.child(tmp_path, changes))
    assert "\n" not in str(error.value)
    assert message in str(error.value)
    assert not ckpt.last_path(tmp_path).exists()


def test_other_vocabulary_without_transfer_is_one_line_error(setup, tmp_path):
    other = Vocab.load(setup.corpus.spm_model)  # the parent's, so first show that it is accepted ...
    assert train_main(setup.child(tmp_path / "same", {"data.spm_model": setup.corpus.spm_model})) == 0
    reversed_run = tmp_path / "reversed"
    assert train_main(setup.child(reversed_run, {"data.vocab": "transfer", "train.max_steps": 1}, data="reversed")) == 0
    assert Vocab.load(reversed_run / "spm.model").sha256 != other.sha256
    # ... then one that is not the checkpoint's, with data.vocab=keep
    with pytest.raises(ConfigError) as error:
        train_main(setup.child(tmp_path / "bad", {"data.spm_model": reversed_run / "spm.model"}))
    assert "\n" not in str(error.value)
    assert "is not the vocabulary of init_from=" in str(error.value) and "data.vocab=transfer" in str(error.value)


@pytest.mark.slow
def test_incompatible_init_from_exits_with_one_line(setup, tmp_path):
    command = [sys.executable, str(ROOT / "train.py"), *setup.child(tmp_path, {"model.heads": 4,
                                                                              "model.d_ff": 48})]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: init_from="), result.stderr
    assert "model.heads: 2 → 4" in lines[0] and "model.d_ff: 64 → 48" in lines[0]


def test_finetune_experiment_composes_with_documented_defaults():
    cfg = compose_config(["experiment=finetune", "init_from=runs/x"])
    assert cfg.data.vocab == "keep" and list(cfg.train.freeze) == [] and cfg.train.train_top_layers is None
    assert (cfg.train.warmup_steps, cfg.train.lr_scale) == (1000, 0.5)
    peak = cfg.train.lr_scale * (cfg.model.d_model * cfg.train.warmup_steps) ** -0.5
    assert peak == pytest.approx((cfg.model.d_model * 4000) ** -0.5)  # the paper schedule's peak (yaml header)
    assert cfg.train.average_last <= cfg.train.keep_last
