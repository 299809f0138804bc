"""Table 3 at CPU scale, on real data: the paper's rows, each scaled the same way, trained on Multi30k EN→DE
for the same tokens, scored on its validation set (the dev set; never the test set), laid out as Table 3.

    python tools/table3_small.py                      # base with seeds 1 and 2, and A_h1 B_dk16 C_N2 D_drop0 E_learned
    python tools/table3_small.py --rows A_h4 C_d256   # more rows of configs/experiment/table3 into the same folder
    python tools/table3_small.py --dry-run            # the commands only

The scale. Widths ÷ 4 (d_model 512 → 128, d_ff 2048 → 512, and a row's own d_model, d_ff or d_k), layers ÷ 2
(N 6 → 3; row C's 2, 4, 8 → 1, 2, 4); heads, dropout, label smoothing and positions as the row has them, so
d_k = d_model / h scales with d_model. A row's change is not typed here: it is the difference between the
composed row (`experiment=table3/<row>`) and the composed base (`experiment=table3/base`) in the model's
architecture keys, dropout, train.label_smoothing and decode.*, so these rows are the paper's rows. The base model and
its training are the preset `experiment=table3_small` (configs/experiment/table3_small.yaml; its header says
how its training was scaled). Every row trains on the same batches for the same number of updates (equal
tokens); the second base seed (`base_seed2`, seed=2) measures the noise between two runs of one row.

Each row, one after another, in `<out>/<row>` (default runs/table3_small): train.py, then evaluate.py on the
validation set with last.pt (as the paper's Table 3: the last checkpoint, no averaging, beam 4, α 0.6), then
`python -m transformer.evaluation.table3 <out> --set val` collects the rows into `<out>/table3.md`. A row whose
evaluation exists is skipped, and train.py resumes a row that was stopped, so the same command continues a
sweep. Extra `key=value` arguments go to every row's train.py (e.g. train.max_steps=200 for a quick look).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformer.cli import compose_config, to_job  # noqa: E402
from transformer.config import ARCH_KEYS, DecodeConfig  # noqa: E402

DEFAULT_ROWS = ("base", "base_seed2", "A_h1", "B_dk16", "C_N2", "D_drop0", "E_learned")
DIVIDE = {"d_model": 4, "d_ff": 4, "d_k": 4, "encoder_layers": 2, "decoder_layers": 2}
VALID = "../shared/data/multi30k/val"  # the preset's data.valid_prefix, relative to the repository


def paper_change(row: str) -> dict[str, object]:
    """The keys (`model.<key>`, `train.label_smoothing`, `decode.<key>`) where the paper's row differs from the
    paper's base (E_learned bounds decode.max_input_len by its position table)."""
    def job(name: str):
        return to_job(compose_config([f"experiment=table3/{name}"]))
    base, changed = job("base"), job(row)
    keys = [("model", key) for key in (*ARCH_KEYS, "dropout")] + [("train", "label_smoothing")] + [
        ("decode", field.name) for field in dataclasses.fields(DecodeConfig)]
    return {f"{group}.{key}": getattr(getattr(changed, group), key) for group, key in keys
            if getattr(getattr(changed, group), key) != getattr(getattr(base, group), key)}


def scaled(change: dict[str, object]) -> dict[str, object]:
    """A paper row's change at this scale: widths ÷ 4, layers ÷ 2, everything else as it is."""
    out = {}
    for key, value in change.items():
        divisor = DIVIDE.get(key.split(".", 1)[1], 1)
        if divisor > 1 and value is not None:
            value = max(1, int(value) // divisor)
        out[key] = value
    return out


def row_overrides(row: str) -> list[str]:
    """train.py's overrides for one row of the small sweep (`base_seed2`: the base with seed 2)."""
    if row == "base_seed2":
        return ["seed=2"]
    change = {} if row == "base" else scaled(paper_change(row))
    return [f"{key}={'null' if value is None else value}" for key, value in change.items()]


def run(command: list[str], dry_run: bool) -> None:
    print("+ " + shlex.join(command), flush=True)
    if not dry_run:
        subprocess.run(command, cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                        help="rows of configs/experiment/table3 (and base_seed2); default: %(default)s")
    parser.add_argument("--out", default="runs/table3_small", help="the sweep's folder (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every row's train.py")
    args = parser.parse_args(argv)
    out = Path(args.out)
    for row in args.rows:
        run_dir = out / row
        if (ROOT / run_dir / "eval" / "val" / "scores.json").is_file():
            print(f"{row}: evaluated already ({run_dir}/eval/val/scores.json), skipped", flush=True)
            continue
        run([sys.executable, "train.py", "experiment=table3_small", f"run_dir={run_dir}", *row_overrides(row),
             *args.overrides], args.dry_run)
        run([sys.executable, "evaluate.py", f"checkpoint={run_dir}/checkpoints/last.pt", f"src={VALID}.en",
             f"ref={VALID}.de", "split=dev", "report=false"], args.dry_run)
    run([sys.executable, "-m", "transformer.evaluation.table3", str(out), "--set", "val", "--out", str(out / "table3.md")],
        args.dry_run)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
