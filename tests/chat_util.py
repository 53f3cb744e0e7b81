"""A tiny Qwen2.5-style checkpoint built in the test: byte-level BPE tokenizer with a chat template, random model."""

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Qwen2.5's template, minus its default system prompt and tool calls
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? Answer: 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Janet’s ducks lay 16 eggs per day. The answer is \\boxed{18}. Café crème – 3€.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
]
GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A café sells 5 crêpes per hour for 6 hours. How many crêpes?", "answer": "5 * 6 = 30\n#### 30"},
    {"question": "Sam had 10 pens and gave away 7. How many are left?", "answer": "10 - 7 = 3\n#### 3"},
    {"question": "Each box holds 12 eggs. How many eggs are in 2 boxes?", "answer": "12 * 2 = 24\n#### 24"},
]


def build_chat_tokenizer(chat_template: str | None = CHAT_TEMPLATE, bos: str | None = None,
                         vocab_size: int = 300) -> PreTrainedTokenizerFast:
  """Byte-level BPE trained on CORPUS, Qwen's special tokens, and (optionally) a chat template."""
  specials = [EOT, IM_START, IM_END] + ([bos] if bos else [])
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
  kwargs = {"bos_token": bos} if bos else {}
  return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT, chat_template=chat_template,
                                 additional_special_tokens=[IM_START, IM_END], **kwargs)


def build_tiny_qwen(path, vocab_size: int, seed: int = 0, favour_id: int | None = None):
  """A random Qwen2ForCausalLM with tiny odd sizes, saved as safetensors; favour_id gets sampled often (~15%)."""
  import torch
  import transformers

  cfg = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=24, intermediate_size=37, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False, eos_token_id=0, bos_token_id=0)
  torch.manual_seed(seed)
  m = transformers.Qwen2ForCausalLM(cfg).eval()
  with torch.no_grad():  # HF zero-inits biases: randomise them so the export's parity check covers them
    for name, p in m.named_parameters():
      if name.endswith("bias"):
        p.copy_(torch.randn_like(p) * 0.2)
    if favour_id is not None:  # a shared direction in every embedding that the favoured token's logit reads
      m.model.embed_tokens.weight[:, 0] += 1.0
      m.lm_head.weight[favour_id, 0] = 0.8
  m.save_pretrained(path, safe_serialization=True)
  return m


def write_gsm8k(path, rows=GSM8K_ROWS):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return str(path)


def write_generation_config(path, eos_ids):
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": list(eos_ids)}, f)
