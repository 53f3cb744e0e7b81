"""Tokenizers: transformers' AutoTokenizer from a local directory, or the built-in character tokenizer."""

from __future__ import annotations

import os

from typing import TYPE_CHECKING

from hilore_jax import runtime

if TYPE_CHECKING:
  from transformers import PreTrainedTokenizerFast

CHAR_TOKENIZER = "char"  # built locally at first use, so the embedded default needs no download
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
_CHARS = "0123456789+-*/=()., ?:#\n" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_VERSION = "v1"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
  """A character-level tokenizer over digits, operators, letters and a few symbols."""
  # transformers (and the torch it may pull in) loads here, not at import: `import hilore_jax` stays seconds faster
  from tokenizers import Tokenizer, decoders, models
  from transformers import PreTrainedTokenizerFast

  vocab = {tok: i for i, tok in enumerate([PAD, EOS, BOS, *_CHARS])}
  # BPE with no merges splits any string into its characters; Fuse joins them back without spaces.
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
  tok.decoder = decoders.Fuse()
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS)


def char_tokenizer_dir(cache_dir: str | None = None) -> str:
  """Directory holding the saved character tokenizer, written once."""
  cache_dir = cache_dir or runtime.cache_root()
  path = os.path.join(cache_dir, f"char_tokenizer_{_VERSION}")
  if not os.path.exists(os.path.join(path, "tokenizer.json")):
    tmp = f"{path}.tmp{os.getpid()}"
    build_char_tokenizer().save_pretrained(tmp)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
      os.replace(tmp, path)
    except OSError:  # another process won the race; its copy is identical
      pass
  return path


def load_tokenizer(name_or_path: str):
  """AutoTokenizer from a local directory; 'char' builds the built-in tokenizer locally."""
  path = char_tokenizer_dir() if name_or_path == CHAR_TOKENIZER else name_or_path
  if not os.path.isdir(path):
    raise FileNotFoundError(f"tokenizer {name_or_path!r}: not a local directory (and not {CHAR_TOKENIZER!r})")
  if name_or_path == CHAR_TOKENIZER:  # its saved class: AutoTokenizer would resolve the same one via torch's import
    from transformers import PreTrainedTokenizerFast as cls
  else:
    from transformers import AutoTokenizer as cls
  tok = cls.from_pretrained(path, local_files_only=True)
  if tok.pad_token_id is None:
    tok.pad_token = tok.eos_token
  return tok
