"""A LoRA run's side of the loop (lora.*): its frozen base (an HF directory and the sha256 of its files), the params
with adapters (fresh or from a PEFT directory), the checkpoint's record of its learner (the base by identity; the
adapters and optimizer state are the train state's own checkpoint, rl/train_state.py), the KL reference (the base
itself) and the exports (PEFT and merged HF).

Where the base is not a directory on disk (a random model, or any model the run warm-starts first) it is written
once to `out_dir/base` before the first checkpoint: from then on every LoRA run's base is a directory, which a
resume loads and a PEFT export's `base_model_name_or_path` names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import jax

from hilore_jax import sharding
from hilore_jax.config import Config
from hilore_jax.errors import CheckpointError, ConfigError
from hilore_jax.model import ModelConfig, hf, lora, peft
from hilore_jax.rl.train_step import StepSpec

log = logging.getLogger(__name__)
BASE_DIR = "base"  # out_dir/base: the base of a run whose model.path is unset
PEFT_DIR = "peft"  # out_dir/peft: the adapters as a PEFT directory


@dataclasses.dataclass(frozen=True)
class Base:
  """A LoRA run's frozen base: its HF directory and the sha256 of the files that define it."""

  path: str
  sha256: str

  def meta(self) -> dict:
    return {"base_path": self.path, "base_sha256": self.sha256}


def files_sha256(path: str) -> str:
  """sha256 over an HF directory's config.json and weight files (names and bytes, in name order)."""
  h = hashlib.sha256()
  names = sorted(f for f in os.listdir(path) if f == "config.json" or f.endswith((".safetensors", ".index.json")))
  for name in names:
    h.update(name.encode() + b"\0")
    with open(os.path.join(path, name), "rb") as f:
      for block in iter(lambda: f.read(1 << 22), b""):
        h.update(block)
  return h.hexdigest()


def base_dir(c: Config) -> str:
  """Where the run's base lives on disk: model.path, or out_dir/base where the run makes its own (no model.path,
  or a warm-start that trains the model before the adapters)."""
  if c.model.path and not c.train.warmstart_steps:
    return os.path.abspath(c.model.path)
  return os.path.abspath(os.path.join(c.out_dir, BASE_DIR))


def identify(c: Config) -> Base | None:
  """The run's base if it is on disk already (model.path, or out_dir/base written by an earlier start)."""
  path = base_dir(c)
  return Base(path, files_sha256(path)) if os.path.isfile(os.path.join(path, "config.json")) else None


def setup(c: Config, model_cfg: ModelConfig, host_params: dict | None, rng: jax.Array
          ) -> tuple[ModelConfig, dict | None, Base | None]:
  """(the model config with the adapters, host params with them or None to initialise on the devices, the base
  where it is on disk). A resume of a run without model.path loads its base from out_dir/base."""
  base = identify(c)
  own = base_dir(c) != os.path.abspath(c.model.path or "")  # the run makes its base (written before step 0)
  if own and c.lora.init_from:
    raise ConfigError(f"lora.init_from {c.lora.init_from}: its base must be a directory on disk, and this run makes "
                      f"its own (no model.path, or train.warmstart_steps > 0); set model.path to the adapter's base")
  if own and base is not None and c.train.resume:  # a resume: the base an earlier start wrote
    model_cfg, host_params = hf.load_hf(base.path, model_cfg.param_dtype, model_cfg.dtype)
    model_cfg = model_cfg.replace(**c.model.kernel())
  elif own:
    base = None  # written once the run has made it
  dtype = c.lora.base_dtype or model_cfg.param_dtype
  model_cfg = model_cfg.replace(lora=c.lora.spec(), param_dtype=dtype)
  if host_params is None:
    return model_cfg, None, base  # model.init_params makes the base and the adapters (model/lora.py)
  host_params = lora.cast_base(host_params, model_cfg.params_dtype)
  init = init_from(c, model_cfg, base) if c.lora.init_from else None
  return model_cfg, lora.add_adapters(model_cfg, host_params, rng, init), base


def init_from(c: Config, model_cfg: ModelConfig, base: Base) -> list[dict]:
  """Each layer's adapters from the PEFT directory lora.init_from; ConfigError naming it where its rank, alpha,
  targets or base differ from this run's."""
  path = c.lora.init_from
  where = f"lora.init_from {path}"
  try:
    conf = peft.read_config(path)
    theirs = peft.spec_of(conf)
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"lora.init_from: {e}") from None
  ours = model_cfg.lora
  for name, a, b in (("rank", theirs.rank, ours.rank), ("alpha", theirs.alpha, ours.alpha),
                     ("targets", list(theirs.targets), list(ours.targets))):
    if a != b:
      raise ConfigError(f"{where}: its {name} is {a}, lora.{name} is {b}")
  named = conf.get("base_model_name_or_path") or ""
  if os.path.isdir(named) and os.path.abspath(named) != base.path and files_sha256(named) != base.sha256:
    raise ConfigError(f"{where}: its base {named} is another model than this run's {base.path} (sha256 of their "
                      f"files differ)")
  if not os.path.isdir(named):
    log.warning("%s: its base %r is not a local directory; only the tensors' shapes are checked", where, named)
  try:
    return peft.adapters_from(model_cfg, peft.load_tensors(path), where)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def write_base(c: Config, model_cfg: ModelConfig, params: dict, tokenizer=None) -> Base:
  """The run's base written to out_dir/base (a model with no directory of its own) and identified: gathered by every
  process (a collective), written by the first, read by all once it is there."""
  path = base_dir(c)
  host = sharding.gather_to_host(lora.base_of(params))
  if jax.process_index() == 0:
    hf.save_hf(model_cfg.replace(lora=None), host, path, tokenizer=tokenizer)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("lora base written")
  return Base(path, files_sha256(path))


# ----------------------------------------------------------------------------- checkpoints and the reference


def check_checkpoint(meta: dict, model_cfg: ModelConfig, base: Base | None, step: int):
  """CheckpointError (one line) where a checkpoint's learner or base is not this run's."""
  saved = meta.get("lora")
  if (saved is None) != (model_cfg.lora is None):
    what = "full fine-tuning" if saved is None else f"LoRA rank {saved['rank']}"
    raise CheckpointError(f"checkpoint step {step} was trained with {what}, this run's lora.rank is "
                          f"{model_cfg.lora.rank if model_cfg.lora else 0}")
  if saved is None:
    return
  for name in ("rank", "alpha", "targets"):
    ours = getattr(model_cfg.lora, name)
    if saved[name] != (list(ours) if name == "targets" else ours):
      raise CheckpointError(f"checkpoint step {step} has lora.{name} {saved[name]}, this run's is {ours}")
  if base is None or saved["base_sha256"] != base.sha256:
    raise CheckpointError(f"checkpoint step {step} was trained on the base {saved['base_path']} (sha256 "
                          f"{saved['base_sha256'][:12]}), this run's base {base.path if base else '(missing)'} is "
                          f"{'another model' if base else 'not on disk'}: resume on the base it was trained on")


def saved_base(meta: dict, c: Config, step: int) -> tuple[ModelConfig, dict]:
  """(model config with the adapters, host base params) of a LoRA checkpoint's base, read from the directory its
  metadata names and checked against its sha256 (train.eval restores a run without a Trainer)."""
  saved = meta["lora"]
  path = saved["base_path"]
  if not os.path.isfile(os.path.join(path, "config.json")) or files_sha256(path) != saved["base_sha256"]:
    now = "another model now" if os.path.isdir(path) else "gone"
    raise CheckpointError(f"checkpoint step {step} was trained on the base {path} (sha256 "
                          f"{saved['base_sha256'][:12]}), which is {now}")
  cfg, params = hf.load_hf(path, c.lora.base_dtype or c.model.param_dtype, c.model.dtype)
  return cfg.replace(lora=c.lora.spec(), **c.model.kernel()), params


def checkpoint_meta(model_cfg: ModelConfig, base: Base | None) -> dict | None:
  """The checkpoint's record of its learner: LoRA's rank, alpha, targets and base identity; None: full."""
  if model_cfg.lora is None:
    return None
  s = model_cfg.lora
  return {"rank": s.rank, "alpha": s.alpha, "targets": list(s.targets), **base.meta()}


def reference_spec(spec: StepSpec) -> StepSpec:
  """The KL reference's step spec: a LoRA model's own params with the adapters off (the frozen base)."""
  return dataclasses.replace(spec, model_cfg=spec.model_cfg.replace(lora=None))


# ----------------------------------------------------------------------------- exports


def export_peft(out_dir: str, model_cfg: ModelConfig, params: dict, base: Base) -> str:
  """out_dir/peft: the adapters as a PEFT directory whose base_model_name_or_path is the base's directory."""
  return peft.save(model_cfg, params, os.path.join(out_dir, PEFT_DIR), base.path)


def export_params(model_cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
  """The model config and params of the merged HF export (W + scale * A B; the params themselves without LoRA)."""
  return lora.merged(model_cfg, params)
