import os

from hilore_jax.tasks import tokenizer


def test_char_tokenizer_roundtrip_from_local_dir():
  tok = tokenizer.load_tokenizer("char")
  assert os.path.exists(os.path.join(tokenizer.char_tokenizer_dir(), "tokenizer.json"))
  text = "12+35=47\n#### 9"
  ids = tok(text)["input_ids"]
  assert len(ids) == len(text)
  assert tok.decode(ids) == text
  assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
  assert tok.pad_token_id != tok.eos_token_id


def test_missing_dir_is_a_clear_error(tmp_path):
  import pytest
  with pytest.raises(FileNotFoundError, match="not a local directory"):
    tokenizer.load_tokenizer(str(tmp_path / "nope"))
