"""GGUF -> HF conversion on a tiny Llama GGUF written here with llama.cpp's own writer (tests/gguf_util.py)."""

import json
import os
import re

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, pre_tokenizers
from tolerance import assert_close

import hilore_jax
from hilore_jax.model import config as model_config
from hilore_jax.model import gguf as gguf_lib
from hilore_jax.model import hf
from gguf_util import HF_CONFIG, N, Q8_TENSOR, TEMPLATE, V, llama_cpp_permute, original_state, trained_tokenizer, \
    write_gguf

TEXTS = ["the cat sat on the mat", "12 + 35 = 47", "  the  mat\n\n12\n", "cats, hats 3512 =  47",
         "<|im_start|>the cat<|im_end|>\n"]

# the pre-tokenizer of HF's own SmolLM2 tokenizer.json: each digit split off, then GPT-2's byte-level split
SMOLLM_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def _digits_first(tok, text) -> list[int]:
  """ids of text with each digit split off first and every piece encoded alone: SmolLM2's split, by hand."""
  return [i for piece in re.split(r"(\d)", text) if piece for i in tok(piece, add_special_tokens=False)["input_ids"]]


def _q8(t):
  q = gguf.GGMLQuantizationType.Q8_0
  return gguf.quants.dequantize(gguf.quants.quantize(t, q), q)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  d = tmp_path_factory.mktemp("gguf")
  return gguf_lib.gguf_to_hf(write_gguf(d / "tiny.gguf"), str(d / "hf"))


def test_params_round_trip_exactly_and_q8_within_its_step(converted):
  orig = original_state()
  out = load_file(os.path.join(converted, hf.SINGLE_FILE))
  assert set(out) == set(orig)
  for name in orig:
    if name != Q8_TENSOR:
      np.testing.assert_array_equal(out[name], orig[name], err_msg=name)  # q/k too: compared with HF's own order
  err = np.abs(out[Q8_TENSOR] - orig[Q8_TENSOR])
  assert 0 < err.max() <= 0.6 * np.abs(orig[Q8_TENSOR]).max() / 127  # half a step, plus fp16 scales
  np.testing.assert_array_equal(out[Q8_TENSOR], _q8(orig[Q8_TENSOR]))


def test_a_wrong_q_k_order_would_be_caught(tmp_path, monkeypatch):
  orig = original_state()
  q = "model.layers.0.self_attn.q_proj.weight"
  assert not np.array_equal(llama_cpp_permute(orig[q], N), orig[q])  # the permutation moves rows at these sizes
  monkeypatch.setattr(gguf_lib, "unpermute", lambda w, n_head: w)
  _, state = gguf_lib.read_gguf(write_gguf(tmp_path / "t.gguf"))
  assert not np.array_equal(state[q], orig[q])


def test_config_and_files(converted):
  cfg = hf.load_config(converted)
  assert cfg == model_config.from_hf_dict({**HF_CONFIG, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
  with open(os.path.join(converted, "generation_config.json")) as f:
    assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
  assert not [f for f in os.listdir(os.path.dirname(converted)) if f.startswith(".tmp")]


def test_load_hf_forward_equals_the_original_params(converted):
  cfg, params = hilore_jax.load_hf(converted)
  expected_state = {**original_state(), Q8_TENSOR: _q8(original_state()[Q8_TENSOR])}
  expected = hf.from_state_dict(cfg, expected_state)
  ids = np.random.RandomState(1).randint(0, V, (2, 11))
  mask = np.ones_like(ids)
  mask[1, :4] = 0
  out = hilore_jax.forward(cfg, params, jnp.asarray(ids), jnp.asarray(mask))
  ref = hilore_jax.forward(cfg, expected, jnp.asarray(ids), jnp.asarray(mask))
  assert_close(out, ref, ulps=0)
  cfg2, params2 = gguf_lib.load_gguf(os.path.join(os.path.dirname(converted), "tiny.gguf"))
  assert cfg2 == cfg
  assert_close(hilore_jax.forward(cfg2, params2, jnp.asarray(ids), jnp.asarray(mask)), ref, ulps=0)


def test_tokenizer_equals_the_one_it_came_from(converted):
  tok = hilore_jax.load_tokenizer(converted)
  ref = trained_tokenizer()
  for text in TEXTS:
    assert tok(text)["input_ids"] == ref.encode(text).ids, text
    assert tok.decode(tok(text)["input_ids"]) == text
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
  assert tok.chat_template == TEMPLATE
  ids = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True)
  ids = ids["input_ids"] if isinstance(ids, dict) else ids
  assert tok.decode(ids) == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
  assert tok.decode(ids, skip_special_tokens=True) == "user\nthe cat\nassistant\n"


def test_smollm_splits_off_each_digit_even_after_whitespace(converted):
  """As HF's SmolLM2 tokenizer.json and llama.cpp do; GPT-2's plain split keeps " 35" whole and breaks "\n\n"."""
  with open(os.path.join(converted, "tokenizer.json")) as f:
    assert json.load(f)["pre_tokenizer"] == SMOLLM_PRE
  assert json.loads(trained_tokenizer().to_str())["pre_tokenizer"] == SMOLLM_PRE
  tok = hilore_jax.load_tokenizer(converted)
  plain = Tokenizer.from_str(tok.backend_tokenizer.to_str())
  plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  text = "the mat\n\n12 =  35"
  pieces = lambda t: [p for p, _ in t.pre_tokenizer.pre_tokenize_str(text)]
  assert pieces(tok.backend_tokenizer) == ["the", "Ġmat", "ĊĊ", "1", "2", "Ġ=", "ĠĠ", "3", "5"]
  assert pieces(plain) == ["the", "Ġmat", "Ċ", "Ċ", "12", "Ġ=", "Ġ", "Ġ35"]
  ids = tok(text)["input_ids"]
  assert tok.convert_ids_to_tokens(ids) == ["the", "Ġmat", "ĊĊ", "1", "2", "Ġ", "=", "Ġ", "Ġ", "3", "5"]
  assert plain.encode(text).tokens == ["the", "Ġmat", "Ċ", "Ċ", "1", "2", "Ġ", "=", "Ġ", "Ġ", "3", "5"]
  assert tok.decode(ids) == text


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe"])
def test_tokenizer_equals_transformers_gguf_reader(tmp_path, pre):
  pytest.importorskip("torch", reason="transformers' GGUF reader needs PyTorch")
  from transformers import AutoTokenizer

  path = write_gguf(tmp_path / "t.gguf", pre=pre)
  ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
  tok = gguf_lib.load_gguf_tokenizer(path)
  for text in TEXTS:
    # transformers reads smollm as plain byte-level: ours equals it once each digit is split off
    want = _digits_first(ref, text) if pre == "smollm" else ref(text)["input_ids"]
    assert tok(text)["input_ids"] == want, (pre, text)
  if pre == "smollm":
    assert tok(TEXTS[2])["input_ids"] != ref(TEXTS[2])["input_ids"]  # "\n\n12": ĊĊ 1 2 here, Ċ Ċ 1 2 there
  msgs = [{"role": "user", "content": "12 + 35"}]
  assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)


@pytest.mark.parametrize("kwargs,message", [
    (dict(drop=("blk.1.ffn_up.weight",)), r"missing tensor 'blk\.1\.ffn_up\.weight'"),
    (dict(arch="gpt2"), r"architecture 'gpt2' is not supported"),
    (dict(extra={"rope_freqs.weight": np.ones(2, np.float32)}), r"tensor 'rope_freqs\.weight' has no place"),
    (dict(int_tensor="blk.0.attn_norm.weight"), r"'blk\.0\.attn_norm\.weight' has type I32"),
    (dict(pre="bloom"), r"tokenizer\.ggml\.pre='bloom' is not supported"),
])
def test_unsupported_files_name_the_problem(tmp_path, kwargs, message):
  path = write_gguf(tmp_path / "bad.gguf", **kwargs)
  with pytest.raises(ValueError, match=message):
    gguf_lib.gguf_to_hf(path, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")
