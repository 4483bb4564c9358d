"""Sweeps (-m): each job in its own process, one table at the end (docs/sweeps.md)."""
