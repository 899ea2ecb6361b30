"""Worker entry point of `shardwise generate --nproc N`: `torchrun --nproc-per-node N -m shardwise.infer ARGS`."""
from shardwise.infer.generate import worker_main

if __name__ == "__main__":
    worker_main()
