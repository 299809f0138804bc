"""The configuration schema: one frozen, keyword-only dataclass per config group, checked in one place.

The groups `model`, `data`, `train` and `decode` of `configs/` are backed by `ModelConfig`, `DataConfig`,
`TrainConfig` and `DecodeConfig` (`DataConfig` is data/config.py's: the lower package reads it);
`TrainJob`, `TranslateJob` and `EvaluateJob` are the whole configs of train.py, translate.py and evaluate.py.
Each dataclass's `__post_init__` holds its range checks (a one-line ConfigError). This module is plain
dataclasses: the model and the Translator use it without Hydra or OmegaConf. transformer/cli.py registers
them with Hydra's ConfigStore (`register()`) as the schemas of `configs/{config,translate,evaluate}.yaml`,
so OmegaConf refuses a value of the wrong type or an unknown key and names it, and `to_job(cfg)` turns a
composed config into the job's dataclass, running those checks.

The defaults are the paper's: `ModelConfig()` is the base model (Table 3), `TrainConfig()` the §5 recipe and
`DecodeConfig()` §6.1's search. The model presets (`model=base|big|tiny`) are YAML files, configs/model/, like
every other preset; `model_preset(name)` reads one from Python through the same schema.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from data.config import DataConfig, at_least, one_of, require
from data.errors import ConfigError
from data.paths import READ, READ_FILE, WRITE_DIR, WRITE_FILE, path_field


# ------------------------------------------------------------------------------------------------ model


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """`model.*`: the architecture (§3). The defaults are the paper's base model (Table 3, first row)."""

    d_model: int = 512
    heads: int = 8
    d_ff: int = 2048
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float = 0.1  # §5.4: on each sublayer's output and on the embeddings + positions
    # Dropouts the paper has not (0 = off), which small-data recipes use (fairseq's --attention-dropout and
    # --activation-dropout): on the attention weights, and on the feed-forward's hidden activation.
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    norm_first: bool = False  # False: the paper's post-norm. True: pre-norm, a later variant.
    # Variants that Marian / OPUS-MT checkpoints use (transformer/interop/marian.py imports them); off = the paper.
    activation: str = "relu"  # the feed-forward's nonlinearity: relu (§3.3) | gelu | swish
    attention_bias: bool = False  # biases on W^Q, W^K, W^V and W^O (the paper's projections have none)
    scale_embedding: bool = True  # embeddings × √d_model (§3.4); Marian's converted models: false
    logits_bias: bool = False  # a fixed (untrained) bias on the logits: Marian's final_logits_bias
    shared_embeddings: bool = True  # one matrix for source, target and softmax (§3.4); false: the decoder's own
    # Variants of Table 3 (docs/TABLE3.md); off = the paper's base.
    d_k: Optional[int] = None  # row (B): query/key width per head; null: d_model // heads (d_v is d_model // heads)
    positions: str = "sinusoidal"  # sinusoidal (§3.5) | learned: row (E), a trained table of max_positions rows
    max_positions: int = 1024  # positions=learned: the most positions of a source (pieces + EOS) or a target

    def __post_init__(self) -> None:
        for name in ("d_model", "heads", "d_ff", "encoder_layers", "decoder_layers"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"model.{name}={value!r} is invalid: set it to a positive integer")
        require(self.d_model % self.heads == 0, f"model.d_model={self.d_model} is not divisible by "
                                                 f"model.heads={self.heads}: choose d_model a multiple of heads")
        for name in DROPOUTS:
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1,
                    f"model.{name}={value!r} is invalid: choose a probability in [0, 1)")
        for name in ("norm_first", "attention_bias", "scale_embedding", "logits_bias", "shared_embeddings"):
            require(isinstance(getattr(self, name), bool),
                    f"model.{name}={getattr(self, name)!r} is invalid: set it to true or false")
        one_of("model.activation", self.activation, ACTIVATION_NAMES, " (relu is the paper's)")
        require(self.d_k is None or (isinstance(self.d_k, int) and not isinstance(self.d_k, bool) and self.d_k >= 1),
                f"model.d_k={self.d_k!r} is invalid: set it to a positive integer (the query/key width per head) "
                "or null (d_model / heads)")
        one_of("model.positions", self.positions, POSITIONS, " (sinusoidal is the paper's)")
        require(isinstance(self.max_positions, int) and not isinstance(self.max_positions, bool)
                and self.max_positions >= 2,
                f"model.max_positions={self.max_positions!r} is invalid: set it to an integer >= 2 (the rows of "
                "the learned position table)")

    @property
    def key_width(self) -> int:
        """d_k of §3.2.2: the width of each head's queries and keys (d_model / heads unless `d_k` is set)."""
        return self.d_model // self.heads if self.d_k is None else self.d_k

    @property
    def value_width(self) -> int:
        """d_v of §3.2.2: the width of each head's values, d_model / heads (Concat of the heads is d_model wide)."""
        return self.d_model // self.heads


ACTIVATION_NAMES = ("relu", "gelu", "swish")  # gelu: the exact (erf) GELU; swish: x·sigmoid(x) (SiLU), as Marian's
POSITIONS = ("sinusoidal", "learned")  # §3.5's sinusoids | Table 3 row (E): learned positional embeddings


def model_config_with_defaults(saved: dict) -> dict:
    """A `model.*` dict saved before a key existed, completed with that key's default (the paper's choice),
    so that old checkpoints and run configs load and compare as the model they were."""
    return {**{f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name not in saved}, **saved}


# Keys whose change makes a saved run a different model: resuming or fine-tuning with other values is an
# error. Every architecture field; the dropouts are training choices.
DROPOUTS = ("dropout", "attention_dropout", "activation_dropout")
ARCH_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in DROPOUTS)
# The data.* keys whose change makes a saved run a different run (compared on resume with ARCH_KEYS).
DATA_KEYS = ("src_lang", "tgt_lang", "vocab_size", "spm_model", "dataset", "subset", "revision", "train_prefix",
             "valid_prefix", "test_prefix", "train_split", "valid_split", "test_split", "max_len", "max_len_ratio",
             "dedup", "lowercase")

def config_dir() -> Path:
    """The Hydra config tree: `transformer/configs` where a wheel installed it (pyproject.toml ships the
    checkout's `configs/` there, for the console scripts), else `configs/` beside the package in a checkout
    or an editable install. The installed copy is looked for first: the folder above an installed package
    is site-packages, where another project's `configs` may lie."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "configs", package.parent / "configs"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(f"no Hydra configs in {package / 'configs'} or {package.parent / 'configs'}: run from a "
                      "checkout of the project or reinstall it (pip install .)")


def model_preset(name: str) -> ModelConfig:
    """The model preset `model=<name>` (configs/model/<name>.yaml: base, big, tiny) without Hydra, checked by
    the same schema: ModelConfig refuses an unknown key and checks the values."""
    import yaml  # here: only a preset read from Python needs it (Hydra reads them for the entry points)

    path = config_dir() / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no model preset {name!r} in {path.parent}: choose one of "
                          f"{sorted(p.stem for p in path.parent.glob('*.yaml'))}")
    try:
        return ModelConfig(**(yaml.safe_load(path.read_text(encoding="utf-8")) or {}))
    except TypeError as error:
        raise ConfigError(f"{path}: {error}") from None


# ------------------------------------------------------------------------------------------------ train


FREEZABLE = ("encoder", "decoder", "embeddings")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """`train.*`: the §5 recipe (Adam(0.9, 0.98, 1e-9) is fixed in transformer/training/schedule.py), the stopping
    rules, and how often to log, validate and save."""

    max_tokens: int = 4096  # most tokens per rank per forward pass: batch size × max(padded src, padded tgt length)
    tokens_per_update: int = 25000  # the update's size, kept at any world size (training.plan_update)
    update_freq: Optional[int] = None  # passes per update; null: derived with each pass's budget (plan_update)
    # A batch's source and target lengths padded up to a multiple of this (1: to the longest sentence, the
    # paper's). 8: a few dozen distinct shapes instead of hundreds, so fewer kernels compiled and cached
    # (oneDNN's per-shape kernels on CPU, train.compile's graphs), at the cost of some padding (docs/BENCHMARKS.md).
    pad_to_multiple: int = 1
    lr_scale: float = 1.0
    warmup_steps: int = 4000
    label_smoothing: float = 0.1
    weight_decay: float = 0.0  # decoupled (AdamW, fairseq's --weight-decay) on every parameter; 0 = the paper
    freeze: list[str] = field(default_factory=list)  # parts kept fixed: encoder | decoder | embeddings
    train_top_layers: Optional[int] = None  # k: train only the top k layers of each stack; null: all
    clip_norm: float = 0.0  # 0: no clipping, as the paper
    precision: str = "auto"  # auto (bf16 on a GPU with native bf16, else fp32) | fp32 | bf16 | fp16
    compile: bool = False
    max_steps: Optional[int] = 100000
    max_epochs: Optional[int] = None
    max_time: Optional[float] = None  # the run's wall-clock budget in seconds, all restarts (transformer/training/budget.py)
    max_nonfinite: int = 10
    save_every_steps: int = 1500
    save_every_minutes: Optional[float] = 10
    keep_last: int = 10
    average_last: int = 5
    valid_every_steps: int = 1500
    valid_bleu_lines: int = 200  # decode this many validation lines for BLEU (0: loss only)
    best_metric: str = "bleu"  # bleu | loss | nll
    patience: int = 0  # validations without improvement before stopping (0: off)
    log_every_steps: int = 100
    num_samples: int = 3  # sample translations logged at each validation
    test_at_end: bool = False  # translate the test split with the averaged model and print sacreBLEU

    def __post_init__(self) -> None:
        for key in ("max_tokens", "tokens_per_update", "warmup_steps", "save_every_steps", "valid_every_steps",
                    "log_every_steps", "max_nonfinite", "average_last", "pad_to_multiple"):
            require(getattr(self, key) > 0, f"train.{key}={getattr(self, key)} must be a positive integer")
        require(self.update_freq is None or self.update_freq > 0,
                f"train.update_freq={self.update_freq} must be a positive integer or null")
        for key in ("max_steps", "max_epochs", "max_time", "save_every_minutes"):
            at_least(f"train.{key}", getattr(self, key), 0, nullable=True)
        for key in ("keep_last", "valid_bleu_lines", "patience", "num_samples", "clip_norm"):
            at_least(f"train.{key}", getattr(self, key), 0)
        require(self.lr_scale > 0, f"train.lr_scale={self.lr_scale} must be positive")
        require(0 <= self.label_smoothing < 1, f"train.label_smoothing={self.label_smoothing} must be in [0, 1)")
        require(0 <= self.weight_decay < 1, f"train.weight_decay={self.weight_decay} must be in [0, 1) (e.g. 0.0001)")
        one_of("train.precision", self.precision, ("auto", "fp32", "bf16", "fp16"))
        one_of("train.best_metric", self.best_metric, ("bleu", "loss", "nll"))
        require(self.best_metric != "bleu" or self.valid_bleu_lines > 0,
                "train.best_metric=bleu needs BLEU at validation, but train.valid_bleu_lines=0: set "
                "train.valid_bleu_lines (e.g. 200) or train.best_metric=loss")
        require(not 0 < self.keep_last < self.average_last,
                f"train.average_last={self.average_last} exceeds train.keep_last={self.keep_last}: keep at least "
                "as many checkpoints as you average")
        unknown = [part for part in self.freeze if part not in FREEZABLE]
        require(not unknown, f"train.freeze names {', '.join(map(repr, unknown))}: the parts that can be frozen "
                              f"are {', '.join(FREEZABLE)} (e.g. train.freeze=[encoder,embeddings])")


# ----------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """`decode.*`: the paper's search (§6.1): beam 4, length penalty α = 0.6 (GNMT form), max length =
    source + 50. Used by validation BLEU, the end-of-training test translation, translate.py, evaluate.py."""

    beam: int = 4
    lenpen: float = 0.6
    lenpen_style: str = "gnmt"  # gnmt: ((5+|Y|)/6)^α, as the paper | power: |Y|^α
    max_len_a: float = 1
    max_len_b: int = 50
    min_len: int = 0
    nbest: int = 1
    max_input_len: int = 1024  # longer inputs are cropped (with a warning)
    max_tokens: int = 8000  # source tokens per decoding batch
    precision: str = "fp32"  # fp32 | bf16 (a bfloat16 copy of the weights) | int8 (CPU: int8 linear maps,
    #                          weights per output channel, kernels.int8_weights); search scores in float32
    # When beam search ends a sentence (transformer/search.py): exact = once no live beam can beat its n-best
    # (the paper's search: the same result as running to the length cap) | patience = once
    # round(beam × patience) hypotheses have ended (CTranslate2; patience 1 is fairseq's early stopping)
    stop: str = "exact"
    patience: float = 1.0
    # Sampling instead of search (back-translation, Edunov et al. 2018; search.sample_search): nbest samples a
    # sentence, each token drawn from softmax(log p / temperature) cut to the top-k tokens (0: all) and then to
    # the nucleus of mass top-p (1.0: all); a sample depends on (seed, the line's number, its rank) alone.
    sampling: bool = False
    sampling_topk: int = 0
    sampling_topp: float = 1.0
    temperature: float = 1.0
    seed: int = 1
    noise: bool = False  # noised back-translation (transformer/decoding/noise.py): delete, fill and shuffle output words
    noise_filler: str = "<blank>"

    def __post_init__(self) -> None:
        one_of("decode.lenpen_style", self.lenpen_style, ("gnmt", "power"))
        for key in ("beam", "nbest", "max_input_len", "max_tokens"):
            require(getattr(self, key) > 0, f"decode.{key}={getattr(self, key)} must be a positive integer")
        for key in ("lenpen", "max_len_a", "max_len_b", "min_len", "sampling_topk", "seed"):
            require(getattr(self, key) >= 0, f"decode.{key}={getattr(self, key)!r} must be >= 0")
        require(self.sampling or self.nbest <= self.beam,
                f"decode.nbest={self.nbest} exceeds decode.beam={self.beam}: raise the beam")
        require(0 < self.sampling_topp <= 1, f"decode.sampling_topp={self.sampling_topp!r} must be in (0, 1]")
        require(self.temperature > 0, f"decode.temperature={self.temperature!r} must be positive")
        for key in ("sampling", "noise"):
            require(isinstance(getattr(self, key), bool), f"decode.{key}={getattr(self, key)!r} must be true or false")
        require(bool(self.noise_filler.strip()) and len(self.noise_filler.split()) == 1,
                f"decode.noise_filler={self.noise_filler!r} must be one word (e.g. <blank>)")
        one_of("decode.precision", self.precision, ("fp32", "bf16", "int8"))
        one_of("decode.stop", self.stop, ("exact", "patience"))
        require(self.patience > 0, f"decode.patience={self.patience!r} must be positive")


# ------------------------------------------------------------------------------------------------- jobs


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """`distill.*`: sequence-level knowledge distillation (Kim & Rush 2016; docs/DISTILLATION.md). With a
    teacher, train.py first has it translate the training corpus's source side (resumable, sharded over the
    run's processes, into run_dir/distilled/) and trains on those translations as targets."""

    teacher: Any = path_field(READ)  # null: no distillation; a checkpoint, a run directory, or a list (an ensemble)
    beam: Optional[int] = None  # the teacher's beam; null: its run's own decode.beam
    original_weight: float = 0.0  # the original pairs beside the distilled ones, counted this many times an epoch
    chunk_lines: int = 10000  # lines translated and written at a time (the unit a killed run resumes from)

    def __post_init__(self) -> None:
        require(self.beam is None or (isinstance(self.beam, int) and self.beam >= 1),
                f"distill.beam={self.beam!r} must be a positive integer or null (the teacher run's own)")
        require(self.original_weight >= 0, f"distill.original_weight={self.original_weight} must be >= 0 (0: the "
                                           "distilled pairs only)")
        require(self.chunk_lines >= 1, f"distill.chunk_lines={self.chunk_lines} must be a positive integer")
        require(self.teacher is not None or self.original_weight == 0,
                "distill.original_weight is set but distill.teacher is null: give the teacher checkpoint")


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """Everything train.py reads (configs/config.yaml)."""

    run_dir: Optional[str] = path_field(WRITE_DIR)  # null: runs/<experiment or model>-<corpus>-<src>-<tgt>
    seed: int = 1
    device: str = "auto"  # auto: cuda if available, else cpu
    init_from: Optional[str] = path_field(READ)  # a checkpoint or run_dir to fine-tune from (docs/FINETUNING.md)
    prepare_only: bool = False  # true: build the vocabulary and encode the data into run_dir, then exit
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(dataset="wmt/wmt14", subset="de-en"))
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        require(self.seed >= 0, f"seed={self.seed} must be an integer >= 0 (numpy's random generators take no "
                                "negative seed)")
        require(self.data.vocab == "keep" or bool(self.init_from),
                f"data.vocab={self.data.vocab} needs init_from=<checkpoint or run_dir>: the model whose embeddings "
                "are carried over")
        deepest = max(self.model.encoder_layers, self.model.decoder_layers)
        top = self.train.train_top_layers
        require(top is None or 0 <= top <= deepest,
                f"train.train_top_layers={top} must be null (train every layer) or an integer from 0 to {deepest} "
                f"(the model has {self.model.encoder_layers} encoder and {self.model.decoder_layers} decoder layers)")
        require(self.data.temperature is None or self.distill.original_weight in (0, 1),
                f"distill.original_weight={self.distill.original_weight:g} with data.temperature: the temperature "
                "sets every corpus's share; leave distill.original_weight at 1 (or 0), or set data.temperature=null")
        if self.model.positions == "learned":
            _check_position_table(self.model.max_positions, self.decode)


def _check_position_table(max_positions: int, decode: DecodeConfig) -> None:
    """A learned position table must hold the longest source that `decode` reads (max_input_len pieces + EOS)
    and the longest translation search may write for it: positions 0 (BOS) .. floor(a·max_input_len + b),
    the cap of decode.max_len_a (a) and max_len_b (b). A longer input or output would fail in the model."""

    def needed(pieces: int) -> int:
        return max(pieces + 1, math.floor(decode.max_len_a * pieces + decode.max_len_b) + 1)

    need = needed(decode.max_input_len)
    if need <= max_positions:
        return
    fitting = [m for m in range(max_positions - 1, 0, -1) if needed(m) <= max_positions][:1]
    fix = f"decode.max_input_len={fitting[0]} or " if fitting else ""
    raise ConfigError(f"model.max_positions={max_positions} (positions=learned) is too small for "
                      f"decode.max_input_len={decode.max_input_len}: such a source and its longest translation "
                      f"(decode.max_len_a·|src| + decode.max_len_b) need {need} positions; set {fix}"
                      f"model.max_positions={need}")


@dataclass(frozen=True, kw_only=True)
class TranslateJob:
    """Everything translate.py reads (configs/translate.yaml)."""

    checkpoint: Any = path_field(READ)  # a run directory, a .pt file, or a list of them (an ensemble)
    input: Optional[str] = path_field(READ_FILE)  # null: stdin
    output: Optional[str] = path_field(WRITE_FILE)  # null: stdout
    device: str = "auto"
    quiet: bool = False  # true: warnings only on stderr, no progress bar
    alignment: bool = False  # true: "translation ||| i-j ..." word alignments from cross-attention
    alignment_layer: Optional[int] = None  # the decoder layer they come from (0-based); null: max(N-2, N//2)
    interactive: bool = False  # true: load once, translate each line as it arrives and flush its translation
    interactive_batch: int = 16  # interactive: lines already waiting are translated together, at most this many
    chunk_lines: int = 10000  # input read and translated this many lines at a time (memory); output=: resumable
    tgt_lang: Optional[str] = None  # the language to translate into: a multilingual model needs it; null: the model's own
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        require(self.checkpoint is not None and self.checkpoint != [],
                "give checkpoint=<run_dir or .pt> (or checkpoint=[a.pt,b.pt] for an ensemble)")
        require(self.chunk_lines > 0, f"chunk_lines={self.chunk_lines} must be a positive number of lines")
        require(not (self.alignment and self.decode.nbest > 1),
                "alignment=true aligns the best translation only: set decode.nbest=1")
        require(not (self.alignment and self.interactive),
                "alignment=true and interactive=true do not go together yet: set one of them to false")
        require(self.interactive_batch > 0,
                f"interactive_batch={self.interactive_batch} must be a positive integer (1: one line at a time)")


# What evaluate.py may write into `out` (none of them may be one of its inputs: data/paths.py).
EVAL_FILES = ("hyp.txt", "scores.json", "report.md", "significance.md", "significance.json", "checkpoints.md",
              "checkpoints.json")


@dataclass(frozen=True, kw_only=True)
class EvaluateJob:
    """Everything evaluate.py reads (configs/evaluate.yaml)."""

    checkpoint: Any = path_field(READ)  # a run directory, a .pt file, or a list of them
    testset: Optional[str] = None  # sacreBLEU name, e.g. wmt14/full (newstest2014) or wmt13 (newstest2013)
    langpair: Optional[str] = None  # null: <src>-<tgt> of the checkpoint
    src: Optional[str] = path_field(READ_FILE)
    ref: Optional[str] = path_field(READ_FILE)
    tok_ref: Optional[str] = path_field(READ_FILE)  # a lowercased, tokenised reference (Multi30k's *.lc.norm.tok.<lang>): adds lcBLEU
    hyp: Any = path_field(READ_FILE)  # score this translation instead of decoding; [base,new,...]: paired tests against the first
    lang: Optional[str] = None  # target language for tokBLEU; null: the checkpoint's, else the ref's suffix
    tgt_lang: Optional[str] = None  # the language to translate into: a multilingual model needs it; null: the model's own
    split: str = "auto"  # test → a Table 2 row, dev → a Table 3 row; auto: dev for newstest2013, else test
    name: Optional[str] = None  # the row's model name; null: the run directory's name
    out: Optional[str] = path_field(WRITE_DIR, writes=EVAL_FILES)  # where hypotheses and scores.json go; null: run_dir/eval/<test set>
    table: Optional[str] = path_field(WRITE_FILE)  # Markdown table to append to; null: run_dir/eval/table.md
    report: Optional[bool] = None  # report.md + figures next to scores.json; null: on when checkpoint= is a run dir
    device: str = "auto"
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    paired_test: str = "bs"  # with several hyp=: bs (paired bootstrap) | ar (approximate randomization)
    paired_samples: int = 0  # resamples (bs) or trials (ar); 0: sacreBLEU's default, 1000 (bs) or 10000 (ar)
    checkpoints: Optional[str] = None  # all: score every kept checkpoint and last-k average of the run

    def __post_init__(self) -> None:
        one_of("split", self.split, ("auto", "dev", "test"), " (dev: a Table 3 row, test: a Table 2 row)")
        one_of("paired_test", self.paired_test, ("bs", "ar"),
                " (bs: paired bootstrap resampling, ar: paired approximate randomization)")
        at_least("paired_samples", self.paired_samples, 0)
        require(self.checkpoints in (None, "all"),
                f"checkpoints={self.checkpoints} is not all: checkpoints=all scores every kept checkpoint of a "
                "run (or leave it out for the one checkpoint= picks)")
        several = isinstance(self.hyp, (list, tuple)) and len(self.hyp) > 1
        require(self.hyp is not None or self.checkpoint is not None,
                "give checkpoint=<run_dir or .pt> to translate, or hyp=<file> to score a translation")
        require(not (several and self.checkpoint is not None),
                "hyp=[...] compares translations already made: drop checkpoint= (or decode each system first with "
                "translate.py)")
        require(self.checkpoints != "all" or self.hyp in (None, [], ()),
                "checkpoints=all decodes with every checkpoint of a run: drop hyp=")
        require(self.checkpoints != "all" or bool(self.src or self.testset),
                "checkpoints=all decodes, so it needs the source: give src=<file> with ref=<file>, or testset=<name>")


JOBS = {"config": TrainJob, "translate": TranslateJob, "evaluate": EvaluateJob}
