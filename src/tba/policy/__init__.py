"""The policy: tokenizers, models (building, loading, LoRA, moving weights, fp32 masters of bf16
weights or their Kahan compensation, the optimizer), where their files come from, KV-cache
sampling, the one log-prob function, SFT."""
