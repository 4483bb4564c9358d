"""task=infer: measured generation with a KV cache; see docs/inference.md."""
