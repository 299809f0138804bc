"""The test suite under the conditions that break tests which lean on a machine's speed or on what its kernels
happen to compute: the README's command as it is, one thread, two threads, and a CPU hog on one core beside
each. Not part of CI.

    python tools/stress_suite.py                       # the six runs, the whole suite each
    python tools/stress_suite.py --only readme --only hog-readme --runs 3   # the README's command, idle and loaded
    python tools/stress_suite.py --runs 3 -- -m "not slow"
    python tools/stress_suite.py --only hog-1thread -- tests/training/test_budget.py
    python tools/stress_suite.py --isa avx2 --only readme --only hog-readme --runs 3   # as on an AVX2-only CPU

Each run is the README's test command (`python -m pytest -q tests`, its workers as pyproject.toml sets them), with
OMP_NUM_THREADS and MKL_NUM_THREADS set to the run's thread count except in the readme conditions; a hog run
also starts one process that spins on core 0 (sched_setaffinity) for as long as the suite runs. A test that passes
idle and fails here asserts something the code does not guarantee: a time, or an output that a briefly trained
model happens to produce.

The table at the end: condition, run, passed, failed, skipped, seconds, and the names of the failed tests;
`--json` writes it too. Each run's whole pytest output goes to `<--logs>/<condition>[-<isa>]-<run>.log` (default
runs/stress/), so that a failure seen under load can be read afterwards. The exit status is 1 if any run failed.

`--isa avx2` runs every condition with the kernels an AVX2-only CPU (an older AMD EPYC) gets, on a CPU that has
more: torch's own kernels at their AVX2 level (ATEN_CPU_CAPABILITY), oneDNN and MKL capped to AVX2
(ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS), so bf16 is emulated as it is there. It is the closest this tool
comes to that machine, not the machine: its speed and its cache sizes stay those of the CPU it runs on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import cpu_name  # noqa: E402  (how every figure of benchmarks/ names its CPU)

CONDITIONS = {  # name: (threads, hog); None: the thread variables as the environment has them (the README's command)
    "readme": (None, False),
    "hog-readme": (None, True),
    "1thread": (1, False),
    "2threads": (2, False),
    "hog-1thread": (1, True),
    "hog-2threads": (2, True),
}


def spin(core: int) -> None:
    """A CPU hog: busy work on one core until killed."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2**31


ISA_CAPS = {  # --isa: the variables that hold torch, oneDNN and MKL to one instruction set on any x86 CPU
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def run_suite(threads: int | None, hog: bool, pytest_args: list[str], log: Path, isa: str = "native") -> dict:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **ISA_CAPS[isa]}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    hogger = multiprocessing.Process(target=spin, args=(0,), daemon=True) if hog else None
    if hogger:
        hogger.start()
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                              cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        if hogger:
            hogger.kill()
            hogger.join()
    seconds = time.monotonic() - started
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(done.stdout + done.stderr)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0),
            "skipped": counts.get("skipped", 0), "seconds": round(seconds),
            "failures": re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M), "exit": done.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of each condition")
    parser.add_argument("--only", choices=sorted(CONDITIONS), action="append", help="conditions to run (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--logs", type=Path, default=ROOT / "runs" / "stress", help="each run's pytest output")
    parser.add_argument("--isa", choices=sorted(ISA_CAPS), default="native",
                        help="avx2: run with the kernels of an AVX2-only CPU (bf16 emulated), on any x86 CPU")
    parser.add_argument("pytest_args", nargs="*", default=["tests"], help="after --: pytest's arguments")
    args = parser.parse_args()
    caps = " ".join(f"{name}={value}" for name, value in ISA_CAPS[args.isa].items())
    isa = f", capped to {args.isa.upper()} ({caps})" if caps else ""
    print(f"{cpu_name()}, {os.cpu_count()} cores{isa}; pytest {' '.join(args.pytest_args)}", flush=True)
    rows = []
    for name in args.only or CONDITIONS:
        threads, hog = CONDITIONS[name]
        for number in range(1, args.runs + 1):
            log = args.logs / f"{name}{'' if args.isa == 'native' else '-' + args.isa}-{number}.log"
            row = {"condition": name, "isa": args.isa, "run": number,
                   **run_suite(threads, hog, args.pytest_args, log, args.isa), "log": str(log)}
            rows.append(row)
            print(f"{name:13s} run {number}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} "
                  f"skipped in {row['seconds']} s {' '.join(row['failures'])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "isa": args.isa, "rows": rows}, indent=1))
    return 1 if any(row["failed"] or row["exit"] not in (0, 5) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
