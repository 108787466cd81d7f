#!/bin/bash
# The simulator's validation on shapes the calibration never saw (issue 50): benchmarks.comm
# on the emulated network for every sparse all-reduce, P = 2, 3, 4, 5, 7, 8, three gradient
# sizes and two densities, at 100 Mbit and 1 Gbit; then benchmarks.simulate --validate-only
# over them (../simulation_validation.json). Resumable: a result file that exists is skipped.
# Run from the repository root with the venv's bin on PATH, nothing else running.
set -e
cd "$(dirname "$0")/../../.."
out=benchmarks/results/validation
for rate in 100mbit 1gbit; do
  for shape in 1000000:0.01 4000000:0.001 12000000:0.01; do
    numel=${shape%%:*}; density=${shape##*:}
    for p in 2 3 4 5 7 8; do
      file=$out/comm_n${numel}_d${density}_p${p}_${rate}.json
      [ -e "$file" ] && continue
      python -m benchmarks.comm --algorithms topka,topkdsa,gtopk,oktopk,spardl --workers $p \
        --numel $numel --density $density --bandwidth $rate --repeat 6 --replays 8 \
        --json "$file" > "$out/comm_n${numel}_d${density}_p${p}_${rate}.log" 2>&1
    done
  done
done
python -m benchmarks.simulate $out/comm_*.json --validate-only --json benchmarks/results/simulation_validation.json
