"""snack.gpu.simulator: the warp shuffles and the block scheduler it adds to Numba's CUDA simulator,
on kernels small enough to check by hand. Run under NUMBA_ENABLE_CUDASIM=1 by
tests/test_gpu_simulator.py (like kernels_sim.py, not collected by a plain `pytest` run)."""
import time

import numba
import numpy as np
import pytest
from numba import cuda

from snack.gpu.simulator import install

install()
FULL = 0xFFFFFFFF


@cuda.jit
def _shuffles(out, rounds):
    t = cuda.threadIdx.x
    lane = t % 32
    v = t * 10 + 1
    a = cuda.shfl_xor_sync(FULL, v, 1)
    b = cuda.shfl_xor_sync(FULL, a, 16)
    c = cuda.shfl_sync(FULL, b + lane, (lane + 5) % 32)
    out[t, 0] = a
    out[t, 1] = b
    out[t, 2] = c
    # many shuffles back to back, lanes running ahead of each other between them
    w = t
    for k in range(rounds):
        if lane % 3 == 0:
            for _ in range(lane):  # some lanes take longer between two shuffles
                w += 0
        w = cuda.shfl_xor_sync(FULL, w, k % 32) * 3 + lane
        w = w % 100003
    out[t, 3] = w


@pytest.mark.parametrize("threads", [32, 96])
def test_shuffles_read_the_lanes_they_name(threads):
    rounds = 40
    out = np.zeros((threads, 4), dtype=np.int64)
    _shuffles[1, threads](out, rounds)
    t = np.arange(threads)
    base, lane = t - t % 32, t % 32
    v = t * 10 + 1
    a = v[t ^ 1]
    b = a[t ^ 16]
    c = (b + lane)[base + (lane + 5) % 32]
    w = t.copy()
    for k in range(rounds):
        w = (w[base + (lane ^ (k % 32))] * 3 + lane) % 100003
    np.testing.assert_array_equal(out[:, 0], a)
    np.testing.assert_array_equal(out[:, 1], b)
    np.testing.assert_array_equal(out[:, 2], c)
    np.testing.assert_array_equal(out[:, 3], w)


@cuda.jit
def _early_exit(out, n_active):
    s = cuda.shared.array(1, dtype=numba.int64)
    t = cuda.threadIdx.x
    if t == 0:
        s[0] = 0
    cuda.syncthreads()
    if t >= n_active:
        return
    for k in range(3):
        cuda.atomic.add(s, 0, 1)
        cuda.syncthreads()
        if t == 0:
            out[k] = s[0]
        cuda.syncthreads()


@pytest.mark.parametrize("n_active", [1, 37, 64])
def test_syncthreads_counts_only_threads_that_have_not_returned(n_active):
    out = np.zeros(3, dtype=np.int64)
    _early_exit[2, 64](out, n_active)  # two blocks, one after the other, the same shared array
    np.testing.assert_array_equal(out, n_active * np.arange(1, 4))


@cuda.jit
def _fails(out, bad, at_shuffle):
    t = cuda.threadIdx.x
    v = cuda.shfl_xor_sync(FULL, t, 1)
    cuda.syncthreads()
    if t == bad:
        out[100000] = 1  # out of bounds: an IndexError in this thread
    if at_shuffle:
        v = cuda.shfl_xor_sync(FULL, v, 2)  # the failing lane's warp waits here
    else:
        cuda.syncthreads()  # the whole block waits here
    out[t] = v


@pytest.mark.parametrize("at_shuffle", [False, True])
def test_an_exception_in_one_thread_is_raised_by_the_launch_and_stops_the_others(at_shuffle):
    out = np.zeros(64, dtype=np.int64)
    t0 = time.monotonic()
    with pytest.raises(IndexError, match=r"tid=\[37, 0, 0\]"):
        _fails[1, 64](out, 37, at_shuffle)
    assert time.monotonic() - t0 < 30  # no lane waited out a timeout
