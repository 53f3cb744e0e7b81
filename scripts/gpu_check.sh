#!/usr/bin/env bash
# The GPU checks of one device window, from the repository root:   OUT=/some/dir bash scripts/gpu_check.sh
#   1. tests/model/test_gpu.py: host offload (O) round trip with residuals on pinned_host; a planned step's measured
#      peak_bytes_in_use within its budget (both skip on CPU)
#   2. python -m experiments.bench.main --config configs/bench_gpu.yaml at 1.10x (gc, its separately compiled control, none,
#      optimal_hr, hilore_static, hilore) with bench.roofline=true, then the H200 roofline projection beside the
#      measurement (results.md's projection table). The timing stops at +/-2 points or 120 s; the projection adds
#      one compile per plan (the plan unrolled), so allow a few minutes more than the bench alone with a cold cache
#   3. python -m train.capacity (compile-only, docs/capacity.md): SmolLM2's GC step at 1024/2048/4096 tokens per row
#      and its longest completion in 24 GiB, compiled by XLA:GPU with dot_product_attention (cuDNN flash attention)
#      and blockwise; its capacity.md sits beside the CPU table of docs/capacity.md (about 12 compiles)
# Everything it writes goes under $OUT (default runs/gpu_check): logs, timings, the bench's results.{json,md}.
set -uo pipefail
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export HILORE_CACHE=${HILORE_CACHE:-$HOME/.cache/hilore_jax}  # keep the compilation cache between windows
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1;
  python -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

start=$SECONDS
python -m pytest -q -rs tests/model/test_gpu.py -s 2>&1 | tee "$OUT/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "gpu tests: rc=$tests_rc in $((SECONDS - start)) s" | tee "$OUT/timing.txt"

start=$SECONDS
python -m experiments.bench.main --config configs/bench_gpu.yaml --out "$OUT/bench_gpu" 'bench.budget_ratios=[1.10]' \
  bench.roofline=true bench.time_cap_s=120 2>&1 | tee "$OUT/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "bench_gpu: rc=$bench_rc in $((SECONDS - start)) s" | tee -a "$OUT/timing.txt"
start=$SECONDS
python -m train.capacity --out "$OUT/capacity" --shapes smollm2-135m --methods gc --budgets-gib 24 --devices 1 \
  --attention dot_product_attention,blockwise --growth-methods gc 2>&1 | tee "$OUT/capacity.log"
capacity_rc=${PIPESTATUS[0]}
echo "capacity: rc=$capacity_rc in $((SECONDS - start)) s" | tee -a "$OUT/timing.txt"
echo "== projection vs measurement =="
sed -n '/^## Projection/,/^## [^P]/p' "$OUT/bench_gpu/results.md" 2>/dev/null | tee "$OUT/projection_vs_measured.md"
exit $(( tests_rc != 0 || bench_rc != 0 || capacity_rc != 0 ))
