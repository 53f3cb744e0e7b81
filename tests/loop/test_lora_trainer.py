"""A LoRA run end to end: adapters trained on a frozen base written beside them, the KL reference that base with
no copy, exact resume, a checkpoint of another base or learner refused, both exports, and lora.init_from."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_util import stable, tiny_config

from hilore_jax import model
from hilore_jax.errors import CheckpointError, ConfigError
from hilore_jax.loop import adapters, evaluation, metrics
from hilore_jax.loop.trainer import Trainer
from hilore_jax.model import hf, lora, peft
from hilore_jax.model.config import LoraSpec
from hilore_jax.rl import train_step

# two passes over minibatches of 6 (old log-probs), a KL term, HiLoRe planning, predicted-KL control (its JVP along
# the adapters) and the adapters' dropout: every piece of a LoRA run's state crosses the checkpoint
LORA = ["lora.rank=3", "lora.alpha=6", "lora.dropout=0.1", "grpo.beta=0.05", "train.steps=4", "checkpoint.every=2",
        "grpo.num_iterations=2", "train.minibatch_size=6", "grpo.filter_zero_std=false", "optimizer.lr=0.01",
        "memory.policy=hilore", "memory.group_size=8", "memory.budget_ratio=1.02", "memory.budget_probes=1",
        "memory.warmup=none", "eval.at_start=false", "optimizer.kl_control.target=0.001",
        "optimizer.kl_control.chunk=2"]


def _size(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_a_lora_run_trains_its_adapters_on_a_frozen_base_and_resumes_exactly(tmp_path):
  t = Trainer(tiny_config(tmp_path / "a", *LORA, "checkpoint.export_hf=true"))
  t.train()
  base_dir = str(tmp_path / "a" / "base")
  assert t.base.path == base_dir and t.base.sha256 == adapters.files_sha256(base_dir)
  _, on_disk = hf.load_hf(base_dir)
  params = jax.device_get(t.state["params"])  # the train layout: layers stacked
  for a, b in zip(jax.tree.leaves(lora.base_of(model.unstacked(params))), jax.tree.leaves(on_disk)):
    np.testing.assert_array_equal(a, b)  # the base the run wrote before step 0 is the one it ends with: frozen
  # the optimizer holds AdamW's two moments of the adapters alone, and no reference copy exists
  assert 2 * _size(lora.trainable(params)) <= _size(t.state["opt_state"]) <= 2 * _size(lora.trainable(params)) + 8
  assert t.ref_params is None
  rows = metrics.read_metrics(tmp_path / "a" / "metrics.jsonl")
  assert rows[-1]["kl"] > 0 and all(r["updates"] >= 2 for r in rows)
  assert all(r["kl_control/predicted"] > 0 for r in rows)
  assert all(r["memory/compiled_bytes"] <= r["memory/budget_bytes"] for r in rows)  # HiLoRe's plans fit, under LoRA
  # the reference is the base: its log-probs are the base model's own
  batch = t.plan_update(t.last_rollout, np.random.default_rng(0)).batches[0]
  plain = train_step.StepSpec(t.model_cfg.replace(lora=None), t.spec.loss_cfg, ())
  np.testing.assert_allclose(t.reference_logprobs(batch), train_step.sequence_logprobs(plain, on_disk, batch),
                             atol=1e-6)
  assert np.abs(np.asarray(t.logprobs(t.state["params"], batch)) -
                np.asarray(t.reference_logprobs(batch))).max() > 1e-4  # and the adapters moved the policy
  # the merged HF export is the adapted model
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 80, (2, 7)))
  hf_cfg, hf_params = hf.load_hf(str(tmp_path / "a" / "hf"))
  np.testing.assert_allclose(model.forward(hf_cfg, hf_params, ids), model.forward(t.model_cfg, params, ids), atol=1e-5)
  summary = json.load(open(tmp_path / "a" / "summary.json"))
  conf = peft.read_config(summary["peft_export"])
  assert conf["base_model_name_or_path"] == base_dir and peft.spec_of(conf) == t.model_cfg.lora
  try:  # peft loads it on the base written beside it, with our logits (the test extras install peft)
    import peft as peft_lib
    import torch
    import transformers
  except ImportError:
    peft_lib = None
  if peft_lib is not None:
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft_lib.PeftModel.from_pretrained(base_model, summary["peft_export"]).eval()
    with torch.no_grad():
      theirs = pm(torch.tensor(np.asarray(ids))).logits.numpy()
    assert np.abs(theirs - np.asarray(model.forward(t.model_cfg, params, ids))).max() <= 1e-4

  # train.eval restores the run without a Trainer: the adapters on the base its metadata names
  eval_cfg, restored = evaluation.restore_params(str(tmp_path / "a"), t.config)
  assert eval_cfg.lora == t.model_cfg.lora
  for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)

  # resumed from step 2 (as if killed after step 4's metrics), the same metrics
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
  os.remove(tmp_path / "b" / "summary.json")
  r = Trainer(tiny_config(tmp_path / "b", *LORA, "train.resume=true"))
  assert r.restore_latest() and r.start_step == 2 and r.base.path == str(tmp_path / "b" / "base")
  r.train()
  assert stable(metrics.read_metrics(tmp_path / "b" / "metrics.jsonl")) == stable(rows)

  # a checkpoint made on another base, or by another learner, is refused in one line
  shutil.copytree(tmp_path / "a", tmp_path / "c")
  other = jax.tree.map(lambda x: x * 1.01, on_disk)
  hf.save_hf(hf_cfg.replace(lora=None), other, str(tmp_path / "c" / "base"))
  with pytest.raises(CheckpointError, match=r"^checkpoint step 4 was trained on the base \S+/a/base \(sha256 \w+\), "
                                            r"this run's base \S+/c/base is another model: resume on the base"):
    Trainer(tiny_config(tmp_path / "c", *LORA, "train.resume=true")).restore_latest()
  with pytest.raises(CheckpointError, match="^checkpoint step 4 was trained with LoRA rank 3, this run's lora.rank "
                                            "is 0$"):
    Trainer(tiny_config(tmp_path / "a", *LORA, "lora.rank=0", "train.resume=true")).restore_latest()


def test_lora_init_from_loads_a_peft_directory_and_refuses_another(tmp_path):
  cfg = tiny_config(tmp_path / "x").model.shape_config()
  for name, seed in (("base", 0), ("other", 1)):
    hf.save_hf(cfg, model.init_params(cfg, jax.random.PRNGKey(seed)), str(tmp_path / name))
  spec = LoraSpec(3, 6.0, ("q", "v"))
  lcfg = cfg.replace(lora=spec)
  params = model.init_params(lcfg, jax.random.PRNGKey(0))
  params["layers"] = [{**l, lora.KEY: {t: {"A": a["A"], "B": 0.1 * jnp.arange(a["B"].size).reshape(a["B"].shape)}
                                       for t, a in l[lora.KEY].items()}} for l in params["layers"]]
  made = peft.save(lcfg, params, str(tmp_path / "adapter"), str(tmp_path / "base"))
  run = ["model.path=" + str(tmp_path / "base"), "tokenizer=char", "train.warmstart_steps=0", "lora.rank=3",
         "lora.alpha=6", "lora.targets=[q,v]", "lora.init_from=" + made]
  overrides = list(run)
  t = Trainer(_from_path(tmp_path / "r", *overrides))
  got = jax.device_get(lora.trainable(t.state["params"]))  # the train layout: adapters stacked
  for mine, theirs in zip(model.unstack_layers(got["layers"]), params["layers"]):
    for tg in ("q", "v"):
      np.testing.assert_array_equal(mine[tg]["B"], np.asarray(theirs[lora.KEY][tg]["B"]))
  assert t.base.path == str(tmp_path / "base")
  for extra, message in ((["lora.rank=4"], r"^lora.init_from \S+/adapter: its rank is 3, lora.rank is 4$"),
                         (["lora.targets=[q,k,v]"], r"its targets is \['q', 'v'\], lora.targets is \['q', 'k', 'v'\]"),
                         (["lora.alpha=8"], r"its alpha is 6.0, lora.alpha is 8.0"),
                         (["model.path=" + str(tmp_path / "other")],
                          r"^lora.init_from \S+/adapter: its base \S+/base is another model than this run's "
                          r"\S+/other")):
    with pytest.raises(ConfigError, match=message):
      Trainer(_from_path(tmp_path / "r2", *overrides, *extra))
  with pytest.raises(ConfigError, match="its base must be a directory on disk, and this run makes its own"):
    Trainer(_from_path(tmp_path / "r3", *overrides, "train.warmstart_steps=5"))


def _from_path(out_dir, *overrides):
  """The tiny config with its shape from model.path (no shape fields)."""
  from hilore_jax import cli
  from trainer_util import TINY

  return cli.load_config(None, [*(a for a in TINY if not a.startswith("model.")), f"out_dir={out_dir}", *overrides])
