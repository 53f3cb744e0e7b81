import jax
import jax.numpy as jnp

from hilore_jax import model
from hilore_jax.capacity.flops import program_flops


def test_scan_counts_its_body_length_times():
  w_LDE, x_BD = jnp.ones((5, 6, 6)), jnp.ones((3, 6))
  scanned = lambda w, x: jax.lax.scan(lambda x, w: (x @ w, None), x, w)[0].sum()
  assert program_flops(scanned, w_LDE, x_BD) == 5 * 2 * 3 * 6 * 6  # by hand: 5 matmuls of [3,6] x [6,6]
  assert program_flops(lambda w, x: (x @ w[0]).sum(), w_LDE, x_BD) == 2 * 3 * 6 * 6


def test_recompute_counts_and_dead_forward_does_not(tiny_cfg):
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  ids = jnp.ones((2, 5), jnp.int32)

  def grad_flops(pols):
    return program_flops(jax.grad(lambda q: jnp.sum(model.forward(tiny_cfg, q, ids, layer_policies=pols))), p)

  n = tiny_cfg.num_hidden_layers
  none, gc = grad_flops((model.NO_REMAT,) * n), grad_flops((model.FULL_REMAT,) * n)
  layers_fwd = program_flops(lambda q: jnp.sum(model.hidden_states(tiny_cfg, q, ids)), p)
  # full checkpointing reruns every layer's forward but the down projection, whose output backward never reads
  down_proj = 2 * ids.size * tiny_cfg.intermediate_size * tiny_cfg.hidden_size
  assert gc - none == layers_fwd - n * down_proj
  # splitting the layer scan into runs changes nothing (XLA's cost analysis would count two bodies here)
  other = model.LayerPolicy(remat=True, group_size=7)
  assert grad_flops((model.FULL_REMAT, other) + (model.FULL_REMAT,) * (n - 2)) == gc
  # every backward read served by an H or L unit: no matmul is rerun, although the jaxpr still lists them
  keep = (model.Q, model.K, model.V, model.MLP_INPUT, model.MLP_GATE, model.MLP_UP)
  lowp = tuple(u for u in model.units.UNITS if u not in keep + (model.LAYER_INPUT,))
  assert grad_flops((model.LayerPolicy(remat=True, save=keep, lowp=lowp, group_size=8),) * n) == none
