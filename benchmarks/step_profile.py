"""Where a training update's time goes, on a prepared run's real batches (issue #45: speed is quality under a
fixed budget).

    python benchmarks/step_profile.py --run-dir runs/multi30k_en_de --threads 1 --write docs/BENCHMARKS.md

The model is the run's (its config.yaml and spm.model), freshly initialised; the batches are its encoded training
split, batched as training batches it (`batch_by_size`, the run's max_tokens and pad_to_multiple), the first
`--updates` of a shuffled epoch, each one pass (the Multi30k presets' update is one pass of 2,048 tokens). Each
update as train.py makes it (`transformer/training/update.py`: autocast, the label-smoothed loss, backward,
gradient clipping, fused Adam), timed phase by phase on the wall clock (the CPU computes synchronously, so a
phase's time is its own), after `--warmup` untimed updates. Then one more pass over the same updates under
torch.profiler, whose self CPU time is summed by the kind of operator: what the matmuls take against what the
elementwise sweeps, the casts, the softmaxes and the optimizer take.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from _common import load_average, machine, measured_on, publish, table  # noqa: E402  (puts the checkout on sys.path)
from data.batching import TokenArrays, batch_by_size, collate
from data.vocab import load_vocab
from transformer.loss import label_smoothed_nll
from transformer.model import Transformer, TransformerConfig
from transformer.training.run import mixed_precision
from transformer.training.schedule import make_optimizer

HEADING = "## Where a Multi30k training update's time goes"
PHASES = ("encoder", "decoder and output projection", "loss", "backward", "clip, Adam, zero_grad")
# operator kind: substrings of aten operator names (the first that matches); the rest is "other"
KINDS = {
    "matmul (linear maps, attention products)": ("addmm", "::mm", "bmm", "linear", "matmul", "mkldnn", "onednn",
                                                 "baddbmm"),
    "attention softmax and masks": ("scaled_dot_product", "_softmax", "softmax", "masked_fill"),
    "loss (log-softmax, label smoothing)": ("log_softmax", "nll_loss", "logsumexp"),
    "dropout": ("dropout", "bernoulli"),
    "layer norm": ("layer_norm",),
    "casts and copies": ("copy_", "_to_copy", "::to", "clone", "contiguous"),
    "optimizer": ("adam", "foreach", "norm", "clamp"),
    "embedding": ("embedding",),
    "elementwise (add, mul, relu, ...)": ("add", "mul", "relu", "div", "sub", "where", "fill", "sum", "mean"),
}


def kind_of(name: str) -> str:
    return next((kind for kind, parts in KINDS.items() if any(p in name for p in parts)), "other")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True, help="a run whose data is prepared (train.py prepare_only=true)")
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--write", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = load_average()
    cfg = OmegaConf.load(args.run_dir / "config.yaml")
    entries = sorted((args.run_dir / "data").glob("train-*"))
    if not entries or not (args.run_dir / "spm.model").exists():
        p.error(f"{args.run_dir} holds no prepared data: run train.py with prepare_only=true first")
    vocab = load_vocab((args.run_dir / "spm.model").read_bytes())
    tokens = TokenArrays.load(entries[-1])
    multiple = int(cfg.train.get("pad_to_multiple", 1) or 1)
    batches, _ = batch_by_size(np.diff(tokens.src_offsets), np.diff(tokens.tgt_offsets), int(cfg.train.max_tokens),
                               multiple=multiple)
    order = np.random.default_rng(0).permutation(len(batches))[: args.warmup + args.updates]
    ids = vocab.token_config()
    batches = [collate(tokens, batches[i], multiple=multiple, pad_id=ids["pad_id"], bos_id=ids["bos_id"],
                       eos_id=ids["eos_id"]) for i in order]

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**ids, **OmegaConf.to_container(cfg.model))).train()
    optimizer = make_optimizer(model.parameters(), weight_decay=float(cfg.train.get("weight_decay", 0.0)))
    autocast, _ = mixed_precision(args.precision, torch.device("cpu"))
    epsilon, clip = float(cfg.train.label_smoothing), float(cfg.train.clip_norm)

    def update(batch, times: dict | None = None) -> None:
        marks = [time.perf_counter()]
        with autocast:
            memory = model.encode(batch.src, padded=batch.src_tokens < batch.src.numel())
            marks.append(time.perf_counter())
            logits = model.decode(batch.tgt_in, memory)[0]
            marks.append(time.perf_counter())
        loss, _ = label_smoothed_nll(logits, batch.tgt_out, epsilon=epsilon, ignore_index=ids["pad_id"])
        marks.append(time.perf_counter())
        (loss / batch.tgt_tokens).backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        if times is not None:
            for phase, (start, end) in zip(PHASES, pairwise(marks), strict=True):  # a mark per phase
                times[phase] += end - start

    for group in optimizer.param_groups:  # the optimizer's lr is 1.0 (the schedule supplies it in training): at
        group["lr"] = 1e-4  # 1.0 the weights blow up, log p falls below -87, and exp() makes slow denormals
    for batch in batches[: args.warmup]:
        update(batch)
    timed = batches[args.warmup:]
    times: dict[str, float] = defaultdict(float)
    for batch in timed:
        update(batch, times)
    total = sum(times.values())
    tgt_tokens = sum(b.tgt_tokens for b in timed)
    padding = 1 - tgt_tokens / sum(b.tgt_in.numel() for b in timed)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in timed:
            update(batch)
    by_kind: dict[str, float] = defaultdict(float)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    for event in events:
        by_kind[kind_of(event.key)] += event.self_cpu_time_total
    profiled = sum(by_kind.values())
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]

    config = model.config
    section = "\n".join([
        HEADING, "",
        measured_on("step_profile.py", threads=args.threads, load_before=load_before), "",
        f"Machine: {machine(torch.device('cpu'))}. The run: {args.run_dir} (d_model {config.d_model}, "
        f"{config.encoder_layers}+{config.decoder_layers} layers, d_ff {config.d_ff}, vocabulary {config.vocab_size}, "
        f"dropout {config.dropout}, attention dropout {getattr(config, 'attention_dropout', 0.0)}, activation dropout "
        f"{getattr(config, 'activation_dropout', 0.0)}; {sum(t.numel() for t in model.parameters()) / 1e6:.1f}M "
        f"parameters), {args.precision}, {len(timed)} real batches of max_tokens {cfg.train.max_tokens} "
        f"({tgt_tokens / len(timed):.0f} target tokens each, {100 * padding:.1f} % target padding) after "
        f"{args.warmup} warm-up updates: {1000 * total / len(timed):.0f} ms an update, {tgt_tokens / total:,.0f} "
        "target tokens/s.", "",
        table(["phase", "ms an update", "share"],
              [[phase, f"{1000 * times[phase] / len(timed):.1f}", f"{100 * times[phase] / total:.1f} %"]
               for phase in PHASES]), "",
        "The same updates under torch.profiler, self CPU time by kind of operator:", "",
        table(["kind", "share of self CPU time"],
              [[kind, f"{100 * value / profiled:.1f} %"] for kind, value in sorted(by_kind.items(),
                                                                                  key=lambda kv: -kv[1])]), "",
        "Its twelve largest operators:", "",
        table(["operator", "calls", "share"],
              [[f"`{e.key}`", e.count, f"{100 * e.self_cpu_time_total / profiled:.1f} %"] for e in top]), ""])
    publish(section, args.write, HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
