"""Plans: memory and time of a configuration traced on fake tensors (see trace.py)."""
