"""Freed memory kept in the heap (core/heap.py)."""

import platform
import subprocess
import sys

import pytest

# A fresh process allocates, touches and frees 20 MiB and 6 MiB five times, counting the page faults of
# each round. glibc left to itself maps the 20 MiB afresh in the first round and grows its heap in the
# second; kept, only the first round faults the memory in.
CYCLES = """
import ctypes, resource
from assay.core.heap import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
assert keep_freed_memory()
sizes = (20 << 20, 6 << 20)
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(n) for n in sizes]
    for p, n in zip(blocks, sizes):
        ctypes.memset(p, 1, n)
    for p in blocks:
        libc.free(p)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_memory_is_reused_without_faulting_it_in_again():
    out = subprocess.run([sys.executable, "-c", CYCLES], capture_output=True, text=True, check=True).stdout
    faults = [int(line) for line in out.split()]
    assert faults[0] > (26 << 20) // 4096 // 2  # the first round does fault its memory in (the count is real)
    assert max(faults[1:]) < 100, faults  # then the same memory is reused: no page is faulted in again
