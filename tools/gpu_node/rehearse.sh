#!/usr/bin/env bash
# The GPU command rehearsed on a CPU machine (issue #49), so that a node reservation is not spent on an import
# error. It builds a stand-in for the node, then runs tools/gpu_node/run.sh --smoke against it, offline.
#
#   bash tools/gpu_node/rehearse.sh                                   # this machine's python3, torch==2.13.0
#   bash tools/gpu_node/rehearse.sh ~/.pyenv/versions/3.12.1/bin/python3 torch==2.11.0   # the node's Python and torch
#
# 1. tools/wheelhouse.py for that Python's version, against tools/gpu_node/requirements-node.txt (online);
# 2. the stand-in node: a fresh venv (the node's python3 is one too), torch installed first, then the packages
#    the wheelhouse leaves to the node, at the recorded versions or within the bounds the project's packages
#    set (online: they stand for the node image);
# 3. run.sh --smoke with that venv as the node's python: a venv with --system-site-packages over it, only the
#    wheelhouse with --no-index (pip's config and PIP_* variables ignored), the check that torch is the node's,
#    the suite's cuda tests (skipped here), two fast files (TESTS), which import the whole stack (hydra,
#    datasets, sentencepiece), and gpu_check --smoke. Everything under $WORK (default /tmp/rehearsal-<python version>).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${1:-python3}
TORCH=${2:-torch==2.13.0}
VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
WORK=${WORK:-/tmp/rehearsal-$VERSION}
rm -rf "$WORK"; mkdir -p "$WORK"
exec > >(tee "$WORK/rehearse.log") 2>&1
echo "== $(date +%T) rehearsal: $PYTHON (Python $VERSION), $TORCH, in $WORK"

status=0 begin=$SECONDS
# The node's pins are for its Python 3.12: another Python may need some left free (3.11: numpy 2.5 has no wheel).
UNPIN=${UNPIN-$(if [ "$VERSION" = 3.11 ]; then echo numpy; fi)}
python3 tools/wheelhouse.py --python "$VERSION" --dest "$WORK/wheelhouse" ${UNPIN:+--unpin $UNPIN} | tail -3
echo "== wheelhouse: $((SECONDS - begin)) s"

begin=$SECONDS
"$PYTHON" -m venv "$WORK/node"
"$WORK/node/bin/python" -m pip install --quiet "$TORCH"
# What the wheelhouse leaves to the node: the recorded versions exactly, the others at any version that meets
# what the project's packages ask of them (node-needs.txt), as on the node, where nobody recorded them.
# shellcheck disable=SC2046  # one requirement a word
"$WORK/node/bin/python" -m pip install --quiet \
    $(grep 'on the node at this version' "$WORK/wheelhouse/MANIFEST.txt" | cut -d' ' -f1) \
    $(grep -v '^#' "$WORK/wheelhouse/node-needs.txt" | cut -d' ' -f1)
echo "== stand-in node: $((SECONDS - begin)) s"

NODE_PYTHON="$WORK/node/bin/python" WHEELHOUSE="$WORK/wheelhouse" VENV="$WORK/venv" OUT="$WORK/out" \
    TESTS="${TESTS:--n 0 -m 'not slow' tests/core/test_config.py tests/core/test_model.py}" \
    CUDA_CAP_S=600 TESTS_CAP_S="${TESTS_CAP_S:-600}" BUDGET_S="${BUDGET_S:-1200}" \
    bash tools/gpu_node/run.sh --smoke || status=$?
cat "$WORK/out/summary.txt"
exit $status
