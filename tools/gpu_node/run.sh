#!/usr/bin/env bash
# The one GPU command (issue #49): on an offline GPU node with its own PyTorch, install the project from the
# wheelhouse without touching that torch, run the suite's `cuda` tests, then the full GPU check, then the fast
# tests on the node's torch in the time left; everything lands in one folder.
#
#   bash tools/gpu_node/run.sh            # on the node, from the checkout's root; OUT=DIR (default runs/gpu_node)
#   bash tools/gpu_node/run.sh --smoke    # the same on a CPU (tools/gpu_node/rehearse.sh): gpu_check --smoke
#
# Needs: ./wheelhouse (python tools/wheelhouse.py, on a machine with an index; with the device tool it travels
# as carry=["wheelhouse"]). Environment: NODE_PYTHON [python3: the interpreter that holds the node's torch],
# WHEELHOUSE [wheelhouse], VENV [/tmp/transformer-wmt-venv], CUDA_CAP_S [120: `pytest -m cuda tests`],
# TESTS [-n 8 -m "not slow and not extras and not cuda" tests: the fast tests; the [hf] extra's are out, the
# node's transformers 5.17 being below its floor, 5.24], TESTS_CAP_S [0: skipped, so that gpu_check has the
# time (CI runs them on CPUs); e.g. 120 for a node with time to spare],
# BUDGET_S [570: the whole command; gpu_check gets what the steps before it left, less TESTS_CAP_S].
# Expected on one H100 (estimates: only the CPU rehearsal has timed this): install 20-40 s, the cuda tests
# under a minute, gpu_check about 6 min (with up to ~8 min left to it), the fast tests only when asked for.
# The check's figures come first: they are what a device session is for, and gpu_check writes them after each
# of its steps, so a cap that ends it mid-way still brings back what it measured.
# The node's pip must be 22.3 or newer (`pip --python`).
#
# What comes back in $OUT (the device tool returns at most 8 files): run.log (everything printed),
# summary.txt (each step's status and seconds), node-freeze.txt (the node's real pip freeze: commit it as
# tools/gpu_node/requirements-node.txt), pytest-cuda.xml and pytest.xml (the test reports), gpu_check.md and
# gpu_check.json (the table), BENCHMARKS.md (docs/BENCHMARKS.md with the check's section written in).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
SMOKE=""; [ "${1:-}" = "--smoke" ] && SMOKE="--smoke"
OUT=${OUT:-runs/gpu_node}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
NODE_PYTHON=${NODE_PYTHON:-python3}
WHEELHOUSE=$(cd "${WHEELHOUSE:-wheelhouse}" 2>/dev/null && pwd) || { echo "error: no wheelhouse folder: run python tools/wheelhouse.py where an index is reachable, and carry it" >&2; exit 2; }
VENV=${VENV:-/tmp/transformer-wmt-venv}
TESTS=${TESTS:-'-n 8 -m "not slow and not extras and not cuda" tests'}
CUDA_CAP_S=${CUDA_CAP_S:-120}
TESTS_CAP_S=${TESTS_CAP_S:-0}
BUDGET_S=${BUDGET_S:-570}
START=$SECONDS
exec > >(tee "$OUT/run.log") 2>&1
: > "$OUT/summary.txt"

# pip reads only what this script says: no index, no find-links or constraints from this machine's config.
for name in $(env | grep -o '^PIP_[A-Z_]*'); do unset "$name"; done
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

step() {  # step NAME COMMAND...: run, time, record; the script goes on after a failing step
    local name=$1 begin=$SECONDS status; shift
    echo "== $(date +%T) $name: $*"
    "$@"; status=$?
    printf '%-10s status %3d  %4d s\n' "$name" "$status" $((SECONDS - begin)) | tee -a "$OUT/summary.txt"
    return $status
}
fail() { echo "error: $*" >&2; printf 'total      %4d s  (stopped: %s)\n' $((SECONDS - START)) "$*" >> "$OUT/summary.txt"; exit 1; }

node_info() {
    "$NODE_PYTHON" -m pip freeze > "$OUT/node-freeze.txt"
    "$NODE_PYTHON" -c 'import sys, torch; print(sys.version.split()[0], sys.executable, "torch", torch.__version__, torch.__file__, "cuda", torch.cuda.is_available())'
    nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
    ls "$WHEELHOUSE" | sed 's/^/wheelhouse: /'
}

preflight() {  # what the wheelhouse leaves to the node must be there, at versions the others accept
    "$NODE_PYTHON" - "$WHEELHOUSE/node-needs.txt" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.requirements import Requirement
except ModuleNotFoundError:
    from pip._vendor.packaging.requirements import Requirement
bad = []
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    need = Requirement(line)
    try:
        have = version(need.name)
    except PackageNotFoundError:
        bad.append(f"{need.name} is not installed on the node (wanted: {need})")
        continue
    if not need.specifier.contains(have, prereleases=True):
        bad.append(f"the node's {need.name} {have} does not meet {need}")
for line in bad:
    print(f"error: {line}: rebuild the wheelhouse with this package's wheel (tools/wheelhouse.py --fallback-mb)", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
}

make_venv() {  # a venv that sees exactly the node python's packages, torch first of all, and installs beside them
    rm -rf "$VENV"
    # Not --system-site-packages: the node's python3 may itself be a venv (/opt/torch/.venv), and that flag
    # reaches the interpreter it was made from, not the venv that holds torch (and, on a machine whose base
    # Python has packages of its own, those too). Instead the node python's own site folders, in its order,
    # go on our path after the venv's, so what we install shadows and nothing of the node's is changed.
    "$NODE_PYTHON" -m venv --without-pip "$VENV" || return 1
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    # addsitedir, not a bare path: the .pth files in the node's folders are read too, as the node's python does.
    "$NODE_PYTHON" -c 'import sys; print("\n".join(f"import site; site.addsitedir({p!r})" for p in sys.path
                                                  if p.endswith(("site-packages", "dist-packages"))))' \
        > "$site/node-site-packages.pth"
    cat "$site/node-site-packages.pth"
}

pip_venv() { "$NODE_PYTHON" -m pip --python "$VENV/bin/python" "$@"; }

install_project() {
    local project report
    project=$(ls "$WHEELHOUSE"/transformer_wmt-*.whl) || return 1
    report=$(mktemp)
    pip_venv install --dry-run --quiet --no-index --find-links "$WHEELHOUSE" --report "$report" "$project" || return 1
    "$VENV/bin/python" - "$report" <<'EOF' || return 1
import json, sys
planned = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.load(open(sys.argv[1]))["install"]]
print("to install:", " ".join(f"{n}=={v}" for n, v in planned))
if any(n.lower() == "torch" for n, _ in planned):
    sys.exit("error: the install would replace the node's torch")
EOF
    pip_venv install --quiet --no-index --find-links "$WHEELHOUSE" "$project"
}

same_torch() {  # the venv's torch is the node's, the same file
    local node venv
    node=$("$NODE_PYTHON" -c 'import torch; print(torch.__version__, torch.__file__)') || return 1
    venv=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.__file__)') || return 1
    echo "node: $node"; echo "venv: $venv"
    [ "$node" = "$venv" ] || { echo "error: the venv's torch is not the node's" >&2; return 1; }
    "$VENV/bin/python" -c 'import datasets, hydra, sacrebleu, sacremoses, sentencepiece, tensorboard, transformer.model; print("imports: ok")'
}

pytest_capped() {  # pytest_capped CAP REPORT ARGS...: SIGINT at the cap, so pytest stops as on Ctrl-C and still
    local cap=$1 report=$2; shift 2  # writes the report of what ran
    eval "timeout -s INT -k 30 $cap \"$VENV/bin/python\" -m pytest -q -p no:cacheprovider --junitxml \"$report\" $*"
}
cuda_tests() { pytest_capped "$CUDA_CAP_S" "$OUT/pytest-cuda.xml" -n 0 -m cuda tests; }
fast_tests() {
    local left=$((BUDGET_S - (SECONDS - START) - 10))
    [ "$TESTS_CAP_S" -gt 0 ] || { echo "skipped (TESTS_CAP_S=0)"; return 0; }
    [ "$left" -gt 20 ] || { echo "skipped: no time left ($left s)"; return 0; }
    pytest_capped "$(( left < TESTS_CAP_S ? left : TESTS_CAP_S ))" "$OUT/pytest.xml" "$TESTS"
}

run_gpu_check() {
    local left=$((BUDGET_S - (SECONDS - START) - TESTS_CAP_S))
    [ "$left" -gt 30 ] || { echo "error: no time left for gpu_check ($left s)" >&2; return 1; }
    echo "gpu_check gets $left s"
    cp docs/BENCHMARKS.md "$OUT/BENCHMARKS.md"
    timeout -s INT -k 20 "$left" "$VENV/bin/python" benchmarks/gpu_check.py $SMOKE --no-tests --out "$OUT" --write "$OUT/BENCHMARKS.md"
}

step node     node_info  || fail "the node's python ($NODE_PYTHON) has no torch"
step preflight preflight || fail "the node lacks what the wheelhouse leaves to it"
step venv     make_venv  || fail "could not make the venv"
step install  install_project    || fail "the offline install failed (its error is above)"
step torch    same_torch || fail "the venv does not use the node's torch"
step cuda     cuda_tests
step gpu_check run_gpu_check
step tests    fast_tests
printf 'total      %4d s\n' $((SECONDS - START)) | tee -a "$OUT/summary.txt"
! grep -qv ' status   0 \|^total' "$OUT/summary.txt"
