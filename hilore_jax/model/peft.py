"""PEFT (Hugging Face peft) LoRA adapter directories in and out: `adapter_config.json` and
`adapter_model.safetensors` with peft's key names, which `peft.PeftModel.from_pretrained(base, dir)` loads.

peft stores a Linear's adapter as lora_A.weight [r, in_features] and lora_B.weight [out_features, r] under
`base_model.model.model.layers.{i}.{module}`; ours are A [in..., r] and B [r, out...] (model/lora.py), the feature
axes flattened in the order of the HF weights' own (model/hf.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hilore_jax.model import lora
from hilore_jax.model.config import LORA_TARGETS, LoraSpec, ModelConfig
from hilore_jax.model.layers import unstack_layers

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULE_OF = {t: lora.TARGETS[t].module.split(".")[-1] for t in LORA_TARGETS}  # q -> q_proj
TARGET_OF = {m: t for t, m in MODULE_OF.items()}
# peft options with no counterpart here: a directory using one of them is refused, not loaded as something else
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False,
                "layers_to_transform": None, "modules_to_save": None}


def key(layer: int, target: str, which: str) -> str:
  """peft's name of one adapter matrix ('A' or 'B') in the saved state dict."""
  return f"base_model.model.model.layers.{layer}.{lora.TARGETS[target].module}.lora_{which}.weight"


def state_dict(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """peft-named float32 arrays of every adapter of params."""
  out = {}
  for i, layer in enumerate(unstack_layers(jax.device_get(params["layers"]))):
    for t in cfg.lora.targets:
      a, b = (np.asarray(layer[lora.KEY][t][w], np.float32) for w in ("A", "B"))
      r = a.shape[-1]
      out[key(i, t, "A")] = np.ascontiguousarray(a.reshape(-1, r).T)
      out[key(i, t, "B")] = np.ascontiguousarray(b.reshape(r, -1).T)
  return out


def adapters_from(cfg: ModelConfig, tensors: dict, where: str) -> list[dict]:
  """Each layer's adapters (lora.add_adapters' form) from peft-named arrays; ValueError naming the tensor and the
  base's shape where they do not fit (another base) or where any is missing or left over."""
  spec, out, used = cfg.lora, [], set()
  for i in range(cfg.num_hidden_layers):
    layer = {}
    for t in spec.targets:
      a_shape, b_shape = lora.adapter_shapes(cfg, t, spec.rank)
      got = {}
      for which, shape, hf_shape in (("A", a_shape, (spec.rank, int(np.prod(a_shape[:-1])))),
                                     ("B", b_shape, (int(np.prod(b_shape[1:])), spec.rank))):
        name = key(i, t, which)
        if name not in tensors:
          raise ValueError(f"{where}: no tensor {name} (this base has {cfg.num_hidden_layers} layers)")
        x = np.asarray(tensors[name], np.float32)
        if x.shape != hf_shape:
          raise ValueError(f"{where}: {name} is {list(x.shape)}, this base's {MODULE_OF[t]} needs {list(hf_shape)}: "
                           f"an adapter of another base")
        got[which] = x.T.reshape(shape)
        used.add(name)
      layer[t] = {"A": jax.numpy.asarray(got["A"]), "B": jax.numpy.asarray(got["B"])}
    out.append(layer)
  extra = sorted(set(tensors) - used)
  if extra:
    raise ValueError(f"{where}: tensors for projections or layers this base's lora does not have: {extra[:4]}")
  return out


def adapter_config(spec: LoraSpec, base_model: str) -> dict:
  """adapter_config.json of spec's adapters on the base at base_model (a path or a hub id)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": spec.rank,
          "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
          "target_modules": [MODULE_OF[t] for t in spec.targets], "inference_mode": True,
          "init_lora_weights": True, **_UNSUPPORTED}


def save(cfg: ModelConfig, params: dict, out_dir: str, base_model: str) -> str:
  """Write a peft adapter directory atomically (a half-written export never replaces a good one)."""
  tensors = state_dict(cfg, params)
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir), dir=parent)
  try:
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
      json.dump(adapter_config(cfg.lora, base_model), f, indent=2)
    save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
    if os.path.exists(out_dir):
      shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def read_config(path: str) -> dict:
  """A peft adapter directory's adapter_config.json; ValueError naming what makes it no LoRA adapter we can run."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise ValueError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
  try:
    with open(file) as f:
      conf = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file}: not valid JSON ({e.msg})") from None
  if conf.get("peft_type") != "LORA":
    raise ValueError(f"{file}: peft_type {conf.get('peft_type')!r} is not LORA")
  for k, ok in _UNSUPPORTED.items():
    v = conf.get(k, ok)
    if v != ok and not (ok is None and not v):  # None and an empty list both mean "none"
      raise ValueError(f"{file}: {k}={v!r} is not supported (only {ok!r})")
  for k in ("rank_pattern", "alpha_pattern"):
    if conf.get(k):
      raise ValueError(f"{file}: per-module {k} is not supported")
  modules = conf.get("target_modules")
  if isinstance(modules, str) or not modules or any(m not in TARGET_OF for m in modules):
    raise ValueError(f"{file}: target_modules {modules!r} must list projections of {sorted(TARGET_OF)}")
  return conf


def spec_of(conf: dict) -> LoraSpec:
  """The LoraSpec an adapter_config.json describes."""
  return LoraSpec(int(conf["r"]), float(conf["lora_alpha"]), tuple(TARGET_OF[m] for m in conf["target_modules"]),
                  float(conf.get("lora_dropout") or 0.0))


def load_tensors(path: str) -> dict[str, np.ndarray]:
  file = os.path.join(path, WEIGHTS_FILE)
  if not os.path.isfile(file):
    raise ValueError(f"{path}: no {WEIGHTS_FILE}")
  with safe_open(file, framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}
