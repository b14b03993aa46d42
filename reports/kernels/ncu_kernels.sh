#!/usr/bin/env bash
# Nsight Compute over one call of each workload of scripts/ncu_workloads.py (docs/kernel_runs.md, run 83):
#   OUT=/some/dir [WORKLOADS="prefill decode g4"] [KERNELS=regex:...] [T=65536] [SET=full] \
#     bash reports/kernels/ncu_kernels.sh
# Writes $OUT/ncu.tar.gz: ncu_<workload>.txt (every profiled kernel's sections: speed of light, memory,
# compute pipes, warp stalls, occupancy, launch) and ncu_<workload>_<kernel>_sass.csv (per-instruction
# samples of the heaviest kernels); the reports stay in /tmp/nsa-ncu-reports. KERNELS overrides each
# workload's kernel filter (run 85: KERNELS=regex:^_selected_dkv). Clocks are left alone
# (--clock-control none). scripts/ncu_summary.py prints the summaries kept in
# reports/kernels/ncu_run*.log. Needs a Firecracker machine (ncu reads no counters under gVisor).
set -uo pipefail
OUT=${OUT:-/tmp/nsa-ncu}
T=${T:-65536}
SET=${SET:-full}
REPS=/tmp/nsa-ncu-reports
rm -rf "$REPS"  # only this run's reports go into the archive
mkdir -p "$OUT" "$REPS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
declare -A FILTER=(  # which kernels each workload profiles, and which get a per-instruction table
  [prefill]="regex:^_(selected|band|importance|topk|gate|sum3)"
  [g4]="regex:^_selected_pipelined"
  [decode]="regex:^_decode"
)
declare -A SASS=(
  [prefill]="_selected_dkv_kernel _band_bwd_dkv_kernel _selected_pipelined_kernel _band_fwd_kernel"
  [g4]="_selected_pipelined_kernel"
  [decode]="_decode_cmp_split_kernel _decode_attn_fused_kernel"
)
WORKLOADS=${WORKLOADS:-prefill decode g4}
for w in $WORKLOADS; do  # every name checked before any profile starts
  [ -n "${FILTER[$w]:-}" ] || { echo "unknown workload '$w': expected prefill, decode or g4"; exit 2; }
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
for w in $WORKLOADS; do
  rep="$REPS/ncu_$w"
  timeout 400 "$NCU" --clock-control none --profile-from-start off --set "$SET" --import-source no \
    -k "${KERNELS:-${FILTER[$w]}}" -f -o "$rep" python3 scripts/ncu_workloads.py "$w" "$T" 2>&1 | tail -n 5
  "$NCU" -i "$rep.ncu-rep" --page details --print-units base > "$rep.txt" 2>&1
  python3 scripts/ncu_summary.py "$rep.txt"
  for k in ${SASS[$w]}; do
    "$NCU" -i "$rep.ncu-rep" -k "$k" --launch-count 1 --page source --csv --print-source sass \
      > "${rep}_${k}_sass.csv" 2>&1 || echo "no source page for $k"
    python3 scripts/ncu_summary.py --sass "${rep}_${k}_sass.csv" 12
  done
done
cd "$REPS" && tar -czf "$OUT/ncu.tar.gz" ./*.txt ./*.csv
