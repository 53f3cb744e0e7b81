"""The model wing: config, decoder (its layer, ops, RoPE, init), the layer dataflow table, remat policies, L codes,
HF interop.

It imports nothing from the rest of the package: memory policies arrive as `LayerPolicy` data.
"""

from hilore_jax.model.config import ModelConfig
from hilore_jax.model.cache import decode_step, filled_attention, forward_cached, init_cache
from hilore_jax.model.attention import attention_context, attention_probs
from hilore_jax.model.decoder import (default_positions, embed, forward, head_logits, hidden_states, layer_params,
                                      layer_residuals, lm_head_weight, logits, num_layers)
from hilore_jax.model.init import init_params
from hilore_jax.model.layer import Mode, Prefill, Probe, Taps, Train, decoder_layer
from hilore_jax.model.layers import (is_stacked, policy_runs, run_layers, stack_layers, stacked, unstack_layers,
                                     unstacked)
from hilore_jax.model.ops import OPS, LayerCtx, layer_ctx, rms_norm
from hilore_jax.model.rope import apply_rope, rope_cos_sin
from hilore_jax.model.shared import packed_shared_hidden_states, shared_hidden_states
from hilore_jax.model.policy import (FULL_REMAT, NO_REMAT, LayerPolicy, offload_supported, ordered, remat,
                                     saved_residuals, uniform)
from hilore_jax.model.units import (ATTN_CTX, ATTN_NORM, ATTN_OUT, ATTN_PROBS, CHECKPOINT_NAMES, LAYER_INPUT,
                                    LOWP_UNITS, MLP_DOWN_IN, MLP_GATE, MLP_INPUT, MLP_NORM, MLP_OUT, MLP_SILU, MLP_UP,
                                    UNITS, K, Q, V)
