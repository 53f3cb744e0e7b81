"""Checks before any work: every path a config names, and loaders (HF checkpoint, tokenizer) whose failures
become one-line errors naming the key and the file, so no bad path ends in a library's traceback."""

from __future__ import annotations

import dataclasses
import json
import os

from safetensors import SafetensorError

from hilore_jax.config import Config, ModelSection
from hilore_jax.errors import CheckpointError, ConfigError, DataError
from hilore_jax.model import ModelConfig, hf
from hilore_jax.tasks import tokenizer as tokenizers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# what a broken checkpoint makes the loaders raise (SafetensorError: a torn or foreign .safetensors file)
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, SafetensorError)


def _directory(key: str, path: str):
  if not os.path.exists(path):
    raise ConfigError(f"{key} {path}: no such directory")
  if not os.path.isdir(path):
    raise ConfigError(f"{key} {path}: not a directory")


def check_hf_dir(key: str, path: str):
  """ConfigError unless path is a Hugging Face checkpoint directory (config.json plus safetensors weights)."""
  _directory(key, path)
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ConfigError(f"{key} {path}: no config.json (not a Hugging Face checkpoint directory)")
  if not any(os.path.isfile(os.path.join(path, f)) for f in (hf.SINGLE_FILE, hf.INDEX_FILE)):
    raise ConfigError(f"{key} {path}: no {hf.SINGLE_FILE} or {hf.INDEX_FILE} (only safetensors weights load)")


def check_tokenizer_dir(key: str, path: str):
  """ConfigError unless path is 'char' or a directory holding a Hugging Face tokenizer."""
  if path == tokenizers.CHAR_TOKENIZER:
    return
  if not os.path.exists(path):
    raise ConfigError(f"{key} {path}: no such directory (and not {tokenizers.CHAR_TOKENIZER!r})")
  _directory(key, path)
  if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
    raise ConfigError(f"{key} {path}: none of {list(TOKENIZER_FILES)} (not a Hugging Face tokenizer directory)")


def check_text_file(key: str, path: str):
  """ConfigError for a missing file, DataError naming file:line for bytes that are not UTF-8 text."""
  if not os.path.exists(path):
    raise ConfigError(f"{key} {path}: no such file")
  if not os.path.isfile(path):
    raise ConfigError(f"{key} {path}: not a file")
  # the JSONL loaders read text; a binary file would otherwise fail mid-iteration with no line number
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      try:
        raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: not UTF-8 text ({key}): {e.reason} at byte {e.start}") from None


def check_out_dir(path: str):
  """ConfigError unless out_dir exists (or can be created) as a writable directory."""
  if not path:
    raise ConfigError("out_dir must not be empty")
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f"out_dir {path}: exists and is not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"out_dir {path}: cannot create it ({e.strerror})") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ConfigError(f"out_dir {path}: not writable")


def model_dir(path: str) -> str:
  """A model.path as a directory: ~ expanded, and the name of a known model (hilore_jax.fetch.MODELS, e.g.
  smollm2-135m-instruct) that is not a path becomes its local copy, fetched on first use."""
  from hilore_jax import fetch

  expanded = os.path.expanduser(path)
  if not os.path.exists(expanded) and path in fetch.MODELS:
    return fetch.fetch(path)
  return expanded


def resolve_model(c: Config) -> Config:
  """c with model.path (and a tokenizer that defaults to it) resolved by model_dir."""
  if not c.model.path:
    return c
  path = model_dir(c.model.path)
  return dataclasses.replace(c, model=dataclasses.replace(c.model, path=path))


def tokenizer_key(c: Config) -> str:
  return "tokenizer" if c.tokenizer else "tokenizer (from model.path)"


def check_paths(c: Config):
  """Every path the config names, before any work: ConfigError naming the key and what is wrong."""
  if c.model.path:
    check_hf_dir("model.path", c.model.path)
  check_tokenizer_dir(tokenizer_key(c), c.tokenizer_path)
  if c.lora.init_from:
    _directory("lora.init_from", c.lora.init_from)
    if not os.path.isfile(os.path.join(c.lora.init_from, "adapter_config.json")):
      raise ConfigError(f"lora.init_from {c.lora.init_from}: no adapter_config.json (not a PEFT adapter directory)")
  check_task_files(c)
  check_out_dir(c.out_dir)


def check_task_files(c: Config):
  if c.task.kind != "arithmetic":
    check_text_file("task.train_path", c.task.train_path)
    check_text_file("task.test_path", c.task.test_path)


def _message(path: str, e: Exception) -> str:
  msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  if isinstance(e, KeyError):
    return f"{path}/config.json: missing field {msg}"
  if isinstance(e, json.JSONDecodeError):
    return f"{path}/config.json: not valid JSON ({msg})"
  if isinstance(e, SafetensorError):
    return f"{path}: unreadable safetensors file ({msg})"
  return msg if path in msg else f"{path}: {msg}"


def load_model_config(key: str, path: str, section: ModelSection) -> ModelConfig:
  """The model config of an HF directory; CheckpointError naming the key and file if config.json is unusable."""
  path = model_dir(path)
  check_hf_dir(key, path)
  try:
    return hf.load_config(path, section.param_dtype, section.dtype).replace(**section.kernel())
  except _LOAD_ERRORS as e:
    raise CheckpointError(f"{key} {_message(path, e)}") from None


def load_hf(key: str, path: str, section: ModelSection) -> tuple[ModelConfig, dict]:
  """(cfg, params) of an HF directory; CheckpointError naming the key, file and tensor on a broken checkpoint."""
  path = model_dir(path)
  check_hf_dir(key, path)
  try:
    cfg, params = hf.load_hf(path, section.param_dtype, section.dtype)
    return cfg.replace(**section.kernel()), params
  except _LOAD_ERRORS as e:
    raise CheckpointError(f"{key} {_message(path, e)}") from None


def load_tokenizer(key: str, path: str):
  """The tokenizer at path ('char': the built-in one); ConfigError naming the key if it does not load."""
  check_tokenizer_dir(key, path)
  try:
    return tokenizers.load_tokenizer(path)
  except (OSError, ValueError, KeyError, TypeError) as e:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(f"{key} {path}: cannot load it ({type(e).__name__}: {msg})") from None
