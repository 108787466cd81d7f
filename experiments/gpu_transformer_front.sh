#!/usr/bin/env bash
# The transformer front (experiments/results/front_transformer_cpu/README.md says what each
# config is) on a machine with one GPU: each run's 4 workers share the GPU over gloo, PARALLEL
# (default 3) runs at a time, seeds 0, 1, 2 of every config in CONFIGS (default: the list
# below, the arms a verdict needs first) in that order. After SECONDS_LEFT
# (default 480) it stops and packs the finished runs (CONFIG-seedS.tar.xz, each run's logs) and
# the logs of the runs it cut off into DEST/front.tar; checkpoints stay behind.
#   bash experiments/gpu_transformer_front.sh DEST [SECONDS_LEFT]
# Needs the Wikipedia text's cache (enwiki-sample.txt, made by testbed.text on a machine
# with gensim) in DATA (default .data, a folder carried to the GPU machine).
set -uo pipefail
DEST=$1
LEFT=${2:-480}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=${RUNS:-/tmp/front_transformer_gpu}
DATA=$(cd "${DATA:-$ROOT/.data}" && pwd)
cd "$ROOT"
export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1
timeout "$LEFT" "${PYTHON:-python3}" -m experiments.ablation --dnn transformer \
    --dataset wikipedia-chars --workers 4 --batch-size 16 --lr 3e-3 --max-epochs 2 \
    --train-samples 32000 --test-samples 1000 --seeds 0,1,2 --parallel "${PARALLEL:-3}" \
    --configs "${CONFIGS:-dense,fp16,powersgd4,powersgd16,spardl@0.4+update+every4+coded,spardl@0.01+update+adamfreeze,spardl@0.01+update,spardl@0.04+update,spardl@0.01,diloco100,spardl@0.001,spardl@0.01+adamfreeze,spardl@0.01+adamfreeze25,spardl@0.001+adamfreeze,postlocal20,diloco20}" \
    --extra "--device cuda --data-dir $DATA --optimizer adamw --warmup-epochs 0.1 --clip-norm 1 --eval-every 100" \
    --out "$RUNS"
echo "front exited $?"
tar -C "$RUNS" -cf "$DEST/front.tar" --exclude='*.pt' --exclude='*.pt.prev' --exclude='*.pt.tmp' .
ls "$RUNS"
