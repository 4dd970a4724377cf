"""Warp intrinsics for Numba's CUDA simulator, so the real kernels run on machines without a GPU.

Numba's simulator (NUMBA_ENABLE_CUDASIM=1) runs one OS thread per CUDA thread but has no warp
shuffles and no libdevice. `install()` adds to its fake `cuda` module:
  shfl_sync(mask, value, src_lane), shfl_xor_sync(mask, value, lane_mask): implemented with a
  32-thread barrier per warp (all 32 lanes must take part, as in SNACK's kernels);
  libdevice.int_as_float / float_as_int: bit casts through numpy;
  shared.array(..., alignment=...): the alignment is accepted (numpy's buffers satisfy it).
Trade-off: slow (two barrier waits per shuffle), so simulated shapes stay tiny; the `mask`
argument is not checked. Used only when the simulator is on. `install()` also shortens the
interpreter's thread switch interval (sys.setswitchinterval, 5 ms by default) to 0.2 ms: the 32
threads of a warp then meet at each shuffle's barrier without waiting out a 5 ms time slice
(tests/gpu_sim/kernels_sim.py: 12.9 -> 2.1 minutes on 2 cores).
"""
from __future__ import annotations

import sys
import threading
import types

import numpy as np

_installed = False
_lock = threading.Lock()
SWITCH_INTERVAL = 2e-4  # seconds


class _Warp:
    __slots__ = ("barrier", "vals")

    def __init__(self):
        self.barrier = threading.Barrier(32, timeout=120)
        self.vals = [None] * 32


def _warp_state():
    t = threading.current_thread()
    mgr = t._manager
    w = t.thread_id // 32
    warps = mgr.__dict__.get("_snack_warps")
    if warps is None:
        with _lock:
            warps = mgr.__dict__.setdefault("_snack_warps", {})
    st = warps.get(w)
    if st is None:
        with _lock:
            st = warps.setdefault(w, _Warp())
    return st, t.thread_id % 32


def _exchange(value, src):
    st, lane = _warp_state()
    st.vals[lane] = value
    st.barrier.wait()
    out = st.vals[src]
    st.barrier.wait()
    return out


def _shfl_sync(self, mask, value, src_lane):
    return _exchange(value, int(src_lane) % 32)


def _shfl_xor_sync(self, mask, value, lane_mask):
    _, lane = _warp_state()
    return _exchange(value, (lane ^ int(lane_mask)) % 32)


_libdevice = types.SimpleNamespace(
    int_as_float=lambda i: np.array(int(i) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()],
    float_as_int=lambda f: np.array(f, dtype=np.float32).view(np.int32)[()],
)


def install() -> None:
    """Adds the intrinsics to the simulator's fake cuda module (idempotent)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator.kernelapi import FakeCUDAModule
    FakeCUDAModule.shfl_sync = _shfl_sync
    FakeCUDAModule.shfl_xor_sync = _shfl_xor_sync
    FakeCUDAModule.libdevice = property(lambda self: _libdevice)
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    plain = FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        # numpy buffers are aligned well beyond what the kernels ask for (16 bytes)
        return plain(self, shape, dtype)

    FakeCUDAShared.array = array
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
    _installed = True
