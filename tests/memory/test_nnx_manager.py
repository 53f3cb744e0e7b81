"""The memory manager drives another JAX trainer: a small flax.nnx decoder, through StepHooks alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hilore_jax import model
from hilore_jax.model import decoder
from hilore_jax.memory import MemoryManager, StepHooks
from hilore_jax.memory.config import MemoryConfig

D, F, HEADS, LAYERS, B, T = 32, 88, 4, 3, 4, 64


class Block(nnx.Module):
  """A pre-norm attention + gated-MLP block whose tensors carry hilore-jax's checkpoint names."""

  def __init__(self, rngs: nnx.Rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
    self.attn_norm, self.mlp_norm = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
    self.q, self.k, self.v, self.o = lin(D, D), lin(D, D), lin(D, D), lin(D, D)
    self.gate, self.up, self.down = lin(D, F), lin(D, F), lin(F, D)

  def __call__(self, x_BTD):
    x = checkpoint_name(x_BTD, "layer_input")
    h = checkpoint_name(self.attn_norm(x), "attn_norm")
    heads = lambda t: t.reshape(B, T, HEADS, D // HEADS)
    q, k, v = (checkpoint_name(heads(f(h)), n) for f, n in ((self.q, "q"), (self.k, "k"), (self.v, "v")))
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(D // HEADS)
    probs = checkpoint_name(jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e30), -1), "attn_probs")
    ctx = checkpoint_name(jnp.einsum("bnts,bsnh->btnh", probs, v), "attn_ctx")
    x = checkpoint_name(x + self.o(ctx.reshape(B, T, D)), "mlp_input")
    h = checkpoint_name(self.mlp_norm(x), "mlp_norm")
    gate, up = checkpoint_name(self.gate(h), "mlp_gate"), checkpoint_name(self.up(h), "mlp_up")
    return x + self.down(checkpoint_name(jax.nn.silu(gate) * up, "mlp_down_in"))


def _loss(graphdef, states, x, y, policies):
  """Each block under its own policy: a pure function of the blocks' states (nnx.split), as jax.checkpoint needs."""
  for state, policy in zip(states, policies):
    x = model.remat(lambda s, x: nnx.merge(graphdef, s)(x), policy)(state, x)
  return jnp.mean((x - y) ** 2)


@pytest.mark.slow
def test_manager_plans_an_nnx_model_within_its_budget():
  blocks = [Block(nnx.Rngs(i)) for i in range(LAYERS)]
  graphdef = nnx.split(blocks[0])[0]
  states = [nnx.split(b)[1] for b in blocks]
  batch = {"x": jnp.asarray(np.random.default_rng(0).normal(size=(B, T, D)), jnp.float32),
           "y": jnp.zeros((B, T, D), jnp.float32)}
  grad_fn = lambda pols: jax.jit(jax.grad(lambda s, b: _loss(graphdef, s, b["x"], b["y"], pols)))

  def compile_peak(policies, b):  # the same definition as hilore-jax's step: temp + the gradients it returns
    mem = grad_fn(tuple(policies)).lower(states, b).compile().memory_analysis()
    return mem.temp_size_in_bytes + mem.output_size_in_bytes

  shape = model.ModelConfig(vocab_size=8, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, num_key_value_heads=HEADS)
  # fixed op times: the plan, and so this test's outcome, must not depend on how fast this machine runs the ops
  times = {"ops": {op: 1e-3 for op in decoder.OPS}, "codec": {}, "offload": {}}
  hooks = StepHooks(model_cfg=shape, compile_peak=compile_peak, batch_shape=lambda b: b["x"].shape[:2],
                    op_profile=lambda *shape_args: times)
  mm = MemoryManager(MemoryConfig(policy="optimal_hr", budget_ratio=1.25, budget_probes=5), hooks)
  mm.setup(None, [batch], step=0)
  assert mm.state.profile is times  # priced with the given times, nothing measured
  (alloc,) = mm.allocate([batch])
  peak = compile_peak(alloc.policies, batch)
  # never above the budget; XLA may schedule a mixed plan below GC's own peak, so only the plan's content says it
  # used the allowance: some units kept
  assert peak <= mm.state.budget_bytes and mm.state.gc_bytes < mm.state.budget_bytes
  assert alloc.metrics["alloc/frac_H"] > 0 and any(p.save for p in alloc.policies)
  # the plan trains: same gradients as keeping everything
  g = grad_fn(alloc.policies)(states, batch)
  g_ref = grad_fn(model.uniform(LAYERS, model.NO_REMAT))(states, batch)
  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(np.abs(b).max()))
