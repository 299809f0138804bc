"""The measurements of docs/MULTILINGUAL.md (issue #46), rerunnable: one multilingual model against two bilingual ones
at the same total training time, then Czech added to the multilingual model three ways at the same budget.
Not part of CI (it trains for an hour or more).

    python tools/multilingual_study.py --budget 1080                  # every step; a bilingual run gets 18 min
    python tools/multilingual_study.py --budget 1080 --only en_de,en_fr,multi
    python tools/multilingual_study.py --table-only

Each step is `python train.py <its overrides> train.max_time=<budget × its share>` on one thread (OMP_NUM_THREADS),
`train.max_steps` lifted so that the budget ends it, in `<out>/<step>/`, its log in `<out>/<step>.log`; then
evaluate.py decodes test_2016_flickr with the run's averaged.pt into each of the step's target languages
(`tgt_lang=`, beam 4, α 0.6) and scores it: cased sacreBLEU and chrF against the raw references, lcBLEU against
the official lowercased tokenised ones. The steps:

- en_de, en_fr: the bilingual presets, one budget each;
- multi: `experiment=multi30k_multilingual` (EN→DE and EN→FR, tags <2de> <2fr>), two budgets: the time the two
  bilingual models took together;
- cs_scratch: a bilingual EN→CS model from scratch (the EN→DE preset's recipe on Czech), one budget;
- cs_transfer: `data.vocab=transfer` from multi to EN→CS (a vocabulary of its own; the old pairs are given up);
- cs_extend: `experiment=multi30k_multilingual_add_cs` from multi (`data.vocab=extend`: the Czech pieces
  appended, the tag <2cs>, and the old pairs replayed, EN→DE and EN→FR at half weight each: about half of every epoch is
  Czech; half the peak learning rate), scored on all three pairs; cs_extend_lr1: the same at the full peak.

A step whose `study.json` exists is not run again: a killed study continues where it stopped. The table
(`<out>/study.md`): step, budget, updates, target tokens/s, and per target language sacreBLEU, chrF, lcBLEU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import cpu_name  # noqa: E402  (how every figure of benchmarks/ names its CPU)
from recipe_sweep import read_log  # noqa: E402  (updates, tokens/s, best valid ppl, peak memory of a train.py log)

MULTI30K = "../shared/data/multi30k"
CZECH = ["data.tgt_lang=cs"]  # the Multi30k data config's train, val and test_2016_flickr prefixes, into Czech

# name: (overrides, budget share, target languages scored; "{multi}" is the multi step's run directory)
STEPS: dict[str, tuple[list[str], int, list[str]]] = {
    "en_de": (["experiment=multi30k_en_de"], 1, ["de"]),
    "en_fr": (["experiment=multi30k_en_fr"], 1, ["fr"]),
    "multi": (["experiment=multi30k_multilingual"], 2, ["de", "fr"]),
    "cs_scratch": (["experiment=multi30k_en_de", *CZECH], 1, ["cs"]),
    "cs_transfer": (["experiment=multi30k_en_de", *CZECH, "init_from={multi}", "data.vocab=transfer"], 1, ["cs"]),
    "cs_extend": (["experiment=multi30k_multilingual_add_cs", "init_from={multi}"], 1, ["cs", "de", "fr"]),
    # the same at the full peak learning rate (the preset's is half of it): the fresh schedule's warm-up to
    # 2.2e-3 moved the trained weights, and German and French lost ground on validation
    "cs_extend_lr1": (["experiment=multi30k_multilingual_add_cs", "init_from={multi}", "train.lr_scale=1.0"], 1,
                      ["cs", "de", "fr"]),
}


def threads_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


# Every step as the study measured it: its averaged.pt the last 5 checkpoints. The bilingual presets have since
# taken the 2-hour recipe's last 15 (docs/RESULTS.md), which at a study's budget (~1,700 updates, a checkpoint every
# 200) would average all of them.
AVERAGING = ["train.keep_last=5", "train.average_last=5"]


def step_overrides(name: str, out: Path, budget: float, precision: str) -> list[str]:
    """train.py's overrides for one step of the study, run in `out` (the study's folder)."""
    overrides = [o.replace("{multi}", str(out / "multi")) for o in STEPS[name][0]]
    return [*overrides, *AVERAGING, f"run_dir={out / name}", "device=cpu", f"train.max_time={budget:g}",
            "train.max_steps=10000000", "train.test_at_end=false", f"train.precision={precision}"]


def run_step(name: str, args: argparse.Namespace) -> dict:
    _, share, languages = STEPS[name]
    out, log_path = args.out / name, args.out / f"{name}.log"
    budget = args.budget * share
    overrides = step_overrides(name, args.out, budget, args.precision)
    command = [sys.executable, str(ROOT / "train.py"), *overrides]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(command[2:])}", flush=True)
    with log_path.open("a") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        subprocess.run(command, cwd=ROOT, env=threads_env(args.threads), stdout=log, stderr=subprocess.STDOUT,
                       check=True)
    own = overrides[:len(STEPS[name][0])]  # the step's own, without what every step gets
    row = {"step": name, "overrides": " ".join(own), "budget": f"{budget:g} s", **read_log(log_path)}
    for lang in languages:
        row[lang] = score_test(out, lang, args)
    (out / "study.json").write_text(json.dumps(row, indent=2) + "\n")
    return row


def score_test(run_dir: Path, lang: str, args: argparse.Namespace) -> dict:
    """evaluate.py on test_2016_flickr into `lang` with the run's averaged.pt: sacreBLEU, chrF, lcBLEU."""
    out = run_dir / f"eval_test_{lang}"
    test = ROOT / MULTI30K / "test_2016_flickr"
    command = [sys.executable, str(ROOT / "evaluate.py"), f"checkpoint={run_dir / 'checkpoints' / 'averaged.pt'}",
               f"src={test}.en", f"ref={test}.{lang}", f"tok_ref={test.parent}/tok/test_2016_flickr.lc.norm.tok.{lang}",
               f"tgt_lang={lang}", f"out={out}", "report=false", f"table={out / 'table.md'}", "device=cpu"]
    with (args.out / f"{run_dir.name}.log").open("a") as log:
        subprocess.run(command, cwd=ROOT, env=threads_env(args.threads), check=True, stdout=subprocess.DEVNULL,
                       stderr=log)
    scores = json.loads((out / "scores.json").read_text())["scores"]
    return {metric: round(scores[key]["score"], 2) for metric, key in (("bleu", "BLEU"), ("chrf", "chrF2"),
                                                                        ("lcbleu", "lcBLEU")) if key in scores}


def write_table(args: argparse.Namespace) -> str:
    rows = {p.parent.name: json.loads(p.read_text()) for p in args.out.glob("*/study.json")}
    lines = [f"Multilingual study on {cpu_name()}, {args.threads} thread(s) a run, train.precision={args.precision}; "
             "test_2016_flickr (sacreBLEU / chrF / lcBLEU of averaged.pt, beam 4).", "",
             "| step | budget | updates | tgt tok/s | best valid ppl | EN→DE | EN→FR | EN→CS |", "|---|---|---|---|---|---|---|---|"]
    for name in (n for n in STEPS if n in rows):
        row = rows[name]
        cells = [" / ".join(str(row[lang].get(m, "-")) for m in ("bleu", "chrf", "lcbleu")) if lang in row else ""
                 for lang in ("de", "fr", "cs")]
        lines.append(f"| {name} | {row['budget']} | {row['updates']} | {row['tok_per_s']} | {row['best_valid_ppl']} | "
                     + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (args.out / "study.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=1800, help="seconds of wall clock for a bilingual run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="bf16", help="fp32 where the CPU has no native bf16 (AVX2 only)")
    parser.add_argument("--only", default="", help="comma-separated steps, in the order of the study")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "multilingual_study")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(STEPS)
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}: choose from {', '.join(STEPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for name in names:
            if (args.out / name / "study.json").exists():
                continue
            if "{multi}" in " ".join(STEPS[name][0]) and not (args.out / "multi" / "study.json").exists():
                parser.error(f"{name} starts from the multi step's model: run --only multi first")
            run_step(name, args)
    print(write_table(args), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
