"""The first real-model path: an HF Qwen2 checkpoint with a chat tokenizer, GSM8K JSONL, GRPO, HF export."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chat_util import GSM8K_ROWS, IM_END, IM_START, build_chat_tokenizer, build_tiny_qwen, write_gsm8k

import hilore_jax
from hilore_jax import cli, tasks
from hilore_jax.tasks import prompts, tokenizer
from hilore_jax.loop.trainer import Trainer

torch = pytest.importorskip("torch", reason="the HF export check needs PyTorch")
transformers = pytest.importorskip("transformers")

SYSTEM = "Be brief."
TEMPLATE = "{question}\nAnswer:"


def _chat_prompt(question):
  return (f"{IM_START}system\n{SYSTEM}{IM_END}\n{IM_START}user\n{question}\nAnswer:{IM_END}\n"
          f"{IM_START}assistant\n")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  d = tmp_path_factory.mktemp("qwen")
  tok = build_chat_tokenizer()
  tok.save_pretrained(d)
  im_end = tok.convert_tokens_to_ids(IM_END)
  build_tiny_qwen(d, vocab_size=len(tok) + 7, favour_id=im_end)
  with open(d / "generation_config.json", "w") as f:  # as Qwen2.5-Instruct ships it
    json.dump({"eos_token_id": [im_end, tok.eos_token_id], "temperature": 0.7, "top_p": 0.8}, f)
  return str(d), write_gsm8k(d / "train.jsonl"), write_gsm8k(d / "test.jsonl", GSM8K_ROWS[:2])


def _config(checkpoint, out_dir, *extra):
  path, train, test = checkpoint
  return cli.load_config(None, [
      f"model.path={path}", "task.kind=gsm8k", f"task.train_path={train}", f"task.test_path={test}",
      "task.prompt_format=chat", f"task.system_prompt={SYSTEM}", f"task.prompt_template={json.dumps(TEMPLATE)}",
      "rollout.num_prompts=2", "rollout.num_generations=3", "rollout.max_prompt_len=96", "rollout.max_new_tokens=5",
      "train.steps=2", "train.warmstart_steps=0", "grpo.filter_zero_std=false", "optimizer.lr=0.001",
      "eval.num_examples=2", "eval.pass_k=0", "eval.at_start=false", "logging.samples_every=1",
      "logging.progress=false", "logging.plot=false", f"out_dir={out_dir}", *extra])


@pytest.mark.slow
def test_grpo_on_a_chat_checkpoint_sees_chat_prompts_and_exports_a_loadable_model(checkpoint, tmp_path):
  t = Trainer(_config(checkpoint, tmp_path))
  tok = t.tokenizer
  im_end = tok.convert_tokens_to_ids(IM_END)
  assert im_end in t.prompter.stop_ids and tok.eos_token_id in t.prompter.stop_ids
  summary = t.train()

  # the prompts the model saw: the chat rendering of the template-formatted question, nothing else
  roll = t.last_rollout
  questions = {r["question"] for r in GSM8K_ROWS}
  seen = [tok.decode(ids[m > 0].tolist()) for ids, m in zip(roll.prompt_ids, roll.prompt_mask)]
  assert all(any(s == _chat_prompt(q) for q in questions) for s in seen), seen[0]
  samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  assert [s["step"] for s in samples] == [1] * 3 + [2] * 3 and samples[-1]["prompt"] == seen[0]

  # completions: cut at the first stop id (im_end does come up), decoded whole, special tokens stripped
  stops = np.isin(roll.tokens, t.prompter.stop_ids) & (roll.mask > 0)
  assert stops.any()
  for row, m, text in zip(roll.tokens, roll.mask, roll.texts):
    n = int(m.sum())
    assert not np.isin(row[:n - 1], t.prompter.stop_ids).any()  # nothing generated past a stop
    keep = row[:n - 1] if row[n - 1] in t.prompter.stop_ids else row[:n]
    assert text == tok.decode(keep.tolist(), skip_special_tokens=True)
    assert IM_END not in text and IM_START not in text and "<|endoftext|>" not in text

  # the HF export: transformers loads it, its logits are ours, its tokenizer round-trips, generate stops right
  hf_dir = summary["hf_export"]
  m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  cfg, params = hilore_jax.load_hf(hf_dir, dtype="float32")
  ids = np.concatenate([roll.prompt_ids[:2, -11:], roll.tokens[:2, :2]], 1)
  ours = np.asarray(jax.jit(hilore_jax.forward, static_argnums=0)(cfg, params, jnp.asarray(ids)))
  np.testing.assert_allclose(ours, m(torch.tensor(ids)).logits.detach().numpy(), atol=1e-4)
  # the export is the trained policy (its layers per layer, as HF holds them; the trainer's stacked)
  chex.assert_trees_all_equal(params, hilore_jax.model.unstacked(jax.device_get(t.state["params"])))
  tok2 = transformers.AutoTokenizer.from_pretrained(hf_dir)
  text = "Müller's café sold 12 crêpes."
  assert tok2(text)["input_ids"] == tok(text)["input_ids"] and tok2.decode(tok2(text)["input_ids"]) == text
  assert tok2.chat_template == tok.chat_template
  assert prompts.build_prompter(tok2, t.config.task, hf_dir, hf_dir).stop_ids == t.prompter.stop_ids
  assert list(t.prompter.stop_ids) == m.generation_config.eos_token_id and m.generation_config.temperature == 0.7


def test_template_format_gives_plain_prompts(checkpoint, tmp_path):
  # the same config without chat formatting: the model would see the bare text
  path = checkpoint[0]
  tok = tokenizer.load_tokenizer(path)
  chat_cfg = _config(checkpoint, tmp_path)
  plain_cfg = _config(checkpoint, tmp_path, "task.prompt_format=template", "task.system_prompt=null")
  ex = tasks.build_task(plain_cfg.task).train_example(0)
  assert ex == tasks.build_task(chat_cfg.task).train_example(0)
  chat, plain = (prompts.build_prompter(tok, c.task, path, path) for c in (chat_cfg, plain_cfg))
  assert tok.decode(chat.prompt_ids(ex, 96)[0]) == _chat_prompt(ex.prompt[:-len("\nAnswer:")])
  assert tok.decode(plain.prompt_ids(ex, 96)[0]) == ex.prompt and IM_START not in ex.prompt
  im_end = tok.convert_tokens_to_ids(IM_END)
  assert chat.end_id == im_end and plain.end_id == tok.eos_token_id  # what a warm-start target ends with
  assert plain.stop_ids == (tok.eos_token_id, im_end)  # im_end still stops it: the checkpoint's generation config
