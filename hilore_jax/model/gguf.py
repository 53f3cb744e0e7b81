"""GGUF files (llama.cpp's format) of Llama and Qwen2 models -> the config, params and tokenizer they describe, and
a complete Hugging Face directory (`gguf_to_hf`).

Weights are dequantised to float32 by the `gguf` package's reader (llama.cpp's own, numpy only) and written by
`save_hf`; the tokenizer is rebuilt from the file's metadata with `tokenizers`. transformers reads GGUF too, but its
path needs torch and accelerate (gigabytes for a user who only wants JAX), so it serves only as the tests' reference.
llama.cpp's conversion reorders the rows of every Llama q/k head for its RoPE layout; `unpermute` undoes that.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from hilore_jax.model import config as model_config
from hilore_jax.model import hf
from hilore_jax.model.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_T = gguf.GGMLQuantizationType
# float and the block-quantised types Llama/Qwen2 releases use; gguf dequantises them all in numpy
TENSOR_TYPES = frozenset({_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q2_K, _T.Q3_K,
                          _T.Q4_K, _T.Q5_K, _T.Q6_K})
# GGUF tensor stem -> HF module name; one table read both ways
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLOBAL_STEM = {v: k for k, v in _GLOBAL.items()}
_LAYER_STEM = {v: k for k, v in _LAYER.items()}
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _byte_level(use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
  """GPT-2's byte-level pre-tokenizer; use_regex: split with GPT-2's own regex first."""
  return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split(regex: str):
  return lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                          _byte_level(use_regex=False)])


# tokenizer.ggml.pre -> a new pre-tokenizer (run before byte-level BPE). smollm is the one in HF's own SmolLM2
# tokenizer.json (StarCoder's), as llama.cpp also reads it: each digit split off, then GPT-2's split. transformers' GGUF
# reader gives smollm the plain GPT-2 split, which differs where a run of whitespace precedes a digit ("\n\n47" is
# Ċ Ċ 4 7 there, ĊĊ 4 7 here); SmolLM2 gives the digit split a far higher probability (tests/model/test_real_model.py).
PRE_TOKENIZERS = {
    "default": _byte_level, "gpt2": _byte_level, "qwen2": _split(_QWEN2_SPLIT), "llama-bpe": _split(_LLAMA3_SPLIT),
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_REQUIRED = object()


def hf_name(name: str) -> str | None:
  """HF name of a GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight); None if unknown."""
  stem, _, kind = name.rpartition(".")
  layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
  if kind not in ("weight", "bias"):
    return None
  if stem in _GLOBAL:
    return f"{_GLOBAL[stem]}.{kind}"
  if layer and layer[2] in _LAYER:
    return f"model.layers.{layer[1]}.{_LAYER[layer[2]]}.{kind}"
  return None


def gguf_name(name: str) -> str:
  """GGUF name of an HF tensor (the inverse of hf_name)."""
  stem, _, kind = name.rpartition(".")
  layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
  return f"blk.{layer[1]}.{_LAYER_STEM[layer[2]]}.{kind}" if layer else f"{_GLOBAL_STEM[stem]}.{kind}"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's q/k row order: per head it stores the rotary pairs interleaved, HF stores the halves apart."""
  rows = w.shape[0]
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(x) -> float:
  # metadata floats are float32: 1e-5 comes back as 9.999999747378752e-06 unless its shortest spelling is kept
  return float(str(np.float32(x)))


def _value(reader: gguf.GGUFReader, path: str, key: str, default=_REQUIRED):
  field = reader.fields.get(key)
  if field is None:
    if default is _REQUIRED:
      raise ValueError(f"{path}: no {key!r} in the GGUF metadata")
    return default
  return field.contents()


def _shape(t) -> tuple[int, ...]:
  return tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions fastest-first


def _open(path: str) -> gguf.GGUFReader:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such GGUF file")
  return gguf.GGUFReader(path)


def _hf_config(reader: gguf.GGUFReader, path: str) -> dict:
  """transformers config.json dict from the file's metadata and which tensors it holds."""
  get = functools.partial(_value, reader, path)
  arch = get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
  shapes = {t.name: _shape(t) for t in reader.tensors}
  if "token_embd.weight" not in shapes:
    raise ValueError(f"{path}: missing tensor 'token_embd.weight' (model.embed_tokens.weight)")
  key = lambda k: f"{arch}.{k}"
  heads, hidden = int(get(key("attention.head_count"))), int(get(key("embedding_length")))
  kv_heads = get(key("attention.head_count_kv"), heads)
  if isinstance(kv_heads, list):
    raise ValueError(f"{path}: {key('attention.head_count_kv')} varies per layer, which is not supported")
  head_dim = int(get(key("attention.key_length"), hidden // heads))
  rope_dims = int(get(key("rope.dimension_count"), head_dim))
  if rope_dims != head_dim:
    raise ValueError(f"{path}: {key('rope.dimension_count')}={rope_dims} rotates part of each head (head dim "
                     f"{head_dim}); only full rotary embeddings are supported")
  scaling = get(key("rope.scaling.type"), "none")
  if scaling not in ("none", "linear"):
    raise ValueError(f"{path}: {key('rope.scaling.type')}={scaling!r} is not supported (none, linear)")
  rope = {"rope_type": "linear", "factor": _f32(get(key("rope.scaling.factor")))} if scaling == "linear" else None
  return {
      "architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": shapes["token_embd.weight"][0],
      "hidden_size": hidden, "intermediate_size": int(get(key("feed_forward_length"))),
      "num_hidden_layers": int(get(key("block_count"))), "num_attention_heads": heads,
      "num_key_value_heads": int(kv_heads), "head_dim": head_dim,
      "rms_norm_eps": _f32(get(key("attention.layer_norm_rms_epsilon"))),
      "rope_theta": _f32(get(key("rope.freq_base"), 10000.0)), "rope_scaling": rope,
      "max_position_embeddings": int(get(key("context_length"), 2048)),
      "tie_word_embeddings": "output.weight" not in shapes, "attention_bias": "blk.0.attn_q.bias" in shapes,
      "mlp_bias": "blk.0.ffn_gate.bias" in shapes, "bos_token_id": get("tokenizer.ggml.bos_token_id", None),
      "eos_token_id": get("tokenizer.ggml.eos_token_id", None),
      "pad_token_id": get("tokenizer.ggml.padding_token_id", None),
  }


def _state_dict(reader: gguf.GGUFReader, path: str, hf_cfg: dict) -> dict[str, np.ndarray]:
  """HF-named float32 tensors, dequantised, with Llama's q/k rows back in HF order."""
  cfg = model_config.from_hf_dict(hf_cfg)
  state = {}
  for t in reader.tensors:
    name = hf_name(t.name)
    if name is None:
      raise ValueError(f"{path}: tensor {t.name!r} has no place in a {cfg.architecture} (not supported)")
    if t.tensor_type not in TENSOR_TYPES:
      raise ValueError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported; supported: "
                       f"{sorted(q.name for q in TENSOR_TYPES)}")
    w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(_shape(t))
    if cfg.model_type == "llama" and ".self_attn.q_proj." in name:
      w = unpermute(w, cfg.num_attention_heads)
    elif cfg.model_type == "llama" and ".self_attn.k_proj." in name:
      w = unpermute(w, cfg.num_key_value_heads)
    state[name] = w
  missing = [n for n in hf.tensor_shapes(cfg) if n not in state]
  if missing:
    raise ValueError(f"{path}: missing tensor {gguf_name(missing[0])!r} ({missing[0]})"
                     + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
  return state


def read_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(transformers config dict, HF-named float32 state dict) of a Llama/Qwen2 GGUF file."""
  reader = _open(path)
  hf_cfg = _hf_config(reader, path)
  return hf_cfg, _state_dict(reader, path, hf_cfg)


def load_gguf(path: str, dtype="float32", compute_dtype=None) -> tuple[ModelConfig, dict]:
  """(cfg, params) from a GGUF file, as load_hf gives them from an HF directory."""
  hf_cfg, state = read_gguf(path)
  cfg = model_config.from_hf_dict(hf_cfg, dtype=compute_dtype or dtype, param_dtype=dtype)
  return cfg, hf.from_state_dict(cfg, state, path)


def _build_tokenizer(reader: gguf.GGUFReader, path: str) -> PreTrainedTokenizerFast:
  get = functools.partial(_value, reader, path)
  kind, pre = get("tokenizer.ggml.model"), get("tokenizer.ggml.pre", "default")
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only 'gpt2', byte-level BPE)")
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}")
  tokens = get("tokenizer.ggml.tokens")
  types = get("tokenizer.ggml.token_type", [1] * len(tokens))
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError(f"{path}: tokenizer.ggml.tokens repeats {len(tokens) - len(vocab)} token(s)")
  merges = [tuple(m.split(" ")) for m in get("tokenizer.ggml.merges")]
  bad = next((m for m in merges if len(m) != 2), None)
  if bad is not None:
    raise ValueError(f"{path}: tokenizer.ggml.merges has {' '.join(bad)!r}, not two tokens")
  tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
  tok.decoder = decoders.ByteLevel()
  # llama.cpp matches user-defined tokens whole but never counts them special
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
  special = {}
  for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                    ("unk", "unknown_token_id")):
    i = get(f"tokenizer.ggml.{key}", None)
    if i is not None:
      special[name] = tokens[i]
  if get("tokenizer.ggml.add_eos_token", False):
    raise ValueError(f"{path}: tokenizer.ggml.add_eos_token=true is not supported")
  if get("tokenizer.ggml.add_bos_token", False) and "bos" in special:
    bos = special["bos"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, vocab[bos])])
  control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
             if k == CONTROL and t not in special.values()]
  return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special.get("bos"), eos_token=special.get("eos"),
                                 pad_token=special.get("pad"), unk_token=special.get("unk"),
                                 additional_special_tokens=control, chat_template=get("tokenizer.chat_template", None))


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
  """The tokenizer a GGUF file's metadata describes (vocab, merges, special tokens, chat template)."""
  return _build_tokenizer(_open(path), path)


def gguf_to_hf(gguf_path: str, out_dir: str) -> str:
  """Write a complete HF directory (config, float32 safetensors, tokenizer with its chat template, generation
  config) from a GGUF file; atomically, so a failed conversion never leaves a directory that looks complete."""
  reader = _open(gguf_path)
  hf_cfg = _hf_config(reader, gguf_path)
  tokenizer = _build_tokenizer(reader, gguf_path)  # before the slow part: an unsupported tokenizer fails fast
  cfg = model_config.from_hf_dict(hf_cfg)
  params = hf.from_state_dict(cfg, _state_dict(reader, gguf_path, hf_cfg), gguf_path)
  eos = [i for i in (cfg.eos_token_id, _value(reader, gguf_path, "tokenizer.ggml.eot_token_id", None))
         if i is not None]
  eos = list(dict.fromkeys(eos))
  generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
                "pad_token_id": cfg.pad_token_id}
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-gguf-" + os.path.basename(out_dir), dir=parent)
  try:
    staged = os.path.join(tmp, "hf")
    hf.save_hf(cfg, params, staged, tokenizer=tokenizer)
    with open(os.path.join(staged, "generation_config.json"), "w") as f:
      json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
    hf._replace_dir(staged, out_dir)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out_dir
