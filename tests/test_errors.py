"""Every bad config value, path, data line or checkpoint ends in one line naming the key or file: no traceback."""

import json
import os
import re
import shutil

import jax
import pytest
from safetensors.numpy import load_file, save_file
from trainer_util import TINY

from hilore_jax import runtime
from hilore_jax.model import ModelConfig, hf, init_params
from experiments.bench import main as bench_main
from experiments.exposure import main as bench_exposure_main
from train import grpo as grpo_main

GOOD_LINE = json.dumps({"question": "1+2?", "answer": "1+2=3\n#### 3"})


def _hf_dir(path, base=None, edit=None):
  """A tiny HF checkpoint directory (no tokenizer), or a copy of base; edit(tensors) changes its weights."""
  if base is None:
    cfg = ModelConfig(vocab_size=80, hidden_size=24, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    hf.save_hf(cfg, init_params(cfg, jax.random.PRNGKey(0)), str(path))
  else:
    shutil.copytree(base, path)
  if edit:
    weights = os.path.join(path, hf.SINGLE_FILE)
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)
  return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """The paths the cases name: {name} in a case's overrides becomes one of these."""
  tmp = tmp_path_factory.mktemp("paths")
  os.makedirs(tmp / "empty")
  (tmp / "good.jsonl").write_text(GOOD_LINE + "\n" + GOOD_LINE + "\n")
  (tmp / "bad.jsonl").write_text(GOOD_LINE + "\n" + '{"question": "q", "answer": 3\n')
  (tmp / "binary.jsonl").write_bytes(GOOD_LINE.encode() + b"\n\xff\xfe\x00\n")
  (tmp / "a_file").write_text("x")
  (tmp / "no_weights").mkdir()
  (tmp / "no_weights" / "config.json").write_text("{}")
  base = _hf_dir(tmp / "hf")
  weights = tmp / "torn" / hf.SINGLE_FILE
  _hf_dir(tmp / "torn", base)
  weights.write_bytes(weights.read_bytes()[:200])  # a download cut short
  _hf_dir(tmp / "bad_json", base)
  (tmp / "bad_json" / "config.json").write_text('{"vocab_size": 80,')
  return {"tmp": str(tmp), "empty": str(tmp / "empty"), "good": str(tmp / "good.jsonl"),
          "bad": str(tmp / "bad.jsonl"), "binary": str(tmp / "binary.jsonl"), "a_file": str(tmp / "a_file"),
          "no_weights": str(tmp / "no_weights"), "torn": str(tmp / "torn"), "bad_json": str(tmp / "bad_json"),
          "missing_tensor": _hf_dir(tmp / "missing_tensor", base, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
          "misshapen": _hf_dir(tmp / "misshapen", base, lambda t: t.update(
              {"model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.k_proj.weight"][:4]}))}


GSM8K = ["task.kind=gsm8k", "task.train_path={good}", "task.test_path={good}"]
CASES = {
    # wrong type, one per section
    "type/root": (["seed=abc"], "config error", r"seed must be an integer, got 'abc'"),
    "type/model": (["model.hidden_size=big"], "config error", r"model.hidden_size must be an integer"),
    "type/model.path": (["model.path=[1]"], "config error", r"model.path must be a string"),
    "type/task": (["task.skip_malformed=maybe"], "config error", r"task.skip_malformed must be true or false"),
    "type/task.arithmetic": (["task.arithmetic.ops=3"], "config error", r"task.arithmetic.ops must be a list"),
    "type/rollout": (["rollout.temperature=hot"], "config error", r"rollout.temperature must be a number"),
    "type/grpo": (["grpo.beta=[1]"], "config error", r"grpo.beta must be a number"),
    "type/optimizer": (["optimizer.lr=fast"], "config error", r"optimizer.lr must be a number"),
    "type/train": (["train.steps=1.5"], "config error", r"train.steps must be an integer, got 1.5"),
    "type/eval": (["eval.at_end=3"], "config error", r"eval.at_end must be true or false"),
    "type/mesh": (["mesh.fsdp=two"], "config error", r"mesh.fsdp must be an integer"),
    "type/checkpoint": (["checkpoint.every=often"], "config error", r"checkpoint.every must be an integer"),
    "type/logging": (["logging.plot=1"], "config error", r"logging.plot must be true or false"),
    "type/memory": (["memory.buckets=2.5"], "config error", r"memory.buckets must be an integer"),
    "type/memory.exposure": (["memory.exposure.kl=2"], "config error", r"memory.exposure.kl must be true or false"),
    "type/bench": (["bench.reps=many"], "config error", r"bench.reps must be an integer", bench_main),
    "type/bench_exposure": (["bench_exposure.reps=x"], "config error", r"bench_exposure.reps must be an integer",
                            bench_exposure_main),
    "type/section": (["train=5"], "config error", r"config section train must be a mapping"),
    # out of range, one per section
    "range/root": (["seed=-1"], "config error", r"seed must be >= 0, got -1"),
    "range/model": (["model.num_attention_heads=0"], "config error", r"model.num_attention_heads must be > 0"),
    "range/model.rope": (["model.rope_scaling=5"], "config error", r"model.rope_scaling must be a mapping"),
    "range/task": (["task.kind=csv"], "config error", r"task.kind must be one of"),
    "range/task.arithmetic": (["task.arithmetic.teacher_error_rate=2"], "config error",
                              r"teacher_error_rate must be in \[0.0, 1.0\], got 2"),
    "range/rollout": (["rollout.top_p=0"], "config error", r"rollout.top_p must be in \(0.0, 1.0\]"),
    "range/grpo": (["grpo.eps_low=1"], "config error", r"grpo.eps_low must be in \(0.0, 1.0\)"),
    "range/optimizer": (["optimizer.b2=1"], "config error", r"optimizer.b2 must be in"),
    "range/nan": (["optimizer.lr=.nan"], "config error", r"optimizer.lr must be a finite number, got nan"),
    "range/train": (["train.logprob_chunk=0"], "config error", r"train.logprob_chunk must be > 0"),
    "range/eval": (["eval.temperature=0"], "config error", r"eval.temperature must be > 0"),
    "range/mesh": (["mesh.data=0"], "config error", r"mesh.data must be > 0 or -1"),
    "range/mesh.devices": (["mesh.fsdp=3"], "config error", r"mesh.fsdp=3 does not divide the \d+ devices"),
    "range/checkpoint": (["checkpoint.keep=0"], "config error", r"checkpoint.keep must be > 0"),
    "range/memory": (["memory.group_size=0"], "config error", r"memory.group_size must be > 0"),
    "range/bench": (["bench.zero_adv_frac=1.5"], "config error", r"bench.zero_adv_frac must be in", bench_main),
    "range/lora_rank": (["lora.rank=-1"], "config error", r"lora.rank must be >= 0 \(0: off\), got -1"),
    "range/lora_alpha": (["lora.rank=4", "lora.alpha=0"], "config error", r"lora.alpha must be > 0, got 0.0"),
    "choice/lora_targets": (["lora.rank=4", "lora.targets=[q,qkv]"], "config error",
                            r"lora.targets: unknown \['qkv'\] \(choose from \['q', 'k', 'v', 'o', 'gate', 'up', "
                            r"'down'\]\)"),
    "path/lora.init_from": (["lora.rank=4", "lora.init_from={tmp}/nope"], "config error",
                            r"lora.init_from \S+/nope: no such directory"),
    "path/lora.init_from_not_peft": (["lora.rank=4", "lora.init_from={empty}"], "config error",
                                     r"lora.init_from \S+/empty: no adapter_config.json \(not a PEFT adapter "
                                     r"directory\)"),
    "unknown_key": (["train.stepz=3"], "config error", r"unknown config key 'train.stepz'"),
    "unknown_key/bench": (["bench.repz=3"], "config error", r"unknown config key 'bench.repz'", bench_main),
    "bench_section_in_a_run": (["bench.reps=3"], "config error", r"unknown config key 'bench'"),
    # one key per fact: a study's old budget keys name the key that now says it
    "moved/bench_exposure": (["bench_exposure.budget_ratio=1.1"], "config error",
                             r"bench_exposure.budget_ratio is now memory.budget_ratio", bench_exposure_main),
    "range/budget/bench": (["bench.budget_ratios=[0.9]"], "config error",
                           r"bench.budget_ratios must be >= 1.0 \(full checkpointing is the floor\)", bench_main),
    # paths
    "path/config": (["--config", "{tmp}/nope.yaml"], "config error", r"--config \S+/nope.yaml: no such file"),
    "path/out_dir": (["out_dir={a_file}"], "config error", r"out_dir \S+/a_file: exists and is not a directory"),
    "path/model.path": (["model.path={tmp}/nope"], "config error", r"model.path \S+/nope: no such directory"),
    "path/model.path_file": (["model.path={a_file}"], "config error", r"model.path \S+/a_file: not a directory"),
    "path/model.path_no_config": (["model.path={empty}"], "config error",
                                  r"model.path \S+/empty: no config.json \(not a Hugging Face checkpoint directory\)"),
    "path/model.path_no_weights": (["model.path={no_weights}"], "config error",
                                   r"model.path \S+/no_weights: no model.safetensors or model.safetensors.index.json"),
    "path/tokenizer": (["tokenizer={tmp}/nope"], "config error", r"tokenizer \S+/nope: no such directory"),
    "path/tokenizer_empty": (["tokenizer={empty}"], "config error",
                             r"tokenizer \S+/empty: none of .*not a Hugging Face tokenizer directory"),
    "path/tokenizer_from_model": (["model.path={missing_tensor}"], "config error",
                                  r"tokenizer \(from model.path\) \S+/missing_tensor: none of"),
    "path/train_path": (["task.kind=gsm8k", "task.train_path={tmp}/nope.jsonl", "task.test_path={good}"],
                        "config error", r"task.train_path \S+/nope.jsonl: no such file"),
    "path/test_path": (["task.kind=gsm8k", "task.train_path={good}", "task.test_path={empty}"], "config error",
                       r"task.test_path \S+/empty: not a file"),
    # data
    "data/malformed_line": (GSM8K[:2] + ["task.test_path={bad}"], "data error",
                            r"\S+/bad.jsonl:2: malformed GSM8K line"),
    "data/not_utf8": (GSM8K[:2] + ["task.test_path={binary}"], "data error",
                      r"\S+/binary.jsonl:2: not UTF-8 text \(task.test_path\)"),
    # Hugging Face checkpoints
    "hf/missing_tensor": (["model.path={missing_tensor}", "tokenizer=char"], "checkpoint error",
                          r"model.path \S+/missing_tensor: missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "hf/misshapen_tensor": (["model.path={misshapen}", "tokenizer=char"], "checkpoint error",
                            r"model.path \S+: tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(4, 24\)"),
    "hf/torn_weights": (["model.path={torn}", "tokenizer=char"], "checkpoint error",
                        r"model.path \S+/torn: unreadable safetensors file"),
    "hf/bad_config_json": (["model.path={bad_json}", "tokenizer=char"], "checkpoint error",
                           r"model.path \S+/bad_json/config.json: not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_error_is_one_line_naming_the_key(case, files, tmp_path, monkeypatch, capsys):
  overrides, kind, pattern, entry = (*CASES[case], grpo_main)[:4]
  monkeypatch.setattr(runtime, "enable_compilation_cache", lambda *a, **k: None)  # process-wide: keep it off
  overrides = [o.format(**files) for o in overrides]
  # a checkpoint brings its own shape: drop the tiny config's shape fields
  base = [a for a in TINY if not a.startswith("model.")] if any(o.startswith("model.path=") for o in overrides) \
      else TINY
  args = [*base, f"out_dir={tmp_path}/run", *overrides]
  if entry is not grpo_main:
    args = ["--out", f"{tmp_path}/bench", *args]
  with pytest.raises(SystemExit) as exc:
    entry.main(args)
  message = exc.value.code
  assert isinstance(message, str) and "\n" not in message, message
  assert message.startswith(f"{kind}: ") and re.search(pattern, message), message
  assert "Traceback" not in capsys.readouterr().err
