"""The loop wing: the GRPO trainer (`trainer.py`) and what it runs on: the sharded state and compiled steps
(`engine.py`), the memory manager's `StepHooks` on them (`step_hooks.py`), the token budget's packed programs
(`packed_step.py`) and a memory plan per microbatch shape (`shaped_memory.py`); evaluation, checkpoints, metrics and
the path checks before any work (`preflight.py`)."""
