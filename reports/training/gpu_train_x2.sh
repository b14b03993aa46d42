#!/usr/bin/env bash
# Two retrieval mixes trained side by side on a 2-GPU machine (docs/training.md, "Runs so far"):
#   OUT=/some/dir STEPS=4000 [MIX_A="..."] [MIX_B="..."] [FLAGS_A="..."] [FLAGS_B="..."] \
#     [PART_MINUTES=9] [RUNS=runs/x2] [DATA=.cache/nsa-train] bash reports/training/gpu_train_x2.sh
# GPU 0 trains NSA and full attention with mix A, GPU 1 with mix B, all four for the same STEPS from
# one seed (each pair sees identical tokens; FLAGS_A/FLAGS_B are extra `nsa-eval train` flags of a
# pair, e.g. "--retrieval-fraction 0.75"). Both pairs are scored on the teacher-forced NIAH grid;
# the pair whose NSA model scores higher within the training length is packed (tar, split at
# 15 MiB) into $OUT, with the logs, curves and heatmaps of both. Needs the corpus in $DATA (carried:
# building it takes minutes; `--corpus-sources` builds another one, see docs/training.md).
# Runs longer than one call: with PART_MINUTES each process stops after that many minutes and the
# next invocation (same RUNS, e.g. inside the repository on a machine still warm) resumes the
# unfinished runs; scoring and packing happen once all four are done. A fresh RUNS starts afresh.
set -uo pipefail
STEPS=${STEPS:-4000}
SEED=${SEED:-0}
RUNS=${RUNS:-/tmp/nsa-x2}
DATA=${DATA:-.cache/nsa-train}
OUT=${OUT:-$RUNS/out}
declare -A MIX=([a]="${MIX_A:-256 512 1024 1536 1792 2000}" [b]="${MIX_B:-1024 1280 1536 1792 2000}")
declare -A FLAGS=([a]="${FLAGS_A:-}" [b]="${FLAGS_B:-}")
PART=${PART_MINUTES:+--stop-after-minutes $PART_MINUTES}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$RUNS" "$OUT"

train() {  # gpu mix attention
  local dir="$RUNS/$2/$3"
  if [ -f "$dir/summary.json" ]; then
    echo "$2 $3: finished earlier"
    return
  elif [ -f "$dir/resume.pt" ]; then
    set -- "$@" --resume
  else
    set -- "$@" --seed "$SEED" --steps "$STEPS" --retrieval-lengths ${MIX[$2]} ${FLAGS[$2]}
  fi
  CUDA_VISIBLE_DEVICES=$1 python3 -m nsa_eval.cli train --attention "$3" --out "$dir" \
    --data "$DATA" --workers 6 $PART "${@:4}" >>"$RUNS/$2-$3.log" 2>&1
  tail -n 1 "$RUNS/$2-$3.log"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, transformers, numpy; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
'numpy', numpy.__version__)"
  echo "steps $STEPS seed $SEED; mix a: ${MIX[a]} ${FLAGS[a]}; mix b: ${MIX[b]} ${FLAGS[b]}"
  train 0 a nsa & train 0 a full & train 1 b nsa & train 1 b full &
  wait
  date -u
  if ! ls "$RUNS"/{a,b}/{nsa,full}/summary.json >/dev/null 2>&1; then
    echo "unfinished: run this script again with the same RUNS to continue"
    exit 0
  fi
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
} 2>&1 | tee -a "$OUT/log.txt"
tar -C "$RUNS" -cf "$OUT/logs.tar" --exclude=checkpoint --exclude=resume.pt a b
[ -f "$RUNS/best" ] || exit 0  # unfinished: nothing to pack yet
best=$(cat "$RUNS/best")
for m in nsa full; do
  tar -C "$RUNS/$best/$m" -cf - checkpoint | split -b 15M -d - "$OUT/$m-ckpt.tar."
done
ls -la "$OUT"
