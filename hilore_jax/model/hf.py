"""Hugging Face checkpoints in and out: config.json plus single or sharded safetensors."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.flax import save_file

from hilore_jax.model import config as model_config
from hilore_jax.model.config import ModelConfig
from hilore_jax.model.layers import unstacked

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _entries(cfg: ModelConfig) -> Iterator[tuple[str, tuple, tuple, Callable, Callable]]:
  """(hf_name, our_path, hf_shape, hf->ours, ours->hf) for every tensor of the architecture."""
  D, F, N, K, H, Vc = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_size, cfg.vocab_size)
  same = (lambda x: x, lambda x: x)
  linear = lambda *shape: (lambda w: w.T.reshape(shape), lambda w: w.reshape(w.shape[0], -1).T)
  out_linear = lambda *shape: (lambda w: w.T.reshape(shape), lambda w: w.reshape(shape[0] * shape[1], -1).T)
  vec = lambda *shape: (lambda b: b.reshape(shape), lambda b: b.reshape(-1))
  yield "model.embed_tokens.weight", ("embed_VD",), (Vc, D), *same
  for i in range(cfg.num_hidden_layers):
    pre, lp = f"model.layers.{i}.", ("layers", i)
    yield pre + "input_layernorm.weight", lp + ("attn_norm_D",), (D,), *same
    yield pre + "post_attention_layernorm.weight", lp + ("mlp_norm_D",), (D,), *same
    a = lp + ("attn",)
    yield pre + "self_attn.q_proj.weight", a + ("wq_DNH",), (N * H, D), *linear(D, N, H)
    yield pre + "self_attn.k_proj.weight", a + ("wk_DKH",), (K * H, D), *linear(D, K, H)
    yield pre + "self_attn.v_proj.weight", a + ("wv_DKH",), (K * H, D), *linear(D, K, H)
    yield pre + "self_attn.o_proj.weight", a + ("wo_NHD",), (D, N * H), *out_linear(N, H, D)
    if cfg.attention_bias:
      yield pre + "self_attn.q_proj.bias", a + ("bq_NH",), (N * H,), *vec(N, H)
      yield pre + "self_attn.k_proj.bias", a + ("bk_KH",), (K * H,), *vec(K, H)
      yield pre + "self_attn.v_proj.bias", a + ("bv_KH",), (K * H,), *vec(K, H)
    if cfg.o_proj_bias:
      yield pre + "self_attn.o_proj.bias", a + ("bo_D",), (D,), *same
    m = lp + ("mlp",)
    yield pre + "mlp.gate_proj.weight", m + ("wgate_DF",), (F, D), *linear(D, F)
    yield pre + "mlp.up_proj.weight", m + ("wup_DF",), (F, D), *linear(D, F)
    yield pre + "mlp.down_proj.weight", m + ("wdown_FD",), (D, F), *linear(F, D)
    if cfg.mlp_bias:
      yield pre + "mlp.gate_proj.bias", m + ("bgate_F",), (F,), *same
      yield pre + "mlp.up_proj.bias", m + ("bup_F",), (F,), *same
      yield pre + "mlp.down_proj.bias", m + ("bdown_D",), (D,), *same
  yield "model.norm.weight", ("final_norm_D",), (D,), *same
  if not cfg.tie_word_embeddings:
    yield "lm_head.weight", ("lm_head_DV",), (Vc, D), *linear(D, Vc)


def _set(tree: dict, path: tuple, value):
  node = tree
  for key, nxt in zip(path[:-1], path[1:]):
    if isinstance(key, int):
      while len(node) <= key:
        node.append({})
      node = node[key]
    else:
      node = node.setdefault(key, [] if isinstance(nxt, int) else {})
  node[path[-1]] = value


def _get(tree, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def _tensor_files(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file, from the index when sharded."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
  single = os.path.join(path, SINGLE_FILE)
  if not os.path.exists(single):
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
  with safe_open(single, framework="flax") as f:
    return {name: single for name in f.keys()}


def load_config(path: str, dtype: Any = "float32", compute_dtype: Any = None) -> ModelConfig:
  """ModelConfig from a local HF directory's config.json."""
  cfg_file = os.path.join(path, "config.json")
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"{cfg_file} not found: model.path must be a local Hugging Face checkpoint directory")
  with open(cfg_file) as f:
    d = json.load(f)
  return model_config.from_hf_dict(d, dtype=compute_dtype or dtype, param_dtype=dtype)


def load_hf(path: str, dtype: Any = "float32", compute_dtype: Any = None) -> tuple[ModelConfig, dict]:
  """(cfg, params) from a local Qwen2ForCausalLM / LlamaForCausalLM directory; params stored in `dtype`."""
  cfg = load_config(path, dtype, compute_dtype)
  files = _tensor_files(path)
  expected = {e[0] for e in _entries(cfg)}
  unexpected = sorted(n for n in files if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                      and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
  if unexpected:
    raise ValueError(f"{path}: tensors not part of {cfg.architecture}: {unexpected[:8]}")
  params: dict = {}
  handles: dict[str, Any] = {}
  try:
    for hf_name, ours, shape, to_ours, _ in _entries(cfg):
      if hf_name not in files:
        raise ValueError(f"{path}: missing tensor {hf_name!r} (expected shape {shape})")
      fname = files[hf_name]
      if fname not in handles:
        handles[fname] = safe_open(fname, framework="flax")
        handles[fname].__enter__()
      t = handles[fname].get_tensor(hf_name)
      if tuple(t.shape) != shape:
        raise ValueError(f"{path}: tensor {hf_name!r} has shape {tuple(t.shape)}, expected {shape} "
                         f"for this config")
      _set(params, ours, to_ours(jnp.asarray(t)).astype(cfg.params_dtype))
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)
  return cfg, params


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple]:
  """HF tensor name -> shape, for every tensor of the architecture."""
  return {hf_name: shape for hf_name, _, shape, _, _ in _entries(cfg)}


def from_state_dict(cfg: ModelConfig, state: dict, where: str = "state dict") -> dict:
  """Our params (in cfg.param_dtype) from HF-named arrays, checked against the architecture's tensor table."""
  entries = list(_entries(cfg))
  unexpected = sorted(set(state) - {e[0] for e in entries})
  if unexpected:
    raise ValueError(f"{where}: tensors not part of {cfg.architecture}: {unexpected[:8]}")
  params: dict = {}
  for hf_name, ours, shape, to_ours, _ in entries:
    if hf_name not in state:
      raise ValueError(f"{where}: missing tensor {hf_name!r} (expected shape {shape})")
    t = np.asarray(state[hf_name])
    if tuple(t.shape) != shape:
      raise ValueError(f"{where}: tensor {hf_name!r} has shape {tuple(t.shape)}, expected {shape} for this config")
    _set(params, ours, jnp.asarray(to_ours(t), cfg.params_dtype))
  return params


def save_hf(cfg: ModelConfig, params: dict, out_dir: str, *, max_shard_bytes: int = 5 * 2**30,
            tokenizer=None) -> str:
  """Write a transformers-loadable directory atomically (a half-written export never replaces a good one)."""
  params = unstacked(jax.device_get(params))  # HF's layout: one tensor per layer (the train layout stacks them)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for hf_name, ours, shape, _, to_hf in _entries(cfg):
    t = jnp.asarray(to_hf(np.asarray(_get(params, ours))))
    if tuple(t.shape) != shape:
      raise ValueError(f"param {'/'.join(map(str, ours))} gives {hf_name} of shape {tuple(t.shape)}, "
                       f"expected {shape}")
    if size and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][hf_name] = t
    size += t.nbytes
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir), dir=parent)
  try:
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(model_config.to_hf_dict(cfg), f, indent=2)
    if len(shards) == 1:
      save_file(shards[0], os.path.join(tmp, SINGLE_FILE), metadata={"format": "pt"})
    else:
      weight_map, total = {}, 0
      for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        total += sum(t.nbytes for t in shard.values())
      with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer is not None:
      tokenizer.save_pretrained(tmp)
    _replace_dir(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def _replace_dir(src: str, dst: str):
  """Move src to dst; an existing dst is removed only after src is in place."""
  if not os.path.exists(dst):
    os.replace(src, dst)
    return
  old = dst + ".old"
  shutil.rmtree(old, ignore_errors=True)
  os.replace(dst, old)
  os.replace(src, dst)
  shutil.rmtree(old, ignore_errors=True)
