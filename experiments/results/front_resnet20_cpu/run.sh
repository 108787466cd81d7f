#!/bin/bash
# The accuracy-per-byte front (issue 39): ResNet-20 on Fashion-MNIST, the 8-epoch recipe of
# ../ablation_resnet20_8epochs_*, 3 seeds per config, on the 2-core CPU machine. Resumable: run
# it again and finished runs are skipped, a library run cut off continues from its last epoch
# (PyTorch's baselines start over). Seed 0 of every config runs before any seed 1, configs in
# the order listed (issue 40's exact-wire runs moved up on 2026-11-26; spardl@0.1 added then, to
# reach past PowerSGD rank 4's 166 KB a step after its start). OUT=dir writes
# elsewhere (the runs were made from a worktree of the commit named in README.md).
cd "$(dirname "$0")/../../.."
python -m experiments.ablation --dnn resnet20 \
  --configs dense,spardl@0.01+warmup16+compact,powersgd4,spardl@0.001+warmup2ep+compact,powersgd1,spardl@0.01+warmup16+exact,spardl@0.001+warmup2ep+exact,powersgd2,spardl@0.05+warmup16+compact,spardl@0.1+warmup16+compact,spardl@0.003+warmup2ep+compact,topka@0.003+warmup2ep+compact,fp16,postlocal4,postlocal16,postlocal64 \
  --seeds 0,1,2 --workers 4 --lr 0.1 --max-epochs 8 --train-samples 60000 --test-samples 10000 \
  --extra "--warmup-epochs 0.5 --lr-decay 5,7 --timeout 3600" --parallel 1 \
  --out "${OUT:-experiments/results/front_resnet20_cpu}"
