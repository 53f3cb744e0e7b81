import os
import subprocess
import sys

import pytest
import yaml

from hilore_jax import cli
from experiments.common import config as bench_config
from hilore_jax.errors import ConfigError
import repo


def test_yaml_and_overrides(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("model:\n  hidden_size: 40\n  num_attention_heads: 4\ntrain:\n  steps: 5\n"
                  "task:\n  arithmetic:\n    ops: ['+', '-']\n")
  c = cli.load_config(str(path), ["train.steps=20", "out_dir=/tmp/run", "grpo.eps_high=0.28", "model.dtype=bfloat16",
                                  "model.attention=blockwise", "model.attention_block_q=16",
                                  "model.scan_layers=false", "model.mlp_chunk_len=96"])
  assert c.train.steps == 20 and c.out_dir == "/tmp/run" and c.grpo.eps_high == 0.28
  assert c.task.arithmetic.ops == ("+", "-")
  mc = c.model.shape_config()
  assert mc.hidden_size == 40 and mc.dtype == "bfloat16"
  assert (mc.attention, mc.attention_block_q, mc.attention_block_k, mc.scan_layers) == ("blockwise", 16, 256, False)
  assert mc.mlp_chunk_len == 96
  with pytest.raises(dataclasses_frozen_error()):
    c.train.steps = 3


def dataclasses_frozen_error():
  import dataclasses
  return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("override,message", [
    ("train.stepz=3", r"unknown config key 'train.stepz'; valid keys here: \[.*'steps'"),
    ("grpo.loss_agg=sum", r"grpo.loss_agg must be one of \['token-mean'"),
    ("memory.policy=sometimes", r"memory.policy must be one of \['none', 'gc', 'sac', .*'hilore'\]"),
    ("memory.lowp_format=int2", r"memory.lowp_format must be one of \['int8', 'fp8_e4m3'"),
    ("memory.exposure.kll=false", r"unknown config key 'memory.exposure.kll'"),
    ("memory.budget_ratio=0.9", r"budget_ratio must be >= 1.0"),
    ("memory.mip_gap=1.5", r"memory.mip_gap must be in \[0, 1\)"),
    ("memory.mip_time_limit_s=-1", r"memory.mip_time_limit_s must be a number of seconds >= 0 \(0: no limit\), got -1"),
    ("memory.plan_runs=-1", r"memory.plan_runs must be an integer >= 0 \(0: any number of runs\), got -1"),
    ("model.scan_layers=2", r"model.scan_layers must be true or false, got 2"),
    ("model.mlp_chunk_len=-3", r"model.mlp_chunk_len must be an integer >= 0 \(0: the MLP never chunked\), got -3"),
    ("rollout.num_generations=1", r"num_generations must be > 1"),
    ("train.steps=ten", r"train.steps must be an integer"),
    ("model.num_key_value_heads=3", r"num_attention_heads .* multiple of num_key_value_heads"),
    ("model.hiden_size=3", r"unknown config key 'model.hiden_size'.*'hidden_size'"),
    ("grpo.advantage=ppo", r"grpo.advantage must be one of"),
    ("train.minibatch_size=7", r"minibatch_size \(7\) must divide"),
    ("task.kind=gsm8k", r"needs task.train_path"),
    ("grpo.dual_clip=0.5", r"dual_clip must be > 1"),
    ("task.arithmetic.ops=['/']", r"ops must be a non-empty subset"),
    ("task.arithmetic.max_valu=3", r"unknown config key 'task.arithmetic.max_valu'"),
    ("model.attention=flash", r"model.attention must be one of \['xla', 'dot_product_attention', 'blockwise'\]"),
    ("model.attention_block_k=0", r"model.attention_block_k must be a positive integer, got 0"),
    ("train.packing_min_saving=1", r"train.packing_min_saving must be in \[0, 1\), got 1"),
    ("train.packing_min_saving=-0.1", r"train.packing_min_saving must be in \[0, 1\), got -0.1"),
    ("train.packing_granule=-64", r"train.packing_granule must be >= 0, got -64"),
])
def test_bad_values_name_the_key(override, message):
  with pytest.raises(ValueError, match=message):
    cli.load_config(None, [override])


ROOT = repo.ROOT


@pytest.mark.slow
def test_cli_reports_config_errors():
  out = subprocess.run([sys.executable, "-m", "train.grpo", "--config", "configs/tiny.yaml", "train.nope=1"],
                       capture_output=True, text=True, cwd=ROOT)
  assert out.returncode != 0 and "unknown config key 'train.nope'" in out.stderr


def test_shipped_configs_load():
  import glob
  paths = glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
  assert paths
  for path in paths:
    sections = [s for s in bench_config.SECTIONS if s in (yaml.safe_load(open(path)) or {})]
    if sections:  # a benchmark's config: the trainer's sections plus its own
      bench_config.load(path, [], sections[0])
    else:
      cli.load_config(path)


def test_exponent_without_a_dot_is_a_number_not_a_string():
  # YAML 1.1 reads 1e-3 as the string '1e-3'; an override a user types that way means the number
  c = cli.load_config(None, ["optimizer.lr=1e-3", "optimizer.kl_control.target=2E2"])
  assert c.optimizer.lr == 1e-3 and c.optimizer.kl_control.target == 200.0
  with pytest.raises(ConfigError, match="optimizer.lr must be a number"):
    cli.load_config(None, ["optimizer.lr=1e-3x"])


def test_renamed_policy_names_its_successor_in_one_line(tmp_path):
  path = tmp_path / "old.yaml"
  path.write_text("memory:\n  policy: adacc_style\n")
  with pytest.raises(ConfigError, match=r"^memory.policy 'adacc_style' is now 'hilore_static' \(HiLoRe with exposure "
                                        r"off\)$"):
    cli.load_config(str(path))
  with pytest.raises(SystemExit) as e:  # the entry point's error: one line, no traceback
    cli.main("test", lambda ns: cli.load_config(ns.config, ns.overrides), ["--config", str(path)])
  assert "\n" not in str(e.value.code) and "'hilore_static'" in str(e.value.code)
  assert cli.load_config(None, ["memory.policy=hilore_static"]).memory.policy == "hilore_static"
  with pytest.raises(ConfigError, match="bench.methods 'adacc_style' is now 'hilore_static'"):
    bench_config.BenchConfig(methods=("gc", "adacc_style"))
