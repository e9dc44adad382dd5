"""Triton's key of its own build, saved once per install instead of hashed at every start-up.

The first kernel a process compiles, or loads from Triton's disk cache, waits for Triton's key
of its build (`triton.runtime.cache.triton_key`: SHA-256 of libtriton and the compiler's
sources), 0.36-0.43 s on the H100 host: with random or page-cached weights, the longest part
of loading them (benchmarks/h100-2026-11-26-s25.md, -s26.md). The key depends only on the files
of the Triton install, so it is saved beside Triton's cache under a name made of every file's
path, size and modification time; a later start-up of the same install reads it back and
hands it to Triton (as Triton's own compile workers do). Without a saved key, a thread hashes
while the weights load (reading and hashing release the GIL) and saves what it found.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path

import triton
from triton.runtime import cache

TRITON_ROOT = os.path.dirname(triton.__file__)


def prepare() -> threading.Thread | None:
    """Make the key ready for the first kernel: the saved one for this install (None is
    returned), or a thread that hashes and saves it, to join before the first kernel."""
    saved = saved_key_path()
    try:
        key = saved.read_text()
    except OSError:
        thread = threading.Thread(target=_hash_and_save, args=(saved,), name="triton-key")
        thread.daemon = True
        thread.start()
        return thread
    cache.triton_key = lambda: key
    return None


def saved_key_path(root: str = TRITON_ROOT) -> Path:
    """Where the key of the Triton install at root is saved: named by a digest of every
    file's relative path, size and modification time, so any change to the install (an
    upgrade, a reinstall, an edited source) names another file."""
    entries = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]  # written by imports, not installs
        for name in files:
            path = os.path.join(folder, name)
            stat = os.stat(path)
            entries.append(f"{os.path.relpath(path, root)}:{stat.st_size}:{stat.st_mtime_ns}")
    digest = hashlib.sha256("\n".join([triton.__version__, *sorted(entries)]).encode())
    return Path(triton.knobs.cache.dir) / f"ostinato-triton-key-{digest.hexdigest()[:32]}"


def _hash_and_save(saved: Path) -> None:
    """Hash (into triton_key's own cache) and save the key; a cache that cannot be written
    only means the next start-up hashes again."""
    key = cache.triton_key()
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=saved.parent, delete=False) as f:
            f.write(key)
        os.replace(f.name, saved)  # whole or absent: a reader never sees half a key
    except OSError:
        pass
