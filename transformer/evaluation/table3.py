"""The runs of a Table 3 sweep collected into one table, laid out as the paper's Table 3 (docs/TABLE3.md).

    python -m transformer.evaluation.table3 runs/table3 [--set wmt13] [--out table3.md]

Every run directory below the folder (one holding config.yaml, as train.py writes it: runs/table3/<row>, or
runs/table3/<row>/<job number> from a Hydra multirun) is one row, named after its folder. What a row shows
comes from the run's own records:
- the changed values: N, d_model, d_ff, h, d_k, d_v, P_drop, ε_ls, positions and train steps (train.max_steps)
  from run_dir/config.yaml, the resolved job. As in the paper, a cell equal to the base model's value stays
  empty, except in the row named `base`. The base model is the folder's row named `base` where it has one (a
  sweep at another scale, tools/table3_small.py), else the paper's (config.ModelConfig and TrainConfig);
- the dev scores: PPL, BLEU (tokBLEU, the paper's metric), the parameter count and the step of the evaluated
  checkpoint, from run_dir/eval/<set>/scores.json as `evaluate.py ... split=dev` writes it. <set> is the one
  folder named after newstest2013 (a name holding wmt13 or 2013, evaluate.py's split=auto rule) unless --set
  names it. A run without that file shows "—" there and its parameters counted from its config.
Rows come base first (then base_<...>, e.g. other seeds), big last, the others in natural order (A_h4 before A_h16). The Markdown table goes to
stdout (and to --out FILE). A folder without a run, or an unreadable record, is a one-line error (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from transformer.config import ConfigError, ModelConfig, TrainConfig, model_config_with_defaults
from data.errors import one_line
from transformer.model import Transformer, TransformerConfig

DEV_SET = re.compile(r"2013|wmt13")  # evaluate.py's split=auto: these names are the dev set (newstest2013)
MISSING = "—"
COLUMNS = ("Row", "N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "ε_ls", "positions", "train steps",
           "PPL (dev)", "BLEU (dev)", "params ×10^6", "evaluated at step")


@dataclass(frozen=True)
class Row:
    """One run: its name, the architecture and recipe it was trained with, and its dev scores (None: none yet)."""

    name: str
    model: ModelConfig
    label_smoothing: float
    max_steps: Optional[int]
    params: Optional[int]
    ppl: Optional[float] = None
    bleu: Optional[float] = None
    step: Optional[int] = None

    def cells(self) -> dict[str, Any]:
        """The changeable values of Table 3, keyed by column."""
        m = self.model
        layers = m.encoder_layers if m.encoder_layers == m.decoder_layers else f"{m.encoder_layers}+{m.decoder_layers}"
        return {"N": layers, "d_model": m.d_model, "d_ff": m.d_ff, "h": m.heads, "d_k": m.key_width,
                "d_v": m.value_width, "P_drop": m.dropout, "ε_ls": self.label_smoothing, "positions": m.positions,
                "train steps": self.max_steps}


BASE = Row(name="base", model=ModelConfig(), label_smoothing=TrainConfig().label_smoothing,
           max_steps=TrainConfig().max_steps, params=None)


def find_runs(folder: Path) -> list[Path]:
    """The run directories at, or up to two levels below, `folder` (a directory holding config.yaml)."""
    found = [path.parent for pattern in ("config.yaml", "*/config.yaml", "*/*/config.yaml")
             for path in sorted(folder.glob(pattern))]
    return [run for run in found if not any(other in run.parents for other in found)]


def row_name(run: Path, folder: Path, runs: list[Path]) -> str:
    """The run's folder name; a multirun job's number (row/0) is kept only where its row has several jobs."""
    if run == folder:
        return run.resolve().name
    name = run.relative_to(folder).as_posix()
    siblings = [other for other in runs if other.parent == run.parent]
    if run.name.isdigit() and run.parent != folder and len(siblings) == 1:
        return run.parent.relative_to(folder).as_posix()
    return name


def dev_scores(run: Path, testset: str | None) -> dict | None:
    """ppl, bleu (tokBLEU), params and step of the run's dev-set scores.json (`testset`: the eval/ folder's
    name; None: the one named after newstest2013), or None where it has none."""
    if testset is not None:
        candidates = [run / "eval" / testset / "scores.json"]
    else:
        candidates = sorted(p for p in run.glob("eval/*/scores.json") if DEV_SET.search(p.parent.name))
        if len(candidates) > 1:
            names = ", ".join(p.parent.name for p in candidates)
            raise ConfigError(f"{run}/eval holds several dev-set evaluations ({names}): choose one with --set NAME")
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        return None
    try:
        scores = json.loads(path.read_text(encoding="utf-8"))
        return {"ppl": scores.get("ppl"), "bleu": scores["scores"]["tokBLEU"]["score"],
                "params": scores.get("params"), "step": scores.get("step")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"{path} is not a scores.json of evaluate.py ({one_line(error, limit=80)}): evaluate the "
                          "run again (evaluate.py checkpoint=... testset=wmt13 split=dev)") from None


def read_row(run: Path, name: str, testset: str | None) -> Row:
    """A run directory's Table 3 row, from its config.yaml and its dev evaluation."""
    record = run / "config.yaml"
    try:
        job = OmegaConf.to_container(OmegaConf.load(record))
        model = ModelConfig(**model_config_with_defaults(job["model"]))
        train, data = job.get("train") or {}, job.get("data") or {}
    except (OSError, OmegaConfBaseException, KeyError, TypeError, ValueError, AttributeError) as error:
        raise ConfigError(f"{record} is not a run config of train.py ({one_line(error, limit=80)}): give the folder "
                          "of train.py's run directories") from None
    scores = dev_scores(run, testset)
    if scores is None:  # not evaluated yet: the count of the model the config describes
        scores = {"params": count_parameters(model, data.get("vocab_size"))}
    return Row(name=name, model=model, label_smoothing=train.get("label_smoothing"), max_steps=train.get("max_steps"),
               **scores)


def count_parameters(model: ModelConfig, vocab_size: int | None) -> int | None:
    """The parameters of `model` with this vocabulary, built on the meta device (no memory, no time)."""
    if vocab_size is None:
        return None
    with torch.device("meta"):
        network = Transformer(TransformerConfig(vocab_size=vocab_size, **dataclasses.asdict(model)))
    return sum(p.numel() for p in network.parameters())


def _natural(name: str) -> tuple:
    """base (and its other seeds, base_<...>) first, big last, the others with their numbers compared as
    numbers (A_h4 < A_h16)."""
    parts = tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
    group = 0 if name == "base" or name.startswith("base_") else 2 if name == "big" else 1
    return (group, [(isinstance(p, int), p) for p in parts])


def _format(value: Any, column: str) -> str:
    if value is None:
        return MISSING
    if column == "PPL (dev)":
        return f"{value:.2f}"
    if column == "BLEU (dev)":
        return f"{value:.1f}"
    if column == "params ×10^6":
        return f"{value / 1e6:.1f}"
    if column == "train steps":
        return f"{value // 1000}K" if value % 1000 == 0 else str(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("|", "\\|")


def markdown(rows: list[Row]) -> str:
    """Table 3's layout: the changed values (empty where a row keeps the base model's: the row named `base`,
    else the paper's), then the dev scores."""
    base = next((row for row in rows if row.name == "base"), BASE).cells()
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(" --- " for _ in COLUMNS) + "|"]
    for row in sorted(rows, key=lambda r: _natural(r.name)):
        changed = {column: (_format(value, column) if row.name == "base" or value != base[column] else "")
                   for column, value in row.cells().items()}
        scores = {"PPL (dev)": row.ppl, "BLEU (dev)": row.bleu, "params ×10^6": row.params,
                  "evaluated at step": row.step}
        cells = [row.name.replace("|", "\\|")] + [changed[c] for c in COLUMNS[1:11]] + [
            _format(scores[c], c) for c in COLUMNS[11:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def collect(folder: str | Path, *, testset: str | None = None) -> str:
    """The Markdown table of the runs in `folder` (see the module docstring)."""
    folder = Path(folder)
    runs = find_runs(folder) if folder.is_dir() else []
    if not runs:
        raise ConfigError(f"{folder} holds no run directory (a folder with config.yaml, as train.py writes one): "
                          "give the folder of a Table 3 sweep, e.g. runs/table3")
    return markdown([read_row(run, row_name(run, folder, runs), testset) for run in runs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformer.evaluation.table3", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="the folder of the sweep's run directories, e.g. runs/table3")
    parser.add_argument("--set", dest="testset", metavar="NAME",
                        help="the eval/ folder of the dev evaluation (default: the one named after newstest2013)")
    parser.add_argument("--out", metavar="FILE", help="also write the table to FILE")
    args = parser.parse_args(argv)
    try:
        table = collect(args.folder, testset=args.testset)
    except ConfigError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    sys.stdout.write(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
