"""How many distinct batch shapes an epoch has, and how much of it is padding, for each train.pad_to_multiple.

    python benchmarks/batch_shapes.py --run-dir runs/multi30k_en_de --max-tokens 2048 --write docs/BENCHMARKS.md

Every distinct (batch, source length, target length) shape costs kernels compiled once and kept: oneDNN's
per-shape kernels on CPU (in bf16 on AVX-512/AMX CPUs they are most of a run's growth in resident memory) and
a compiled graph each with train.compile. Rounding both lengths up to a multiple of k (`train.pad_to_multiple=k`)
bounds the shapes, and costs the padding counted here (target positions that hold no token, of all target
positions). Reads the run's encoded training split (run_dir/data/train-*); computes, times nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from _common import cpu_name, publish, table  # noqa: E402  (puts the checkout on sys.path)
from data.batching import TokenArrays, batch_by_size, collate

HEADING = "## Batch shapes and padding (train.pad_to_multiple)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True, help="a run whose data is prepared (train.py prepare_only=true)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--multiples", default="1,4,8,16")
    p.add_argument("--write", type=Path)
    args = p.parse_args()
    entries = sorted((args.run_dir / "data").glob("train-*"))
    if not entries:
        p.error(f"{args.run_dir / 'data'} holds no encoded training split: run train.py with prepare_only=true")
    tokens = TokenArrays.load(entries[-1])
    src, tgt = np.diff(tokens.src_offsets), np.diff(tokens.tgt_offsets)
    rows = []
    for multiple in (int(m) for m in args.multiples.split(",")):
        batches, _ = batch_by_size(src, tgt, args.max_tokens, multiple=multiple)
        shapes, positions, real = set(), 0, 0
        for indices in batches:
            batch = collate(tokens, indices, multiple=multiple)
            shapes.add((*batch.src.shape, batch.tgt_in.shape[1]))
            positions, real = positions + batch.tgt_in.numel(), real + batch.tgt_tokens
        rows.append([multiple, len(batches), len(shapes), f"{100 * (1 - real / positions):.1f} %"])
    section = "\n".join([
        HEADING, "",
        f"Counted on {entries[-1]} ({len(src):,} pairs), max_tokens {args.max_tokens}; a count, not a timing "
        f"(the CPU, {cpu_name()}, does not matter). Command: `python benchmarks/batch_shapes.py --run-dir "
        f"{args.run_dir} --max-tokens {args.max_tokens}`.", "",
        table(["pad_to_multiple", "batches an epoch", "distinct shapes", "target padding"], rows), ""])
    publish(section, args.write, HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
