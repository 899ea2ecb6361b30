"""Training loop pieces: data, optimizer steps, metrics and checkpoints."""
