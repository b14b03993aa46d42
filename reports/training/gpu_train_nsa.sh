#!/usr/bin/env bash
# Train one NSA model on the bundled full-tiny's tokens (same seed, steps and mix) and score it on the
# teacher-forced NIAH grid beside full-tiny (docs/training.md). Extra arguments go to `nsa-eval train`.
#   OUT=/some/dir bash reports/training/gpu_train_nsa.sh --num-selected 16
# Packs the checkpoint (tar, split at 15 MiB), the run's logs and the NIAH scores into $OUT.
set -uo pipefail
RUNS=/tmp/nsa-one
OUT=${OUT:-$RUNS/out}
rm -rf "$RUNS" && mkdir -p "$RUNS" "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
read -r STEPS LENGTHS < <(python3 -c "import json; c = json.load(open('nsa_eval/checkpoints/full-tiny/training.json'))['config']
print(c['steps'], *c['mix']['retrieval_lengths'])")
{
  date -u
  echo "steps $STEPS, retrieval lengths $LENGTHS, extra: $*"
  python3 -m nsa_eval.cli train --attention nsa --out "$RUNS/nsa" --seed 0 --steps "$STEPS" \
    --retrieval-lengths $LENGTHS --data .cache/nsa-train "$@" 2>&1 | grep -v "it/s\]"
  python3 -m nsa_eval.train.niah_eval "$RUNS/nsa/checkpoint" nsa_eval/checkpoints/full-tiny \
    --out "$RUNS/niah_gpu.json" --png-dir "$RUNS" --samples 2 2>&1 | grep -v "it/s\]\|s/it\]"
  date -u
} 2>&1 | tee "$OUT/train_log.txt"
tar -C "$RUNS" -cf "$OUT/train_logs.tar" --exclude=checkpoint .
tar -C "$RUNS/nsa" -cf - checkpoint | split -b 15M -d - "$OUT/nsa-ckpt.tar."
