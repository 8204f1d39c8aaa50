"""Keep freed memory in the process's heap for the next step (glibc).

A forward pass allocates its activations afresh, tens of MB a prefill step. glibc's malloc hands the
largest of them to mmap and, when freed, back to the kernel, and trims the heap's free top: the next
step faults the same pages in again, one 4 KiB zeroed page at a time: tens of thousands of faults a
multi-turn call. Kept, a call takes under a hundred, and with the engine's warm-up step it runs faster,
more so on a busy host. A training step's activations and logits come and go the same way: the SFT and
RL trainers keep them too (docs/experiments.md has the measurements)."""

from __future__ import annotations

import ctypes
import functools

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: an allocation above it still maps and unmaps on its own
TRIM_THRESHOLD = 2**30  # free memory at the heap's top kept up to this much
# the same settings for a process started from outside (glibc reads them at start-up): the benchmark gives
# them to vLLM so that both engines run on equally tuned allocators
GLIBC_TUNABLES = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"


@functools.cache
def keep_freed_memory() -> bool:
    """Fix malloc's mmap threshold at 32 MiB and keep up to 1 GiB free at the heap's top, for this
    process (once). False where the C library is not glibc: nothing is changed."""
    libc = ctypes.CDLL(None)  # the symbols already loaded: the C library's among them
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: another mallopt takes other options
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def keep_freed_memory_on(device: torch.device) -> bool:
    """`keep_freed_memory` for a process that computes on `device`: only the CPU's memory is malloc's."""
    return device.type == "cpu" and keep_freed_memory()
