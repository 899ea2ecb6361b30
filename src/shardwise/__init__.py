"""shardwise: plan, verify and run N-D parallel training of transformer models on PyTorch."""

__version__ = "0.1.0"
