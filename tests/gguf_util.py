"""A tiny Llama GGUF written with llama.cpp's own writer (gguf-py): F32 tensors, one Q8_0, llama.cpp's q/k order,
a byte-level BPE tokenizer learned here and a chat template; what tests/model/test_gguf.py converts and
tests/test_fetch.py serves as a known model."""

import json

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hilore_jax.model import config as model_config
from hilore_jax.model import gguf as gguf_lib
from hilore_jax.model import hf

V, D, F, N, KV, LAYERS = 37, 24, 96, 6, 2, 2  # head dim 4; F a multiple of Q8_0's 32-wide blocks
Q8_TENSOR = "model.layers.1.mlp.down_proj.weight"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the cat sat on the mat", "12 + 35 =\n\n47", "a hat, the cat\n\nthe mat", "35 cats sat on 12 mats",
          "user assistant\n\n1"] * 3  # ĊĊ gets a merge, so GPT-2's split of "\n\n1" (Ċ, Ċ1) gives other ids
TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": D, "intermediate_size": F,
             "num_hidden_layers": LAYERS, "num_attention_heads": N, "num_key_value_heads": KV, "rms_norm_eps": 1e-5,
             "rope_theta": 500.0, "max_position_embeddings": 64, "tie_word_embeddings": False}


def trained_tokenizer() -> Tokenizer:
  """A byte-level BPE with 37 tokens, learned here as SmolLM2's was: the reference our rebuilt tokenizer must equal."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=V, special_tokens=SPECIALS, show_progress=False))
  return tok


def original_state(seed=0) -> dict:
  """Random HF-named float32 weights (norms near 1) of the tiny Llama."""
  rng = np.random.RandomState(seed)
  cfg = model_config.from_hf_dict(HF_CONFIG)
  return {n: (rng.randn(*s) * 0.3 + (n.endswith("norm.weight"))).astype(np.float32)
          for n, s in hf.tensor_shapes(cfg).items()}


def llama_cpp_permute(w, n_head):
  # what llama.cpp's convert_hf_to_gguf does to q/k rows (its RoPE pairs adjacent rows)
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, state=None, arch="llama", pre="smollm", drop=(), extra=None, int_tensor=None):
  """A GGUF file of the tiny model: F32 tensors, one Q8_0, llama.cpp's q/k order, tokenizer and chat template."""
  state = original_state() if state is None else state
  vocab_json = json.loads(trained_tokenizer().to_str())["model"]
  tokens = sorted(vocab_json["vocab"], key=vocab_json["vocab"].get)
  w = gguf.GGUFWriter(str(path), arch=arch)
  w.add_block_count(LAYERS)
  w.add_context_length(64)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(N)
  w.add_head_count_kv(KV)
  w.add_rope_dimension_count(D // N)
  w.add_rope_freq_base(500.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
  w.add_token_merges([" ".join(m) for m in vocab_json["merges"]])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_unk_token_id(0)
  w.add_add_bos_token(False)
  w.add_chat_template(TEMPLATE)
  for name, t in state.items():
    gname = gguf_lib.gguf_name(name)
    if gname in drop:
      continue
    if ".q_proj." in name:
      t = llama_cpp_permute(t, N)
    elif ".k_proj." in name:
      t = llama_cpp_permute(t, KV)
    if name == Q8_TENSOR:
      w.add_tensor(gname, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                   raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    elif gname == int_tensor:
      w.add_tensor(gname, t.astype(np.int32))
    else:
      w.add_tensor(gname, t)
  for name, t in (extra or {}).items():
    w.add_tensor(name, t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)
