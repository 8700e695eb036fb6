#!/usr/bin/env bash
# CI step (.ci/run): the offline GPU node path of docs/gpu.md as far as a CPU machine goes, over an old site torch.
# The wheelhouse is built from the index; the "node" is a Python environment of its own holding the site's torch —
# pyproject.toml's lowest (torch>=, 2.6) with the triton and CUDA runtime it pins, installed first from the index as a
# site would (its wheels downloaded once into the cache `make test-compat` shares, COMPAT_WHEELS); `make node-install`
# makes the venv over it with every index and pip configuration disabled, checks torch untouched and builds the
# kernels; the node's `pip freeze` (its torch and triton among it) is checked unchanged; then gpu-check's CPU smoke
# runs in the new venv. `make node` would go on to `make gpu-check`, which needs a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS
site_torch=${SITE_TORCH:-$(sed -n 's/^ *"torch>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)}
wheels=${COMPAT_WHEELS:-$HOME/.cache/spark-bench/wheels}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
make -s --no-print-directory wheelhouse WHEELHOUSE="$work/wheelhouse"
python3 -m venv "$work/node"
mkdir -p "$wheels"
# the site's torch as the index has it (a machine-wide pip constraint, if any, is the CI machine's, not the site's)
PIP_CONSTRAINT=/dev/null "$work/node/bin/pip" download -q -d "$wheels" "torch==$site_torch"
PIP_CONSTRAINT=/dev/null "$work/node/bin/pip" install -q --no-index --find-links "$wheels" "torch==$site_torch"
before=$("$work/node/bin/pip" freeze)
echo "ci-node: the site: $(echo "$before" | grep -E '^(torch|triton)==' | tr '\n' ' ')"
make -s --no-print-directory node-install NODE_PYTHON="$work/node/bin/python" VENV="$work/venv" \
  WHEELHOUSE="$work/wheelhouse"
after=$("$work/node/bin/pip" freeze)
if [ "$after" != "$before" ]; then
  echo "ci-node: node-install changed the node's own environment:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
"$work/venv/bin/python" scripts/gpu/check.py --device cpu --smoke --out "$work/check" > "$work/check.log" \
  || { tail -n 40 "$work/check.log"; exit 1; }
grep -E '^gpu-check: (triton|wrote)' "$work/check.log" || true
echo "ci-node: wheelhouse, offline install over the site's torch $site_torch and gpu-check's CPU smoke passed in" \
  "$((SECONDS - start)) s"
