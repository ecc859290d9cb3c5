#!/usr/bin/env bash
# Every GPU check of the CUDA paths in one run (about 7 minutes on one H100/H200), from the repo root:
#
#   [MODES=m1,m2,...] [WORKLOADS="resnet18 gpt2"] bash benchmarks/gpu_check.sh OUT_DIR [REPEATS] [STAGES]
#
# STAGES: a comma-separated subset of tests,overlap,bench,blocking (default: all of them; the install runs always).
# MODES: the benchmark's modes (default: compute-only,torch-ddp,poseidon-ps,poseidon-hybrid,poseidon-server).
# WORKLOADS: the benchmark's workloads, space-separated (default: resnet18 gpt2).
# 1. the GPU and torch there; the package installed against that torch (the native core builds for CPU
#    tensors), in the background while the tests run from the source tree;
# 2. tests/test_cuda.py (2 and 3 ranks on the GPU), then the parity, SFB, pattern, server and Pipe-SGD
#    tests with the ranks' models on the GPU (POSEIDON_TEST_DEVICE=cuda, 2 ranks sharing it over gloo);
# 3. which streams the sync copies ran on, under which kernels, and the tracer's figures, Pipe-SGD's too
#    (benchmarks/cuda_overlap.py);
# 4. the benchmark side by side, 2 ranks on the GPU, resnet18 and gpt2 at 8x their CPU batch, REPEATS times;
# 5. tests/test_cuda.py again under CUDA_LAUNCH_BLOCKING=1 (every launch synchronous: a result that
#    differs only without it is a stream race).
# Writes at most 8 files into OUT_DIR (check.log holds the summary lines; bench.json every run's results).
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [REPEATS] [STAGES]}
repeats=${2:-1}
stages=,${3:-tests,overlap,bench,blocking},
want() { [[ $stages == *,$1,* ]]; }
mkdir -p "$out"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec > >(tee -a "$out/check.log") 2>&1

stage() {  # stage NAME SECONDS LOG COMMAND...: run with a time limit, append to LOG, print rc and tail
  local name=$1 limit=$2 log=$3 t0=$SECONDS rc
  shift 3
  echo "== $name (limit ${limit}s)" | tee -a "$log" >/dev/null
  echo "== $name"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "   rc $rc in $((SECONDS - t0)) s"
  tail -n 3 "$log" | sed 's/^/   /'
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
(t0=$SECONDS; MAX_JOBS=8 python3 -m pip install --no-build-isolation --no-deps -e . >"$work/install.log" 2>&1
 echo "install rc $? in $((SECONDS - t0)) s" >>"$work/install.log") &
installer=$!

tests="$out/tests.log"
if want tests; then
stage test_cuda 100 "$tests" python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda.py
stage on_gpu 160 "$tests" env POSEIDON_TEST_DEVICE=cuda python3 -m pytest -q -rfE -p no:cacheprovider --maxfail 25 --timeout 60 -k P2 \
  tests/test_parity.py tests/test_sfb_parity.py tests/test_patterns.py tests/test_server.py tests/test_pipe_sgd.py
fi
wait "$installer"
{ grep -iE "error" "$work/install.log" | head -n 20; echo ...; tail -n 15 "$work/install.log"; } >"$out/install.log"
tail -n 2 "$out/install.log"
python3 -c "from poseidon_torch.core import native_status; print('native core:', native_status() or 'built and loads')" 2>&1 | tail -1

if want overlap; then
stage overlap 200 "$out/overlap.log" python3 benchmarks/cuda_overlap.py --out "$work/overlap"
cp "$work/overlap/summary.json" "$out/overlap_summary.json" 2>/dev/null
gzip -c "$work/overlap/poseidon-ps.json" >"$out/poseidon-ps-profile.json.gz" 2>/dev/null
grep -E "^==|training|copy time|tracer" "$out/overlap.log" | sed 's/^/   /'
fi

if want bench; then
modes=${MODES:-compute-only,torch-ddp,poseidon-ps,poseidon-hybrid,poseidon-server}
for workload in ${WORKLOADS:-resnet18 gpt2}; do
  for run in $(seq "$repeats"); do
    stage "bench $workload #$run" 100 "$out/bench.txt" python3 -m poseidon_torch.bench --mode localhost --hosts 2 \
      --device cuda --batch-scale 8 --workload "$workload" --iters 20 --warmup 5 --modes "$modes" --no-trace \
      --timeout 120 --out "$work/bench-$workload-$run"
  done
done
python3 - "$work" "$out/bench.json" <<'PY'
import json, sys
from pathlib import Path
runs = {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("bench-*/results.json"))}
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
PY
grep -E "^(resnet18|gpt2) " "$out/bench.txt" | sed 's/^/   /'
fi
if want blocking; then
stage launch_blocking 60 "$tests" env CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/test_cuda.py -k "P2 and not ignore_the_ready_event and not upload_is_not_ordered"
fi
