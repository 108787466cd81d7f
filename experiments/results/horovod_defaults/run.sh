#!/bin/bash
# The runs of README.md's tables: each config (NAME|grace_from_params keys|DistributedOptimizer
# keywords[|more experiment flags]) on its seeds, one epoch, 2 ranks under horovodrun --gloo.
# Finished runs are skipped. The runs before the library's floor (min_entries, 2026-11-26) set
# "min_entries": 0, which is what they ran with.
cd "$(dirname "$0")/../../.."
out=experiments/results/horovod_defaults
run() {  # dnn seeds name params optimizer-args [more experiment flags]
  for seed in $2; do
    file=$out/$1-$3-seed$seed.json
    [ -e "$file" ] && continue
    horovodrun -np 2 -H localhost:2 --gloo python -m experiments.horovod_defaults --dnn "$1" \
      --epochs 1 --seed "$seed" --params "$4" --optimizer-args "$5" $6 --json "$file"
  done
}
five="0 1 2 3 4"
ten="0 1 2 3 4 5 6 7 8 9"
# The library's defaults since 2026-11-26: the floor of 2,048 entries on the compact wire. Every
# other SparDL run here ran the exact wire, then the default: add "wire": "exact" to redo one.
run fashioncnn "$ten" floor2048-compact '{"min_entries": 2048, "wire": "compact"}' '{}'
# The floor (min_entries) at 1,024 and at 2,048 entries a step; 2,048 is the library's default
# (the floor1024 runs were made while 1,024 was: their JSON's params are empty).
run fashioncnn "$ten" floor1024 '{"min_entries": 1024}' '{}'
run fashioncnn "$ten" floor2048 '{"min_entries": 2048}' '{}'
# Before the floor: density 0.01 as given, and the levers tried on it.
run fashioncnn "$ten" none '{"min_entries": 0}' '{}'
run fashioncnn "$five" warm150 '{"min_entries": 0, "density_warmup_steps": 150}' '{}'
run fashioncnn "$five" warm300 '{"min_entries": 0, "density_warmup_steps": 300}' '{}'
run fashioncnn "$five" warm600 '{"min_entries": 0, "density_warmup_steps": 600}' '{}'
run fashioncnn "$ten" k1024 '{"min_entries": 0, "compress_ratio": 0.0557}' '{}'
run fashioncnn "$five" k1024warm300 '{"min_entries": 0, "compress_ratio": 0.0557, "density_warmup_steps": 300}' '{}'
run fashioncnn "0 1" densecomm '{"compressor": "none", "memory": "none", "communicator": "dense"}' '{}'
run fashioncnn "0 1 2" pertensor '{"min_entries": 0}' '{"bucket_cap_mb": 1e-6}'
run fashioncnn "0 1 2" pertensor-min100 '{"min_entries": 0}' '{"bucket_cap_mb": 1e-6, "min_numel": 100}'
run fashioncnn "0 1 2" pertensor-min1000 '{"min_entries": 0}' '{"bucket_cap_mb": 1e-6, "min_numel": 1000}'
run fashioncnn "0 1 2" pertensor-min1000-warm300 '{"min_entries": 0, "density_warmup_steps": 300}' '{"bucket_cap_mb": 1e-6, "min_numel": 1000}'
# Horovod's own example's recipe (examples/pytorch/pytorch_mnist.py): batch 64, momentum 0.5,
# lr 0.01 times the ranks.
hvdex="--batch-size 64 --lr 0.02 --momentum 0.5"
run fashioncnn "$five" hvdexample-none '{"min_entries": 0}' '{}' "$hvdex"
run fashioncnn "$five" hvdexample-k1024 '{"min_entries": 0, "compress_ratio": 0.0557}' '{}' "$hvdex"
# MnistCNN at 0.01 sends 12,000 entries a step: the floor does not bind.
run mnistcnn "0 1 2" none '{}' '{}'
run mnistcnn "0 1 2" warm300 '{"density_warmup_steps": 300}' '{}'
