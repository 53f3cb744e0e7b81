import os

import jax
import jax.numpy as jnp

from hilore_jax import model
from hilore_jax.memory import profile as units
from hilore_jax.model import units as U


def test_unit_bytes_match_what_backward_saves(tiny_cfg):
  B, T = 2, 7
  us = units.enumerate_units(tiny_cfg, B, T, group_size=8)
  assert len(us) == tiny_cfg.num_hidden_layers * len(U.UNITS)
  p = model.init_params(tiny_cfg, jax.random.PRNGKey(0))
  ids = jnp.ones((B, T), jnp.int32)
  save_all = model.LayerPolicy(remat=True, save=U.UNITS)
  res = model.saved_residuals(
      lambda q: jnp.sum(model.forward(tiny_cfg, q, ids, layer_policies=(save_all,) * 3)), p)
  for u in us[:len(U.UNITS)]:
    hit = [r for r in res if r.name == u.kind]
    assert len(hit) == 3 and hit[0].shape == u.shape, u.kind
    assert u.bytes_h == 4 * jnp.size(jnp.zeros(u.shape))
    if u.kind in model.LOWP_UNITS:
      assert u.bytes_l == u.shape[0] * u.shape[1] * (-(-u.shape[-1] // 8) * (8 + 4)) if len(u.shape) == 3 else True
      assert u.bytes_l < u.bytes_h / 2  # int8 + one float32 scale per group of 8
    else:
      assert u.bytes_l is None


def test_profile_is_measured_and_cached(tiny_cfg, tmp_path):
  prof = units.profile_ops(tiny_cfg, 2, 16, group_size=8, reps=3, cache_dir=str(tmp_path))
  assert set(prof["ops"]) == set(U.PRODUCERS) and all(v > 0 for v in prof["ops"].values())
  assert set(prof["codec"]) == set(model.LOWP_UNITS)
  assert all(t > 0 for per in prof["codec"].values() for t in per.values())
  assert prof["offload"] == {}  # CPU: no host offload to time
  files = os.listdir(tmp_path)
  assert len(files) == 1
  again = units.profile_ops(tiny_cfg, 2, 16, group_size=8, reps=3, cache_dir=str(tmp_path))
  assert again == prof  # read back from the cache, not re-measured
  other = units.profile_key(tiny_cfg.replace(dtype="bfloat16"), 2, 16, 8)
  assert other != units.profile_key(tiny_cfg, 2, 16, 8)
  us = units.enumerate_units(tiny_cfg, 2, 16, 8, prof)
  assert us[0].recompute_s == prof["ops"][U.BY_NAME[us[0].kind].producer]
  assert us[0].codec_s == prof["codec"][us[0].kind]["int8"] and us[0].offload_s is None
