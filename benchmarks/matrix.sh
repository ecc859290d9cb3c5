#!/usr/bin/env bash
# The README's results table: 2 and 4 emulated hosts x 1 and 10 Gbit/s x the three workloads, each with
# compute-only, torch DDP, PoseidonDDP PS-only and PoseidonDDP hybrid in one invocation.
# Needs root (network namespaces + tc); takes about 15 minutes on a 2-core machine.
#   bash benchmarks/matrix.sh [OUT_DIR]
set -uo pipefail
out=${1:-bench_out}
status=0
export POSEIDON_TRACE_SKIP=4 POSEIDON_TRACE_ITERS=8   # trace part of the timed loop for the overlap column
for hosts in 2 4; do
  for bw in 1gbit 10gbit; do
    # a failed mode is recorded in results.json and the table; go on with the other configurations
    python -m poseidon_torch.bench --mode netns --hosts "$hosts" --bandwidth "$bw" --workload all \
      --iters 12 --warmup 3 --out "$out/h${hosts}_${bw}" || status=1
  done
done
python -m poseidon_torch.bench.report "$out"/h2_1gbit/results.json "$out"/h2_10gbit/results.json \
  "$out"/h4_1gbit/results.json "$out"/h4_10gbit/results.json > "$out/table.md"
cat "$out/table.md"
exit $status
