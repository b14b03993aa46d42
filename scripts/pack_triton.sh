#!/usr/bin/env bash
# The Triton this project pins, packed to travel to the H200 (whose image has Triton 3.6) in device
# calls of 64 MiB with the working tree:
#   bash scripts/pack_triton.sh [VERSION]       # here: writes .t38/partaa, .t38/partab (~26 MB each)
# On the H200, one call per piece to a warm machine (`carry` [".t38/partaa"], then [".t38/partab"]):
#   cp .t38/partaa /tmp/t38.partaa                                         # first call
#   cat /tmp/t38.partaa .t38/partab | tar -C /tmp/t38site -xJ && export PYTHONPATH=/tmp/t38site   # second
# (mkdir -p /tmp/t38site first). The wheel is stripped of what the kernels do not use: the AMD backend
# (and its entry point), CUPTI, the Blackwell ptxas, the Proton profiler, the instrumentation library
# and libtriton's symbols; zip does not keep the tools' exec bits, so they are set again here.
set -euo pipefail
VERSION=${1:-3.8.0}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$WORK" "triton==$VERSION"
mkdir "$WORK/site"
python3 -m zipfile -e "$WORK"/triton-*.whl "$WORK/site"
cd "$WORK/site"
rm -rf triton/backends/amd triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti \
  triton/backends/nvidia/lib/cupti-blackwell triton/_C/libproton.so triton/instrumentation
sed -i '/amd/d' triton-*.dist-info/entry_points.txt
chmod +x triton/backends/nvidia/bin/*
strip --strip-unneeded triton/_C/libtriton.so
cd - > /dev/null
mkdir -p .t38
grep -qs '^/.t38/' .git/info/exclude || echo '/.t38/' >> .git/info/exclude  # never committed
rm -f .t38/part*
tar -C "$WORK/site" -cf - . | xz -6 -T2 | split -b 26M - .t38/part
ls -l .t38
