#!/usr/bin/env bash
# The kernels on a GPU (docs/kernels.md): the GPU tests, then the benchmark.
#   OUT=/some/dir [FLA_WHEELS=dir] [TESTS=0] [BENCH=0] [BENCH_ARGS=...] bash reports/kernels/gpu_kernels.sh [RUN_NAME]
# Writes $OUT/kernels.tar (gpu_tests_<run>.log, bench_<run>.log, kernels.csv, kernels.md). TESTS=0 or
# BENCH=0 skips that half (each takes 5-8 minutes on an H200: where one call is limited to 10 minutes,
# run each half in a call of its own). BENCH_ARGS (default `--lengths 8k 64k`) replaces the
# benchmark's arguments, e.g. `--table-only --lengths 8k 16k 32k 64k`. To time the Triton the project
# pins on a machine whose image has another, scripts/pack_triton.sh packs it and says how to unpack
# it there, ahead on PYTHONPATH.
set -uo pipefail
RUN=${1:-run}
OUT=${OUT:-/tmp/nsa-kernels}
DIR=/tmp/nsa-kernels-$RUN
mkdir -p "$OUT" "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "${TESTS:-1}" != 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$DIR/gpu_tests_$RUN.log"
  timeout 540 python3 -m pytest -m gpu tests/kernels -q -s -p no:cacheprovider 2>&1 \
    | tee -a "$DIR/gpu_tests_$RUN.log" | grep -E "passed|failed|error|Error|ms|x " | tail -n 40
fi
if [ "${BENCH:-1}" = 0 ]; then
  tar -C "$DIR" -cf "$OUT/kernels.tar" .
  exit 0
fi
# flash-linear-attention's parallel_nsa joins the benchmark where its wheels are at $FLA_WHEELS (never
# vendored: fla_core and flash_linear_attention 0.6.0, installed without dependencies)
FLA_WHEELS=${FLA_WHEELS:-.whl}
if ls "$FLA_WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install --no-deps -q "$FLA_WHEELS"/*.whl 2>&1 | grep -v WARNING
fi
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout 560 python3 -m nsa_eval.commands.bench kernels ${BENCH_ARGS:---lengths 8k 64k} --out "$DIR" 2>&1 \
  | tee "$DIR/bench_$RUN.log" | tail -n 60
tar -C "$DIR" -cf "$OUT/kernels.tar" .
