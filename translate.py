"""Translate raw text: `python translate.py checkpoint=<run_dir or .pt> < src.txt > hyp.txt`.

Exactly one output line per input line, in order (k lines with `decode.nbest=k`, Moses n-best style);
stdout carries translations only, everything else goes to stderr.

    python translate.py checkpoint=runs/quickstart < src.txt > hyp.txt
    python translate.py checkpoint=[a.pt,b.pt] input=src.txt output=hyp.txt   # an ensemble
    python translate.py checkpoint=runs/quickstart decode=greedy decode.precision=bf16
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig

from transformer import checkpoint as ckpt
from transformer.cli import ConfigError, compose_config, main_with_user_errors, setup_logging
from transformer.kernels import keep_freed_memory
from transformer.model import Transformer, TransformerConfig
from transformer.search import Ensemble, Hypothesis
from transformer.translation import translate_ids

log = logging.getLogger("translate")


@dataclass
class Translator:
    """A model (or an ensemble) with its vocabulary and target language, ready to decode."""

    model: torch.nn.Module
    vocab: object
    tgt_lang: str | None
    src_lang: str | None
    states: list[dict]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but no CUDA device is visible: use device=cpu or device=auto")
    return torch.device(name)


def load_translator(checkpoint, device: torch.device) -> Translator:
    """Load one checkpoint, or several as an ensemble (they must share one vocabulary)."""
    from data.vocab import Vocab

    names = list(checkpoint) if isinstance(checkpoint, (list, ListConfig)) else [checkpoint]
    if not names:
        raise ConfigError("checkpoint=[] names no checkpoint: give a run directory or a .pt file")
    from data.errors import DataError

    paths = [ckpt.resolve(str(name)) for name in names]
    states = [ckpt.load(path) for path in paths]
    protos = []
    for path, state in zip(paths, states):
        try:
            protos.append(ckpt.spm_bytes(state))
        except ckpt.CheckpointError as error:
            raise ckpt.CheckpointError(f"{path}: {error}") from None
    for path, proto in zip(paths[1:], protos[1:]):
        if proto != protos[0]:
            raise ConfigError(f"{path} has another vocabulary than {paths[0]}: an ensemble needs models that "
                              "share one SentencePiece model")
    try:
        vocab = Vocab.from_bytes(protos[0])
    except DataError as error:
        raise ckpt.CheckpointError(f"{paths[0]}: its stored vocabulary is unreadable ({error}); use another "
                                   "checkpoint") from None
    models = []
    for path, state in zip(paths, states):
        config = state.get("model_config")
        if not isinstance(config, dict):
            raise ckpt.CheckpointError(f"{path} has no model_config: it was not written by this framework's "
                                       "train.py; use another checkpoint")
        try:
            model = Transformer(TransformerConfig(**config))
        except (TypeError, ValueError) as error:
            raise ckpt.CheckpointError(f"{path} has an invalid model_config ({error}); "
                                       "use another checkpoint") from None
        if model.config.vocab_size != vocab.size:
            raise ckpt.CheckpointError(f"{path}: its model has {model.config.vocab_size} token embeddings but its "
                                       f"vocabulary {vocab.size} pieces; the file is inconsistent: use another")
        ckpt.load_model_state(model, state["model"], path, fix="the file is damaged or foreign: use another checkpoint")
        models.append(model.to(device).eval())
        log.info("loaded %s (update %s)", path, state.get("step"))
    data_cfg = (states[0].get("config") or {}).get("data", {})
    return Translator(model=models[0] if len(models) == 1 else Ensemble(models), vocab=vocab,
                      tgt_lang=data_cfg.get("tgt_lang"), src_lang=data_cfg.get("src_lang"), states=states)


def read_lines(raw: bytes, source: str) -> list[str]:
    """Split raw bytes into lines; invalid UTF-8 is replaced, with a warning naming the line."""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    texts = []
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix(b"\r")
        try:
            texts.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            log.warning("%s line %d is not valid UTF-8: the bad bytes were replaced by U+FFFD", source, number)
            texts.append(line.decode("utf-8", errors="replace"))
    return texts


def translate_texts(translator: Translator, texts: list[str], decode: DictConfig, device: torch.device,
                    *, progress: bool = True, source: str = "input") -> list[list[tuple[str, float]]]:
    """(translation, score) lists, one per input text, best first."""
    from tqdm import tqdm

    ids = translator.vocab.encode([" ".join(t.split()) for t in texts])
    for number, row in enumerate(ids, start=1):
        if len(row) > decode.max_input_len:
            log.warning("%s line %d has %d pieces: cropped to decode.max_input_len=%d", source, number, len(row),
                        decode.max_input_len)
            ids[number - 1] = row[: decode.max_input_len]
    with tqdm(total=len(ids), desc="translating", unit="line", file=sys.stderr, disable=not progress,
              mininterval=1.0) as bar:
        hyps: list[list[Hypothesis]] = translate_ids(
            translator.model, ids, beam=decode.beam, lenpen=decode.lenpen, lenpen_style=decode.lenpen_style,
            max_len_a=decode.max_len_a, max_len_b=decode.max_len_b, min_len=decode.min_len, nbest=decode.nbest,
            max_tokens=decode.max_tokens, device=device, precision=decode.precision, progress=bar)
    out = []
    for row in hyps:
        # Byte-fallback pieces can spell a line break; one translation must stay one output line.
        detok = [" ".join(text.splitlines()) for text in translator.vocab.decode([h.tokens for h in row])]
        out.append(list(zip(detok, [h.score for h in row])))
    return out


def check_decode_config(decode: DictConfig) -> None:
    if decode.lenpen_style not in ("gnmt", "power"):
        raise ConfigError(f"decode.lenpen_style={decode.lenpen_style} is not one of gnmt, power")
    for key in ("beam", "nbest", "max_input_len", "max_tokens"):
        if not isinstance(decode[key], int) or decode[key] <= 0:
            raise ConfigError(f"decode.{key}={decode[key]} must be a positive integer")
    for key, kind in (("lenpen", float), ("max_len_a", float), ("max_len_b", int), ("min_len", int)):
        value = decode[key]
        if not isinstance(value, (int, float) if kind is float else int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"decode.{key}={value!r} must be {'a number' if kind is float else 'an integer'} >= 0")
    if decode.nbest > decode.beam:
        raise ConfigError(f"decode.nbest={decode.nbest} exceeds decode.beam={decode.beam}: raise the beam")
    if decode.precision not in ("fp32", "bf16"):
        raise ConfigError(f"decode.precision={decode.precision} is not one of fp32, bf16")


def main(argv: list[str]) -> int:
    cfg = compose_config(argv, config_name="translate")
    setup_logging(quiet=cfg.quiet)
    check_decode_config(cfg.decode)
    device = pick_device(cfg.device)
    translator = load_translator(cfg.checkpoint, device)
    if cfg.input is None:
        raw, source = sys.stdin.buffer.read(), "stdin"
    else:
        if not Path(cfg.input).is_file():
            raise ConfigError(f"input={cfg.input} is not a file: give a text file, one sentence a line")
        raw, source = Path(cfg.input).read_bytes(), cfg.input
    texts = read_lines(raw, source)
    results = translate_texts(translator, texts, cfg.decode, device, progress=not cfg.quiet, source=source)
    if cfg.decode.nbest > 1:
        lines = [f"{i} ||| {text} ||| {score:.6f}" for i, row in enumerate(results) for text, score in row]
    else:
        lines = [row[0][0] for row in results]
    text = "".join(line + "\n" for line in lines)
    if cfg.output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(cfg.output).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    keep_freed_memory()  # glibc malloc: reuse freed memory (transformer/kernels.py)
    main_with_user_errors(main)()
