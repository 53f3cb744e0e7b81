"""The task wing: verifiable tasks (synthetic arithmetic, GSM8K, MATH-style JSONL), their verifiers, prompt
formatting and tokenizers. It imports no JAX (a layout test enforces it), so data code runs anywhere."""

from hilore_jax.tasks.task import Example, Task, build_task

__all__ = ["Example", "Task", "build_task"]
