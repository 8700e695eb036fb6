#!/usr/bin/env bash
# CI step (.ci/run): the offline GPU node path of docs/gpu.md as far as a CPU machine goes. The wheelhouse is built
# from the index; the "node" is a Python environment of its own with torch and triton (this machine's builds, as
# an admin or a module would provide them); `make node-install` makes the venv over it with every index and pip
# configuration disabled, checks torch untouched and builds the kernels; then gpu-check's CPU smoke runs in that
# venv. `make node` would go on to `make gpu-check`, which needs a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
make -s --no-print-directory wheelhouse WHEELHOUSE="$work/wheelhouse"
python3 -m venv "$work/node"
"$work/node/bin/pip" install -q -c requirements.lock torch triton
before=$("$work/node/bin/pip" freeze)
make -s --no-print-directory node-install NODE_PYTHON="$work/node/bin/python" VENV="$work/venv" \
  WHEELHOUSE="$work/wheelhouse"
if [ "$("$work/node/bin/pip" freeze)" != "$before" ]; then
  echo "ci-node: node-install changed the node's own environment" >&2
  exit 1
fi
"$work/venv/bin/python" scripts/gpu/check.py --device cpu --smoke --out "$work/check" > "$work/check.log" \
  || { tail -n 40 "$work/check.log"; exit 1; }
echo "ci-node: wheelhouse, offline install over the node's torch and gpu-check's CPU smoke passed in $((SECONDS - start)) s"
