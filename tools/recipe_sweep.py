"""A recipe search anyone can rerun: candidate settings of a preset, each trained for the same wall-clock budget on
the same number of threads, each judged on the validation set only. Not part of CI (it trains for hours).

    python tools/recipe_sweep.py --budget 900                          # every candidate, EN→DE, 15 min each
    python tools/recipe_sweep.py --experiment multi30k_en_fr --only tiny_lc,preset --budget 1800
    python tools/recipe_sweep.py --list                                # the candidates and their overrides
    python tools/recipe_sweep.py --table-only                          # the table of what has finished
    python tools/recipe_sweep.py --ensemble tiny_lc,lc_drop            # two finished runs as one ensemble

Each candidate is `python train.py experiment=<experiment> <its overrides> train.max_time=<budget>` (with
OMP_NUM_THREADS=<threads>, `train.max_steps` lifted so that the budget ends it unless the candidate sets one, no
test translation), run in
`<out>/<candidate>/`, its log in `<out>/<candidate>.log`. Then evaluate.py decodes the validation set with the
run's averaged.pt (the preset's decoding: beam 4, α 0.6) and scores it: cased sacreBLEU against the raw
references, and lcBLEU (the Multi30k papers' metric) against the references put through the task's own
preprocessing (`scoring.lc_norm_tok`, which reproduces the official `lc.norm.tok` files). The test set is never
read. A finished candidate (its `sweep.json`) is not run again: a killed sweep continues where it stopped.
`--ensemble a,b`: the averaged checkpoints of finished candidates that share a vocabulary, decoded as one
ensemble (their log-probabilities averaged) and scored the same way: two runs trained side by side, one thread
each, cost what one two-thread run costs. Which averaging window such an ensemble wants is evaluate.py's to
say: `'checkpoint=[<out>/a,<out>/b]' checkpoints=all` with the validation set and a `tok_ref=` file made by
`python -m transformer.evaluation.scoring lc-norm-tok` (the runs must keep the checkpoints to compare:
`train.keep_last`).

The table (`<out>/sweep.md`, also `sweep.json`): candidate, overrides, updates, target tokens/s, best validation
perplexity (and its update), validation sacreBLEU and lcBLEU of the average, peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import cpu_name  # noqa: E402  (how every figure of benchmarks/ names its CPU)

# name: overrides of the experiment preset. Peak lr of the schedule = lr_scale · d_model^-0.5 · warmup^-0.5.
# tiny: Wu et al. 2021's Transformer-Tiny (fairseq's transformer_tiny: 4+4 layers, d_model 128, FFN 256, 4 heads,
# dropout 0.3, peak lr 5e-3 at 2k warm-up, 4096 tokens an update, a 10k joint vocabulary).
TINY = ["model.d_model=128", "model.d_ff=256", "model.heads=4", "model.encoder_layers=4", "model.decoder_layers=4",
        "model.dropout=0.3", "train.tokens_per_update=4096", "train.max_tokens=4096", "train.warmup_steps=2000",
        "train.lr_scale=2.53", "data.vocab_size=10000"]
CANDIDATES: dict[str, list[str]] = {
    "preset": [],
    "tiny": TINY,
    "batch4k": ["train.tokens_per_update=4096", "train.max_tokens=4096", "train.lr_scale=1.4"],
    "vocab5k": ["data.vocab_size=5000"],
    "deep4": ["model.encoder_layers=4", "model.decoder_layers=4"],
    "drop03": ["model.dropout=0.3"],
    "ls02": ["train.label_smoothing=0.2"],
    "avg10": ["train.keep_last=10", "train.average_last=10"],
    # the preset again from another seed, for an ensemble of two runs (give both one vocabulary: data.spm_model=)
    "seed2": ["seed=2"],
    # beside the paper's residual dropout, the regularisers of small-data recipes (named options, 0 = the paper)
    "attdrop": ["model.attention_dropout=0.1", "model.activation_dropout=0.1"],
    "wd": ["train.weight_decay=0.0001"],
    # the Multi30k papers' lcBLEU is scored on lowercased text: a model that reads and writes lowercase
    "lc": ["data.lowercase=true"],
    "tiny_lc": [*TINY, "data.lowercase=true", "train.keep_last=10", "train.average_last=10"],  # as published
    "lc_drop": ["data.lowercase=true", "data.vocab_size=10000", "model.attention_dropout=0.1",
                "model.activation_dropout=0.1"],
    # the published system's data handling: lowercased text and no length-ratio filter (data.max_len_ratio's 1.5,
    # a web-crawl cleaning rule, drops 888 of Multi30k's 29,000 professionally translated EN-DE pairs)
    "lc_full": ["data.lowercase=true", "data.max_len_ratio=null"],
    # the filter alone (cased), the seventh round (docs/RESULTS.md): weaker than the preset with it
    "nofilter": ["data.max_len_ratio=null"],
    # the final's members passed their validation best at ~8,000 updates (docs/RESULTS.md): end them there
    "steps8500": ["train.max_steps=8500"],
    "patience3": ["train.patience=3"],
    # lengths rounded up to multiples of 8: 40 % of the memory, flat speed, 16 % fewer target tokens an update
    "pad8": ["train.pad_to_multiple=8"],
}


def train_command(name: str, overrides: list[str], args: argparse.Namespace) -> list[str]:
    """The candidate's train.py command: the experiment, its overrides, the sweep's budget on the CPU."""
    command = [sys.executable, str(ROOT / "train.py"), f"experiment={args.experiment}", *overrides, *args.extra,
               f"run_dir={args.out / name}", "device=cpu", f"train.max_time={args.budget}", "train.test_at_end=false",
               f"train.precision={args.precision}"]
    if not any(o.startswith("train.max_steps=") for o in [*overrides, *args.extra]):
        command.append("train.max_steps=10000000")  # the budget ends the run, unless the candidate sets a step limit
    return command


def run_candidate(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    out = args.out / name
    log_path = args.out / f"{name}.log"
    command = train_command(name, overrides, args)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(command[2:])}", flush=True)
    with log_path.open("a") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    row = {"candidate": name, "overrides": " ".join(overrides) or "(the preset)", "budget": f"{args.budget:g} s",
           "threads": args.threads, **read_log(log_path)}
    row.update(score_validation(out, args))
    (out / "sweep.json").write_text(json.dumps(row, indent=2) + "\n")
    return row


def read_log(path: Path) -> dict:
    """Updates, mean target tokens/s and the best validation perplexity from a train.py log (of a multilingual
    run, the mean over its pairs, the one best.pt follows: the per-pair lines name their pair before the loss)."""
    text = path.read_text()
    updates = [int(m) for m in re.findall(r"update (\d+) \|", text)]
    speeds = [float(m) for m in re.findall(r"(\d+) tgt tok/s", text)]
    valid = [(float(ppl), int(step)) for step, ppl in re.findall(r"validation at update (\d+) \| loss .*?ppl ([\d.]+)",
                                                                 text)]
    peak = re.findall(r"peak resident memory ([\d.]+) MiB", text)
    best = min(valid) if valid else (float("nan"), 0)
    return {"updates": max(updates, default=0), "tok_per_s": round(sum(speeds) / len(speeds)) if speeds else 0,
            "best_valid_ppl": round(best[0], 2), "best_at": best[1],
            "peak_rss_mib": round(float(peak[-1])) if peak else None}


def score_validation(run_dir: Path, args: argparse.Namespace, checkpoints: list[Path] | None = None) -> dict:
    """evaluate.py on the validation set with the run's averaged.pt (or `checkpoints`, an ensemble):
    sacreBLEU and lcBLEU."""
    from omegaconf import OmegaConf

    from transformer.evaluation.scoring import lc_norm_tok

    checkpoints = checkpoints or [run_dir / "checkpoints" / "averaged.pt"]
    data = OmegaConf.load(checkpoints[0].parent.parent / "config.yaml").data  # <run>/checkpoints/averaged.pt
    src, ref = Path(f"{data.valid_prefix}.{data.src_lang}"), Path(f"{data.valid_prefix}.{data.tgt_lang}")
    if not src.is_absolute():
        src, ref = ROOT / src, ROOT / ref
    tok_ref = args.out / f"valid.lc.norm.tok.{data.tgt_lang}"
    if not tok_ref.exists():
        lines = ref.read_text(encoding="utf-8").splitlines()
        tok_ref.write_text("".join(line + "\n" for line in lc_norm_tok(lines, data.tgt_lang)), encoding="utf-8")
    checkpoint = checkpoints[0] if len(checkpoints) == 1 else "[" + ",".join(map(str, checkpoints)) + "]"
    out = run_dir / "eval_valid"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    subprocess.run([sys.executable, str(ROOT / "evaluate.py"), f"checkpoint={checkpoint}", f"src={src}",
                    f"ref={ref}", f"tok_ref={tok_ref}", f"out={out}", "report=false", f"table={out / 'table.md'}",
                    "device=cpu"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=open(args.out / f"{run_dir.name}.log", "a"))
    scores = {name: s["score"] for name, s in json.loads((out / "scores.json").read_text())["scores"].items()}
    return {"checkpoint": " + ".join(f"{c.parent.parent.name}/{c.name}" for c in checkpoints),
            "valid_bleu": round(scores["BLEU"], 2),
            "valid_lcbleu": round(scores["lcBLEU"], 2)}


COLUMNS = [("candidate", "candidate"), ("overrides", "overrides"), ("budget", "budget"), ("threads", "threads"),
           ("updates", "updates"),
           ("tok_per_s", "tgt tok/s"), ("best_valid_ppl", "best valid ppl"), ("best_at", "at update"),
           ("valid_bleu", "valid BLEU"), ("valid_lcbleu", "valid lcBLEU"), ("peak_rss_mib", "peak RSS MiB")]


def write_table(args: argparse.Namespace) -> str:
    rows = [json.loads(p.read_text()) for p in sorted(args.out.glob("*/sweep.json"))]
    rows.sort(key=lambda r: -r.get("valid_lcbleu", 0))
    lines = [f"Recipe sweep: experiment={args.experiment} on {cpu_name()}, train.precision={args.precision}; "
             "validation set only (sorted by valid lcBLEU).", "",
             "| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"`{r[k]}`" if k == "overrides" else str(r.get(k, "")) for k, _ in COLUMNS) + " |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    (args.out / "sweep.md").write_text(text)
    (args.out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="multi30k_en_de")
    parser.add_argument("--budget", type=float, default=900, help="seconds of wall clock per candidate")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="bf16", help="fp32 where the CPU has no native bf16 (AVX2 only)")
    parser.add_argument("--only", default="", help="comma-separated candidate names")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/sweep_<experiment>")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--ensemble", default="", help="comma-separated finished candidates, scored as one ensemble")
    parser.add_argument("extra", nargs="*", help="overrides for every candidate (key=value)")
    args = parser.parse_args()
    args.out = (args.out or ROOT / "runs" / f"sweep_{args.experiment}").resolve()
    names = [n for n in args.only.split(",") if n] or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidate(s) {', '.join(unknown)}: choose from {', '.join(CANDIDATES)}")
    if args.list:
        for name in names:
            print(f"{name:12s} {' '.join(CANDIDATES[name]) or '(the preset)'}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ensemble:
        members = args.ensemble.split(",")
        rows = [json.loads((args.out / m / "sweep.json").read_text()) for m in members]
        name = "+".join(members)
        (args.out / name).mkdir(exist_ok=True)
        row = {"candidate": name, "overrides": "ensemble of " + ", ".join(members),
               "budget": " + ".join(r.get("budget", "?") for r in rows),
               "threads": " + ".join(str(r.get("threads", "?")) for r in rows),
               "updates": " + ".join(str(r["updates"]) for r in rows), "tok_per_s": "-", "best_valid_ppl": "-",
               "best_at": "-", "peak_rss_mib": "-",
               **score_validation(args.out / name, args, [args.out / m / "checkpoints" / "averaged.pt"
                                                          for m in members])}
        (args.out / name / "sweep.json").write_text(json.dumps(row, indent=2) + "\n")
        print(write_table(args))
        return 0
    if not args.table_only:
        for name in names:
            if (args.out / name / "sweep.json").exists():
                print(f"{name}: done before ({args.out / name / 'sweep.json'})")
                continue
            row = run_candidate(name, CANDIDATES[name], args)
            print(json.dumps(row), flush=True)
            write_table(args)
    print(write_table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
