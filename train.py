"""Train the Transformer: `python train.py [key=value ...]`, or under `torchrun` for DDP.

Reads top to bottom: set up, build, loop, save. The pieces live in `transformer/` and `data/`.

    python train.py                                   # the paper's base model on WMT14 EN-DE
    python train.py experiment=quickstart             # a small model on the generated corpus, on a CPU
    torchrun --nproc_per_node=8 train.py experiment=paper_big_en_de
    python train.py ... prepare_only=true             # vocabulary + encoded data only (e.g. on a CPU box)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from transformer import checkpoint as ckpt
from transformer import distributed, finetune
from transformer.cli import ConfigError, compose_config, main_with_user_errors, setup_logging
from transformer.kernels import keep_freed_memory, warn_if_emulated
from transformer.loss import label_smoothed_nll
from transformer.model import Transformer, TransformerConfig
from transformer.schedule import make_optimizer, noam_lambda

log = logging.getLogger("train")

# Keys whose change makes a saved run a different run: resuming with other values is an error.
ARCH_KEYS = ("d_model", "heads", "d_ff", "encoder_layers", "decoder_layers", "norm_first")
DATA_KEYS = ("src_lang", "tgt_lang", "vocab_size", "spm_model", "dataset", "subset", "train_prefix",
             "max_len", "max_len_ratio", "dedup")


# ----------------------------------------------------------------------------------------------------
# Set-up helpers


def resolve_run_dir(cfg: DictConfig) -> Path:
    """`run_dir`, or runs/<experiment or model>-<data>."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    name = cfg.choices.get("experiment") or cfg.choices["model"]
    return Path("runs") / f"{name}-{cfg.choices['data']}"


def pick_device(cfg: DictConfig, dist: distributed.DistInfo) -> torch.device:
    if cfg.device == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        kind = str(cfg.device)
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={cfg.device} but no CUDA device is visible: use device=cpu or device=auto")
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return device
    if kind != "cpu":
        raise ConfigError(f"device={cfg.device} is not one of auto, cpu, cuda")
    return torch.device("cpu")


def model_config(cfg: DictConfig, vocab_size: int) -> TransformerConfig:
    try:
        return TransformerConfig(vocab_size=vocab_size, **{k: cfg.model[k] for k in (*ARCH_KEYS, "dropout")})
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None


def check_train_config(cfg: DictConfig) -> None:
    t = cfg.train
    # Types first: a value of the wrong type (train.max_steps=abc) must be a one-line error, not a TypeError
    # deep in the loop. (name, kind, allow null, lowest value)
    typed = [("seed", int, False, None), ("train.max_steps", int, True, 0), ("train.max_epochs", int, True, 0),
             ("train.max_time", float, True, 0), ("train.max_nonfinite", int, False, 1),
             ("train.keep_last", int, False, 0), ("train.average_last", int, False, 1),
             ("train.valid_bleu_lines", int, False, 0), ("train.patience", int, False, 0),
             ("train.num_samples", int, False, 0), ("train.lr_scale", float, False, None),
             ("train.label_smoothing", float, False, None), ("train.clip_norm", float, False, 0),
             ("train.save_every_minutes", float, True, 0), ("train.compile", bool, False, None),
             ("train.test_at_end", bool, False, None), ("prepare_only", bool, False, None)]
    for name, kind, nullable, lowest in typed:
        value = OmegaConf.select(cfg, name)
        if value is None and nullable:
            continue
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool))
        if not ok or (lowest is not None and value < lowest):
            what = {bool: "true or false", int: "an integer", float: "a number"}[kind]
            bound = "" if lowest is None else f" >= {lowest}"
            raise ConfigError(f"{name}={value!r} is invalid: set it to {what}{bound}{' or null' if nullable else ''}")
    if t.lr_scale <= 0:
        raise ConfigError(f"train.lr_scale={t.lr_scale} must be positive")
    if t.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision={t.precision} is not one of fp32, bf16, fp16")
    if t.best_metric not in ("bleu", "loss", "nll"):
        raise ConfigError(f"train.best_metric={t.best_metric} is not one of bleu, loss, nll")
    for key in ("max_tokens", "tokens_per_update", "warmup_steps", "save_every_steps", "valid_every_steps",
                "log_every_steps"):
        if not isinstance(t[key], int) or t[key] <= 0:
            raise ConfigError(f"train.{key}={t[key]} must be a positive integer")
    if t.update_freq is not None and (not isinstance(t.update_freq, int) or t.update_freq <= 0):
        raise ConfigError(f"train.update_freq={t.update_freq} must be a positive integer or null")
    if 0 < t.keep_last < t.average_last:
        raise ConfigError(f"train.average_last={t.average_last} exceeds train.keep_last={t.keep_last}: "
                          "keep at least as many checkpoints as you average")
    if not 0 <= t.label_smoothing < 1:
        raise ConfigError(f"train.label_smoothing={t.label_smoothing} must be in [0, 1)")


def differences(saved: dict, current: dict, section: str, keys: tuple[str, ...]) -> list[str]:
    return [f"{section}.{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def check_resume_compatible(saved_cfg: dict, cfg: DictConfig) -> None:
    current = OmegaConf.to_container(cfg, resolve=True)
    diffs = (differences(saved_cfg["model"], current["model"], "model", ARCH_KEYS)
             + differences(saved_cfg["data"], current["data"], "data", DATA_KEYS)
             + differences(saved_cfg, current, "", ("seed",))
             + differences({"freeze": [], "train_top_layers": None, **saved_cfg["train"]}, current["train"], "train",
                           ("max_tokens", "freeze", "train_top_layers")))  # the saved Adam state's parameters
    if diffs:
        raise ConfigError("run_dir holds a different run (" + "; ".join(d.lstrip(".") for d in diffs)
                          + "): use another run_dir or the saved values")


def provenance(cfg: DictConfig, dist: distributed.DistInfo, update_freq: int, argv: list[str]) -> dict:
    import datasets
    import sacrebleu
    import sentencepiece

    root = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": [sys.executable, sys.argv[0], *argv],
        "host": socket.gethostname(),
        "git_commit": commit,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "datasets": datasets.__version__, "sentencepiece": sentencepiece.__version__,
                     "sacrebleu": sacrebleu.__version__},
        "world_size": dist.world_size,
        "update_freq": update_freq,
        "max_tokens_per_update": cfg.train.max_tokens * dist.world_size * update_freq,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def dropout_seed(seed: int, update: int, slot: int) -> int:
    """The RNG seed of one forward pass: a function of (seed, update, batch index within the update) only,
    so the dropout masks do not depend on the world size and a resumed run draws the same ones."""
    digest = hashlib.blake2b(f"{seed}/{update}/{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class StopRequest:
    """SIGTERM/SIGINT (preemption, Ctrl-C) ask the loop to save and stop at the next update boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    # A scheduler that signals every process of a job (SLURM) and torchrun, which forwards the signal it got,
    # deliver the same request twice within milliseconds: only a signal this much later means "stop now".
    REPEAT_WINDOW_S = 2.0

    def __enter__(self) -> StopRequest:
        self.requested = False
        self.first_at = 0.0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if time.monotonic() - self.first_at < self.REPEAT_WINDOW_S:
                return  # the same request, delivered twice
            raise KeyboardInterrupt  # a second signal: stop now
        self.requested, self.first_at = True, time.monotonic()
        log.warning("%s received: saving a checkpoint at the end of this update, then stopping",
                    signal.Signals(signum).name)


# ----------------------------------------------------------------------------------------------------
# Validation


@torch.no_grad()
def validate(model, valid, cfg: DictConfig, dist: distributed.DistInfo, device, autocast) -> dict:
    """Loss, NLL and perplexity over the whole validation set (its batches split over the ranks)."""
    from data.batching import batch_by_size, collate

    model.eval()
    batches, _ = batch_by_size(valid.src_lengths, valid.tgt_lengths, cfg.train.max_tokens)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for indices in batches[dist.rank :: dist.world_size]:
        batch = collate(valid.dataset, indices, device=device)
        with autocast:
            logits = model(batch.src, batch.tgt_in)
        loss, nll = label_smoothed_nll(logits, batch.tgt_out, epsilon=cfg.train.label_smoothing,
                                       ignore_index=model.config.pad_id)
        sums += torch.stack([loss.double(), nll.double(), torch.tensor(batch.tgt_tokens, dtype=torch.float64,
                                                                       device=device)])
    distributed.all_reduce_sum(sums)
    loss, nll, tokens = sums.tolist()
    model.train()
    tokens = max(tokens, 1.0)
    return {"loss": loss / tokens, "nll": nll / tokens, "ppl": math.exp(min(nll / tokens, 100.0))}


def validation_bleu(model, valid, vocab, cfg: DictConfig, device) -> tuple[float, list[tuple[str, str, str]]]:
    """sacreBLEU of the decodes of the first `valid_bleu_lines` validation sentences (rank 0 only)."""
    from transformer.scoring import sacrebleu_scores
    from transformer.translation import translate_ids

    n = min(cfg.train.valid_bleu_lines, len(valid.dataset))
    rows = valid.dataset.select(range(n))
    model.eval()
    hyps = translate_ids(model, rows["src_ids"], beam=cfg.decode.beam, lenpen=cfg.decode.lenpen,
                         lenpen_style=cfg.decode.lenpen_style, max_len_a=cfg.decode.max_len_a,
                         max_len_b=cfg.decode.max_len_b, max_tokens=cfg.decode.max_tokens, device=device)
    model.train()
    texts = vocab.decode([h[0].tokens for h in hyps])
    scores = sacrebleu_scores(texts, rows["tgt"], lang=cfg.data.tgt_lang)
    bleu = next(s.score for s in scores if s.name == "BLEU")
    samples = list(zip(rows["src"][: cfg.train.num_samples], texts, rows["tgt"][: cfg.train.num_samples]))
    return bleu, samples


# ----------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    with StopRequest() as stop:
        try:
            return train(argv, stop)
        except torch.OutOfMemoryError as error:
            rank = os.environ.get("RANK")
            detail = " ".join(str(error).split())[:160]
            raise ConfigError(f"out of memory{f' on rank {rank}' if rank else ''} ({detail}): lower train.max_tokens "
                              "(raise train.update_freq to keep the update size), then run the same command "
                              "to resume") from None
        except Exception as error:  # under torchrun: a collective that lost its peers is one line, not a traceback
            failure = distributed.peer_failure(error)
            if failure is None:
                raise
            raise failure from None


def train(argv: list[str], stop: StopRequest) -> int:
    # 1. Configuration, processes, devices --------------------------------------------------------------
    cfg = compose_config(argv)
    setup_logging()
    check_train_config(cfg)
    finetune.check_config(vocab_mode=cfg.data.vocab, init_from=cfg.init_from, freeze=cfg.train.freeze,
                          train_top_layers=cfg.train.train_top_layers, encoder_layers=cfg.model.encoder_layers,
                          decoder_layers=cfg.model.decoder_layers)
    run_dir = resolve_run_dir(cfg)
    cfg.run_dir = str(run_dir)
    dist = distributed.init_from_env("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    if not dist.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    device = pick_device(cfg, dist)
    for directory in (run_dir, ckpt.checkpoint_dir(run_dir)):  # fail now, not at the first save
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create {directory}: {error.strerror or error}; choose another run_dir") from None
    if dist.is_main:
        for stale in ckpt.remove_temporaries(run_dir):
            log.warning("removed %s, left by a checkpoint write that was interrupted", stale)

    # 2. Resume or start: the saved run's checkpoint, or init_from ---------------------------------------
    resume_path = ckpt.latest_resumable(run_dir)
    state = None
    if resume_path is not None:
        state = ckpt.load(resume_path)
        check_resume_compatible(state["config"], cfg)
        if cfg.init_from:
            log.warning("init_from=%s is ignored: resuming the run in %s", cfg.init_from, run_dir)
        log.info("resuming from %s (update %d)", resume_path, state["step"])
    init = None
    if state is None and cfg.init_from:
        init = ckpt.load(ckpt.resolve(str(cfg.init_from)))
        diffs = differences(init["model_config"], OmegaConf.to_container(cfg.model), "model", ARCH_KEYS)
        if diffs:
            raise ConfigError(f"init_from={cfg.init_from} has another architecture ({'; '.join(diffs)}): "
                              "set model.* to the checkpoint's values")

    # 3. Data: vocabulary, encoded splits, the batch stream -----------------------------------------------
    from data.batching import BatchStream, collate
    from data.pipeline import prepare
    from data.vocab import Vocab

    if cfg.data.generate == "synthetic" and dist.is_main:
        from data.synthetic import write_corpus

        write_corpus(Path(cfg.data.train_prefix).parent, seed=cfg.seed)
    distributed.barrier()
    # A resumed run keeps the vocabulary its checkpoint carries. Fine-tuning (docs/FINETUNING.md) keeps the
    # checkpoint's with data.vocab=keep; with transfer, prepare trains one on this corpus (or reads data.spm_model).
    init_vocab = Vocab.from_bytes(ckpt.spm_bytes(init)) if init is not None else None
    keep_vocab = Vocab.from_bytes(ckpt.spm_bytes(state)) if state is not None else None
    if init_vocab is not None and cfg.data.vocab == "keep":
        if cfg.data.spm_model and Vocab.load(cfg.data.spm_model).sha256 != init_vocab.sha256:
            raise ConfigError(f"data.spm_model={cfg.data.spm_model} is not the vocabulary of init_from={cfg.init_from}: "
                              "set data.vocab=transfer to use it (shared pieces keep their embeddings) or "
                              "data.spm_model=null to keep the checkpoint's")
        keep_vocab = init_vocab
    # Every rank calls prepare: a file lock lets the first build the vocabulary and cache, the others read them.
    splits = ("train", "valid", "test") if cfg.train.test_at_end else ("train", "valid")
    prepared = prepare(cfg.data, run_dir, seed=cfg.seed, splits=splits, vocab=keep_vocab)
    if cfg.prepare_only:
        log.info("data prepared in %s; train with the same command without prepare_only=true", run_dir)
        return 0
    vocab, train_data, valid = prepared.vocab, prepared.train, prepared.valid
    update_freq = cfg.train.update_freq or max(1, round(cfg.train.tokens_per_update
                                                        / (dist.world_size * cfg.train.max_tokens)))
    stream = BatchStream(train_data.src_lengths, train_data.tgt_lengths, max_tokens=cfg.train.max_tokens,
                         seed=cfg.seed, world_size=dist.world_size, rank=dist.rank, update_freq=update_freq)
    if stream.skipped:
        log.warning("%d training pairs are longer than train.max_tokens=%d and are skipped",
                    stream.skipped, cfg.train.max_tokens)

    # 4. Model, optimizer, schedule, precision -----------------------------------------------------------
    mcfg = model_config(cfg, vocab.size)
    torch.manual_seed(cfg.seed)
    model = Transformer(mcfg).to(device)
    if init is not None:
        pieces = {}
        if cfg.data.vocab == "transfer":
            pieces = {"old_pieces": init_vocab.pieces(range(init_vocab.size)),
                      "new_pieces": vocab.pieces(range(vocab.size))}
        transfer = finetune.load_pretrained(model, init["model"], source=f"init_from={cfg.init_from}", **pieces)
        log.info("initialised from %s%s", cfg.init_from,
                 f"; data.vocab=transfer: {transfer.summary()}" if transfer else "")
    frozen = finetune.freeze(model, parts=cfg.train.freeze, train_top_layers=cfg.train.train_top_layers)
    if frozen:
        log.info("%s", finetune.describe_frozen(model, frozen))
    optimizer = make_optimizer(finetune.trainable(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, noam_lambda(d_model=mcfg.d_model, warmup_steps=cfg.train.warmup_steps,
                               lr_scale=cfg.train.lr_scale))
    precision = cfg.train.precision
    warn_if_emulated(precision, device.type)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
                if precision != "fp32" else contextlib.nullcontext())
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    step, best, stale, elapsed, nonfinite, train_tokens = 0, None, 0, 0.0, 0, 0
    if state is not None:
        ckpt.load_model_state(model, state["model"], resume_path, fix="use another run_dir, or delete that file")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        stream.load_state_dict(state["data_state"])
        step, elapsed = state["step"], state["train_seconds"]
        best, stale, train_tokens = state["best"], state["stale"], state["train_tokens"]
        if state["world_size"] * state["update_freq"] != dist.world_size * update_freq:
            log.warning("world_size × update_freq changed (%d×%d → %d×%d): the batch sequence differs from "
                        "the original run's", state["world_size"], state["update_freq"], dist.world_size,
                        update_freq)
    train_model = model
    if dist.world_size > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False)  # the only buffer is the fixed sinusoid table
    if cfg.train.compile:
        train_model = torch.compile(train_model)
    params = sum(p.numel() for p in model.parameters())
    log.info("model: %s, %.1fM parameters; %d rank(s) × update_freq %d × max_tokens %d; device %s, %s",
             mcfg, params / 1e6, dist.world_size, update_freq, cfg.train.max_tokens, device, precision)

    writer = None
    if dist.is_main:
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        (run_dir / "provenance.json").write_text(json.dumps(provenance(cfg, dist, update_freq, argv), indent=2) + "\n")
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(run_dir / "tensorboard"))

    resolved = OmegaConf.to_container(cfg, resolve=True)

    def save(path: Path, kind: str = "train") -> None:
        if not dist.is_main:
            return
        ckpt.save({
            "format_version": ckpt.FORMAT_VERSION, "kind": kind, "step": step,
            "model_config": dataclasses.asdict(mcfg), "model": model.state_dict(),
            "spm_model": ckpt.spm_tensor(vocab.model_proto), "config": resolved,
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "data_state": stream.state_dict(),
            "train_seconds": elapsed, "best": best, "stale": stale,
            "world_size": dist.world_size, "update_freq": update_freq,
            "device": device.type, "train_tokens": train_tokens,
        }, path)

    def save_numbered() -> None:
        if not dist.is_main:
            return
        path = ckpt.numbered_path(run_dir, step)
        save(path)
        ckpt.crash_point("before-last")  # test-only (see transformer/checkpoint.py)
        ckpt.link_or_copy(path, ckpt.last_path(run_dir))
        ckpt.prune(run_dir, cfg.train.keep_last)

    # 5. The loop: one iteration = one update of `update_freq` forward/backward passes per rank -----------
    t = cfg.train
    loss_fn_args = {"epsilon": t.label_smoothing, "ignore_index": mcfg.pad_id}
    window = torch.zeros(4, dtype=torch.float64, device=device)  # loss, nll, target tokens, updates
    window_seconds = 0.0  # training time only: validation and saving are not in the throughput
    last_save = time.monotonic()
    gnorm = torch.tensor(0.0)
    # A finished run started again (e.g. a requeued job) trains no further update.
    reason = stop_reason(t, step, stream.epoch, elapsed)
    if reason is None and t.patience and stale >= t.patience:
        reason = f"no better {t.best_metric} in {stale} validations (patience)"
    model.train()
    while reason is None:
        update_start = time.monotonic()
        position = stream.state_dict()
        slots = stream.next_update()
        batches = [(slot, collate(train_data.dataset, indices, device=device)) for slot, indices in slots]
        # The global target-token count divides the summed loss; the stop flag rides along so that every
        # rank stops at the same update.
        counts = torch.tensor([sum(b.tgt_tokens for _, b in batches), float(stop.requested)],
                              dtype=torch.float64, device=device)
        distributed.all_reduce_sum(counts)
        global_tokens, stop_votes = counts.tolist()
        if stop_votes:
            stream.load_state_dict(position)  # this update's batches were not trained on
            reason = "a stop signal"
            break
        step += 1
        for i, (slot, batch) in enumerate(batches):
            torch.manual_seed(dropout_seed(cfg.seed, step, slot))
            sync = contextlib.nullcontext()
            if dist.world_size > 1 and i < len(batches) - 1:
                sync = train_model.no_sync()  # gradients are all-reduced once, after the last pass
            with sync:
                with autocast:
                    logits = train_model(batch.src, batch.tgt_in)
                loss, nll = label_smoothed_nll(logits, batch.tgt_out, **loss_fn_args)
                # DDP averages gradients over ranks; × world_size turns that into the global sum.
                scaler.scale(loss * (dist.world_size / global_tokens)).backward()
            window[:2] += torch.stack([loss.detach().double(), nll.detach().double()])
        window[2] += global_tokens / dist.world_size
        train_tokens += int(global_tokens)
        window[3] += 1
        scaler.unscale_(optimizer)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm if t.clip_norm > 0 else math.inf)
        if torch.isfinite(gnorm):
            scaler.step(optimizer)
            nonfinite = 0
        else:
            nonfinite += 1
            log.warning("update %d: non-finite gradient norm, skipped (%d in a row)", step, nonfinite)
            if nonfinite >= t.max_nonfinite:
                save(run_dir / "checkpoints" / f"diagnostic-{step:08d}.pt", kind="diagnostic")
                raise ConfigError(f"{nonfinite} updates in a row had non-finite gradients (last: update {step}); "
                                  "a diagnostic checkpoint is in run_dir/checkpoints: lower the learning rate "
                                  "(train.lr_scale), use train.precision=fp32 or set train.clip_norm")
        scaler.update()
        lr = scheduler.get_last_lr()[0]  # this update's lr; after step() it is the next update's
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed += time.monotonic() - update_start
        window_seconds += time.monotonic() - update_start

        # 6. Logging, validation, checkpoints, stopping ------------------------------------------------
        if step % t.log_every_steps == 0:
            distributed.all_reduce_sum(window)
            loss_sum, nll_sum, tokens, updates = window.tolist()
            seconds = window_seconds
            stats = {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": math.exp(min(nll_sum / tokens, 100)),
                     "lr": lr, "gnorm": float(gnorm), "tokens_per_s": tokens / seconds,
                     "tokens_per_update": tokens / updates}
            eta = (t.max_steps - step) * seconds / updates if t.max_steps else float("nan")
            log.info("update %d | lr %.3g | loss %.3f | nll %.3f | ppl %.2f | gnorm %.3f | %.0f tgt tok/s | "
                     "%.0f tgt tok/update | eta %s", step, lr, stats["loss"], stats["nll"], stats["ppl"],
                     stats["gnorm"], stats["tokens_per_s"], stats["tokens_per_update"], format_seconds(eta))
            if writer:
                for key, value in stats.items():
                    writer.add_scalar(f"train/{key}", value, step)
            window.zero_()
            window_seconds = 0.0

        reason = stop_reason(t, step, stream.epoch, elapsed)

        if step % t.valid_every_steps == 0 or reason is not None:
            metrics = validate(model, valid, cfg, dist, device, autocast)
            if t.valid_bleu_lines > 0 and dist.is_main:
                metrics["bleu"], samples = validation_bleu(model, valid, vocab, cfg, device)
                if writer:
                    writer.add_text("valid/samples", "\n\n".join(
                        f"src: {s}  \nhyp: {h}  \nref: {r}" for s, h, r in samples), step)
            log.info("validation at update %d | %s", step,
                     " | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
            if writer:
                for key, value in metrics.items():
                    writer.add_scalar(f"valid/{key}", value, step)
            if t.best_metric in metrics:
                value = metrics[t.best_metric]
                better = best is None or (value > best if t.best_metric == "bleu" else value < best)
                if better:
                    best, stale = value, 0
                    save(ckpt.best_path(run_dir))
                else:
                    stale += 1
            if t.patience and stale >= t.patience and reason is None:
                reason = f"no better {t.best_metric} in {stale} validations (patience)"

        if step % t.save_every_steps == 0 or reason is not None:
            save_numbered()
            last_save = time.monotonic()
        elif t.save_every_minutes and time.monotonic() - last_save >= 60 * t.save_every_minutes:
            save(ckpt.last_path(run_dir))
            last_save = time.monotonic()

    # 7. The end: the averaged checkpoint, and where everything is ---------------------------------------
    if reason == "a stop signal":
        save(ckpt.last_path(run_dir))
        log.info("stopped by a signal at update %d; run the same command to resume", step)
    else:
        log.info("training stopped at update %d: %s", step, reason)
        if dist.is_main:
            steps = [s for s, _ in ckpt.list_numbered(run_dir)][-t.average_last :]
            averaged = ckpt.average([ckpt.numbered_path(run_dir, s) for s in steps])
            ckpt.save(averaged, ckpt.averaged_path(run_dir))
            log.info("averaged the checkpoints of updates %s into %s", steps, ckpt.averaged_path(run_dir))
            if t.test_at_end:
                model.load_state_dict(averaged["model"])
                test_translation(model, prepared.test, vocab, cfg, device, run_dir)
            print_summary(run_dir, cfg, argv)
    if writer:
        writer.close()
    distributed.barrier()
    distributed.cleanup()
    return 0


def stop_reason(t: DictConfig, step: int, epoch: int, elapsed: float) -> str | None:
    """Which of max_steps, max_epochs, max_time ends training after `step` updates, or None."""
    if t.max_steps and step >= t.max_steps:
        return f"max_steps={t.max_steps}"
    if t.max_epochs and epoch >= t.max_epochs:
        return f"max_epochs={t.max_epochs}"
    if t.max_time and elapsed >= t.max_time:
        return f"max_time={t.max_time}s"
    return None


def test_translation(model, test, vocab, cfg: DictConfig, device, run_dir: Path) -> None:
    """Translate the test split with the averaged model (beam search, decode.*) and print sacreBLEU."""
    from transformer.scoring import sacrebleu_scores
    from transformer.translation import translate_ids

    model.eval()
    log.info("translating the %d test sentences with beam %d", len(test.dataset), cfg.decode.beam)
    hyps = translate_ids(model, test.dataset["src_ids"], beam=cfg.decode.beam, lenpen=cfg.decode.lenpen,
                         lenpen_style=cfg.decode.lenpen_style, max_len_a=cfg.decode.max_len_a,
                         max_len_b=cfg.decode.max_len_b, max_tokens=cfg.decode.max_tokens, device=device)
    texts = vocab.decode([h[0].tokens for h in hyps])
    scores = sacrebleu_scores(texts, test.dataset["tgt"], lang=cfg.data.tgt_lang)
    out = run_dir / "eval" / "test"
    out.mkdir(parents=True, exist_ok=True)
    (out / "hyp.txt").write_text("".join(line + "\n" for line in texts), encoding="utf-8")
    (out / "scores.json").write_text(json.dumps({s.name: s.as_dict() for s in scores}, indent=2) + "\n")
    for score in scores:
        print(score.line, flush=True)
    for src, hyp, ref in list(zip(test.dataset["src"], texts, test.dataset["tgt"]))[:3]:
        log.info("example | src: %s | hyp: %s | ref: %s", src, hyp, ref)


def print_summary(run_dir: Path, cfg: DictConfig, argv: list[str]) -> None:
    """Where everything is, and what to try next."""
    test_src = f"{cfg.data.test_prefix}.{cfg.data.src_lang}" if cfg.data.test_prefix else "src.txt"
    test_ref = f"{cfg.data.test_prefix}.{cfg.data.tgt_lang}" if cfg.data.test_prefix else "ref.txt"
    lines = [
        f"run directory:  {run_dir}",
        f"  checkpoints:  {run_dir / 'checkpoints'} (averaged.pt = the average of the last {cfg.train.average_last})",
        f"  tensorboard:  tensorboard --logdir {run_dir / 'tensorboard'}",
        f"  config:       {run_dir / 'config.yaml'}; provenance: {run_dir / 'provenance.json'}",
        "next:",
        f"  python translate.py checkpoint={run_dir} < {test_src}",
        f"  python evaluate.py checkpoint={run_dir} src={test_src} ref={test_ref}",
        f"  python train.py {' '.join(argv)} train.max_steps=<more>    # resumes where this run stopped",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    main_with_user_errors(main)()
