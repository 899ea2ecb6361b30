"""errors.out_of_memory: which failures are a failed allocation (exit 7, errors.OutOfMemory) and the line the
user reads. The GPU's words are tested here on CPU (torch.OutOfMemoryError is the CUDA caching allocator's
exception class; its text below is the allocator's format); tests/dist/test_run_safety_cli.py provokes a
real host-memory failure and follows the fix."""
from __future__ import annotations

import pytest
import torch

from shardwise.errors import EXIT_OUT_OF_MEMORY, NOT_RESTARTABLE, OutOfMemory, out_of_memory

CUDA_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use.\n"
             "Of the allocated memory 75.3 GiB is allocated by PyTorch, and 1.4 GiB is reserved by PyTorch but "
             "unallocated. If reserved but unallocated memory is large try setting "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_the_gpu_allocators_error_gives_its_first_line():
    assert out_of_memory(torch.OutOfMemoryError(CUDA_TEXT)) == CUDA_TEXT.splitlines()[0]


def test_the_host_allocators_error_loses_its_c10_prefix():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: refused by the host allocator (or the kernel) at once
    assert out_of_memory(caught.value).startswith("DefaultCPUAllocator: can't allocate memory: you tried to "
                                                  "allocate 1125899906842624 bytes")
    assert out_of_memory(MemoryError()) == "Python could not allocate memory"


def test_other_failures_are_not_out_of_memory():
    assert out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)")) is None
    assert out_of_memory(ValueError("bad value")) is None


def test_out_of_memory_is_its_own_code_and_never_restarted():
    assert OutOfMemory("x").exit_code == EXIT_OUT_OF_MEMORY == 7 and EXIT_OUT_OF_MEMORY in NOT_RESTARTABLE
