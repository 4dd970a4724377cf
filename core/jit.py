"""`njit_cached`: Numba's `njit(cache=True)`, safe for processes that compile at the same time.

Numba keeps one index file per cached function, mapping each signature to a data file named by
its position in that index (`f-<line>.py311.1.nbc`, `.2.nbc`, ...). Saving a new signature reads
the index, picks the first free number, writes the index, then the data, with no lock between
the steps (numba 0.68). Two processes that add different signatures of one function at once
(float32 in one, float64 in another, on a cold cache shared through a home directory, or pytest-
xdist workers) can both pick number 1: the index then maps one signature to the data file the
other process wrote last, and every later process that loads that signature runs machine code
compiled for other argument types (tests/test_jit_cache.py reproduces it).

`njit_cached(**options)` makes the same dispatcher as `njit(cache=True, **options)` but with a
cache that holds a lock file (`<index>.lock`, via `filelock`) around each load and each save, so
the read-pick-write sequence of one process never interleaves with another's. Loading takes the
lock too: a process must not read an index entry whose data file another is still replacing.
The lock is held for milliseconds (reading or writing one data file), never during a compile.
"""
from __future__ import annotations

import contextlib

from filelock import FileLock
from numba import njit
from numba.core.caching import FunctionCache

__all__ = ["njit_cached", "LockedFunctionCache"]


class LockedFunctionCache(FunctionCache):
    """Numba's per-function disk cache with its loads and saves under a lock file."""

    @contextlib.contextmanager
    def _locked(self, required: bool):
        # The index's own path names the lock: one lock per function and Python version, in
        # whichever directory Numba's locator chose (NUMBA_CACHE_DIR, __pycache__, user dir).
        lock = FileLock(self._cache_file._index_path + ".lock")
        try:
            self._impl.locator.ensure_cache_path()
            lock.acquire()
        except OSError:
            if required:
                raise
            yield  # a directory we cannot write to: nobody saves there, reading needs no lock
            return
        try:
            yield
        finally:
            lock.release()

    def _load_overload(self, sig, target_context):
        if not self._enabled:
            return None
        with self._locked(required=False):
            return super()._load_overload(sig, target_context)

    def _save_overload(self, sig, data):
        if not self._enabled:
            return
        with self._locked(required=True):
            super()._save_overload(sig, data)


def njit_cached(**options):
    """Decorator: `numba.njit(**options)` with an on-disk cache safe across processes."""
    if "cache" in options:
        raise TypeError("njit_cached: the 'cache' option is implied; do not pass it")

    def wrap(py_func):
        dispatcher = njit(**options)(py_func)
        dispatcher._cache = LockedFunctionCache(py_func)  # what Dispatcher.enable_caching sets
        return dispatcher

    return wrap
