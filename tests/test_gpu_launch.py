"""The driver launch path's parameter block (no GPU needed: the driver call is replaced by a
function that reads the block back, as cuLaunchKernel does)."""
import threading
import time

import numpy as np
import torch

from snack.gpu.launch import _DriverKernel


def _kernel_with_fake_driver(n_arrays, n_scalars, seen):
    """A _DriverKernel whose launch records (thread, array pointers, scalars) from the parameter
    block, with a pause in the middle of the read (the real call runs without the GIL)."""
    k = object.__new__(_DriverKernel)
    k.n_arrays = n_arrays
    n = 7 * n_arrays + n_scalars
    k.slots = np.zeros(n, dtype=np.int64)
    k.params = 0
    k.last = [None] * (n_arrays + n_scalars)
    k.max_threads = 1024
    k.fn = 0
    k.lock = threading.Lock()

    def fake_launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        first = int(k.slots[4])
        time.sleep(1e-4)  # another thread may run here
        ptrs = [int(k.slots[7 * a + 4]) for a in range(n_arrays)]
        seen.append((threading.get_ident(), first, ptrs, [int(v) for v in k.slots[7 * n_arrays:]], (gx, bx)))
        return 0

    k._launch = fake_launch
    return k


def test_parameter_block_holds_each_calls_arguments():
    seen = []
    k = _kernel_with_fake_driver(2, 1, seen)
    a, b, c = torch.zeros(3), torch.zeros(5), torch.zeros(7)
    k((4, 1), 2048, 0, [a, b], [11], 0)   # 2048 threads: capped at the kernel's maximum
    k((4, 1), 256, 0, [c, b], [12], 0)    # only what changed is rewritten
    k((4, 1), 256, 0, [c, b], [12], 0)
    assert [s[2] for s in seen] == [[a.data_ptr(), b.data_ptr()], [c.data_ptr(), b.data_ptr()]] + \
        [[c.data_ptr(), b.data_ptr()]]
    assert [s[3] for s in seen] == [[11], [12], [12]]
    assert seen[0][4] == (4, 1024)
    assert k.slots[7 + 2] == b.numel() and k.slots[7 + 3] == b.element_size()


def test_threads_launching_one_kernel_do_not_mix_their_arguments():
    seen = []
    k = _kernel_with_fake_driver(1, 0, seen)
    tensors = [torch.zeros(i + 1) for i in range(4)]
    mine = {}

    def worker(t):
        mine[threading.get_ident()] = t.data_ptr()
        for _ in range(50):
            k((1, 1), 32, 0, [t], [], 0)

    threads = [threading.Thread(target=worker, args=(t,)) for t in tensors]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(seen) == 200
    for tid, first, ptrs, _, _ in seen:
        assert first == ptrs[0] == mine[tid], "a launch read another thread's arguments"
