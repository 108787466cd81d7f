#!/usr/bin/env bash
# Issue 63's GPU table: 'communicator': 'auto' beside the fixed candidates it chooses among
# and PyTorch's hooks, on a machine with one GPU (4 gloo workers share it), VGG-16 at 1 Gbit
# and 100 Mbit, then ResNet-20 at 1 Gbit while the device time lasts. Results land in RESULTS
# (default benchmarks/results/gpu); each rate is a resumable run (benchmarks.train_step keeps
# finished arm-runs in JSON.partial), so the same command run again continues where a device
# call's time limit stopped it. Set-up as for gpu_train_steps.sh (root, CUDA torch, carried
# iproute2, Fashion-MNIST). REPEATS (default 2) interleaved repeats of every arm.
#   1 Gbit:   auto, SparDL at 0.01 and 0.001 (compact wire), PowerSGD's hook rank 4, DDP's
#             fp16 hook (its 44 MB a step take 0.37 s there on an H100)
#   100 Mbit: auto, SparDL at 0.01, 0.003 and 0.001, PowerSGD's hook ranks 1 and 4 (fp32 and
#             fp16 DDP take 7 s and 3.5 s a step there: not run)
# Then `python -m benchmarks.auto_check FILE` on each result prints auto against the fastest
# fixed arm (Welch), the numbers docs/results/gpu.md records.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_setup.sh"
REPEATS=${REPEATS:-2}
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
status=0
steps() {  # DNN BATCH RATE ALGORITHMS
    local file="$R/train_step_$1_auto_cuda_$3_$COMMIT.json"
    "$PY" -m benchmarks.train_step --device cuda --dnn "$1" --batch-size "$2" --workers 4 \
        --steps 30 --skip 12 --repeats "$REPEATS" --algorithms "$4" --bandwidths "$3" \
        --json "$file" 2>&1 | tail -n 16 || status=1
    [ -f "$file" ] && { "$PY" -m benchmarks.auto_check "$file" | tail -n 20 || status=1; }
}
steps vgg16 8 1gbit auto,fixed_spardl@0.01,fixed_spardl@0.001,powersgd4,fp16
steps vgg16 8 100mbit auto,fixed_spardl@0.01,fixed_spardl@0.003,fixed_spardl@0.001,powersgd1,powersgd4
steps resnet20 32 1gbit auto,fixed_spardl@0.01,fixed_spardl@0.001,powersgd4,fp16
exit $status
