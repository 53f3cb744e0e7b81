#!/bin/bash
# The full capacity grid (docs/capacity.md) in pieces on a shared machine: each piece is one shape, device count and
# attention kernel with one method series beside GC's (cached after its first piece, so a budgeted series starts at
# GC's longest completion), run under the shared lock and released between pieces. Every compiled point is cached
# in $OUT/<shape>/capacity_cache.json: rerun the script to resume; a finished piece costs no compile. Each piece's
# rows are kept as $OUT/<shape>/pieces/<devices>-<attention>-<method>.json (capacity.json is the last piece's).
#
#   scripts/capacity_grid.sh                      # everything: 1 device first, then 8 (forced CPU devices)
#   SHAPES=qwen2.5-1.5b DEVICES=1 scripts/capacity_grid.sh
set -u
OUT=${OUT:-runs/capacity}
LOCK=${LOCK:-/work/locks/big.lock}
SHAPES=${SHAPES:-"smollm2-135m qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b"}
DEVICES=${DEVICES:-"1 8"}
ATTENTION=${ATTENTION:-"blockwise xla"}
METHODS=${METHODS:-"nogc hilore optimal_hr sac gc_int8"}
BUDGETS=${BUDGETS:-"24,80,141"}
PIECE_TIMEOUT=${PIECE_TIMEOUT:-4h}
GROWTH=${GROWTH:-1}  # 0: no growth piece (GC's bytes by tokens per row) in this call
# model.mlp_chunk_len of every piece: docs/capacity.md's grid was measured with the MLP unchunked (0), before the
# trainer's default became 512; MLP_CHUNK_LEN=512 measures the default (in another OUT: a cache holds one setting)
MLP_CHUNK_LEN=${MLP_CHUNK_LEN:-0}
# memory.plan_runs of every piece: the grid was measured at 4, before the trainer's default became 2
PLAN_RUNS=${PLAN_RUNS:-4}
for devices in $DEVICES; do
  for shape in $SHAPES; do
    if [ "$GROWTH" = 1 ] && [ "$devices" = 1 ] && [ ! -f "$OUT/$shape/pieces/growth.json" ]; then  # GC's bytes at 1024/2048/4096 tokens
      mkdir -p "$OUT/$shape/pieces"
      echo "$(date +%T) piece $shape growth"
      flock "$LOCK" nice -n 15 timeout "$PIECE_TIMEOUT" python -m train.capacity --out "$OUT/$shape" --shapes "$shape" \
        --methods gc --budgets-gib "$BUDGETS" --devices 1 --attention "${ATTENTION// /,}" --growth-methods gc --mlp-chunk-len "$MLP_CHUNK_LEN" --plan-runs "$PLAN_RUNS" \
        >> "$OUT/$shape/pieces.log" 2>&1 && cp "$OUT/$shape/capacity.json" "$OUT/$shape/pieces/growth.json"
    fi
    for attention in $ATTENTION; do
      for method in $METHODS; do
        dir=$OUT/$shape
        piece=$dir/pieces/$devices-$attention-$method.json
        [ -f "$piece" ] && continue
        mkdir -p "$dir/pieces"
        echo "$(date +%T) piece $shape x$devices $attention gc,$method"
        flock "$LOCK" nice -n 15 timeout "$PIECE_TIMEOUT" python -m train.capacity --out "$dir" --shapes "$shape" \
          --methods "gc,$method" --budgets-gib "$BUDGETS" --devices "$devices" --attention "$attention" \
          --growth-methods '' --mlp-chunk-len "$MLP_CHUNK_LEN" --plan-runs "$PLAN_RUNS" >> "$dir/pieces.log" 2>&1
        rc=$?
        if [ $rc -eq 0 ]; then cp "$dir/capacity.json" "$piece"; else echo "  exit $rc (see $dir/pieces.log)"; fi
      done
    done
  done
done
