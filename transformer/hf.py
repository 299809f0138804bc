"""The interop command line: OPUS-MT / Marian models in, ours out to Hugging Face and CTranslate2.

    python -m transformer.hf import SRC RUN_DIR [--src-lang en --tgt-lang is]
    python -m transformer.hf export CHECKPOINT_OR_RUN_DIR [OUT_DIR] [--ctranslate2 DIR [--quantization int8]]

`import` turns a `MarianMTModel` directory into a run directory of ours, `export` writes a post-norm model of ours
as a `MarianMTModel` directory (OUT_DIR; transformer/interop/marian.py says how, both ways) and, with
`--ctranslate2 DIR`, as a CTranslate2 model (transformer/interop/ct2_export.py), which a pre-norm model (the
students of docs/DISTILLATION.md) exports to alone: MarianMTModel is post-norm only. Needs `pip install -e '.[hf]'`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from data.config import language_tags
from data.errors import ConfigError, DataError, one_line
from data.paths import READ, WRITE_DIR, check_input, check_output_dir
from transformer import checkpoint as ckpt
from transformer.interop.ct2_export import QUANTIZATIONS, export_ctranslate2
from transformer.interop.marian import InteropError, export_marian, import_marian, load_model, train_overrides

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


def _exportable(args: argparse.Namespace):
    """The checkpoint's model, vocabulary and data settings, or a one-line refusal where an export would lose what
    the model needs; read before the export's dependencies are looked for, so the refusal does not wait on them."""
    checkpoint = args.checkpoint
    if args.out_dir is None and not args.ctranslate2:
        raise InteropError("export writes nothing: give OUT_DIR (a MarianMTModel directory), --ctranslate2 DIR, "
                           "or both")
    both = args.out_dir is not None and args.ctranslate2
    if both and Path(args.out_dir).resolve() == Path(args.ctranslate2).resolve():
        raise InteropError(f"OUT_DIR and --ctranslate2 are both {args.out_dir}: each export writes its own "
                           "config.json, so the second would break the first; give two folders")
    model, vocab, state = load_model(checkpoint)
    data = (state.get("config") or {}).get("data") or {}
    if model.config.norm_first and args.out_dir is not None:
        raise InteropError(f"{checkpoint} is a pre-norm model (model.norm_first=true) and MarianMTModel is post-norm "
                           "only: drop OUT_DIR and export the CTranslate2 model alone (--ctranslate2 DIR)")
    if language_tags(data):
        raise InteropError(f"{checkpoint} is a multilingual model (into {', '.join(language_tags(data))}): "
                           "MarianTokenizer and CTranslate2 would not put its target-language tag first, "
                           "so its exports would translate wrongly; translate it with translate.py tgt_lang=")
    return model, vocab, data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformer.hf", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a MarianMTModel (OPUS-MT) directory -> a run directory of ours")
    imp.add_argument("src", help="the directory MarianMTModel/MarianTokenizer.save_pretrained wrote")
    imp.add_argument("run_dir", help="the run directory to create")
    imp.add_argument("--src-lang", help="source language code (default: the tokenizer config's, if any)")
    imp.add_argument("--tgt-lang", help="target language code (default: the tokenizer config's, if any)")
    exp = commands.add_parser("export", help="a checkpoint or run directory -> a MarianMTModel directory")
    exp.add_argument("checkpoint", help="a run directory or a .pt file")
    exp.add_argument("out_dir", nargs="?", help="the Hugging Face directory to write (post-norm models)")
    exp.add_argument("--ctranslate2", metavar="DIR", help="also write a CTranslate2 model to DIR")
    exp.add_argument("--quantization", choices=QUANTIZATIONS, help="CTranslate2 weight type (default float32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        check_cli_paths(args)
        if getattr(args, "quantization", None) and not args.ctranslate2:
            raise InteropError("--quantization applies to the CTranslate2 model: give --ctranslate2 DIR too")
        exported = _exportable(args) if args.command == "export" else None
        needs = ((["transformers"] if args.command == "import" or args.out_dir is not None else [])
                 + (["ctranslate2"] if getattr(args, "ctranslate2", None) else []))
        missing = [name for name in needs if not _importable(name)]
        if missing:
            raise InteropError(f"python -m transformer.hf {args.command} needs {' and '.join(missing)}, which "
                               "is not installed: pip install -e '.[hf]'")
    except (InteropError, ckpt.CheckpointError, DataError, ConfigError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    if "transformers" in needs:
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
            model, vocab, data = exported
            if args.out_dir is not None:
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
