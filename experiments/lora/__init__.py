"""LoRA against full fine-tuning, compile-only (`python -m experiments.lora.memory`), and a LoRA run's sampler merged
against base plus adapters (`python -m experiments.lora.sampler`)."""
