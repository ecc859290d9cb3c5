#!/usr/bin/env bash
# Time to accuracy on slow links, every mode against what a slow-network user picks today (issue 45):
# the language model at 2 emulated hosts over each of RATES, and at 4 hosts over FOUR_HOST_RATE with each
# host's CPU capped at its share, every mode by the same time budget, REPEATS runs per cell; then the
# summary (median and range per cell, the winner, speed-ups over DDP and one-host at DDP's final value).
#   sudo bash benchmarks/accuracy_matrix.sh [OUT_DIR]          (needs root: network namespaces, cgroups)
# Writes OUT_DIR/run<R>/<hosts>h_<rate>/results.json (+ results.png, logs) per run and cell, and
# OUT_DIR/summary.md and OUT_DIR/summary.json; prints its estimate of the wall time first.
# Environment (defaults in brackets):
#   TASK         the task [lm-wide: the 3.3 M-parameter byte LM, batch 8 per host; lm: 0.84 M, batch 16]
#   BUDGET       training seconds per mode and run, on rank 0's clock [300]
#   REPEATS      runs of every cell [3]; runs are the outer loop, so a stopped matrix has whole runs
#   RATES        link rates of the 2-host cells ["1gbit 100mbit 10mbit"; empty for none, to run the 4-host cell alone]
#   FOUR_HOST_RATE  the 4-host cell's link, empty for none [100mbit]
#   CPUS_PER_HOST   the 4-host cell's CPU per host [this machine's cores / 4]
#   MODES        comma-separated [the three baselines, torch DDP and every PoseidonDDP mode but the
#                Python reference core and the pull-priority experiment]
#   EVAL_1gbit, EVAL_100mbit, EVAL_10mbit, EVAL_<rate>  --eval-every per rate [25, 10, 3; else 10; a rate's
#                characters other than letters, digits and _ read as _: EVAL_1_5mbit for 1.5mbit]: every
#                mode snapshots on the same step grid, so the grid must give DDP, the slowest, enough
#                points; the fast modes then keep many snapshots (13 MB each for lm-wide) and their
#                evaluation after training takes seconds per snapshot
#   POWERSGD_RANK [4], POWERSGD_START [torch's default, 1000: plain all-reduce until step 1000, so on a
#                slow link within the budget PowerSGD runs as DDP; torch suggests 10% of the steps],
#   LOCALSGD_PERIOD [4], LOCALSGD_WARMUP [torch's default, 0]
#   OVERHEAD_S   seconds per mode beyond its budget, for the estimate only [90: start, the last step, evaluation]
set -uo pipefail
out=${1:-accuracy_matrix_out}
task=${TASK:-lm-wide}
budget=${BUDGET:-300}
repeats=${REPEATS:-3}
rates=${RATES-"1gbit 100mbit 10mbit"}
four_host_rate=${FOUR_HOST_RATE-100mbit}
cpus_per_host=${CPUS_PER_HOST:-$(python -c "import os; print(len(os.sched_getaffinity(0)) / 4)")}
modes=${MODES:-torch-ddp,torch-ddp-powersgd,torch-ddp-localsgd,one-host,poseidon-ps,poseidon-hybrid,poseidon-server,poseidon-server-lazy,poseidon-delay1,poseidon-delay2,poseidon-ssp1,poseidon-ssp3,poseidon-async}
overhead=${OVERHEAD_S:-90}
baselines=(--powersgd-rank "${POWERSGD_RANK:-4}" --localsgd-period "${LOCALSGD_PERIOD:-4}")
baselines+=(${POWERSGD_START:+--powersgd-start-iter "$POWERSGD_START"} ${LOCALSGD_WARMUP:+--localsgd-warmup "$LOCALSGD_WARMUP"})

cells=()
for rate in $rates; do cells+=("2:$rate:"); done
[ -n "$four_host_rate" ] && cells+=("4:$four_host_rate:$cpus_per_host")
n_modes=$(tr ',' '\n' <<< "$modes" | grep -c .)
runs=$((repeats * ${#cells[@]} * n_modes))
estimate_s=$((runs * (budget + overhead)))
echo "accuracy matrix: ${#cells[@]} cells x $n_modes modes x $repeats runs = $runs mode runs of ${budget} s" \
     "+ ~${overhead} s each: about $((estimate_s / 3600)) h $((estimate_s % 3600 / 60)) min" >&2

status=0
results=()
for run in $(seq 1 "$repeats"); do
  for cell in "${cells[@]}"; do
    IFS=: read -r hosts rate cpus <<< "$cell"
    eval_var="EVAL_${rate//[^A-Za-z0-9_]/_}"  # a variable name: 1.5mbit reads EVAL_1_5mbit
    eval_every=${!eval_var:-$(case ${rate,,} in 1gbit) echo 25;; 100mbit) echo 10;; 10mbit) echo 3;; *) echo 10;; esac)}
    dir="$out/run${run}/${hosts}h_${rate}"
    echo "[run $run] $hosts hosts, $rate${cpus:+, $cpus CPU per host}: $dir" >&2
    # a failed mode is recorded in results.json and the table; go on with the other cells
    python -m poseidon_torch.bench.accuracy --task "$task" --mode netns --hosts "$hosts" --bandwidth "$rate" \
      ${cpus:+--cpus-per-host "$cpus"} --time-budget "$budget" --eval-every "$eval_every" --modes "$modes" \
      "${baselines[@]}" --timeout $((3 * budget + 1800)) --out "$dir" || status=1
    [ -f "$dir/results.json" ] && results+=("$dir/results.json")
  done
done
if [ ${#results[@]} -gt 0 ]; then
  python -m poseidon_torch.bench.accuracy.summary "${results[@]}" --json "$out/summary.json" > "$out/summary.md"
  cat "$out/summary.md"
fi
exit $status
