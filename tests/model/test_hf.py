import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hilore_jax
from hilore_jax.model import hf

torch = pytest.importorskip("torch", reason="torch is not importable: the HF parity tests need PyTorch")
transformers = pytest.importorskip("transformers")

CASES = {
    "qwen2_gqa_untied": ("qwen2", dict(tie_word_embeddings=False), {}),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True), {}),
    "llama_bias_untied": ("llama", dict(attention_bias=True, tie_word_embeddings=False), {}),
    "llama_nobias_tied_llama3rope": (
        "llama", dict(attention_bias=False, tie_word_embeddings=True, mlp_bias=True),
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16}),
    "llama_linear_rope_headdim": ("llama", dict(head_dim=10, tie_word_embeddings=False),
                                  {"rope_type": "linear", "factor": 2.0}),
}


def _torch_model(kind, extra, rope, seed=0):
  common = dict(vocab_size=37, hidden_size=24, intermediate_size=29, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)
  rope_parameters = {"rope_type": "default", "rope_theta": 500.0, **rope}
  cls_cfg, cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if kind == "qwen2"
                  else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
  cfg = cls_cfg(**common, **extra, rope_parameters=rope_parameters)
  torch.manual_seed(seed)
  m = cls(cfg).eval()
  with torch.no_grad():  # randomise everything (HF zero-inits biases, ones norms) so each tensor is checked
    for p in m.parameters():
      p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.shape[0] == 24 else 0.0))
  return m


def _ids(b=2, t=11, seed=0):
  return np.random.RandomState(seed).randint(0, 37, (b, t))


# every case on the XLA kernel; the other kernels on each head size (head_dim 4 and 10): what tells the cases apart
# (biases, tying, RoPE scaling) sits outside the attention kernel, so their cross product ran the same code again
KERNEL_CASES = ("qwen2_gqa_untied", "llama_linear_rope_headdim")
CASE_KERNELS = [(c, "xla") for c in sorted(CASES)] + [
    (c, a) for a in ("dot_product_attention", "blockwise") for c in KERNEL_CASES]


@pytest.mark.slow
@pytest.mark.parametrize("case,attention", CASE_KERNELS)
def test_logits_match_transformers(case, attention, tmp_path):
  m = _torch_model(*CASES[case])
  m.save_pretrained(tmp_path)
  cfg, params = hilore_jax.load_hf(str(tmp_path), dtype="float32")
  cfg = cfg.replace(attention=attention)
  ids = _ids()
  ref = m(torch.tensor(ids)).logits.detach().numpy()
  out = np.asarray(hilore_jax.forward(cfg, params, jnp.asarray(ids)))
  assert np.abs(out - ref).max() <= 1e-4

  # left padding: HF takes explicit position ids, ours derive them from the mask
  mask = np.ones_like(ids)
  mask[1, :3] = 0
  pos = np.maximum(mask.cumsum(-1) - 1, 0)
  ref = m(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits
  out = np.asarray(hilore_jax.forward(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))
  assert np.abs(out - ref.detach().numpy())[mask.astype(bool)].max() <= 1e-4


@pytest.mark.parametrize("case", ["qwen2_gqa_untied", "llama_nobias_tied_llama3rope"])
def test_save_hf_roundtrip_through_transformers(case, tmp_path):
  m = _torch_model(*CASES[case])
  m.save_pretrained(tmp_path / "src")
  cfg, params = hilore_jax.load_hf(str(tmp_path / "src"), dtype=jnp.float32)
  hilore_jax.save_hf(cfg, params, str(tmp_path / "out"))
  m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
  assert type(m2) is type(m)
  ids = torch.tensor(_ids(seed=1))
  np.testing.assert_allclose(m2(ids).logits.detach().numpy(), m(ids).logits.detach().numpy(), atol=1e-5)


def test_sharded_save_and_load(tmp_path):
  m = _torch_model(*CASES["qwen2_gqa_untied"])
  m.save_pretrained(tmp_path / "src")
  cfg, params = hilore_jax.load_hf(str(tmp_path / "src"))
  hilore_jax.save_hf(cfg, params, str(tmp_path / "sharded"), max_shard_bytes=8_000)
  files = os.listdir(tmp_path / "sharded")
  assert hf.INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) > 2
  cfg2, params2 = hilore_jax.load_hf(str(tmp_path / "sharded"))
  assert cfg2 == cfg
  ids = jnp.asarray(_ids())
  np.testing.assert_array_equal(hilore_jax.forward(cfg, params, ids), hilore_jax.forward(cfg2, params2, ids))
  m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
  np.testing.assert_allclose(m2(torch.tensor(_ids())).logits.detach().numpy(),
                             m(torch.tensor(_ids())).logits.detach().numpy(), atol=1e-5)


@pytest.mark.slow
def test_bf16_load(tmp_path):
  m = _torch_model(*CASES["qwen2_tied"])
  m.save_pretrained(tmp_path)
  cfg, params = hilore_jax.load_hf(str(tmp_path), dtype="bfloat16")
  assert params["embed_VD"].dtype == jnp.bfloat16 and cfg.dtype == "bfloat16"
  ref = m(torch.tensor(_ids())).logits.detach().numpy()
  assert np.abs(np.asarray(hilore_jax.forward(cfg, params, jnp.asarray(_ids()))) - ref).max() < 0.5


def _broken(tmp_path, edit):
  m = _torch_model(*CASES["qwen2_gqa_untied"])
  m.save_pretrained(tmp_path)
  path = str(tmp_path / hf.SINGLE_FILE)
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path)


def test_missing_tensor_is_named(tmp_path):
  _broken(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'.*\(29, 24\)"):
    hilore_jax.load_hf(str(tmp_path))


def test_misshapen_tensor_is_named(tmp_path):
  def edit(t):
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:4]
  _broken(tmp_path, edit)
  with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(4, 24\), expected \(8, 24\)"):
    hilore_jax.load_hf(str(tmp_path))


def test_unsupported_architecture(tmp_path):
  _torch_model(*CASES["qwen2_tied"]).save_pretrained(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="unsupported architecture.*MistralForCausalLM"):
    hilore_jax.load_hf(str(tmp_path))


def test_failed_export_keeps_previous(tmp_path, tiny_cfg):
  import jax
  params = hilore_jax.init_params(tiny_cfg, jax.random.PRNGKey(0))
  out = str(tmp_path / "export")
  hilore_jax.save_hf(tiny_cfg, params, out)
  before = sorted(os.listdir(out))
  bad = jax.tree_util.tree_map(lambda x: x, params)
  bad["layers"][0]["mlp"]["wup_DF"] = bad["layers"][0]["mlp"]["wup_DF"][:, :5]
  with pytest.raises(ValueError, match="up_proj"):
    hilore_jax.save_hf(tiny_cfg, bad, out)
  assert sorted(os.listdir(out)) == before
  assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []
  hilore_jax.load_hf(out)
