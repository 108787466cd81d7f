#!/usr/bin/env bash
# The GPU's training-step table (docs/results/gpu.md) and the compact wire's kernels, on a
# machine with one GPU: 4 gloo workers share it, links emulated at 100 Mbit and 1 Gbit.
# Results land in RESULTS (default benchmarks/results/gpu). Needs root, python3 with torch built
# for CUDA, iproute2 (on a machine without it: `bash benchmarks/carry_iproute2.sh` here, carry
# .ipr there) and Fashion-MNIST's IDX files (FASHION_MNIST, default the Debian package's folder;
# the steps read a few hundred images, so a truncated copy of the training set will do).
#   1. the selection, scatter and codec kernels (the compact wire's encode and decode among them)
#      on VGG-16's size at density 0.01, against one read of their bytes at the copy bandwidth
#   2. VGG-16 training steps at 100 Mbit: PowerSGD's hook at rank 1 and 4, SparDL at 0.01 on the
#      exact and the compact wire, SparDL at 0.005 on the compact wire
#   3. at 1 Gbit: PowerSGD's hook at rank 1 and 4, SparDL at 0.01 on the compact wire, and
#      DDP's fp16 hook (fp32 DDP's bytes alone take 0.71 s a step there, 7.1 s at 100 Mbit)
# About 7 minutes on an H100, most of it the 100 Mbit run's start-ups; run it again for a repeat.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_setup.sh"
status=0
"$PY" -m benchmarks.kernels --device cuda --density 0.01 --repeat 20 \
    --json "$R/kernels_cuda_vgg16_d0.01.json" || status=1
steps() {  # RATE ALGORITHMS FILE
    "$PY" -m benchmarks.train_step --device cuda --dnn vgg16 --batch-size 8 --steps 9 \
        --skip 3 --algorithms "$2" --bandwidths "$1" --json "$R/$3" 2>&1 | tail -n 12 || status=1
}
steps 100mbit powersgd1,powersgd4,spardl_exact,spardl_compact,spardl_0005_compact \
    train_step_vgg16_cuda_100mbit_compact.json
steps 1gbit powersgd1,powersgd4,spardl_compact,fp16 train_step_vgg16_cuda_1gbit_compact.json
exit $status
