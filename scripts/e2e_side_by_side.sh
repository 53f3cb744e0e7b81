#!/bin/bash
# End to end on the real model against TRL, as issue 33 measures it: this trainer with memory.policy gc and hilore,
# each on a cold cache (a fresh HILORE_CACHE: no set-up cache, no compiled programs) and then warm (the same cache
# again: the second run of a recipe), and TRL's GRPOTrainer once; one run at a time, then one table.
#
#   bash scripts/e2e_side_by_side.sh OUT [N]      # N steps per run (default 6); about 45 minutes on 2 cores
#   PHASES=cold TRL=0 bash scripts/e2e_side_by_side.sh OUT 40   # the cold runs alone, no TRL (40-step wall times)
#
# Runs ../shared/peers' project_peer.py and trl_peer.py (PEERS=...), the recipe configs/smollm2-135m-arith.yaml
# (CONFIG=...), TRL from $HOME/.venvs/trl (TPY=...; see ../shared/peers/README.md). Time on a quiet machine.
set -u
OUT=${1:?out dir}; N=${2:-6}
PEERS=${PEERS:-$(dirname "$0")/../../shared/peers}; CONFIG=${CONFIG:-configs/smollm2-135m-arith.yaml}
PY=${PY:-python}; TPY=${TPY:-$HOME/.venvs/trl/bin/python}; PHASES=${PHASES:-cold warm}; TRL=${TRL:-1}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
$PY -m train.fetch_model smollm2-135m-instruct > "$OUT/fetch.log" 2>&1 || { echo "fetch failed: $OUT/fetch.log"; exit 1; }
models=${HILORE_CACHE:-$HOME/.cache/hilore_jax}/models
for method in gc hilore; do
  cache=$(readlink -f "$OUT")/cache-$method
  rm -rf "$cache"; mkdir -p "$cache"; ln -s "$models" "$cache/models"  # the model is not part of a cold start
  for phase in $PHASES; do
    echo "== hilore_jax memory.policy=$method, $phase cache ($N steps)"
    HILORE_CACHE=$cache python3 "$PEERS/project_peer.py" --project . --python "$PY" --config "$CONFIG" --steps "$N" \
      --out "$OUT/$method-$phase" --set "memory.policy=$method" > "$OUT/$method-$phase.out" 2>&1 \
      || { echo "failed: $OUT/$method-$phase.out"; tail -5 "$OUT/$method-$phase.out"; }
  done
done
if [ "$TRL" = 1 ]; then
  echo "== TRL GRPOTrainer ($N steps)"
  $PY "$PEERS/grpo_resolve.py" "$CONFIG" eval.at_start=false eval.at_end=false grpo.filter_zero_std=false \
    > "$OUT/resolved.json" 2> "$OUT/resolve.log" || { echo "resolve failed: $OUT/resolve.log"; exit 1; }
  $TPY "$PEERS/trl_peer.py" --project . --resolved "$OUT/resolved.json" --steps "$N" --out "$OUT/trl" \
    > "$OUT/trl.out" 2>&1 || { echo "TRL failed: $OUT/trl.out"; tail -5 "$OUT/trl.out"; }
fi
{ echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-); load at the end: $(uptime)"
  echo "project: $(git rev-parse --short HEAD)"; } \
  > "$OUT/machine.txt"
$PY scripts/e2e_table.py "$OUT" | tee "$OUT/table.md"
