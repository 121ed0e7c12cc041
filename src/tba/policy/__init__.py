"""The policy: tokenizer, model building and loading, KV-cache sampling, sequence log-probs."""
