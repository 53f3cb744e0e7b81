"""What many tests build: the tiny odd-shaped decoder's config, its parameters, and update batches of random tokens."""

import jax
import numpy as np

from hilore_jax import model
from hilore_jax.model import ModelConfig
from hilore_jax.rl.update_batch import UpdateBatch

# prime-ish sizes catch transposes; GQA with 2 query heads per kv head
TINY_MODEL = dict(vocab_size=31, hidden_size=24, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def tiny_model(**overrides) -> ModelConfig:
  """The tests' tiny decoder (vocab 31, D 24, F 37, 2 layers, 4 query heads on 2 kv heads), with overrides."""
  return ModelConfig(**{**TINY_MODEL, **overrides})


def params(cfg: ModelConfig, seed: int = 0, init_std: float = 0.2, noise: float = 0.0):
  """cfg's initial parameters; noise > 0 adds that much standard normal to every leaf (norms and biases too, so no
  weight sits at a special value such as 1 or 0)."""
  p = model.init_params(cfg, jax.random.PRNGKey(seed), init_std=init_std)
  if not noise:
    return p
  leaves, tree = jax.tree_util.tree_flatten(p)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree_util.tree_unflatten(tree, [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def update_batch(rng: np.random.Generator, P: int, N: int, V: int, lengths_B, *, order=None, prompt_lens=None,
                 adv_B=None, old_logp: bool = False, ref_logp: bool = False, **fields) -> UpdateBatch:
  """Rows of random tokens in [1, V): completions of lengths_B real tokens in N (right-padded; 0: a padding row),
  prompts of prompt_lens real tokens in P (left-padded; all P by default), one per distinct entry of order (rows with
  the same entry share a prompt, as a group does; a prompt per row by default); advantages standard normal unless
  adv_B; old log-probs log U(0.02, 0.2) on real tokens if old_logp, the reference's 1.1 times them if ref_logp;
  further UpdateBatch fields (on_policy, replayed) as given."""
  lengths_B = np.asarray(lengths_B)
  B = len(lengths_B)
  order = np.arange(B) if order is None else np.asarray(order)
  n = int(order.max()) + 1
  prompt_lens = np.full(n, P) if prompt_lens is None else np.asarray(prompt_lens)
  pmask = (np.arange(P)[None] >= P - prompt_lens[:, None]).astype(np.int32)
  pids = (rng.integers(1, V, (n, P)) * pmask).astype(np.int32)
  mask = (np.arange(N)[None] < lengths_B[:, None]).astype(np.int32)
  tokens = (rng.integers(1, V, (B, N)) * mask).astype(np.int32)
  adv = rng.normal(size=B) if adv_B is None else adv_B
  old = (np.log(rng.uniform(0.02, 0.2, (B, N))) * mask).astype(np.float32) if old_logp or ref_logp else None
  return UpdateBatch(pids[order], pmask[order], tokens, mask, np.asarray(adv, np.float32),
                     old_logp=old if old_logp else None, ref_logp=(old * 1.1).astype(np.float32) if ref_logp else None,
                     **{k: None if v is None else np.asarray(v, np.int32) for k, v in fields.items()})
