"""Fine-tuning: start from a trained model's weights, reconcile two vocabularies, freeze parts of the model.

train.py calls `set_up(model, init, ...)`, which does these steps in order (docs/FINETUNING.md; the settings
are checked with the rest of the config, in transformer/config.py):

    transfer = load_pretrained(model, init["model"], source="init_from=...",
                               old_pieces=..., new_pieces=...)      # pieces only with data.vocab=transfer
    frozen = freeze(model, parts=cfg.train.freeze, train_top_layers=cfg.train.train_top_layers)
    optimizer = make_optimizer(trainable(model), ...)

`data.vocab` says where a fine-tuning run's vocabulary comes from:
    keep      the checkpoint's own, with its embedding as it is (the default)
    transfer  the run's own: trained on the new corpus (data.vocab_size pieces), or data.spm_model. The
              embedding rows of the pieces it shares with the checkpoint's vocabulary (matched by piece
              string; PAD/UNK/BOS/EOS by id) are copied; the other rows start as in a new model,
              N(0, d_model^-0.5) (transformer/model.py). Every other tensor is copied as it is.

Freezing sets `requires_grad=False` before the optimizer is built, and the optimizer receives only the
trainable parameters, so a frozen tensor never changes (not even through Adam's state). The embedding
is one matrix for source, target and the output projection (§3.4): freezing `embeddings` freezes all
three.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import torch
from torch import Tensor, nn

from data.vocab import MarianVocab, Vocab, load_vocab
from transformer import checkpoint as ckpt
from transformer.checkpoint import CheckpointError
from transformer.config import ARCH_KEYS, DROPOUTS, ConfigError, TrainJob
from transformer.model import Transformer

EMBEDDING = "embedding.weight"  # the shared source/target/output matrix [V, D]

log = logging.getLogger(__name__)


def set_up(model: Transformer, init: dict | None, *, init_from: str | None, vocab_mode: str, vocab: Vocab | MarianVocab,
           freeze_parts: Sequence[str], train_top_layers: int | None) -> list[nn.Parameter]:
    """A new run's model before its first update: the weights of `init` (the checkpoint `init_from` names;
    None: keep the random initialisation) with its vocabulary kept or transferred onto `vocab`, then the
    frozen parts; returns the parameters to train."""
    if init is not None:
        pieces = {}
        if vocab_mode != "keep":
            old = load_vocab(ckpt.spm_bytes(init))
            if not (isinstance(old, Vocab) and isinstance(vocab, Vocab)):
                raise ConfigError(f"data.vocab={vocab_mode} matches pieces between two SentencePiece vocabularies of "
                                  f"this framework, but init_from={init_from} or the run has a Marian vocabulary: "
                                  "use data.vocab=keep")
            pieces = {"old_pieces": old.pieces(range(old.size)), "new_pieces": vocab.pieces(range(vocab.size))}
        transfer = load_pretrained(model, init["model"], source=f"init_from={init_from}", **pieces)
        if vocab_mode == "extend":
            added = extend_embedding(model, init["model"][EMBEDDING], old=old, new=vocab)
            log.info("initialised from %s; data.vocab=extend: every one of its %d pieces keeps its id and row, and "
                     "%d new rows start as the mean of the rows of the old pieces that spell them", init_from,
                     old.size, added)
        else:
            log.info("initialised from %s%s", init_from,
                     f"; data.vocab=transfer: {transfer.summary()}" if transfer else "")
    frozen = freeze(model, parts=freeze_parts, train_top_layers=train_top_layers)
    if frozen:
        log.info("%s", describe_frozen(model, frozen))
    return trainable(model)


# ------------------------------------------------------------------------------------ the architecture


def explicit_model_keys(overrides: Sequence[str]) -> set[str]:
    """The model.* keys the command line sets itself: `model.d_ff=...`, or all of them with `model=big`."""
    keys: set[str] = set()
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "model":
            keys.update((*ARCH_KEYS, *DROPOUTS))
        elif key.startswith("model."):
            keys.add(key.removeprefix("model."))
    return keys


def adopt_architecture(job: TrainJob, overrides: Sequence[str], *, resuming: Path | None = None) -> TrainJob:
    """With `init_from`, the job with the checkpoint's architecture (and dropout) for every model.* key the
    command line does not set, so that fine-tuning a big model needs no `model=big`; the keys it does set
    stay, and `resume_or_initialise` refuses them where they contradict the checkpoint. A run `resuming` from
    its own checkpoint takes them from there: what it adopted when it started, with init_from gone or not."""
    if not job.init_from:
        return job
    try:
        saved = ckpt.load(resuming or ckpt.resolve(job.init_from), mmap=True).get("model_config")
    except CheckpointError:
        return job  # resume_or_initialise reports it, unless a resumed run ignores init_from
    if not isinstance(saved, dict):
        return job
    explicit = explicit_model_keys(overrides)
    taken = {k: saved[k] for k in (*ARCH_KEYS, *DROPOUTS) if k in saved and k not in explicit}
    model = dataclasses.replace(job.model, **taken)
    if model != job.model:
        log.info("model: the architecture of init_from=%s (%s)", job.init_from,
                 ", ".join(f"{k}={v}" for k, v in taken.items()))
    return dataclasses.replace(job, model=model)


# ------------------------------------------------------------------------------- vocabulary coverage

POOR_COVERAGE = 0.01  # above this share of byte-fallback pieces, data.vocab=keep is worth a warning


@dataclass(frozen=True)
class Coverage:
    """How well a vocabulary spells a corpus: the share of its pieces that are byte fallback (or UNK), and
    the characters most often spelt as bytes."""

    fallback: float
    characters: tuple[str, ...]


def coverage(vocab: Vocab | MarianVocab, rows: Sequence[Sequence[int]]) -> Coverage:
    """The `Coverage` of encoded `rows` (piece ids, e.g. a split's src_ids): the share of byte-fallback pieces
    and UNK (a Marian vocabulary has no byte fallback: what its pieces cannot spell is UNK)."""
    ids = vocab.token_config()
    unspelt = np.zeros(max(vocab.size, ids.get("target_vocab_size") or 0), dtype=bool)
    unspelt[vocab.byte_ids()] = True
    unspelt[ids["unk_id"]] = True
    total, fallback, characters = 0, 0, collections.Counter()
    for row in rows:
        ids = np.asarray(row, dtype=np.int64)
        flags = unspelt[ids]
        total, fallback = total + len(ids), fallback + int(flags.sum())
        if flags.any():  # a run of byte pieces spells one or more characters
            edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
            for begin, end in zip(edges[::2], edges[1::2]):
                characters.update(vocab.decode([ids[begin:end].tolist()])[0].strip())
    return Coverage(fallback=fallback / max(total, 1), characters=tuple(c for c, _ in characters.most_common(5)))


def warn_if_poorly_covered(vocab: Vocab | MarianVocab, splits: Mapping[str, Sequence[Sequence[int]]], *, init_from: str,
                           limit: int = 20000) -> dict[str, Coverage]:
    """data.vocab=keep: measure how the checkpoint's vocabulary covers the new corpus (its first `limit` rows
    per side); warn with the figures when byte fallback exceeds POOR_COVERAGE on a side (a new script, or
    letters such as þ and ð that the parent's corpus never had). Returns the measurements by side."""
    measured = {side: coverage(vocab, rows[:limit]) for side, rows in splits.items()}
    figures = ", ".join(f"{side} {c.fallback:.1%}" for side, c in measured.items())
    poor = [c for c in measured.values() if c.fallback > POOR_COVERAGE]
    if poor:
        letters = sorted({ch for c in measured.values() for ch in c.characters})
        log.warning("data.vocab=keep: the vocabulary of init_from=%s covers this corpus poorly: %s of the pieces are "
                    "byte fallback (characters it never saw: %s); data.vocab=transfer trains a vocabulary on this "
                    "corpus and keeps the embeddings of the pieces both share (docs/FINETUNING.md)", init_from,
                    figures, " ".join(letters) or "?")
    else:
        log.info("data.vocab=keep: byte fallback of the checkpoint's vocabulary on this corpus: %s", figures)
    return measured


# ------------------------------------------------------------------------------------ loading weights


@dataclass(frozen=True)
class Transfer:
    """What `load_pretrained` did with the embedding when the vocabularies differ."""

    carried: int  # rows of the new vocabulary copied from the checkpoint
    total: int  # pieces of the new vocabulary
    old_total: int  # pieces of the checkpoint's vocabulary

    def summary(self) -> str:
        return (f"carried over {self.carried} of {self.total} pieces (the checkpoint's vocabulary has "
                f"{self.old_total}); the other {self.total - self.carried} start at N(0, d_model^-0.5)")


def shared_pieces(old_pieces: Sequence[str], new_pieces: Sequence[str],
                  special_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(new ids, old ids) of the pieces present in both vocabularies.

    Special ids (PAD, UNK, BOS, EOS: the same ids in every vocabulary of this framework) map to
    themselves whatever their piece strings; every other piece is matched by its string.
    """
    specials = sorted(set(special_ids))
    old_index = {piece: i for i, piece in enumerate(old_pieces) if i not in specials}
    new_ids, old_ids = list(specials), list(specials)
    for i, piece in enumerate(new_pieces):
        if i not in specials and piece in old_index:
            new_ids.append(i)
            old_ids.append(old_index[piece])
    return new_ids, old_ids


def load_pretrained(model: Transformer, init: Mapping[str, Tensor], *, source: str,
                    old_pieces: Sequence[str] | None = None,
                    new_pieces: Sequence[str] | None = None) -> Transfer | None:
    """Copy the weights of a checkpoint's state dict `init` into `model`, bit for bit.

    Every tensor of the model must be in `init` with the same shape. With `old_pieces` and `new_pieces`
    (data.vocab=transfer) the embedding is the exception: its rows are copied for the shared pieces
    (`shared_pieces`) and the others keep the model's own initialisation; returns what was carried.
    A mismatch raises CheckpointError: one line naming `source` and the first differing tensors.
    """
    own = model.state_dict()  # tensors that share storage with the model's: copy_ writes into the model
    if (old_pieces is None) != (new_pieces is None):
        raise ValueError("load_pretrained: give both old_pieces and new_pieces, or neither")
    transfer = old_pieces is not None
    missing, unexpected = sorted(own.keys() - init.keys()), sorted(init.keys() - own.keys())
    if missing or unexpected:
        parts = ([f"missing {_names(missing)}"] if missing else []) + (
            [f"unexpected {_names(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"{source} does not fit this model ({'; '.join(parts)}): it was written by another "
                              "architecture or version; fine-tune from a checkpoint of this framework")
    shapes = [f"{name} {tuple(init[name].shape)} vs {tuple(tensor.shape)}" for name, tensor in own.items()
              if tuple(init[name].shape) != tuple(tensor.shape) and not (transfer and name == EMBEDDING)]
    if shapes:
        raise CheckpointError(f"{source} does not fit this model (shapes: {_names(shapes)}); set model.* to the "
                              "checkpoint's architecture")
    old_embedding = init[EMBEDDING]
    if transfer:
        if old_embedding.shape[0] != len(old_pieces):
            raise CheckpointError(f"{source} is inconsistent: its embedding has {old_embedding.shape[0]} rows but "
                                  f"its vocabulary {len(old_pieces)} pieces; use another checkpoint")
        if old_embedding.shape[1] != own[EMBEDDING].shape[1] or own[EMBEDDING].shape[0] != len(new_pieces):
            raise CheckpointError(f"{source}: embedding {tuple(old_embedding.shape)} cannot be mapped onto "
                                  f"{tuple(own[EMBEDDING].shape)} for a vocabulary of {len(new_pieces)} pieces")
    with torch.no_grad():
        for name, tensor in own.items():
            if not (transfer and name == EMBEDDING):
                tensor.copy_(init[name])
        if not transfer:
            return None
        config = model.config
        new_ids, old_ids = shared_pieces(old_pieces, new_pieces,
                                         (config.pad_id, config.unk_id, config.bos_id, config.eos_id))
        embedding = own[EMBEDDING]  # [V_new, D]
        rows = old_embedding[torch.tensor(old_ids)].to(device=embedding.device, dtype=embedding.dtype)
        embedding[torch.tensor(new_ids, device=embedding.device)] = rows  # [N_shared, D] rows
    return Transfer(carried=len(new_ids), total=len(new_pieces), old_total=len(old_pieces))


def extend_embedding(model: Transformer, old_embedding: Tensor, *, old: Vocab, new: Vocab) -> int:
    """data.vocab=extend: the rows of the pieces `new` appends to `old` (ids old.size ...), each the mean of the
    old rows of the pieces `old` spells its text with (a word-initial piece "▁hund" as the word "hund"); the
    old rows are `load_pretrained`'s copy, bit for bit. Returns the number of new rows."""
    if new.pieces(range(old.size)) != old.pieces(range(old.size)):
        raise CheckpointError("data.vocab=extend: the run's vocabulary does not begin with the checkpoint's pieces "
                              "in their order; delete run_dir/spm.model to extend again")
    embedding = model.state_dict()[EMBEDDING]
    texts = [piece.replace("▁", " ").strip() or piece for piece in new.pieces(range(old.size, new.size))]
    with torch.no_grad():
        for row, ids in zip(range(old.size, new.size), old.encode(texts)):
            if ids:
                embedding[row] = old_embedding[torch.tensor(ids)].mean(0).to(embedding.dtype)
    return new.size - old.size


def _names(items: list[str], limit: int = 4) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


# ---------------------------------------------------------------------------------------------- freezing


def freeze(model: Transformer, *, parts: Sequence[str], train_top_layers: int | None) -> list[str]:
    """Set requires_grad=False on the parameters of `parts` (a subset of config.FREEZABLE) and, with
    `train_top_layers=k`, on every layer of each stack below its top k. Returns the frozen names.

    `encoder` / `decoder`: the stack's layers (and the final LayerNorm of a pre-norm stack), not the
    embedding. `embeddings`: the one shared matrix, i.e. source and target embeddings and the output
    projection (and the decoder's own, when the model has one). `train_top_layers` leaves a pre-norm
    stack's final LayerNorm (the top) trainable.
    """
    modules: list[nn.Module] = []
    for part in parts:
        modules.extend({"encoder": [model.encoder], "decoder": [model.decoder],
                        "embeddings": [model.embedding, model.output_embedding]}[part])
    if train_top_layers is not None:
        for stack in (model.encoder, model.decoder):
            modules.extend(list(stack.layers)[: max(0, len(stack.layers) - train_top_layers)])
    chosen = {id(p) for module in modules for p in module.parameters()}
    frozen = []
    for name, param in model.named_parameters():
        if id(param) in chosen:
            param.requires_grad_(False)
            frozen.append(name)
    if frozen and all(not p.requires_grad for p in model.parameters()):
        raise ConfigError("train.freeze and train.train_top_layers freeze every parameter: nothing would train; "
                          "freeze less")
    return frozen


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates (frozen ones are left out: Adam never touches them)."""
    return [p for p in model.parameters() if p.requires_grad]


def describe_frozen(model: nn.Module, frozen: Sequence[str]) -> str:
    """One line for the log: how many parameters train, and which top-level parts are frozen."""
    total = sum(p.numel() for p in model.parameters())
    training = sum(p.numel() for p in trainable(model))
    groups: dict[str, None] = {}  # ordered set: "embedding", "encoder.layers.0", "encoder", ...
    for name in frozen:
        stack, _, rest = name.partition(".")
        groups[f"{stack}.layers.{rest.split('.')[1]}" if rest.startswith("layers.") else stack] = None
    return f"frozen: {', '.join(groups)}; training {training / 1e6:.2f}M of {total / 1e6:.2f}M parameters"
