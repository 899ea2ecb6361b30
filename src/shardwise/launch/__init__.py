"""Launch front ends: local processes through torch's elastic launcher (torch.distributed.run)."""
