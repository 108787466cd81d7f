#!/usr/bin/env bash
# The CUDA paths on a machine with one GPU, tested and timed in one go; results land in
# RESULTS (default benchmarks/results/gpu), logs beside them. Needs python3 with torch built for
# CUDA and the Fashion-MNIST IDX files (FASHION_MNIST, default /usr/share/datasets/fashion-mnist).
#   1. tests/test_cuda.py: every sparse all-reduce on CUDA tensors over the local transport and
#      over gloo (4 processes sharing the GPU) against the CPU bit for bit, the codecs, the
#      DistributedOptimizer and the training CLI on the GPU
#   2. kernels of 25M entries (exact top-k, threshold selection, scatter, codecs) against one
#      read of the gradient at the copy bandwidth measured there, densities 0.01 and 0.001
#   3. DeepReduce codec throughput (Bloom, polyfit, ...) on VGG-16's real gradient
#   4. every algorithm's step on VGG-16's gradient on the GPU, 4 gloo processes (loopback)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_setup.sh"
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$R/test_cuda.log" | tail -n 15 || status=1
for d in 0.01 0.001; do
    "$PY" -m benchmarks.kernels --device cuda --numel 25000000 --density "$d" --repeat 20 \
        --json "$R/kernels_cuda_25m_d$d.json" || status=1
done
"$PY" -m benchmarks.codec_speed --device cuda --model vgg16 --repeat 5 \
    --json "$R/codec_speed_vgg16_cuda.json" || status=1
"$PY" -m benchmarks.comm --device cuda --gradient vgg16 --workers 4 --density 0.01 --repeat 10 \
    --json "$R/comm_vgg16_cuda_loopback.json" 2>&1 | tail -n 12 || status=1
exit $status
