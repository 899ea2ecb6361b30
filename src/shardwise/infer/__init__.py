"""Inference: `shardwise generate` (prefill + KV-cache decode, single process or tensor / pipeline parallel)."""
