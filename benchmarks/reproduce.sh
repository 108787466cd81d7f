#!/usr/bin/env bash
# Reproduces every benchmark table and plot of the docs (docs/results/) into
# benchmarks/results/ (about 80 minutes on 2 CPU cores; network emulation needs root). Set up
# on a fresh machine first by scripts/setup_env.sh, which this calls.
#   1. VGG-16's real gradient (14.7M entries), 4 workers, density 0.01, every algorithm, on an
#      emulated 1 Gbit and 100 Mbit network (with PyTorch's DDP, fp16 and PowerSGD hooks in the
#      same runs) and unshaped (loopback); whole training steps against PyTorch's hooks
#   2. P = 2, 3, 4, 6, 8 on the emulated 1 Gbit network (4M entries): time against workers, and,
#      with the same runs on 100 Mbit (psweep_100mbit/), the simulator's validation set
#   3. density 0.001 .. 0.1 at 4 workers, 1 Gbit
#   4. the simulator (to 1024 workers, SparDL's d sweep), the codec benchmarks, the CPU kernel
#      timings (python -m benchmarks.kernels --device cuda where a GPU is), plots and tables
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)
PY="$VENV/bin/python"
R=${RESULTS:-$ROOT/benchmarks/results}
mkdir -p "$R"
cd "$ROOT"
HOOKS=torch_ddp,torch_fp16,torch_powersgd1,torch_powersgd4
for net in 1gbit 100mbit; do
    "$PY" -m benchmarks.comm --gradient vgg16 --workers 4 --density 0.01 --repeat 10 --warmup 3 \
        --algorithms "dense,topka,topkdsa,gtopk,oktopk,spardl,$HOOKS" \
        --bandwidth "$net" --json "$R/comm_vgg16_$net.json"
done
"$PY" -m benchmarks.train_step --dnn vgg16 --batch-size 8 --steps 10 --skip 3 \
    --json "$R/train_step_vgg16.json"
"$PY" -m benchmarks.comm --gradient vgg16 --workers 4 --density 0.01 --repeat 10 \
    --json "$R/comm_vgg16_loopback.json"
for net in 100mbit 1gbit; do
    "$PY" -m benchmarks.exchange_order --bandwidth "$net" --json "$R/exchange_order_$net.json"
    "$PY" -m benchmarks.exchange_order --op alltoall --workers 4 --sizes 10000,100000,1000000,4000000 \
        --repeat 9 --bandwidth "$net" --json "$R/exchange_order_alltoall_$net.json"
done
mkdir -p "$R/psweep_100mbit"
for p in 2 3 4 6 8; do
    "$PY" -m benchmarks.comm --workers "$p" --numel 4000000 --density 0.01 --repeat 4 --warmup 1 \
        --replays 16 --probe-repeat 9 --bandwidth 1gbit --json "$R/comm_p${p}_1gbit.json"
    "$PY" -m benchmarks.comm --workers "$p" --numel 4000000 --density 0.01 --repeat 4 --warmup 1 \
        --replays 16 --bandwidth 100mbit --json "$R/psweep_100mbit/comm_p${p}_100mbit.json"
done
for d in 0.001 0.01 0.1; do
    "$PY" -m benchmarks.comm --workers 4 --numel 4000000 --density "$d" --repeat 4 --warmup 1 \
        --bandwidth 1gbit --json "$R/comm_density${d}_1gbit.json"
done
"$PY" -m benchmarks.simulate "$R"/comm_p*_1gbit.json "$R"/psweep_100mbit/comm_p*_100mbit.json \
    --numel 14700000 --density 0.01 \
    --json "$R/simulation.json"
"$PY" -m benchmarks.codecs --json "$R/codecs_spardl.json"
"$PY" -m benchmarks.codec_speed --model resnet56 --json "$R/codec_speed_resnet56.json"
"$PY" -m benchmarks.kernels --device cpu --json "$R/kernels_cpu.json"
"$PY" -m benchmarks.plots "$R"
"$PY" -m benchmarks.tables "$R" > "$R/tables.md"
