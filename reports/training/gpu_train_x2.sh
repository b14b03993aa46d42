#!/usr/bin/env bash
# Two retrieval mixes trained side by side on a 2-GPU machine (docs/training.md, "Second run"):
#   OUT=/some/dir STEPS=4000 [MIX_A="..."] [MIX_B="..."] bash reports/training/gpu_train_x2.sh
# GPU 0 trains NSA and full attention with mix A, GPU 1 with mix B, all four for the same STEPS from
# one seed (each pair sees identical tokens). Both pairs are scored on the teacher-forced NIAH grid;
# the pair whose NSA model scores higher within the training length is packed (tar, split at
# 15 MiB) into $OUT, with the logs, curves and heatmaps of both. Needs .cache/nsa-train.
set -uo pipefail
STEPS=${STEPS:-4000}
SEED=${SEED:-0}
RUNS=/tmp/nsa-x2
OUT=${OUT:-$RUNS/out}
declare -A MIX=([a]="${MIX_A:-256 512 1024 1536 1792 2000}" [b]="${MIX_B:-1024 1280 1536 1792 2000}")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
rm -rf "$RUNS"
mkdir -p "$RUNS" "$OUT"

train() {  # gpu mix attention
  CUDA_VISIBLE_DEVICES=$1 python3 -m nsa_eval.cli train --attention "$3" --out "$RUNS/$2/$3" \
    --seed "$SEED" --steps "$STEPS" --data .cache/nsa-train --workers 6 \
    --retrieval-lengths ${MIX[$2]} >"$RUNS/$2-$3.log" 2>&1
  tail -n 1 "$RUNS/$2-$3.log"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, numpy; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
'numpy', numpy.__version__)"
  echo "steps $STEPS seed $SEED; mix a: ${MIX[a]}; mix b: ${MIX[b]}"
  train 0 a nsa & train 0 a full & train 1 b nsa & train 1 b full &
  wait
  date -u
  for m in a b; do
    gpu=$([ "$m" = a ] && echo 0 || echo 1)
    CUDA_VISIBLE_DEVICES=$gpu python3 -m nsa_eval.train.niah_eval "$RUNS/$m/nsa/checkpoint" \
      "$RUNS/$m/full/checkpoint" --out "$RUNS/$m/niah_gpu.json" --png-dir "$RUNS/$m" --samples 2 &
  done
  wait
  python3 -c "from nsa_eval.train.plots import plot_runs
for m in 'ab': plot_runs(['$RUNS/' + m + '/nsa', '$RUNS/' + m + '/full'], '$RUNS/' + m + '/loss_curves.png')"
  python3 - "$RUNS" <<'EOF'
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
best = None
for mix in "ab":
    scores = json.loads((runs / mix / "niah_gpu.json").read_text())
    for name in ("nsa", "full"):
        s = scores[name]
        print(mix, name, "within", s["accuracy_within"], "beyond", s["accuracy_beyond"], s["accuracy_by_length"])
    within = scores["nsa"]["accuracy_within"]
    if best is None or within > best[1]:
        best = (mix, within)
print("best mix", best[0])
(runs / "best").write_text(best[0])
EOF
  date -u
} 2>&1 | tee "$OUT/log.txt"
tar -C "$RUNS" -cf "$OUT/logs.tar" --exclude=checkpoint a b
best=$(cat "$RUNS/best")
for m in nsa full; do
  tar -C "$RUNS/$best/$m" -cf - checkpoint | split -b 15M -d - "$OUT/$m-ckpt.tar."
done
ls -la "$OUT"
