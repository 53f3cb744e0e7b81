"""A few-step GRPO config on a tiny model, and what the trainer tests compare runs by."""

from hilore_jax import cli

TINY = [
    "model.vocab_size=80", "model.hidden_size=24", "model.intermediate_size=37", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2",
    "task.arithmetic.max_value=9", "task.arithmetic.num_test=16",
    "rollout.num_prompts=3", "rollout.num_generations=4", "rollout.max_prompt_len=6", "rollout.max_new_tokens=3",
    "train.warmstart_steps=40", "train.warmstart_batch_size=16", "train.warmstart_lr=0.01", "train.minibatch_size=0",
    "optimizer.lr=0.001", "eval.num_examples=8", "eval.pass_k=2", "logging.progress=false", "logging.plot=false",
    "checkpoint.export_hf=false",
    # the memory set-up cache is keyed by the config: tests that run one config twice would share it (its own tests
    # turn it on in their own cache directory)
    "memory.cache=false",
]


def tiny_config(out_dir, *overrides):
  return cli.load_config(None, [*TINY, f"out_dir={out_dir}", *overrides])


VOLATILE = ("time/", "throughput/", "compile/", "memory/host_")  # what differs between two runs of the same steps


def stable(rows: list[dict]) -> list[dict]:
  """metrics.jsonl rows without the keys that differ between identical runs (timings, compile counts)."""
  return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]
