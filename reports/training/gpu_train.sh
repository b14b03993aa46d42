#!/usr/bin/env bash
# The GPU run behind the bundled nsa-tiny / full-tiny checkpoints (docs/training.md).
#   OUT=/some/dir bash reports/training/gpu_train.sh [MINUTES] [SEED]
# Trains NSA for MINUTES (step count fixed from its measured speed), then full attention for the
# same steps on the same tokens, scores both on a teacher-forced NIAH grid, and packs logs, plots
# and each checkpoint (tar, split at 15 MiB) into $OUT. Needs .cache/nsa-train (the corpus built
# on the development machine: `nsa-eval train` builds it on first use).
set -uo pipefail
MINUTES=${1:-3.5}
SEED=${2:-0}
RUNS=/tmp/nsa-train
OUT=${OUT:-$RUNS/out}
rm -rf "$RUNS/nsa" "$RUNS/full"
mkdir -p "$RUNS" "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, numpy; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
'numpy', numpy.__version__)"
  python3 -m nsa_eval.cli train --attention both --out "$RUNS" --seed "$SEED" --minutes "$MINUTES" \
    --data .cache/nsa-train
  if [ ! -f "$RUNS/full/summary.json" ]; then
    echo "!!! the Triton run failed: retrying with the reference kernels (PyTorch) for NSA"
    python3 -m nsa_eval.cli train --attention both --out "$RUNS" --seed "$SEED" --minutes 2.5 \
      --data .cache/nsa-train --kernel-impl reference --overwrite
  fi
  python3 -m nsa_eval.train.niah_eval "$RUNS/nsa/checkpoint" "$RUNS/full/checkpoint" \
    --out "$RUNS/niah_gpu.json" --png-dir "$RUNS" --samples 2
  date -u
} 2>&1 | tee "$OUT/log.txt"
tar -C "$RUNS" -cf "$OUT/logs.tar" --exclude=checkpoint nsa full loss_curves.png niah_gpu.json \
  niah_nsa.png niah_full.png
for m in nsa full; do
  tar -C "$RUNS/$m" -cf - checkpoint | split -b 15M -d - "$OUT/$m-ckpt.tar."
done
ls -la "$OUT"
