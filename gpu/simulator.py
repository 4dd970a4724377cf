"""Warp intrinsics and a leaner block scheduler for Numba's CUDA simulator, so the real kernels
run on machines without a GPU.

Numba's simulator (NUMBA_ENABLE_CUDASIM=1) runs one OS thread per CUDA thread but has no warp
shuffles and no libdevice. `install()` adds to its fake `cuda` module:
  shfl_sync(mask, value, src_lane), shfl_xor_sync(mask, value, lane_mask): all 32 lanes of the
  warp must take part (as in SNACK's kernels); each shuffle is one meeting of the 32 threads:
  every lane writes its value into one of two buffers (alternating from shuffle to shuffle, so
  a lane running ahead into the next shuffle cannot overwrite a value still to be read) and the
  last to arrive wakes the others;
  libdevice.int_as_float / float_as_int: bit casts through numpy;
  shared.array(..., alignment=...): the alignment is accepted (numpy's buffers satisfy it).
It also replaces how a block runs: the simulator's block manager polls every thread of the block
in a loop to find out when all of them wait at `syncthreads`, and that loop held the interpreter
lock most of the time; here the last live thread to reach the barrier releases the others, a
thread that returns stops counting (as in the simulator), and the manager just joins the
threads. An exception in one thread aborts the others at their next barrier or shuffle and is
raised from the launch, as the simulator does.
Trade-off: still one OS thread per CUDA thread, so simulated shapes stay tiny; the `mask`
argument is not checked. Used only when the simulator is on. The interpreter's thread switch
interval stays at its default (5 ms): with the polling loop gone, threads hand the interpreter
lock on at each barrier, and a shorter interval only forces more hand-offs (0.2 ms, set here
while the simulator's scheduler polled: tests/gpu_sim on 2 cores 292 s against 215-234 s).
"""
from __future__ import annotations

import threading
import time
import types

import numpy as np

_installed = False
SHUFFLE_TIMEOUT = 120.0  # seconds a lane waits for the rest of its warp before the launch fails


def _closed_gate() -> threading.Lock:
    g = threading.Lock()
    g.acquire()
    return g


class _Warp:
    """The meeting point of a warp's 32 threads for shuffles."""
    __slots__ = ("lock", "count", "vals", "gates", "phase")

    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0
        self.vals = ([None] * 32, [None] * 32)
        self.gates = [_closed_gate() for _ in range(32)]
        self.phase = [0] * 32


class _BlockSync:
    """`syncthreads` for one simulated block: the last live thread to arrive opens the others'
    gates; a thread that leaves (returns, or raises) no longer counts."""
    __slots__ = ("lock", "alive", "waiting", "threads", "failed")

    def __init__(self, threads):
        self.lock = threading.Lock()
        self.alive = len(threads)
        self.waiting = []
        self.threads = threads
        self.failed = None

    def arrive(self, gate) -> None:
        with self.lock:
            if len(self.waiting) + 1 < self.alive:
                self.waiting.append(gate)
                release = None
            else:
                release, self.waiting = self.waiting, []
        if release is None:
            gate.acquire()
        else:
            for g in release:
                g.release()

    def leave(self, thread) -> None:
        with self.lock:
            self.alive -= 1
            release = []
            if thread.exception is not None and self.failed is None:
                self.failed = thread
                for t in self.threads:
                    t.abort = True
                release, self.waiting = self.waiting, []
            elif self.waiting and len(self.waiting) >= self.alive:
                release, self.waiting = self.waiting, []
        for g in release:
            g.release()


def _exchange(value, src=None, lane_mask=0):
    """The value of lane `src` of this thread's warp, or, without `src`, of lane `lane ^ lane_mask`."""
    t = threading.current_thread()
    st = t._manager._snack_warps[t.thread_id // 32]
    lane = t.thread_id % 32
    if src is None:
        src = lane ^ lane_mask
    ph = st.phase[lane]
    st.phase[lane] = ph ^ 1
    buf = st.vals[ph]
    buf[lane] = value
    with st.lock:
        st.count += 1
        last = st.count == 32
        if last:
            st.count = 0
    if last:
        for i, g in enumerate(st.gates):
            if i != lane:
                g.release()
    else:
        gate, t0 = st.gates[lane], time.monotonic()
        while not gate.acquire(timeout=0.5):
            if t.abort:
                raise RuntimeError("abort flag set during a warp shuffle")
            if time.monotonic() - t0 > SHUFFLE_TIMEOUT:
                raise RuntimeError(f"warp shuffle: lane {lane} waited {SHUFFLE_TIMEOUT:.0f} s for the other lanes "
                                   "of its warp (all 32 lanes must take part)")
    return buf[src % 32]


def _shfl_sync(self, mask, value, src_lane):
    return _exchange(value, src=int(src_lane))


def _shfl_xor_sync(self, mask, value, lane_mask):
    return _exchange(value, lane_mask=int(lane_mask))


_libdevice = types.SimpleNamespace(
    int_as_float=lambda i: np.array(int(i) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()],
    float_as_int=lambda f: np.array(f, dtype=np.float32).view(np.int32)[()],
)


def _install_block_scheduler() -> None:
    from numba.cuda.simulator.kernel import BlockManager, BlockThread

    plain_thread_run = BlockThread.run

    def thread_run(self):
        try:
            plain_thread_run(self)  # catches the kernel's exception into self.exception
        finally:
            self._manager._snack_sync.leave(self)

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        self._manager._snack_sync.arrive(self._snack_gate)
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run(self, grid_point, *args):
        def target():
            self._f(*args)

        threads = [BlockThread(target, self, grid_point, p, self._debug) for p in np.ndindex(*self._block_dim)]
        for t in threads:
            t._snack_gate = _closed_gate()
        self._snack_sync = _BlockSync(threads)
        self._snack_warps = {w: _Warp() for w in range((len(threads) + 31) // 32)}
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = self._snack_sync.failed
        if failed is not None:
            raise failed.exception[0].with_traceback(failed.exception[1])

    BlockThread.run = thread_run
    BlockThread.syncthreads = syncthreads
    BlockManager.run = run


def install() -> None:
    """Adds the intrinsics to the simulator's fake cuda module and its block scheduler
    (idempotent)."""
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
    _install_block_scheduler()
    _installed = True
