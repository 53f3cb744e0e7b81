#!/usr/bin/env bash
# The GPU checks of one device window, from the repository root:   OUT=/some/dir bash scripts/gpu_check.sh
#   1. tests/test_gpu.py: host offload (O) round trip with residuals on pinned_host; a planned step's measured
#      peak_bytes_in_use within its budget (both skip on CPU)
#   2. python -m train.bench --config configs/bench_gpu.yaml (gc, none, optimal_hr, adacc_style, hilore at 1.00x
#      and 1.10x; < 8 minutes on one H200 with a warm compilation cache, HILORE_CACHE/xla)
# Everything it writes goes under $OUT (default runs/gpu_check): logs, timings, the bench's results.{json,md}.
set -uo pipefail
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export HILORE_CACHE=${HILORE_CACHE:-$HOME/.cache/hilore_jax}  # keep the compilation cache between windows
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1;
  python -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

start=$SECONDS
python -m pytest -q -rs tests/test_gpu.py -s 2>&1 | tee "$OUT/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "gpu tests: rc=$tests_rc in $((SECONDS - start)) s" | tee "$OUT/timing.txt"

start=$SECONDS
python -m train.bench --config configs/bench_gpu.yaml --out "$OUT/bench_gpu" 2>&1 | tee "$OUT/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "bench_gpu: rc=$bench_rc in $((SECONDS - start)) s" | tee -a "$OUT/timing.txt"
exit $(( tests_rc != 0 || bench_rc != 0 ))
