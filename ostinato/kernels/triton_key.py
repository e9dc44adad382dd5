"""Triton's key of its own build, hashed while the model loads.

The first kernel a process compiles, or loads from Triton's disk cache, waits for Triton's key
of its build (`triton.runtime.cache.triton_key`: SHA-256 of libtriton and the compiler's
sources), 0.37 s of a 2.8 s start-up on the H100 host (benchmarks/h100-2026-11-26-s25.md).
Reading and hashing release the GIL, so a thread started before the weights load computes it
while they do, and the first kernel finds it in triton_key's cache.
"""

from __future__ import annotations

import threading

from triton.runtime import cache


def hash_in_background() -> threading.Thread:
    """Start hashing; join the thread before the first kernel (a launch that calls triton_key
    while the thread runs would hash again, not wrongly, only for nothing)."""
    thread = threading.Thread(target=cache.triton_key, name="triton-key", daemon=True)
    thread.start()
    return thread
