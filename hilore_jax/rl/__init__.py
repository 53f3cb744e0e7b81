"""The RL wing: GRPO numerics, chunked log-probs, the train step's pure functions, the typed update batch, rollouts,
the KV-cache sampler, replay, the supervised warm-start and predicted-KL step control. Its settings are in
rl/config.py."""
