#!/usr/bin/env bash
# bench/gpu/check.sh [--cpu-smoke] [--budget S]: the first GPU's checks in one go (bench/gpu/check.py says what each
# row must show; vLLM's gapo-train rows first, each step's seconds printed, steps past --budget read SKIP). A CUDA host needs
# its torch and transformers; the rest (vLLM for that torch, DeepSpeed, pydantic, math-verify, ...) may come as the
# offline kit in .whl/ (bench/gpu/kit.py pack, here), joined, verified and installed into the node's python3 at
# /tmp/site. Without vLLM the vLLM rows say so. On a machine without a GPU every row reads SKIP and it exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
# .venv when its torch sees CUDA, or on a host with no GPU (every row then reads SKIP): a CPU profile's .venv
# (make install) on a GPU host would see no device.
if [ -x .venv/bin/python ] && { [ "${1:-}" = --cpu-smoke ] || [ -z "$(nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)" ] \
    || .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }; then
  PY=.venv/bin/python
elif [ -x .venv/bin/python ]; then
  echo "check.sh: .venv's torch sees no CUDA device (a CPU profile?); using $(command -v python3)" >&2
fi
# The node's python3 takes gapo's other dependencies from the kit in .whl/ (bench/gpu/kit.py); a .venv has its own.
if [ "$PY" = python3 ] && [ -f .whl/manifest.json ]; then
  tic=$(date +%s)
  python3 bench/gpu/kit.py install --dir .whl --target /tmp/site
  echo "[kit install: $(( $(date +%s) - tic )) s]"
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
export OMP_WAIT_POLICY=PASSIVE WANDB_MODE=disabled
exec "$PY" bench/gpu/check.py "$@"
