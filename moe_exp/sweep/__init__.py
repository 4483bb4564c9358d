"""Sweeps under -m: each job in its own process, one table at the end; see docs/sweeps.md."""
