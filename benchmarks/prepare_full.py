"""Measured, not projected: `train.py prepare_only=true` on a corpus the size of WMT14 EN-DE (4.5M pairs).

    python benchmarks/prepare_full.py                        # prints a Markdown section (about 15 min on 2 cores)
    python benchmarks/prepare_full.py --write docs/BENCHMARKS.md
    python benchmarks/prepare_full.py --copies 2             # a quick run of the same code (91k pairs)

The corpus: the real 45,538-pair EN-DE sample (`../shared/data/text/train.en-de.{en,de}`) written out
`--copies` times (99: 4,508,262 pairs, WMT14 EN-DE's size) as plain text files in a temporary directory, with
newstest2013 as the validation split. Duplicates change the work of one stage only: loading, cleaning (which
keeps them: `data.dedup=false`, the default) and encoding handle every line, but SentencePiece counts
identical sentences once, so the vocabulary stage trains on the sample's ~91k distinct sentences (weighted)
rather than 2M distinct ones: its figure is a lower bound (docs/BENCHMARKS.md, "Data preparation", has the
scaling of vocabulary training in distinct sentences).

The command is the paper's base recipe (`experiment=paper_base_en_de`, 37k pieces) on those files. The run is
watched from outside: every 0.2 s the resident memory of its whole process tree (train.py and its encoding
workers) and their CPU time are read from /proc, and the stages are cut where train.py logs their ends
("data: train: ..." after loading and cleaning, "vocabulary: ..." after the vocabulary, "train: encoded ..."
after encoding).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch  # noqa: E402
from _common import machine, write_section  # noqa: E402
from data_prep import effective_cores, fmt  # noqa: E402

HEADING = "## Preparing a WMT14-sized corpus (measured)"
TICKS = os.sysconf("SC_CLK_TCK")
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20

# The log line that ends each stage (train.py's data pipeline, data/pipeline.py), in order.
STAGES = [
    ("load + clean train (text → Arrow)", re.compile(r"data: train: \d+ pairs read")),
    ("vocabulary (SentencePiece BPE, 2M-sentence sample of ~91k distinct)", re.compile(r"data: vocabulary: .*pieces, [\d.]+ s\)")),
    ("encode train", re.compile(r"data: train: encoded")),
    ("load, clean, encode valid (3,000 pairs) and exit", None),  # ends when the process does
]


def write_corpus(text_dir: Path, out: Path, copies: int) -> int:
    """`copies` × the sample as out/train.{en,de}, newstest2013 as out/valid.{en,de}; returns the pair count."""
    out.mkdir(parents=True, exist_ok=True)
    pairs = 0
    for lang in ("en", "de"):
        lines = (text_dir / f"train.en-de.{lang}").read_bytes()
        with open(out / f"train.{lang}", "wb") as f:
            for _ in range(copies):
                f.write(lines)
        pairs = lines.count(b"\n") * copies
        (out / f"valid.{lang}").write_bytes((text_dir / f"newstest2013.{lang}").read_bytes())
    return pairs


def tree(root: int) -> list[int]:
    """root and all its descendants (from /proc/*/stat's parent field)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def sample(root: int, seen: dict[int, float]) -> tuple[float, float]:
    """(resident MB of the tree, CPU seconds of every process of the tree seen so far, the finished ones at
    their last sample: a process's own user + system time only, so that a finished worker, whose time also
    moves into its parent's children's time, is not counted twice)."""
    rss = 0.0
    for pid in tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except OSError:
            continue
        seen[pid] = max(seen.get(pid, 0.0), (int(fields[11]) + int(fields[12])) / TICKS)  # utime + stime
        rss += pages * PAGE_MB
    return rss, sum(seen.values())


def measure(data: Path, copies: int, workers: int) -> str:
    load_before, cores_before = os.getloadavg()[0], effective_cores()
    with tempfile.TemporaryDirectory(prefix="prepare_full_") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        pairs = write_corpus(data / "text", work / "corpus", copies)
        write_seconds = time.perf_counter() - started
        size_gb = sum(f.stat().st_size for f in (work / "corpus").iterdir()) / 1e9
        cmd = [sys.executable, str(ROOT / "train.py"), "experiment=paper_base_en_de", "prepare_only=true",
               f"run_dir={work / 'run'}", "device=cpu", "data.dataset=null",
               f"data.train_prefix={work / 'corpus' / 'train'}", f"data.valid_prefix={work / 'corpus' / 'valid'}",
               "train.test_at_end=false", f"data.num_workers={workers}"]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        log: list[tuple[float, str]] = []
        reader = threading.Thread(target=lambda: log.extend((time.perf_counter(), line) for line in proc.stderr))
        reader.start()
        samples, seen = [], {}
        while proc.poll() is None:
            samples.append((time.perf_counter(), *sample(proc.pid, seen)))
            time.sleep(0.2)
        reader.join()
        end = time.perf_counter()
        if proc.returncode != 0:
            sys.exit("train.py prepare_only failed:\n" + "".join(line for _, line in log[-20:]))
        own = os.times()  # train.py was waited for: its whole tree's CPU time is in our children's times
        cpu_total = own.children_user + own.children_system
        disk_gb = sum(f.stat().st_size for f in (work / "run").rglob("*") if f.is_file()) / 1e9
    load_after, cores_after = os.getloadavg()[0], effective_cores()

    bounds = [start]
    for _, pattern in STAGES[:-1]:
        hit = next((t for t, line in log if t > bounds[-1] and pattern.search(line)), None)
        if hit is None:
            sys.exit(f"no log line matched {pattern.pattern!r}: has data/pipeline.py's logging changed?")
        bounds.append(hit)
    bounds.append(end)
    rows = []
    for (name, _), lo, hi in zip(STAGES, bounds, bounds[1:]):
        inside = [s for s in samples if lo <= s[0] <= hi] or [min(samples, key=lambda s: abs(s[0] - hi))]
        before = max((s for s in samples if s[0] <= lo), key=lambda s: s[0], default=(lo, 0.0, 0.0))
        after = max((s for s in samples if s[0] <= hi), key=lambda s: s[0], default=before)
        cpu = after[2] - before[2]
        rows.append(f"| {name} | {fmt(hi - lo)} | {fmt(cpu)} | {max(s[1] for s in inside) / 1024:.2f} GB |")
    loaded = max(load_before, load_after) > 0.5 * (os.cpu_count() or 1)
    cmd_line = f"python benchmarks/prepare_full.py --copies {copies} --workers {workers}"
    return "\n".join([
        HEADING,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine(torch.device('cpu'))}. Command: `{cmd_line}`, which runs "
        f"`python train.py experiment=paper_base_en_de prepare_only=true data.num_workers={workers}` on "
        f"{pairs:,} pairs ({copies} copies of the 45,538-pair real sample as text files, {size_gb:.2f} GB; "
        "newstest2013 as the validation split) and watches its process tree (benchmarks/prepare_full.py says how). "
        f"1-minute load average {load_before:.1f} before, {load_after:.1f} after; two busy processes got "
        f"{cores_before:.1f} and {cores_after:.1f} cores' worth of time"
        + (" (the machine was shared with other jobs: wall-clock times are longer than on idle cores; CPU time "
           "is what the work costs)." if loaded else "."),
        "",
        "| stage | wall time | CPU time (all processes, sampled every 0.2 s) | peak resident memory (whole process tree) |",
        "| --- | --- | --- | --- |",
        *rows,
        f"| **all of prepare_only** | **{fmt(end - start)}** | **{fmt(cpu_total)}** (exact: `getrusage`) | "
        f"**{max(s[1] for s in samples) / 1024:.2f} GB** |",
        "",
        f"Writing the text files took {fmt(write_seconds)}; the run directory (vocabulary and encoded Arrow cache) "
        f"holds {disk_gb:.2f} GB. Peak memory of the tree counts pages the encoding workers share with their "
        "parent once per process, so it overstates the physical use.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--copies", type=int, default=99, help="copies of the 45,538-pair sample (99: 4.5M pairs)")
    parser.add_argument("--workers", type=int, default=2, help="data.num_workers")
    parser.add_argument("--write", type=Path, help="Markdown file whose section of this name to replace")
    args = parser.parse_args()
    if not (args.data / "text" / "train.en-de.en").is_file():
        sys.exit(f"error: the WMT14 text sample is not at {args.data / 'text'} (use --data)")
    section = measure(args.data.resolve(), args.copies, args.workers)
    print(section)
    if args.write:
        write_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
