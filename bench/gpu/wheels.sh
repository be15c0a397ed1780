#!/usr/bin/env bash
# bench/gpu/wheels.sh [PYTHON_VERSION]: fill .whl/ with what bench/gpu/check.sh needs beside torch and transformers,
# for a GPU node with no package index (its python3, default 3.12). Versions are this checkout's .venv's (make
# install), so the node runs what the tests here ran. vLLM is not among them: its CUDA wheel (~400 MB) is installed
# on the node itself (`pip install -e '.[gpu]'`), and without it check.sh's vLLM rows read SKIP.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV="${1:-3.12}"
VENV_PY=.venv/bin/python
[ -x "$VENV_PY" ] || { echo "wheels.sh: needs this checkout's .venv (make install) for the versions" >&2; exit 2; }
# gapo's imports on check.sh's paths (the rl step scores with math-verify in worker processes) and DeepSpeed's.
NAMES="pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson dill math-verify
latex2sympy2_extended antlr4-python3-runtime"
PINS=$("$VENV_PY" -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $NAMES)
mkdir -p .whl
PLATFORMS=""
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
# shellcheck disable=SC2086  # word splitting of the lists is intended
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLATFORMS \
  -d .whl $PINS
# DeepSpeed ships as a source archive: built here into a pure-Python wheel (its CUDA ops are compiled on use, and
# gapo's AdamW is torch's, so none is).
"$VENV_PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$("$VENV_PY" -c \
  "import importlib.metadata as m; print(m.version('deepspeed'))")"
ls -1 .whl
