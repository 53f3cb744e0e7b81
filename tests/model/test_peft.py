"""PEFT in and out: what a LoRA run exports loads in peft with its logits, and a peft adapter loads here with its."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hilore_jax
from hilore_jax.model import lora, peft
from hilore_jax.model.config import LoraSpec

torch = pytest.importorskip("torch", reason="torch is not importable: the PEFT tests need PyTorch")
transformers = pytest.importorskip("transformers")
peft_lib = pytest.importorskip("peft", reason="peft is not importable: pip install -e '.[test]'")

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _base(tmp_path, kind="qwen2"):
  """A tiny random HF model saved to tmp_path/base (odd sizes, GQA, untied)."""
  common = dict(vocab_size=37, hidden_size=24, intermediate_size=29, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False)
  cls_cfg, cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if kind == "qwen2"
                  else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
  torch.manual_seed(0)
  m = cls(cls_cfg(**common)).eval()
  with torch.no_grad():
    for p in m.parameters():
      p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.shape[0] == 24 else 0.0))
  path = str(tmp_path / "base")
  m.save_pretrained(path)
  return path


def _ids():
  return np.random.RandomState(0).randint(0, 37, (2, 9))


def _peft_logits(base_path, adapter_path, ids):
  m = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
  pm = peft_lib.PeftModel.from_pretrained(m, adapter_path).eval()
  with torch.no_grad():
    return pm(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("kind,targets", [("qwen2", TARGETS), ("llama", ("q", "v", "down"))])
def test_an_exported_adapter_loads_in_peft_with_our_logits(tmp_path, kind, targets):
  base_path = _base(tmp_path, kind)
  cfg, params = hilore_jax.load_hf(base_path, dtype="float32")
  cfg = cfg.replace(lora=LoraSpec(4, 7.0, targets))
  params = lora.add_adapters(cfg, params, jax.random.PRNGKey(1))
  keys = iter(jax.random.split(jax.random.PRNGKey(2), 64))  # trained adapters: B off zero
  params["layers"] = [{**l, lora.KEY: {t: {"A": a["A"], "B": 0.3 * jax.random.normal(next(keys), a["B"].shape)}
                                       for t, a in l[lora.KEY].items()}} for l in params["layers"]]
  out = peft.save(cfg, params, str(tmp_path / "adapter"), base_path)
  conf = json.load(open(os.path.join(out, peft.CONFIG_FILE)))
  assert conf["base_model_name_or_path"] == base_path and conf["r"] == 4 and conf["lora_alpha"] == 7.0
  ids = _ids()
  ours = np.asarray(hilore_jax.forward(cfg, params, jnp.asarray(ids)))
  theirs = _peft_logits(base_path, out, ids)
  assert np.abs(ours - theirs).max() <= 1e-4
  base_only = np.asarray(hilore_jax.forward(cfg.replace(lora=None), params, jnp.asarray(ids)))
  assert np.abs(base_only - theirs).max() > 1e-2  # the adapters are what matched
  # and back: the same arrays
  back = peft.adapters_from(cfg, peft.load_tensors(out), "test")
  for mine, read in zip(params["layers"], back):
    for t in targets:
      for w in ("A", "B"):
        np.testing.assert_array_equal(np.asarray(mine[lora.KEY][t][w]), np.asarray(read[t][w]))
  assert peft.spec_of(peft.read_config(out)) == cfg.lora


def test_a_peft_adapter_runs_here_with_its_logits(tmp_path):
  base_path = _base(tmp_path)
  m = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
  lc = peft_lib.LoraConfig(r=3, lora_alpha=9, target_modules=["q_proj", "o_proj", "up_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")
  pm = peft_lib.get_peft_model(m, lc)
  with torch.no_grad():
    for name, p in pm.named_parameters():
      if "lora_B" in name:
        p.copy_(torch.randn_like(p) * 0.3)
  pm.save_pretrained(str(tmp_path / "theirs"))
  path = str(tmp_path / "theirs")
  conf = peft.read_config(path)
  spec = peft.spec_of(conf)
  assert spec == LoraSpec(3, 9.0, ("q", "o", "up"))
  cfg, params = hilore_jax.load_hf(base_path, dtype="float32")
  cfg = cfg.replace(lora=spec)
  params = lora.add_adapters(cfg, params, jax.random.PRNGKey(0), peft.adapters_from(cfg, peft.load_tensors(path),
                                                                                   path))
  ids = _ids()
  pm.eval()
  with torch.no_grad():
    theirs = pm(torch.tensor(ids)).logits.numpy()
  assert np.abs(np.asarray(hilore_jax.forward(cfg, params, jnp.asarray(ids))) - theirs).max() <= 1e-4


def test_a_peft_adapter_of_another_shape_is_refused(tmp_path):
  base_path = _base(tmp_path)
  cfg, params = hilore_jax.load_hf(base_path, dtype="float32")
  cfg = cfg.replace(lora=LoraSpec(4, 8.0, ("q",)))
  out = peft.save(cfg, lora.add_adapters(cfg, params, jax.random.PRNGKey(0)), str(tmp_path / "a"), base_path)
  wider = cfg.replace(hidden_size=30, head_dim=4, lora=cfg.lora)
  with pytest.raises(ValueError, match=r"q_proj.lora_A.weight is \[4, 24\], this base's q_proj needs \[4, 30\]: an "
                                       r"adapter of another base"):
    peft.adapters_from(wider, peft.load_tensors(out), out)
  deeper = cfg.replace(num_hidden_layers=3)
  with pytest.raises(ValueError, match="no tensor base_model.model.model.layers.2"):
    peft.adapters_from(deeper, peft.load_tensors(out), out)
  conf = json.load(open(os.path.join(out, peft.CONFIG_FILE)))
  json.dump({**conf, "use_dora": True}, open(os.path.join(out, peft.CONFIG_FILE), "w"))
  with pytest.raises(ValueError, match="use_dora=True is not supported"):
    peft.read_config(out)
