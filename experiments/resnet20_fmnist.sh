#!/usr/bin/env bash
# The recorded longer runs: ResNet-20 on Fashion-MNIST, 4 local workers (gloo), 5 epochs, every
# sparse all-reduce at density 0.01 against dense, then the comparison table and plots
# (experiments/results/resnet20_fmnist/). About 35 minutes on 2 CPU cores. To keep that within
# reach the epochs use the first 20,000 training images (5,000 per worker) and 2,000 test images;
# set TRAIN_SAMPLES= (empty) for all 60,000.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)
OUT=${OUT:-$ROOT/experiments/results/resnet20_fmnist}
TRAIN_SAMPLES=${TRAIN_SAMPLES-20000}
ALGORITHMS=${ALGORITHMS:-dense spardl topka topkdsa gtopk oktopk}
cd "$ROOT"
for algo in $ALGORITHMS; do
    flags=(--compression --compressor "$algo")
    [ "$algo" = dense ] && flags=()
    "$VENV/bin/python" -m experiments.main_trainer --dnn resnet20 --dataset fashion-mnist \
        --nworkers 4 --batch-size 32 --lr 0.1 --warmup-epochs 1 --lr-decay 4 --max-epochs 5 \
        --density 0.01 ${TRAIN_SAMPLES:+--train-samples "$TRAIN_SAMPLES"} --test-samples 2000 \
        "${flags[@]}" --out "$OUT/$algo"
    rm -f "$OUT/$algo"/ckpt-rank*.pt "$OUT/$algo"/final-rank*.pt
done
"$VENV/bin/python" -m experiments.report "$OUT"
