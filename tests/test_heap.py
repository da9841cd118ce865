"""The runner keeps a batch's freed activations in the heap for the next batch (``runner.keep_freed_batches``)."""
import json
import platform
import subprocess
import sys

import pytest

# In a fresh process (glibc's thresholds are per process), with an argument after keep_freed_batches(): is a 20 MB
# tensor served from the heap (below the program break) rather than from pages mapped for it, and how many page
# faults do batches 6-8 of a churn of 46 MB batches take (each batch's small allocations shift where the next one's
# tensors fit: the heap settles over the first few)? Without it, glibc's starting threshold (raised by whatever the
# imports freed, a few MB) maps the 20 MB tensor; whether its default trim threshold then hands each batch back
# depends on where small allocations fell (in a model, they did: 60,000-140,000 faults per 256 long pairs).
PROBE = """
import ctypes, json, resource, sys, torch
from xenc_lab.cpu.heap import keep_freed_batches
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
if len(sys.argv) > 1:
    assert keep_freed_batches()
big = torch.empty(20 << 20, dtype=torch.uint8)
on_heap = big.data_ptr() < libc.sbrk(0)
del big
def batch(sizes):
    live = [torch.ones(n << 20, dtype=torch.uint8) for n in sizes]  # written: a fresh page faults
    del live
for _ in range(5):
    batch((20, 13, 13))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    batch((20, 13, 13))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"on_heap": on_heap, "faults": faults}))
"""


def probe(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's heap only")
def test_keep_freed_batches_serves_big_tensors_from_the_heap_and_repeat_batches_take_few_page_faults():
    default, raised = probe(), probe("raised")
    print(f"glibc's defaults: {default}; after keep_freed_batches(): {raised}")
    assert not default["on_heap"]  # the test can fail: a 20 MB tensor is mapped for itself by default
    assert raised["on_heap"]
    assert raised["faults"] < 500  # a 46 MB batch handed back and taken again would take ~11,800 a batch
