"""The memory-method benchmark: every method's actor update on synthetic GRPO minibatches, timed in interleaved
rounds beside a noise-floor control, with gradient errors and risk diagnostics (`python -m experiments.bench.main`),
and a roofline projection of the same plans (`python -m experiments.bench.roofline`)."""
