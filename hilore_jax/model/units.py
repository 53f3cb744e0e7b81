"""The layer dataflow table: every tensor a decoder layer tags for backward, who produces it, who reads it.

This is the one statement of that fact. The decoder tags its tensors with these names, the memory profile times
the producer ops (the decoder's own functions, `ops.OPS`), the cost model derives what backward must rerun,
calibration and the methods read which units may be low-precision and which weights' gradients they reach.
`tests/model/test_units.py` checks the table against the names the decoder emits and the tensors each op reads.
"""

from __future__ import annotations

import dataclasses
import math

# Checkpoint names (what `jax.ad_checkpoint.checkpoint_name` tags in a layer).
LAYER_INPUT = "layer_input"      # residual stream entering the layer
ATTN_NORM = "attn_norm"          # RMSNorm output read by q/k/v projections (one unit)
Q, K, V = "q", "k", "v"          # q/k after RoPE, v
ATTN_PROBS = "attn_probs"        # softmax probabilities [B, K, G, T, S]
ATTN_CTX = "attn_ctx"            # attention output, the o_proj input
ATTN_OUT = "attn_out"            # o_proj output
MLP_INPUT = "mlp_input"          # residual stream after attention
MLP_NORM = "mlp_norm"            # RMSNorm output read by gate/up projections (one unit)
MLP_GATE, MLP_UP = "mlp_gate", "mlp_up"
MLP_SILU = "mlp_silu"            # silu(gate)
MLP_DOWN_IN = "mlp_down_in"      # silu(gate) * up, the down-projection input
MLP_OUT = "mlp_out"              # down-projection output
LORA_XA = "lora_xa"              # LoRA: x A of every adapted projection, [B, T, r] each (its B gradient reads it)
LORA_OP = "lora_a"               # the op computing a layer's x A products (ops.OPS)
# the projection inputs an adapter may read (model/lora.py's targets sit on their projections)
PROJECTION_INPUTS = (ATTN_NORM, ATTN_CTX, MLP_NORM, MLP_DOWN_IN)

# What backward reads a tensor for: its value in a norm, softmax or nonlinearity's derivative (and any weight
# gradient), only the gradient of the weights it multiplies (a projection input), or nothing. Either way an L unit
# serves backward from its decoded code (model/lowp.py); only a recompute needs a tensor exactly.
EXACT, WEIGHTS, NONE = "exact", "weights", "none"


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One row of the table."""

  name: str
  shape: str  # shape letters: B batch, T query positions, S key positions, D hidden, N heads, K kv heads,
  #             G query heads per kv head, H head size, F intermediate
  producer: str | None  # the op (a key of ops.OPS) that computes it; None: the layer boundary
  reads: tuple[str, ...]  # tensors that op reads (recomputing it needs them)
  backward: str  # EXACT | WEIGHTS | NONE
  weights: tuple[str, ...] = ()  # (sub-dict, leaf) of the params whose gradient reads it
  lowp: bool = False  # may be kept as a low-precision code (L): the op that reads it in backward keeps the code
  unit: bool = False  # the allocator chooses H / L / R for it (the rest is never kept on its own)
  matmul: bool = False  # produced by a matrix multiplication (SAC-style methods keep these)


TABLE: tuple[Tensor, ...] = (
    # the layer boundary: a checkpointed layer keeps it exactly as its argument, so L only when nothing is rerun
    Tensor(LAYER_INPUT, "BTD", None, (), EXACT, lowp=True, unit=True),
    Tensor(ATTN_NORM, "BTD", "attn_norm_op", (LAYER_INPUT,), WEIGHTS,
           (("attn", "wq_DNH"), ("attn", "wk_DKH"), ("attn", "wv_DKH")), lowp=True, unit=True),
    Tensor(Q, "BTNH", "q_proj", (ATTN_NORM,), EXACT, lowp=True, unit=True, matmul=True),
    Tensor(K, "BTKH", "k_proj", (ATTN_NORM,), EXACT, lowp=True, unit=True, matmul=True),
    Tensor(V, "BTKH", "v_proj", (ATTN_NORM,), EXACT, lowp=True, unit=True, matmul=True),
    Tensor(ATTN_PROBS, "BKGTS", "scores", (Q, K), EXACT, lowp=True, unit=True),
    Tensor(ATTN_CTX, "BTNH", "pv", (ATTN_PROBS, V), WEIGHTS, (("attn", "wo_NHD"),), lowp=True, unit=True,
           matmul=True),
    Tensor(ATTN_OUT, "BTD", "o_proj", (ATTN_CTX, LAYER_INPUT), NONE),
    Tensor(MLP_INPUT, "BTD", "o_proj", (ATTN_CTX, LAYER_INPUT), EXACT, lowp=True, unit=True, matmul=True),
    Tensor(MLP_NORM, "BTD", "mlp_norm_op", (MLP_INPUT,), WEIGHTS, (("mlp", "wgate_DF"), ("mlp", "wup_DF")),
           lowp=True, unit=True),
    Tensor(MLP_GATE, "BTF", "gate_proj", (MLP_NORM,), EXACT, lowp=True, unit=True, matmul=True),
    Tensor(MLP_UP, "BTF", "up_proj", (MLP_NORM,), EXACT, lowp=True, unit=True, matmul=True),
    Tensor(MLP_SILU, "BTF", "act", (MLP_GATE, MLP_UP), NONE),
    Tensor(MLP_DOWN_IN, "BTF", "act", (MLP_GATE, MLP_UP), WEIGHTS, (("mlp", "wdown_FD"),), lowp=True, unit=True),
    Tensor(MLP_OUT, "BTD", "down_proj", (MLP_DOWN_IN,), NONE),
)

BY_NAME: dict[str, Tensor] = {t.name: t for t in TABLE}
# LoRA's x A is tagged too (a policy may keep it); it is a row only of a LoRA run's table (`table`)
CHECKPOINT_NAMES: tuple[str, ...] = tuple(t.name for t in TABLE) + (LORA_XA,)
UNITS: tuple[str, ...] = tuple(t.name for t in TABLE if t.unit)  # what the allocator decides, per layer
LOWP_UNITS: tuple[str, ...] = tuple(t.name for t in TABLE if t.lowp)
EXACT_READS: tuple[str, ...] = tuple(t.name for t in TABLE if t.backward == EXACT and t.producer)
BACKWARD_READS: tuple[str, ...] = tuple(t.name for t in TABLE if t.backward != NONE)  # what backward reads at all
BOUNDARY: tuple[str, ...] = tuple(t.name for t in TABLE if t.producer is None)  # kept by a checkpointed layer
MATMUL_UNITS: tuple[str, ...] = tuple(t.name for t in TABLE if t.unit and t.matmul)
# the producer ops a recompute may need, each with the tensors it reads
PRODUCERS: dict[str, tuple[str, ...]] = {t.producer: t.reads for t in TABLE if t.producer}


def code_names(unit: str) -> tuple[str, str]:
  """Checkpoint names of an L unit's codes and scales (what a remat policy saves instead of the tensor)."""
  return f"{unit}:code", f"{unit}:scale"


def dims(cfg, batch: int, seq: int) -> dict[str, int]:
  """Size of every shape letter for a model config and a [batch, seq] input (A: the width of a LoRA layer's x A
  products, rank x adapted projections)."""
  N, K = cfg.num_attention_heads, cfg.num_key_value_heads
  lora = getattr(cfg, "lora", None)
  return {"B": batch, "T": seq, "S": seq, "D": cfg.hidden_size, "N": N, "K": K, "G": N // K, "H": cfg.head_size,
          "F": cfg.intermediate_size, "A": lora.rank * len(lora.targets) if lora else 0}


def shape(name: str, sizes: dict[str, int]) -> tuple[int, ...]:
  """The tensor's shape from its letters."""
  return tuple(sizes[c] for c in (LORA_ROW if name == LORA_XA else BY_NAME[name]).shape)


def numel(name: str, sizes: dict[str, int]) -> int:
  return math.prod(shape(name, sizes))


FUSED_ATTN = "attn"  # the fused kernel's op: q, k, v -> context in one call
FUSED_KERNELS = ("dot_product_attention", "blockwise")  # the model.attention kernels with no probabilities tensor


def fused(attention: str) -> bool:
  """Whether the kernel computes the context from q, k and v in one op (units.FUSED_ATTN), with no attn_probs."""
  return attention in FUSED_KERNELS


LORA_ROW = Tensor(LORA_XA, "BTA", LORA_OP, PROJECTION_INPUTS, WEIGHTS, unit=True, matmul=True)


def table(attention: str = "xla", adapted: tuple[str, ...] | None = None) -> tuple[Tensor, ...]:
  """The rows for an attention kernel and, with LoRA, the projection inputs whose projections carry adapters.

  jax.nn.dot_product_attention and the blockwise kernel never materialise the probabilities: the context comes from
  q, k and v in one op, whose backward reruns it (its softmax statistics are not a named tensor a policy could
  keep), so there is no attn_probs row. The allocator's units are the same.

  adapted (LoRA; None: every weight trains): the frozen weights have no gradient, so a projection input is read in
  backward only by its adapters' A gradients (WEIGHTS) and not at all where no adapter reads it (NONE: no unit);
  the x A products are one more unit (LORA_XA, last: nothing in the layer reads it, only the B gradients do).
  """
  rows = TABLE
  if fused(attention):
    ctx = dataclasses.replace(BY_NAME[ATTN_CTX], producer=FUSED_ATTN, reads=(Q, K, V))
    rows = tuple(ctx if t.name == ATTN_CTX else t for t in rows if t.name != ATTN_PROBS)
  if adapted is None:
    return rows
  frozen = lambda t: (t if t.name in adapted else dataclasses.replace(t, backward=NONE, lowp=False, unit=False))
  rows = tuple(frozen(t) if t.name in PROJECTION_INPUTS else t for t in rows)
  return rows + ((dataclasses.replace(LORA_ROW, reads=tuple(adapted)),) if adapted else ())


def lora_rows(kinds) -> tuple[Tensor, ...]:
  """The rows of `table(adapted=...)` for a layer's unit kinds: a LoRA layer's units carry LORA_XA, and its
  adapted inputs are exactly the projection inputs among them (the others are no unit); else TABLE. What the cost
  model reads, which sees units, not configs."""
  kinds = set(kinds)
  if LORA_XA not in kinds:
    return TABLE
  return table("xla", tuple(k for k in PROJECTION_INPUTS if k in kinds))


def units_of(adapted: tuple[str, ...] | None) -> tuple[str, ...]:
  """The allocator's units of a layer: UNITS, or with LoRA those of its table (in table order)."""
  return UNITS if adapted is None else tuple(t.name for t in table("xla", adapted) if t.unit)
