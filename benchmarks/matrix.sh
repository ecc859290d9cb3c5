#!/usr/bin/env bash
# The README's results table: each configuration runs compute-only, torch DDP, PoseidonDDP PS-only and
# PoseidonDDP hybrid side by side, in one invocation per workload.
#   bash benchmarks/matrix.sh [OUT_DIR]
# Environment (defaults in brackets):
#   CONFIGS    mode:hosts[:bandwidth] list ["localhost:2 netns:2:1gbit netns:2:10gbit netns:4:1gbit"]
#   WORKLOADS  ["fc_heavy resnet transformer"]
#   MODES      comma-separated modes [the runner's default: compute-only,torch-ddp,poseidon-ps,poseidon-hybrid]
#   REPEATS    runs of every configuration [1]; the report gives each run's cells
#   ITERS, WARMUP  timed and untimed iterations [12, 3]
#   OPTIMIZER  sgd or adamw [sgd]; the parameter-server comparison (issue 11) uses
#              MODES=compute-only,torch-ddp,ddp-zero,poseidon-server,poseidon-server-lazy OPTIMIZER=adamw
# netns configurations need root (network namespaces + tc); each one takes a few minutes on 2 cores.
set -uo pipefail
out=${1:-bench_out}
configs=${CONFIGS:-"localhost:2 netns:2:1gbit netns:2:10gbit netns:4:1gbit"}
workloads=${WORKLOADS:-"fc_heavy resnet transformer"}
repeats=${REPEATS:-1}
export POSEIDON_TRACE_SKIP=4 POSEIDON_TRACE_ITERS=8   # trace part of the timed loop for the overlap column
status=0
results=()
for run in $(seq 1 "$repeats"); do
  for config in $configs; do
    IFS=: read -r mode hosts bw <<< "$config"
    bw=${bw:-1gbit}
    for workload in $workloads; do
      dir="$out/run${run}/${mode}_h${hosts}_${bw}_${workload}"
      # a failed mode is recorded in results.json and the table; go on with the other configurations
      python -m poseidon_torch.bench --mode "$mode" --hosts "$hosts" --bandwidth "$bw" --workload "$workload" \
        --iters "${ITERS:-12}" --warmup "${WARMUP:-3}" --optimizer "${OPTIMIZER:-sgd}" ${MODES:+--modes "$MODES"} --out "$dir" || status=1
      results+=("$dir/results.json")
    done
  done
done
python -m poseidon_torch.bench.report "${results[@]}" > "$out/table.md"
cat "$out/table.md"
exit $status
