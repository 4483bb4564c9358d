"""Training: building a run, the measured loop, checkpoints, held-out evaluation."""
