"""Where a run starts: its directory (`resolve_run_dir`), what it starts from (`resume_or_initialise`: its own
checkpoint, init_from's weights, or nothing, and the vocabulary it keeps), its data (`prepare_data`), and how
one update is made at this world size (`plan_update`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from data.paths import check_job_paths
from data.pipeline import Prepared, prepare
from data.vocab import MarianVocab, Vocab, load_vocab
from quickstart.corpus import write_corpus
from transformer import checkpoint as ckpt
from transformer import distributed
from transformer.checkpoint import TrainState
from transformer.config import ARCH_KEYS, DATA_KEYS, ConfigError, TrainJob, model_config_with_defaults
from transformer.evaluation.scoring import bleu_metric
from transformer.training import finetune
from transformer.training.run_lock import hold_run_dir

log = logging.getLogger("train")


def start_processes(job: TrainJob, cfg: DictConfig, argv: list[str]) -> tuple[TrainJob, distributed.DistInfo,
                                                                         torch.device]:
    """Every path the job names checked (data/paths.py); the job as it runs (init_from's architecture adopted,
    its run_dir resolved and held by this job alone: training/run_lock.py), this process's place among
    the ranks and its device; the run directory made (rank 0 clears a crashed run's temporary files)."""
    run_dir = resolve_run_dir(job, cfg)
    resuming = ckpt.last_path(run_dir).exists()  # then init_from and the teacher are not read: they may be gone
    check_job_paths(dataclasses.replace(job, run_dir=str(run_dir)),  # data/paths.py
                    unread=("init_from", "distill.teacher") if resuming else ())
    if job.train.valid_bleu_lines or job.train.test_at_end:  # sacreBLEU's tokenizer for each target language
        for lang in {job.data.tgt_lang, *(c.tgt_lang or job.data.tgt_lang for c in job.data.extra_train)}:
            bleu_metric(lang)  # a missing one is said now, not at the first validation hours later
    own = ckpt.latest_resumable(run_dir) if resuming and job.init_from else None  # what a resumed child adopted
    job = finetune.adopt_architecture(job, argv, resuming=own)
    job = dataclasses.replace(job, run_dir=str(run_dir))
    device = distributed.pick_device(job.device, training=True)  # cuda:LOCAL_RANK under torchrun
    dist = distributed.init_from_env(device.type)
    if not dist.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    hold_run_dir(run_dir, dist, device)  # one training per run_dir, before anything in it is touched
    ckpt.make_run_dir(run_dir, clean=dist.is_main)
    return job, dist, device


def resolve_run_dir(job: TrainJob, cfg: DictConfig) -> Path:
    """`run_dir`, or runs/<experiment or model>-<corpus>-<src>-<tgt> (`default_run_name`); a multirun job gets
    `<that>/<job number>`."""
    choices = cfg.get("choices", {})
    base = Path(job.run_dir) if job.run_dir else Path("runs") / default_run_name(
        choices.get("experiment") or choices.get("model") or "base", job.data)
    return base / str(cfg.job_num) if cfg.get("job_num") is not None else base


def default_run_name(recipe: str, data) -> str:
    """`<recipe>-<corpus>-<src>-<tgt>`: the corpus is the dataset's name (its last path part: wmt/wmt14 →
    wmt14) or the train_prefix's folder and file (corpus/train → corpus_train), so that two runs on different
    data or language pairs never share, and resume, one directory."""
    if data.dataset:
        corpus = Path(str(data.dataset).rstrip("/")).name
    else:
        prefix = Path(str(data.train_prefix))
        corpus = f"{prefix.parent.name}_{prefix.name}" if prefix.parent.name else prefix.name
    name = f"{recipe}-{corpus}-{data.src_lang}-{data.tgt_lang}"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def differences(saved: dict, current: dict, section: str, keys) -> list[str]:
    return [f"{section}.{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def run_differences(saved: dict, config: dict) -> list[str]:
    """The keys of a saved run's config (a checkpoint's, or run_dir/config.yaml) that make `config` another run:
    the architecture, the data and its splits, the seed, and what the saved Adam state depends on. A data path
    inside the run's own folder (a distilled corpus) is compared from that folder, so a run moved, copied or
    named by another path (absolute, or from another directory) still resumes."""
    # keys a run saved before they existed take the value they had then
    train_saved = {"freeze": [], "train_top_layers": None, "pad_to_multiple": 1, **saved.get("train", {})}
    data_saved = _inside_run({"lowercase": False, **saved.get("data", {})}, saved.get("run_dir"))
    data_now = _inside_run(config["data"], config.get("run_dir"))
    diffs = (differences(model_config_with_defaults(saved.get("model", {})), config["model"], "model", ARCH_KEYS)
             + differences(data_saved, data_now, "data", DATA_KEYS)
             + differences(saved, config, "", ("seed",))
             + differences(train_saved, config["train"], "train",
                           ("max_tokens", "pad_to_multiple", "freeze", "train_top_layers")))
    return [d.lstrip(".") for d in diffs]


def _inside_run(data: dict, run_dir) -> dict:
    """`data` with each path key under `run_dir` written as `<run_dir>/...`: a path and the run_dir it was derived
    from are both relative or both absolute, so where the saved run was started from does not matter."""
    if not run_dir:
        return data
    inside = {}
    for key in ("train_prefix", "valid_prefix", "test_prefix", "spm_model"):
        value = data.get(key)
        relative = os.path.relpath(value, run_dir) if isinstance(value, str) else os.pardir
        if relative.split(os.sep)[0] != os.pardir:
            inside[key] = os.path.join("<run_dir>", relative)
    return {**data, **inside}


@dataclass
class Start:
    """What a run starts from: its own checkpoint (resume), another run's weights (init_from), or nothing;
    and the vocabulary it must keep (None: prepare one from the corpus or data.spm_model)."""

    resume: dict | None = None
    resume_path: Path | None = None
    init: dict | None = None
    vocab: Vocab | MarianVocab | None = None
    extend: Vocab | None = None  # data.vocab=extend: init_from's vocabulary, which the run's extends


def resume_or_initialise(job: TrainJob, run_dir: Path) -> Start:
    """Resume the run in `run_dir` if it has a checkpoint (then init_from is ignored); else initialise from
    `init_from` if set; and decide the vocabulary: the resumed run's, or init_from's with data.vocab=keep."""
    config = dataclasses.asdict(job)
    resume_path = ckpt.latest_resumable(run_dir)
    if resume_path is not None:
        state = ckpt.load(resume_path)
        diffs = run_differences(state["config"], config)
        if diffs:
            raise ConfigError("run_dir holds a different run (" + "; ".join(diffs)
                              + "): use another run_dir or the saved values")
        if job.init_from:
            log.warning("init_from=%s is ignored: resuming the run in %s", job.init_from, run_dir)
        log.info("resuming from %s (update %d)", resume_path, state["step"])
        return Start(resume=state, resume_path=resume_path, vocab=load_vocab(ckpt.spm_bytes(state)))
    record = run_dir / "config.yaml"  # written before the first update: a run that has not saved a checkpoint yet
    if record.is_file():
        diffs = run_differences(OmegaConf.to_container(OmegaConf.load(record)), config)
        if diffs:
            raise ConfigError(f"run_dir holds another run that has no checkpoint yet ({'; '.join(diffs)}; see "
                              f"{record}): use another run_dir, or delete {run_dir} to start it again")
    if not job.init_from:
        if job.train.freeze or job.train.train_top_layers is not None:
            log.warning("freezing without init_from: the frozen weights stay at their random initialisation")
        return Start()
    init = ckpt.load(ckpt.resolve(job.init_from))
    diffs = differences(model_config_with_defaults(init["model_config"]), config["model"], "model", ARCH_KEYS)
    if diffs:
        raise ConfigError(f"init_from={job.init_from} has another architecture ({'; '.join(diffs)}): "
                          "drop those model.* overrides (the checkpoint's architecture is used without them)")
    start = Start(init=init)
    if job.data.vocab == "extend":
        start.extend = load_vocab(ckpt.spm_bytes(init))
    if job.data.vocab == "keep":
        start.vocab = load_vocab(ckpt.spm_bytes(init))
        if job.data.spm_model and load_vocab(job.data.spm_model).sha256 != start.vocab.sha256:
            raise ConfigError(f"data.spm_model={job.data.spm_model} is not the vocabulary of init_from="
                              f"{job.init_from}: set data.vocab=transfer to use it (shared pieces keep their "
                              "embeddings) or data.spm_model=null to keep the checkpoint's")
    return start


def prepare_data(job: TrainJob, run_dir: Path, start: Start, *, is_main: bool) -> Prepared:
    """The run's vocabulary and encoded splits (the quickstart's corpus written first, where it is generated).
    Every rank calls it: a file lock lets the first build the vocabulary and cache, the others read them.
    Fine-tuning with the checkpoint's vocabulary warns when it covers the new corpus poorly."""
    if job.data.generate == "synthetic" and is_main:
        write_corpus(Path(job.data.train_prefix).parent, seed=job.seed)
    distributed.barrier()
    splits = ("train", "valid", "test") if job.train.test_at_end else ("train", "valid")
    data = prepare(job.data, run_dir, seed=job.seed, splits=splits, vocab=start.vocab, extend=start.extend)
    if start.init is not None and job.data.vocab == "keep" and is_main:
        sample = data.train.dataset.select(range(min(20000, len(data.train.dataset))))
        finetune.warn_if_poorly_covered(data.vocab, {"source": sample["src_ids"], "target": sample["tgt_ids"]},
                                        init_from=job.init_from)
    return data


def prepared_only(run_dir: Path) -> int:
    """The end of a `prepare_only=true` run: the data is ready, no model was built."""
    log.info("data prepared in %s; train with the same command without prepare_only=true", run_dir)
    distributed.cleanup()
    return 0


# ------------------------------------------------------------------------------------- the update size

MIN_TOKENS = 256  # the floor on a rank's tokens per forward pass that plan_update derives


@dataclass(frozen=True)
class UpdatePlan:
    """How one update is made: `world_size` ranks × `update_freq` forward passes × `max_tokens` each."""

    world_size: int
    update_freq: int
    max_tokens: int  # per rank and forward pass: the budget BatchStream fills (padded max(src, tgt) tokens)

    @property
    def tokens(self) -> int:
        return self.world_size * self.update_freq * self.max_tokens


def plan_update(*, tokens_per_update: int, world_size: int, max_tokens: int, update_freq: int | None = None,
                saved: TrainState | None = None) -> tuple[UpdatePlan, str | None]:
    """The update plan for `world_size` ranks, and a warning when it cannot be what was asked for.

    Derived (`update_freq` None): the fewest forward passes that keep each rank within `max_tokens`,
    `ceil(T / (W × max_tokens))`, each of `T / (W × update_freq)` tokens, so that the update holds T tokens
    at any world size; never below min(max_tokens, MIN_TOKENS) per pass. Above T / MIN_TOKENS ranks (97 for
    the paper's 25k) the floor holds and the update grows past T; more than 10 % past it (from 108 ranks) is
    the warning. Given `update_freq`: `max_tokens` as it is (an update more than 10 % off T is the warning).
    Resumed (`saved`): the saved run's per-pass budget, so that its batches and data position stay valid,
    with the passes that keep its update size at this world size.
    """
    if saved is not None:
        total = saved.world_size * saved.update_freq
        # The saved passes per update, spread over this world size; a train.update_freq other than the saved
        # one is the user's own choice.
        freq = update_freq if update_freq and update_freq != saved.update_freq else max(1, round(total / world_size))
        plan = UpdatePlan(world_size, freq, saved.max_tokens or max_tokens)  # older checkpoints: max_tokens
        if world_size * freq != total:
            return plan, (f"world_size × update_freq changed ({saved.world_size}×{saved.update_freq} → "
                          f"{world_size}×{freq}): the update holds {plan.tokens} tokens instead of "
                          f"{total * plan.max_tokens}, and the batch sequence "
                          "differs from the original run's")
        asked = plan_update(tokens_per_update=tokens_per_update, world_size=saved.world_size, max_tokens=max_tokens)[0]
        if update_freq is None and saved.max_tokens and asked.tokens != plan.tokens:
            return plan, (f"train.tokens_per_update={tokens_per_update} is not this run's update of {plan.tokens} "
                          "tokens, which a resumed run keeps (its batches and data position depend on it); for "
                          "another update size start a new run_dir with init_from=<this run>")
        return plan, None
    if update_freq is not None:
        plan = UpdatePlan(world_size, update_freq, max_tokens)
        if abs(plan.tokens - tokens_per_update) > 0.1 * tokens_per_update:
            return plan, (f"train.update_freq={update_freq} sets the update: {world_size} rank(s) × {update_freq} "
                          f"passes × train.max_tokens={max_tokens} = {plan.tokens} tokens, "
                          f"{plan.tokens / tokens_per_update:.2g}× train.tokens_per_update={tokens_per_update}, which "
                          "it overrides; set train.update_freq=null to derive the passes from tokens_per_update, or "
                          f"train.tokens_per_update={plan.tokens} to name the update you mean")
        return plan, None
    freq = max(1, math.ceil(tokens_per_update / (world_size * max_tokens)))
    plan = UpdatePlan(world_size, freq, max(min(max_tokens, MIN_TOKENS), tokens_per_update // (world_size * freq)))
    if plan.tokens > 1.1 * tokens_per_update:
        return plan, (f"{world_size} ranks × at least {plan.max_tokens} tokens per pass make an update of "
                      f"{plan.tokens} tokens, {plan.tokens / tokens_per_update:.1f}× train.tokens_per_update="
                      f"{tokens_per_update}, with the schedule unchanged: set train.tokens_per_update={plan.tokens} "
                      "and scale the learning rate with train.lr_scale as large-batch recipes do (e.g. × the "
                      "square root of the ratio, with a longer warmup), or train on fewer ranks")
    return plan, None
