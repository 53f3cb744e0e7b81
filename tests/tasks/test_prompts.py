import json
import os

import numpy as np
import pytest
from chat_util import CHAT_TEMPLATE, IM_END, IM_START, build_chat_tokenizer, write_generation_config

from hilore_jax import cli, tasks
from hilore_jax.errors import ConfigError
from hilore_jax.rl import sft
from hilore_jax.tasks import Example, prompts, tokenizer
from hilore_jax.tasks.config import TaskConfig
import repo

QUESTION = "Tom has 3 apples and buys 4 more. How many apples?"
CHAT = TaskConfig(prompt_format="chat", system_prompt="Be brief.")


@pytest.fixture(scope="module")
def tok():
  return build_chat_tokenizer()


def _text(tok, ids):
  return tok.decode([int(i) for i in ids])


def test_chat_prompt_is_the_rendered_conversation_and_template_is_unchanged(tok):
  chat = prompts.build_prompter(tok, CHAT, "tiny")
  ids, cut = chat.prompt_ids(Example(QUESTION, 7), 200)
  want = f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\n{QUESTION}{IM_END}\n{IM_START}assistant\n"
  assert _text(tok, ids) == want and not cut
  assert ids == tok(want, add_special_tokens=False)["input_ids"]
  plain = prompts.build_prompter(tok, TaskConfig(), "tiny")
  assert plain.prompt_ids(Example(QUESTION, 7), 200) == (tok(QUESTION)["input_ids"], False)
  no_system = prompts.build_prompter(tok, TaskConfig(prompt_format="chat"), "tiny")
  assert _text(tok, no_system.prompt_ids(Example(QUESTION, 7), 200)[0]).startswith(f"{IM_START}user\n{QUESTION}")


def test_a_template_bos_is_not_added_twice():
  # Llama-3 style: the tokenizer adds BOS when encoding, and the chat template writes it too
  bos = "<|begin_of_text|>"
  tok = build_chat_tokenizer("{{ bos_token }}" + CHAT_TEMPLATE, bos=bos)
  from tokenizers import processors
  bos_id = tok.convert_tokens_to_ids(bos)
  tok._tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
  assert tok("x")["input_ids"][0] == bos_id  # the plain path adds it
  ids, _ = prompts.build_prompter(tok, CHAT, "tiny").prompt_ids(Example(QUESTION, 7), 200)
  assert ids[0] == bos_id and ids.count(bos_id) == 1


def test_chat_truncation_drops_from_the_question_and_keeps_the_turn_markers(tok):
  chat = prompts.build_prompter(tok, CHAT, "tiny")
  full, _ = chat.prompt_ids(Example(QUESTION, 7), 200)
  n = len(full) - 5
  ids, mask, truncated = chat.encode([Example(QUESTION, 7), Example("Hi?", 1)], n)
  assert truncated == 1 and ids.shape == (2, n) and mask[0].all()
  text = _text(tok, ids[0])
  head, tail = f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\n", f"{IM_END}\n{IM_START}assistant\n"
  assert text.startswith(head) and text.endswith("How many apples?" + tail)
  assert QUESTION.endswith(text[len(head):-len(tail)]) and len(text) < len(head + QUESTION + tail)
  assert _text(tok, ids[1][mask[1] > 0]) == f"{head}Hi?{tail}"  # left-padded, untouched
  # template format keeps today's rule: the last max_len tokens
  plain = prompts.build_prompter(tok, TaskConfig(), "tiny")
  assert plain.prompt_ids(Example(QUESTION, 7), 6) == (tok(QUESTION)["input_ids"][-6:], True)
  with pytest.raises(ConfigError, match="max_prompt_len=8 leaves no room for the question"):
    chat.encode([Example(QUESTION, 7)], 8)


def test_stop_ids_end_of_turn_eos_and_generation_config(tok, tmp_path):
  im_end, eot = tok.convert_tokens_to_ids([IM_END, "<|endoftext|>"])
  assert prompts.end_of_turn_id(tok) == im_end
  assert prompts.build_prompter(tok, CHAT, "tiny").stop_ids == (im_end, eot)
  assert prompts.build_prompter(tok, TaskConfig(), "tiny").stop_ids == (eot,)
  write_generation_config(tmp_path, [eot, 5])
  chat = prompts.build_prompter(tok, CHAT, "tiny", str(tmp_path))
  assert chat.stop_ids == (im_end, eot, 5) and chat.end_id == im_end


def test_chat_without_a_template_is_a_config_error():
  char = tokenizer.load_tokenizer("char")
  with pytest.raises(ConfigError, match="task.prompt_format=chat: the tokenizer at char has no chat template"):
    prompts.build_prompter(char, CHAT, "char")
  with pytest.raises(ConfigError, match="task.system_prompt needs task.prompt_format=chat"):
    TaskConfig(system_prompt="hi")
  with pytest.raises(ConfigError, match="task.prompt_format must be one of"):
    TaskConfig(prompt_format="chatml")


def test_decode_stops_at_the_first_stop_id_and_skips_specials(tok):
  chat = prompts.build_prompter(tok, CHAT, "tiny")
  im_start, im_end, eot = tok.convert_tokens_to_ids([IM_START, IM_END, "<|endoftext|>"])
  a, b = tok("Müller 72", add_special_tokens=False)["input_ids"], tok(" more", add_special_tokens=False)["input_ids"]
  assert "".join(tok.decode([t]) for t in a) != "Müller 72"  # 'ü' is two byte tokens: decoded one by one it breaks
  rows = [a + [im_end] + b, [im_start] + a + [eot] + b, a + b]
  N = max(map(len, rows)) + 1
  tokens = np.array([r + [eot] * (N - len(r)) for r in rows])
  mask = np.array([[1] * len(r) + [0] * (N - len(r)) for r in rows])
  mask[2, len(a):] = 0  # the mask ends a row too
  assert chat.decode(tokens, mask) == ["Müller 72"] * 3


def test_the_qwen_recipe_renders_gsm8k_questions_as_chat(tok):
  # the recipe's instruction holds '\boxed{}', which str.format would take for a field and reject
  root = repo.ROOT
  sample = os.path.join(root, "tests", "data", "gsm8k_sample.jsonl")
  c = cli.load_config(os.path.join(root, "configs", "qwen2.5-0.5b-gsm8k.yaml"),
                      [f"task.train_path={sample}", f"task.test_path={sample}"])
  assert c.model.arch == () and c.task.prompt_format == "chat" and c.train.warmstart_steps == 0
  ex = tasks.build_task(c.task).test_examples[0]
  question = json.loads(open(sample).readline())["question"]
  assert ex.prompt == question + "\nPlease reason step by step, and put your final answer within \\boxed{}."
  ids, cut = prompts.build_prompter(tok, c.task, "tiny").prompt_ids(ex, 10**4)
  assert tok.decode(ids) == f"{IM_START}user\n{ex.prompt}{IM_END}\n{IM_START}assistant\n" and not cut


def test_warmstart_batches_see_the_same_prompts_and_end_targets_with_the_turn_end(tok):
  chat = prompts.build_prompter(tok, CHAT, "tiny")
  ex = Example(QUESTION, "7", target="3 + 4 = 7\n#### 7")
  batch = sft.sft_batch(chat, [ex], 64, 40)
  np.testing.assert_array_equal(batch.prompt_ids, chat.encode([ex], 64)[0])
  n = int(batch.mask[0].sum())
  assert batch.tokens[0, n - 1] == tok.convert_tokens_to_ids(IM_END)
  assert tok.decode(batch.tokens[0, :n - 1].tolist()) == ex.target
