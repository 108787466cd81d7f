#!/bin/bash
# The runs of README.md's 2026-11-26 table: each config (NAME|grace_from_params keys|
# DistributedOptimizer keywords) on seeds 0..4 (FashionCNN) or 0..2 (MnistCNN), one epoch, 2
# ranks under horovodrun --gloo. Finished runs are skipped.
cd "$(dirname "$0")/../../.."
out=experiments/results/horovod_defaults
run() {  # dnn seeds name params optimizer-args
  for seed in $2; do
    file=$out/$1-$3-seed$seed.json
    [ -e "$file" ] && continue
    horovodrun -np 2 -H localhost:2 --gloo python -m experiments.horovod_defaults --dnn "$1" \
      --epochs 1 --seed "$seed" --params "$4" --optimizer-args "$5" --json "$file"
  done
}
five="0 1 2 3 4"
run fashioncnn "$five" none '{}' '{}'
run fashioncnn "$five" warm150 '{"density_warmup_steps": 150}' '{}'
run fashioncnn "$five" warm300 '{"density_warmup_steps": 300}' '{}'
run fashioncnn "$five" warm600 '{"density_warmup_steps": 600}' '{}'
run fashioncnn "$five" k1024 '{"compress_ratio": 0.0557}' '{}'
run fashioncnn "$five" k1024warm300 '{"compress_ratio": 0.0557, "density_warmup_steps": 300}' '{}'
run fashioncnn "0 1" densecomm '{"compressor": "none", "memory": "none", "communicator": "dense"}' '{}'
run fashioncnn "0 1 2" pertensor '{}' '{"bucket_cap_mb": 1e-6}'
run fashioncnn "0 1 2" pertensor-min100 '{}' '{"bucket_cap_mb": 1e-6, "min_numel": 100}'
run fashioncnn "0 1 2" pertensor-min1000 '{}' '{"bucket_cap_mb": 1e-6, "min_numel": 1000}'
run fashioncnn "0 1 2" pertensor-min1000-warm300 '{"density_warmup_steps": 300}' '{"bucket_cap_mb": 1e-6, "min_numel": 1000}'
run mnistcnn "0 1 2" none '{}' '{}'
run mnistcnn "0 1 2" warm300 '{"density_warmup_steps": 300}' '{}'
