"""How often a training batch has no source padding, and what the attention mask costs when it has none.

    python benchmarks/attention_mask.py                        # both parts (the vocabularies: a few minutes)
    python benchmarks/attention_mask.py --write docs/BENCHMARKS.md
    python benchmarks/attention_mask.py --smoke                # a tiny encoder and 2,000 pairs (the suite runs it)

A source batch without padding attends with no mask (transformer/model.py `Transformer.encode`), which lets
`F.scaled_dot_product_attention` choose any kernel on GPU (flash attention takes no mask).

1. Batches: the real corpora in ../shared/data (Multi30k EN-DE with its preset's 8,000 pieces and 2,048
   tokens a pass; the WMT14 EN-DE sample with base's 37,000 pieces and the per-GPU passes of base's 25k-token
   update on 1 GPU, 7 × 3,571, and on 8, 3,125; and its lengths repeated 100 times, a corpus of WMT14's size),
   batched by `data.batching.batch_by_size` as training does:
   the share of batches whose sources are all one length (no padding), the source tokens they hold, and the
   padding of each side, and how full a pass is (batch size × padded size over the budget: fewer, fuller
   passes cost less). Beside it, a finer bucketing that this script only simulates: the pairs of each source
   length batched apart (sorted by target length, cut by the same budget), so that no batch has source
   padding, at the price of more, smaller batches. The vocabularies are trained here
   (`data.vocab.train_vocab`).
2. Encoder speed on the CPU: base's encoder on one batch without padding (128 × 32 tokens), forward and
   backward in training mode, and forward in inference mode, given the all-True mask (what every batch got
   before) and given none, in turns, medians. The CPU attention is ours (transformer/kernels.py): the mask
   is one masked_fill over the scores there, so this measures that pass, not a kernel change; the GPU's
   difference (flash or not) needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from _common import (ROOT, alternate, describe, load_average, measured_on, median, random_tokens, table,
                     write_section)
from data.batching import batch_by_size
from data.vocab import train_vocab
from transformer.model import Transformer, TransformerConfig

HEADING = "## Attention masks"
DATA = ROOT.parent / "shared" / "data"


# --------------------------------------------------------------------------------------------- batches
def corpora(smoke: bool) -> list[dict]:
    """Each corpus: its files, vocabulary size and the per-pass token budgets that training uses on it."""
    multi30k = {"name": "Multi30k EN-DE train", "prefix": DATA / "multi30k" / "train", "vocab": 8000,
                "budgets": {"2,048 (its preset)": 2048}}
    wmt14 = {"name": "WMT14 EN-DE sample train", "prefix": DATA / "text" / "train.en-de", "vocab": 37000,
             "budgets": {"3,571 (base, 1 GPU: 7 passes)": 3571, "3,125 (base, 8 GPUs)": 3125}, "repeat": 100}
    if smoke:
        return [{**multi30k, "vocab": 500, "lines": 2000}]
    return [multi30k, wmt14]


def piece_lengths(corpus: dict, directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """Pieces per sentence of each side (no EOS), with a vocabulary trained on both sides."""
    sides = []
    for lang in ("en", "de"):
        lines = Path(f"{corpus['prefix']}.{lang}").read_text(encoding="utf-8").splitlines()
        sides.append(lines[:corpus.get("lines")])
    vocab = train_vocab((line for side in sides for line in side), directory / "spm.model", corpus["vocab"],
                        num_threads=os.cpu_count() or 1, total=sum(len(side) for side in sides))
    src, tgt = (np.array([len(ids) for ids in vocab.encode(side)], dtype=np.int64) for side in sides)
    keep = (src > 0) & (tgt > 0)
    return src[keep], tgt[keep]


def one_source_length_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """The finer bucketing: the pairs of each source length apart, sorted by target length and cut greedily
    so that batch size × max(source + 1, longest target + 1) stays within max_tokens."""
    src, tgt = src_lens + 1, tgt_lens + 1
    batches = []
    for length in np.unique(src):
        group = np.flatnonzero(src == length)
        group = group[np.argsort(tgt[group], kind="stable")]
        group = group[np.maximum(length, tgt[group]) <= max_tokens]
        start = 0
        while start < len(group):
            sizes = np.maximum(length, tgt[group[start:start + max_tokens // length]])  # non-decreasing
            count = int(np.count_nonzero(np.arange(1, len(sizes) + 1) * sizes <= max_tokens))
            batches.append(group[start:start + count])
            start += count
    return batches


def padding_figures(batches: list[np.ndarray], src_lens: np.ndarray, tgt_lens: np.ndarray,
                    max_tokens: int) -> list[str]:
    src, tgt = src_lens + 1, tgt_lens + 1  # + EOS; the target side: BOS + y or y + EOS
    unpadded = [b for b in batches if src[b].min() == src[b].max()]
    src_cells = sum(len(b) * src[b].max() for b in batches)
    tgt_cells = sum(len(b) * tgt[b].max() for b in batches)
    filled = np.mean([len(b) * max(src[b].max(), tgt[b].max()) for b in batches]) / max_tokens
    return [f"{len(batches):,}", f"{filled:.0%}", f"{len(unpadded) / len(batches):.1%}",
            f"{sum(src[b].sum() for b in unpadded) / sum(src[b].sum() for b in batches):.1%}",
            f"{1 - sum(src[b].sum() for b in batches) / src_cells:.1%}",
            f"{1 - sum(tgt[b].sum() for b in batches) / tgt_cells:.1%}"]


def batch_rows(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for corpus in corpora(args.smoke):
            src, tgt = piece_lengths(corpus, Path(directory))
            scales = [(corpus["name"], src, tgt)]
            if corpus.get("repeat"):  # WMT14's size (4.5M pairs) with the sample's length distribution
                scales.append((f"{corpus['name']}, its lengths × {corpus['repeat']}", np.tile(src, corpus["repeat"]),
                               np.tile(tgt, corpus["repeat"])))
            for name, src, tgt in scales:
                for label, budget in corpus["budgets"].items():
                    today, _ = batch_by_size(src, tgt, budget)
                    rows.append([name, f"{len(src):,}", label, "today (`batch_by_size`)",
                                 *padding_figures(today, src, tgt, budget)])
                    rows.append([name, f"{len(src):,}", label, "one source length a batch (simulated)",
                                 *padding_figures(one_source_length_batches(src, tgt, budget), src, tgt, budget)])
    return rows


# --------------------------------------------------------------------------------------------- speed
def speed_rows(args: argparse.Namespace) -> tuple[TransformerConfig, list[list[str]]]:
    config = (TransformerConfig(vocab_size=1000, d_model=64, heads=4, d_ff=128, encoder_layers=2, decoder_layers=2,
                                dropout=0.1) if args.smoke else TransformerConfig.base(vocab_size=37000))
    torch.manual_seed(0)
    model = Transformer(config)
    src = random_tokens(args.batch, args.length, config.vocab_size, seed=1, device=torch.device("cpu"))
    src[:, -1] = config.eos_id
    cpu = torch.device("cpu")

    def train_step(padded: bool):
        def run() -> None:
            model.train()
            model.encode(src, padded=padded).out.sum().backward()
            model.zero_grad(set_to_none=True)
        return run

    def inference(padded: bool):
        def run() -> None:
            model.eval()
            with torch.inference_mode():
                model.encode(src, padded=padded)
        return run

    rows = []
    for mode, make in (("training: forward + backward", train_step), ("inference: forward", inference)):
        times = alternate({"mask": make(True), "none": make(False)}, device=cpu, warmup=1, repeats=args.repeats)
        masked, bare = median(times["mask"]), median(times["none"])
        rows.append([mode, f"{masked * 1000:,.0f} ms", f"{bare * 1000:,.0f} ms", f"{masked / bare:.3f}×"])
    return config, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="tiny: checks that the script runs")
    parser.add_argument("--write", type=Path, help="Markdown file whose section to replace")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.length, args.repeats = 8, 16, 1
    torch.set_num_threads(args.threads)
    load_before = load_average()
    batch_table = batch_rows(args)
    config, speed_table = speed_rows(args)
    section = "\n".join([
        HEADING, "",
        measured_on("attention_mask.py", threads=args.threads, load_before=load_before), "",
        "A source batch without padding attends with no mask (no mask tensor reaches the kernel). How often "
        "training batches have none, on the corpora in ../shared/data (this repository's test data). The WMT14 sample is 1 % of WMT14; "
        "its lengths repeated 100 times stand for a corpus of WMT14's size with the sample's length "
        "distribution, whose length buckets hold 100× the pairs:", "",
        table(["corpus", "pairs", "tokens a pass", "bucketing", "batches", "pass filled", "without source padding",
               "source tokens in them", "source padding", "target padding"], batch_table), "",
        f"Encoder ({describe(config)}) on {args.batch} × {args.length} source tokens without padding, the "
        f"all-True mask given or none, {args.repeats} timed runs each in turns after a warm-up, medians:", "",
        table(["encoder", "with the mask", "without", "with / without"], speed_table),
    ])
    print(section)
    if args.write:
        write_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
