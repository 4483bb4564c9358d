"""task=infer: generation with a KV cache, measured (docs/inference.md)."""
