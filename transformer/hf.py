"""Hugging Face Marian and CTranslate2 interop: import OPUS-MT / Marian models, export ours.

    python -m transformer.hf import SRC RUN_DIR [--src-lang en --tgt-lang is]
    python -m transformer.hf export CHECKPOINT_OR_RUN_DIR OUT_DIR [--ctranslate2 DIR [--quantization int8]]

`import`: SRC is a directory as `transformers` writes a `MarianMTModel` (config.json, weights, source.spm,
target.spm, vocab.json, tokenizer config). RUN_DIR becomes a run directory of ours: `checkpoints/imported.pt`
(weights, config, vocabulary) and `spm.model` (the vocabulary), which translate.py, evaluate.py and
`train.py init_from=RUN_DIR` read like any other. The model is the same function: what Marian does
differently from the paper maps onto model options (ModelConfig: activation, attention_bias,
scale_embedding, logits_bias, shared_embeddings), and Marian's sinusoids, laid out [sin ... | cos ...]
where ours interleave them, are matched exactly by permuting the model dimension of every weight that
reads or writes the residual stream (a relabelling of its coordinates: LayerNorm, attention and the
tied softmax are all invariant to it). Token ids are carried as Marian numbers them (EOS=0, UNK=1,
PAD=<pad>'s id, the decoder starting with PAD) in a Marian vocabulary (data/vocab.py `MarianVocab`).
What cannot be represented exactly is refused with one line naming it.

`export`: a post-norm model of ours (any vocabulary kind) as a `MarianMTModel` directory that
`MarianMTModel.from_pretrained` and `MarianTokenizer.from_pretrained` load, the inverse mapping of
`import` (so import(export(x)) has x's weights bit for bit). `--ctranslate2 DIR` also writes a
CTranslate2 model (transformer/ct2_export.py). A pre-norm model is refused: HF's Marian is post-norm only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

from data.errors import ConfigError, DataError
from data.paths import READ, WRITE_DIR, check_input, check_output_dir
from data.vocab import BOS_ID, MarianVocab, Vocab, load_vocab
from transformer import checkpoint as ckpt
from transformer.config import ARCH_KEYS, ModelConfig
from data.errors import one_line
from transformer.model import Transformer, TransformerConfig

log = logging.getLogger(__name__)

IMPORTED = "imported.pt"  # run_dir/checkpoints/IMPORTED: what `import` writes (checkpoint.resolve finds it)
MAX_POSITIONS = 1024  # positions of an exported model (HF and CTranslate2 keep a table; ours computes any)
_ACTIVATIONS_FROM_HF = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}


class InteropError(Exception):
    """A model or directory that cannot be imported or exported exactly; the message is one line."""


# ------------------------------------------------------------------------------------------ the mapping


def residual_permutation(d_model: int) -> torch.Tensor:
    """perm [D] with ours[..., j] = marian[..., perm[j]] for every residual-stream coordinate.

    Our sinusoid j = 2i is sin(pos / 10000^(2i/D)) and j = 2i+1 its cosine (§3.5); Marian puts the sines
    first (columns 0 .. ceil(D/2)-1) and the cosines after them.
    """
    sines = (d_model + 1) // 2
    return torch.tensor([j // 2 if j % 2 == 0 else sines + j // 2 for j in range(d_model)])


def marian_config(config: TransformerConfig, *, max_positions: int = MAX_POSITIONS):
    """The `transformers.MarianConfig` of our architecture and token ids (post-norm only)."""
    refuse_table3_variants(config, "Hugging Face Marian")
    from transformers import MarianConfig

    if config.norm_first:
        raise InteropError("a pre-norm model (model.norm_first=true) has no Hugging Face Marian equivalent: "
                           "MarianMTModel is post-norm only; export a post-norm model")
    return MarianConfig(
        vocab_size=config.vocab_size, decoder_vocab_size=config.target_size, d_model=config.d_model,
        encoder_layers=config.encoder_layers, decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.heads, decoder_attention_heads=config.heads,
        encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff, activation_function=config.activation,
        dropout=config.dropout, attention_dropout=0.0, activation_dropout=0.0,
        scale_embedding=config.scale_embedding, share_encoder_decoder_embeddings=config.shared_embeddings,
        tie_word_embeddings=True, max_position_embeddings=max_positions,
        pad_token_id=config.pad_id, decoder_start_token_id=config.bos_id, eos_token_id=config.eos_id,
        forced_eos_token_id=None, bos_token_id=None, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
    )


def refuse_table3_variants(config: ModelConfig, target: str) -> None:
    """Table 3's variants that Marian and CTranslate2 models cannot hold, refused with one line each: their
    attention gives queries, keys and values one width (d_model / heads), and their positions are sinusoids."""
    if config.key_width != config.value_width:
        raise InteropError(f"model.d_k={config.d_k} has no {target} equivalent (its heads use d_model/heads="
                           f"{config.value_width} for queries, keys and values alike): export a model with "
                           "model.d_k=null")
    if config.positions != "sinusoidal":
        raise InteropError(f"model.positions={config.positions} has no {target} equivalent (its positions are "
                           "sinusoids): export a model trained with model.positions=sinusoidal")


def _layer_map(stack: str, i: int, *, decoder: bool) -> list[tuple[str, str, str]]:
    """(our name, Marian name, how the residual axis is permuted) of one layer's tensors that map one to one.
    "in": columns read the residual stream; "out": rows (and bias) write it; "norm": LayerNorm vectors."""
    ours, hf = f"{stack}.layers.{i}.", f"model.{stack}.layers.{i}."
    rows = [("self_attn.out_proj.weight", "self_attn.out_proj.weight", "out"),
            ("self_attn.out_proj.bias", "self_attn.out_proj.bias", "out"),
            ("self_attn_norm.weight", "self_attn_layer_norm.weight", "norm"),
            ("self_attn_norm.bias", "self_attn_layer_norm.bias", "norm"),
            ("ffn.w1.weight", "fc1.weight", "in"), ("ffn.w1.bias", "fc1.bias", "none"),
            ("ffn.w2.weight", "fc2.weight", "out"), ("ffn.w2.bias", "fc2.bias", "out"),
            ("ffn_norm.weight", "final_layer_norm.weight", "norm"), ("ffn_norm.bias", "final_layer_norm.bias", "norm")]
    if decoder:
        rows += [("cross_attn.q_proj.weight", "encoder_attn.q_proj.weight", "in"),
                 ("cross_attn.q_proj.bias", "encoder_attn.q_proj.bias", "none"),
                 ("cross_attn.out_proj.weight", "encoder_attn.out_proj.weight", "out"),
                 ("cross_attn.out_proj.bias", "encoder_attn.out_proj.bias", "out"),
                 ("cross_attn_norm.weight", "encoder_attn_layer_norm.weight", "norm"),
                 ("cross_attn_norm.bias", "encoder_attn_layer_norm.bias", "norm")]
    return [(ours + a, hf + b, axis) for a, b, axis in rows]


def _fused(stack: str, i: int, *, decoder: bool) -> list[tuple[str, list[str]]]:
    """Our fused projections and the Marian projections they stack (rows in this order)."""
    ours, hf = f"{stack}.layers.{i}.", f"model.{stack}.layers.{i}."
    fused = [(ours + "self_attn.in_proj", [hf + f"self_attn.{p}_proj" for p in "qkv"])]
    if decoder:
        fused.append((ours + "cross_attn.kv_proj", [hf + f"encoder_attn.{p}_proj" for p in "kv"]))
    return fused


def _permute(tensor: torch.Tensor, axis: str, perm: torch.Tensor) -> torch.Tensor:
    if axis == "in":
        return tensor[:, perm]
    if axis in ("out", "norm"):
        return tensor[perm]
    return tensor


def from_marian_state(hf: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a MarianMTModel state dict (float32 tensors, ours in the residual order)."""
    perm = residual_permutation(config.d_model)
    source = hf["model.shared.weight"] if config.shared_embeddings else hf["model.encoder.embed_tokens.weight"]
    out = {"embedding.weight": source[:, perm]}
    if not config.shared_embeddings:
        out["target_embedding.weight"] = hf["model.decoder.embed_tokens.weight"][:, perm]
    if config.logits_bias:
        out["logits_bias"] = hf["final_logits_bias"].reshape(-1)
    for stack, layers in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        for i in range(layers):
            decoder = stack == "decoder"
            for ours, theirs, axis in _layer_map(stack, i, decoder=decoder):
                if ours.endswith("proj.bias") and not config.attention_bias:
                    continue
                out[ours] = _permute(hf[theirs], axis, perm)
            for ours, parts in _fused(stack, i, decoder=decoder):
                out[ours + ".weight"] = torch.cat([hf[p + ".weight"] for p in parts])[:, perm]
                if config.attention_bias:
                    out[ours + ".bias"] = torch.cat([hf[p + ".bias"] for p in parts])
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}


def to_marian_state(ours: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """The MarianMTModel tensors of our state dict (the inverse of `from_marian_state`); biases a model of
    ours lacks (attention, logits) are zeros, which is what they are then."""
    inverse = torch.argsort(residual_permutation(config.d_model))
    d = config.d_model
    source = ours["embedding.weight"][:, inverse]
    target = source if config.shared_embeddings else ours["target_embedding.weight"][:, inverse]
    hf = {"model.encoder.embed_tokens.weight": source, "model.decoder.embed_tokens.weight": target,
          "lm_head.weight": target,
          "final_logits_bias": (ours["logits_bias"] if config.logits_bias
                                else torch.zeros(config.target_size)).reshape(1, -1)}
    if config.shared_embeddings:
        hf["model.shared.weight"] = source
    zero = torch.zeros(d)
    for stack, layers in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        for i in range(layers):
            decoder = stack == "decoder"
            for name, theirs, axis in _layer_map(stack, i, decoder=decoder):
                if name.endswith("proj.bias") and not config.attention_bias:
                    hf[theirs] = zero
                else:
                    hf[theirs] = _permute(ours[name], axis, inverse)
            for name, parts in _fused(stack, i, decoder=decoder):
                weights = ours[name + ".weight"][:, inverse].chunk(len(parts))
                biases = ours[name + ".bias"].chunk(len(parts)) if config.attention_bias else [zero] * len(parts)
                for part, weight, bias in zip(parts, weights, biases):
                    hf[part + ".weight"], hf[part + ".bias"] = weight, bias
    return {name: tensor.contiguous() for name, tensor in hf.items()}


# ------------------------------------------------------------------------------------------------ import


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InteropError(f"cannot read {what} {path}: {e.strerror or e}; give a directory that "
                           "MarianMTModel.save_pretrained and MarianTokenizer.save_pretrained wrote") from None
    except ValueError as e:
        raise InteropError(f"{path} is not valid JSON ({one_line(e, limit=80)}); the {what} is damaged") from None


def _token(value, default: str) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", default))
    return default if value is None else str(value)


def _pieces(table: dict, path: Path, size: int) -> list[str]:
    """The pieces of a Marian id table (piece -> id), by id; the ids must be exactly 0 .. size-1."""
    by_id = {}
    for piece, index in table.items():
        if not isinstance(index, int) or index in by_id:
            raise InteropError(f"{path} maps {piece!r} to {index!r}: ids must be distinct integers")
        by_id[index] = piece
    if sorted(by_id) != list(range(len(by_id))) or len(by_id) != size:
        raise InteropError(f"{path} has {len(by_id)} entries with ids {min(by_id, default=0)}..{max(by_id, default=0)}"
                           f", but the model has {size} embedding rows: an id table that does not number every row "
                           "0..V-1 cannot be imported exactly")
    return [by_id[i] for i in range(size)]


def import_marian(src: str | Path, run_dir: str | Path, *, src_lang: str | None = None,
                  tgt_lang: str | None = None) -> tuple[Path, TransformerConfig]:
    """Convert the MarianMTModel directory `src` into the run directory `run_dir`; returns the checkpoint
    written and the model's config. Raises InteropError for what it cannot represent exactly."""
    from transformers import MarianConfig, MarianMTModel

    src, run_dir = Path(src), Path(run_dir)
    c = _read_json(src / "config.json", "model config")
    if c.get("model_type") != "marian":
        raise InteropError(f"{src}/config.json has model_type={c.get('model_type')!r}: only Marian (MarianMTModel, "
                           "OPUS-MT) models can be imported")
    tokenizer = _read_json(src / "tokenizer_config.json", "tokenizer config") \
        if (src / "tokenizer_config.json").is_file() else {}
    try:
        hc = MarianConfig.from_dict(c)
    except (TypeError, ValueError) as e:
        raise InteropError(f"{src}/config.json is not a MarianConfig ({one_line(e, limit=120)})") from None
    _refuse_unrepresentable(src, c, hc)
    try:
        model, info = MarianMTModel.from_pretrained(str(src), output_loading_info=True, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as e:
        raise InteropError(f"transformers cannot load {src} ({one_line(e, limit=160)}); give a MarianMTModel "
                           "directory") from None
    hf = {name: t.detach().float() for name, t in model.state_dict().items()}
    ignorable = ("embed_positions", "final_logits_bias")
    missing = [k for k in info["missing_keys"] if not any(i in k for i in ignorable)]
    unexpected = [k for k in info["unexpected_keys"] if not any(i in k for i in ignorable)]
    if missing or unexpected or info.get("mismatched_keys"):
        named = (missing + unexpected + [str(k) for k in info.get("mismatched_keys", [])])[:3]
        raise InteropError(f"{src} has weights that do not fit a MarianMTModel ({', '.join(named)}): it cannot be "
                           "imported exactly")
    for stack in ("encoder", "decoder"):
        positions = getattr(model.model, stack).embed_positions
        if not torch.equal(positions.weight.detach(), positions.create_weight()):
            raise InteropError(f"{src}: the {stack}'s position embeddings are not Marian's sinusoids: only "
                               "sinusoidal positions can be imported")
    if not torch.equal(hf["lm_head.weight"], hf["model.decoder.embed_tokens.weight"]):
        raise InteropError(f"{src}: an output projection apart from the decoder's embeddings (tie_word_embeddings) "
                           "cannot be represented by this framework's model")
    for key in ("attention_dropout", "activation_dropout"):
        if getattr(hc, key, 0.0):
            log.warning("%s=%s is not carried over: fine-tuning applies model.dropout=%s to sublayer outputs and "
                        "embeddings only (§5.4)", key, getattr(hc, key), hc.dropout)
    return _convert(src, run_dir, hc, hf, tokenizer, src_lang=src_lang, tgt_lang=tgt_lang)


def _refuse_unrepresentable(src: Path, c: dict, hc) -> None:
    """One-line InteropError for what config.json asks and our model cannot compute."""
    refusals = {
        "decoder_attention_heads": hc.decoder_attention_heads != hc.encoder_attention_heads,
        "decoder_ffn_dim": hc.decoder_ffn_dim != hc.encoder_ffn_dim,
        "activation_function": hc.activation_function not in _ACTIVATIONS_FROM_HF,
        "normalize_before": bool(c.get("normalize_before")), "add_bias_logits": bool(c.get("add_bias_logits")),
        "normalize_embedding": bool(c.get("normalize_embedding")),
    }
    why = {"decoder_attention_heads": "encoder and decoder with different head counts",
           "decoder_ffn_dim": "encoder and decoder with different feed-forward widths",
           "activation_function": f"activation {hc.activation_function!r} (relu, gelu and swish are supported)",
           "normalize_before": "pre-norm layers", "add_bias_logits": "a trained logits bias",
           "normalize_embedding": "a LayerNorm on the embeddings"}
    for key, refused in refusals.items():
        if refused:
            raise InteropError(f"{src}: {why[key]} ({key}) cannot be represented by this framework's model")


def _convert(src: Path, run_dir: Path, hc, hf: dict[str, torch.Tensor], tokenizer: dict, *, src_lang: str | None,
             tgt_lang: str | None) -> tuple[Path, TransformerConfig]:
    """Write the run directory of a loaded and checked Marian model (`hf`: its state dict)."""
    vocab = _marian_vocab(src, tokenizer, hc)
    attention_bias = any(bool(t.any()) for name, t in hf.items() if "attn." in name and name.endswith("proj.bias"))
    config = TransformerConfig(
        **vocab.token_config(), d_model=hc.d_model, heads=hc.encoder_attention_heads, d_ff=hc.encoder_ffn_dim,
        encoder_layers=hc.encoder_layers, decoder_layers=hc.decoder_layers, dropout=float(hc.dropout),
        activation=_ACTIVATIONS_FROM_HF[hc.activation_function], attention_bias=attention_bias,
        scale_embedding=bool(hc.scale_embedding), logits_bias=bool(hf["final_logits_bias"].any()),
        shared_embeddings=bool(hc.share_encoder_decoder_embeddings))
    if not config.shared_embeddings and hf["model.decoder.embed_tokens.weight"].shape[0] != config.target_size:
        raise InteropError(f"{src}: the decoder has {hf['model.decoder.embed_tokens.weight'].shape[0]} embedding "
                           f"rows but its vocabulary {config.target_size} pieces: it cannot be imported exactly")
    ours = Transformer(config)
    ckpt.load_model_state(ours, from_marian_state(hf, config), src, fix="the model directory is inconsistent")

    src_lang = src_lang or tokenizer.get("source_lang")
    tgt_lang = tgt_lang or tokenizer.get("target_lang")
    model_keys = {key: getattr(config, key) for key in (f.name for f in dataclasses.fields(ModelConfig))}
    state = ckpt.checkpoint_dict(kind="imported", step=0, model_config=dataclasses.asdict(config),
                                 model=ours.state_dict(), spm_model=vocab.model_proto,
                                 config={"model": model_keys, "data": {"src_lang": src_lang, "tgt_lang": tgt_lang}},
                                 imported_from=str(src.resolve()))
    path = ckpt.checkpoint_dir(run_dir) / IMPORTED
    ckpt.save(state, path)
    vocab.save(run_dir / "spm.model")
    return path, config


def _marian_vocab(src: Path, tokenizer: dict, hc) -> Vocab | MarianVocab:
    """The vocabulary of `src`: its SentencePiece models and id table(s), special ids checked. A model that
    this framework exported (one SentencePiece model whose own ids are the table, PAD=0 UNK=1 BOS=2 EOS=3,
    the decoder started by BOS) gets its own kind of vocabulary back, so import(export(x)) is x."""
    separate = bool(tokenizer.get("separate_vocabs"))
    table = _read_json(src / "vocab.json", "vocabulary")
    pieces = _pieces(table, src / "vocab.json", hc.vocab_size)
    target = None
    if separate:
        target_table = _read_json(src / "target_vocab.json", "target vocabulary")
        target = _pieces(target_table, src / "target_vocab.json", hc.decoder_vocab_size)
    names = {"pad": _token(tokenizer.get("pad_token"), "<pad>"), "unk": _token(tokenizer.get("unk_token"), "<unk>"),
             "eos": _token(tokenizer.get("eos_token"), "</s>")}
    ids = {}
    for role, piece in names.items():
        index = {p: i for i, p in enumerate(pieces)}.get(piece)
        target_index = None if target is None else {p: i for i, p in enumerate(target)}.get(piece)
        if index is None or (target is not None and target_index != index):
            raise InteropError(f"{src}: the {role} token {piece!r} is not at one id of every vocabulary: special "
                               "tokens must share their ids")
        ids[role] = index
    eos = hc.eos_token_id[0] if isinstance(hc.eos_token_id, list) else hc.eos_token_id
    if (ids["pad"], ids["eos"]) != (hc.pad_token_id, eos):
        raise InteropError(f"{src}: config.json says pad={hc.pad_token_id}, eos={eos} but the vocabulary "
                           f"pad={ids['pad']}, eos={ids['eos']}: the model and its tokenizer disagree")
    spm = {}
    for side in ("source", "target"):
        try:
            spm[side] = (src / f"{side}.spm").read_bytes()
        except OSError as e:
            raise InteropError(f"cannot read {src / f'{side}.spm'}: {e.strerror or e}; a Marian model directory "
                               "has source.spm and target.spm") from None
    start = hc.decoder_start_token_id
    if start in (ids["unk"], ids["eos"]) or not 0 <= start < min(len(pieces), len(target or pieces)):
        raise InteropError(f"{src}: the decoder starts with id {start} (decoder_start_token_id), which is UNK, EOS "
                           "or no id: it cannot be represented by this framework's model")
    if spm["source"] == spm["target"] and target is None and start == BOS_ID:
        try:
            own = Vocab(spm["source"], origin=str(src / "source.spm"))
        except DataError:
            own = None
        if own is not None and own.pieces(range(own.size)) == pieces:
            return own
    try:
        return MarianVocab.create(source_spm=spm["source"], target_spm=spm["target"], pieces=pieces,
                                  target_pieces=target, pad_id=ids["pad"], unk_id=ids["unk"], eos_id=ids["eos"],
                                  bos_id=start)
    except DataError as e:
        raise InteropError(f"{src}: {e}") from None


def train_overrides(config: TransformerConfig) -> str:
    """The `model.*` overrides with which train.py builds this architecture (init_from checks them)."""
    def value(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return " ".join(f"model.{key}={value(getattr(config, key))}" for key in ARCH_KEYS)


# ------------------------------------------------------------------------------------------------ export


def load_model(checkpoint: str | Path) -> tuple[Transformer, Vocab | MarianVocab, dict]:
    """Our model (eval mode, float32, CPU), its vocabulary and checkpoint record, from a .pt or run dir."""
    path = ckpt.resolve(checkpoint)
    state = ckpt.load(path)
    model = ckpt.model_of(state, path)
    vocab = load_vocab(ckpt.spm_bytes(state))
    return model.float().eval(), vocab, state


def marian_model(model: Transformer):
    """The `MarianMTModel` computing what `model` computes (same weights, Marian's layout)."""
    from transformers import MarianMTModel

    config = model.config
    marian = MarianMTModel(marian_config(config)).eval()
    weights = to_marian_state({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, config)
    with torch.no_grad():
        for name, tensor in marian.state_dict().items():
            if "embed_positions" in name:
                continue
            if name not in weights:
                raise InteropError(f"MarianMTModel has a tensor {name} this exporter does not know: the installed "
                                   "transformers version is not supported")
            tensor.copy_(weights[name])
    gen = marian.generation_config
    gen.decoder_start_token_id, gen.eos_token_id, gen.pad_token_id = config.bos_id, config.eos_id, config.pad_id
    gen.bad_words_ids = [[config.pad_id]] + ([[config.bos_id]] if config.bos_id != config.pad_id else [])
    gen.forced_eos_token_id, gen.max_length = None, MAX_POSITIONS
    return marian


def _tokenizer_files(vocab: Vocab | MarianVocab, directory: Path) -> dict:
    """Write source.spm, target.spm and vocab.json (+ target_vocab.json) for MarianTokenizer; its kwargs."""
    if isinstance(vocab, MarianVocab):
        source, target = vocab.source_spm, vocab.target_spm
        pieces, target_pieces = vocab.source_pieces, vocab.target_pieces if vocab.separate else None
    else:
        source = target = vocab.model_proto
        pieces, target_pieces = vocab.pieces(range(vocab.size)), None
    (directory / "source.spm").write_bytes(source)
    (directory / "target.spm").write_bytes(target)
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False))
    kwargs = {"source_spm": str(directory / "source.spm"), "target_spm": str(directory / "target.spm"),
              "vocab": str(directory / "vocab.json"), "unk_token": pieces[vocab.unk_id],
              "eos_token": pieces[vocab.eos_id], "pad_token": pieces[vocab.pad_id], "model_max_length": MAX_POSITIONS}
    if target_pieces is not None:
        (directory / "target_vocab.json").write_text(json.dumps({p: i for i, p in enumerate(target_pieces)},
                                                                ensure_ascii=False))
        kwargs.update(target_vocab_file=str(directory / "target_vocab.json"), separate_vocabs=True)
    return kwargs


def export_marian(model: Transformer, vocab: Vocab | MarianVocab, out_dir: str | Path, *,
                  src_lang: str | None = None, tgt_lang: str | None = None) -> Path:
    """Write `model` and `vocab` as a MarianMTModel + MarianTokenizer directory."""
    from transformers import MarianTokenizer

    out_dir = Path(out_dir)
    marian = marian_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    marian.save_pretrained(str(out_dir))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = MarianTokenizer(source_lang=src_lang, target_lang=tgt_lang,
                                    **_tokenizer_files(vocab, Path(tmp)))
        tokenizer.save_pretrained(str(out_dir))
    return out_dir


# ------------------------------------------------------------------------------------------ command line


# The paths of each command, by role (data/paths.py): checked before anything is imported or read.
CLI_PATHS = {"import": {"src": READ, "run_dir": WRITE_DIR},
             "export": {"checkpoint": READ, "out_dir": WRITE_DIR, "ctranslate2": WRITE_DIR}}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def check_cli_paths(args: argparse.Namespace) -> None:
    """Each path argument of `args.command` checked by its role (CLI_PATHS); one-line ConfigError."""
    inputs = []
    for name, role in CLI_PATHS[args.command].items():
        value, key = getattr(args, name, None), name if name != "ctranslate2" else "--ctranslate2"
        if value is None:
            continue
        if role == READ:
            inputs.append((key, check_input(value, key, directory=None)))
        else:
            check_output_dir(value, key, inputs=inputs)


def main(argv: list[str] | None = None) -> int:
    from transformer.ct2_export import QUANTIZATIONS, export_ctranslate2  # it imports this module

    parser = argparse.ArgumentParser(prog="python -m transformer.hf", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a MarianMTModel (OPUS-MT) directory -> a run directory of ours")
    imp.add_argument("src", help="the directory MarianMTModel/MarianTokenizer.save_pretrained wrote")
    imp.add_argument("run_dir", help="the run directory to create")
    imp.add_argument("--src-lang", help="source language code (default: the tokenizer config's, if any)")
    imp.add_argument("--tgt-lang", help="target language code (default: the tokenizer config's, if any)")
    exp = commands.add_parser("export", help="a checkpoint or run directory -> a MarianMTModel directory")
    exp.add_argument("checkpoint", help="a run directory or a .pt file")
    exp.add_argument("out_dir", help="the Hugging Face directory to write")
    exp.add_argument("--ctranslate2", metavar="DIR", help="also write a CTranslate2 model to DIR")
    exp.add_argument("--quantization", choices=QUANTIZATIONS, help="CTranslate2 weight type (default float32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        check_cli_paths(args)
        needs = ["transformers"] + (["ctranslate2"] if getattr(args, "ctranslate2", None) else [])
        missing = [name for name in needs if not _importable(name)]
        if missing:
            raise InteropError(f"python -m transformer.hf {args.command} needs {' and '.join(missing)}, which "
                               "is not installed: pip install -e '.[hf]'")
    except (InteropError, ConfigError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # stderr keeps to our lines: an error is one line
    transformers_logging.set_verbosity_error()
    try:
        if args.command == "import":
            if Path(args.run_dir, "checkpoints").exists():
                raise InteropError(f"{args.run_dir} already holds checkpoints: import into a new run directory")
            path, config = import_marian(args.src, args.run_dir, src_lang=args.src_lang, tgt_lang=args.tgt_lang)
            print(f"wrote {path}; translate: python translate.py checkpoint={args.run_dir}; fine-tune: python "
                  f"train.py experiment=finetune init_from={args.run_dir} {train_overrides(config)} ...")
        else:
            if args.quantization and not args.ctranslate2:
                raise InteropError("--quantization applies to the CTranslate2 model: give --ctranslate2 DIR too")
            model, vocab, state = load_model(args.checkpoint)
            data = (state.get("config") or {}).get("data") or {}
            out = export_marian(model, vocab, args.out_dir, src_lang=data.get("src_lang"),
                                tgt_lang=data.get("tgt_lang"))
            print(f"wrote {out} (MarianMTModel, MarianTokenizer)")
            if args.ctranslate2:
                ct2 = export_ctranslate2(model, vocab, args.ctranslate2, quantization=args.quantization)
                print(f"wrote {ct2} (CTranslate2, {args.quantization or 'float32'})")
    except (InteropError, ckpt.CheckpointError, DataError, ConfigError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
