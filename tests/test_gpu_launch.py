"""The driver launch path's parameter block (no GPU needed: the driver call is replaced by a
function that reads the block back, as cuLaunchKernel does)."""
import threading
import time

import numpy as np
import pytest
import torch

from conftest import collector_off
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


def _read_params(params, n):
    """The kernel arguments as cuLaunchKernel reads them: params is an array of n pointers, each
    to one 8-byte argument."""
    import ctypes
    ptrs = (ctypes.c_uint64 * n).from_address(params)
    return [ctypes.c_int64.from_address(p).value for p in ptrs]


def _bound_with_fake_driver(monkeypatch, arrays, scalars, seen, grid=(3, 2), block=256, smem=100):
    """A BoundLaunch on the driver path with the CUDA calls replaced: the launch records what
    the kernel would receive."""
    from snack.gpu import launch as L
    monkeypatch.setattr(L, "_mode", "driver")
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_raw_stream", lambda idx: 77)
    dispatcher = object()
    k = _kernel_with_fake_driver(len(arrays), len(scalars), [])
    k.max_threads = 128
    n = 7 * len(arrays) + len(scalars)

    def fake_launch(fn, gx, gy, gz, bx, by, bz, s, stream, params, extra):
        seen.append(dict(args=_read_params(params, n), grid=(gx, gy, gz), block=(bx, by, bz), smem=s,
                         stream=stream, thread=threading.current_thread().name))
        time.sleep(1e-5)
        return 0

    k._launch = fake_launch
    bound = L.BoundLaunch(dispatcher, grid, block, smem, arrays, scalars)
    return bound, k, dispatcher


def test_bound_launch_writes_fixed_arguments_once_and_per_call_arrays_when_they_change(monkeypatch):
    from snack.gpu import launch as L
    seen = []
    fa, fb = torch.zeros(6, dtype=torch.int32), torch.zeros(9, dtype=torch.int16)
    x1, y = torch.zeros(5), torch.zeros(4, dtype=torch.float64)
    bound, k, disp = _bound_with_fake_driver(monkeypatch, [fa, None, fb, None], [5, 2.5], seen)
    monkeypatch.setitem(L._driver_kernels, L._kernel_key(disp, 0, [fa, x1, fb, y]), k)
    dev = torch.device("cuda", 0)
    x2 = torch.zeros(8)
    bound([x1, y], dev)
    bound([x2, y], dev)
    bound([x2[:3], y], dev)  # same pointer, fewer elements: rewritten too
    assert len(seen) == 3
    for call, x in zip(seen, (x1, x2, x2[:3])):
        a = call["args"]
        for j, t in enumerate((fa, x, fb, y)):
            assert a[7 * j + 4] == t.data_ptr(), f"argument {j}: wrong pointer"
            assert a[7 * j + 2] == a[7 * j + 5] == t.numel(), f"argument {j}: wrong length"
            assert a[7 * j + 3] == a[7 * j + 6] == t.element_size(), f"argument {j}: wrong item size"
        assert a[28] == 5 and a[29] == int(np.float64(2.5).view(np.int64))
        assert call["grid"] == (3, 2, 1) and call["block"] == (128, 1, 1)  # capped at the kernel's maximum
        assert call["smem"] == 100 and call["stream"] == 77


def test_driver_kernels_are_compiled_per_dtype_of_every_array(monkeypatch):
    # the same dispatcher with arrays that differ only in a middle argument's dtype (an int32 or
    # a uint16 index) gets a kernel compiled for each, never the other's
    import contextlib
    from numba import cuda
    from snack.gpu import launch as L
    made = []

    class FakeKernel:
        compiled = True

        def __init__(self, dispatcher, sig, n_arrays, n_scalars, max_smem):
            made.append(sig)

    monkeypatch.setattr(L, "_DriverKernel", FakeKernel)
    monkeypatch.setattr(L, "device_properties", lambda device: (1, 0, 0))
    monkeypatch.setattr(cuda, "gpus", {0: contextlib.nullcontext()}, raising=False)
    monkeypatch.setattr(L, "_driver_kernels", {})
    disp = object()
    f32, i32, u16 = torch.zeros(2), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.uint16)
    k1 = L._driver_kernel(disp, 0, [f32, i32, f32, f32], [1], None)
    k2 = L._driver_kernel(disp, 0, [f32, u16, f32, f32], [1], None)
    assert k1 is not k2
    assert L._driver_kernel(disp, 0, [f32, i32, f32, f32], [1], None) is k1
    assert [str(sig[1].dtype) for sig in made] == ["int32", "uint16"]


def test_a_kernel_compile_leaves_no_cycle_holding_the_callers_frame(monkeypatch):
    # Numba's compiler leaves garbage cycles of its frames, and through f_back they hold the
    # frames of the call that compiled (a training step's forward, its output and graph): the
    # first launch of a kernel collects them. Here the fake compile leaves such a cycle, with the
    # cyclic collector off so that nothing else collects it.
    import contextlib
    import sys
    import weakref
    from numba import cuda
    from snack.gpu import launch as L

    class CompilerLikeKernel:
        compiled = True

        def __init__(self, dispatcher, sig, n_arrays, n_scalars, max_smem):
            cycle = [sys._getframe()]  # garbage once this returns: a list in a cycle with this frame,
            cycle.append(cycle)        # whose f_back is the caller's

    monkeypatch.setattr(L, "_DriverKernel", CompilerLikeKernel)
    monkeypatch.setattr(L, "device_properties", lambda device: (1, 0, 0))
    monkeypatch.setattr(cuda, "gpus", {0: contextlib.nullcontext()}, raising=False)
    monkeypatch.setattr(L, "_driver_kernels", {})

    def step():
        x = torch.randn(3, requires_grad=True)
        L._driver_kernel(object(), 0, [torch.zeros(2)], [], None)  # the first call compiles
        y = (x * 2).sum()  # assigned after the compile, as a forward's output is
        return weakref.ref(y)

    with collector_off():
        assert step()() is None
        monkeypatch.setattr(L, "gc", type("NoGC", (), {"collect": staticmethod(lambda: 0)}))
        monkeypatch.setattr(L, "_driver_kernels", {})
        assert step()() is not None  # (without the collection the cycle keeps it: the test bites)
    # a kernel loaded from the on-disk cache (no Numba compile, no cycles) costs no collection
    # (~0.1 s each on a small host)
    calls = []
    monkeypatch.setattr(L, "gc", type("CountGC", (), {"collect": staticmethod(lambda: calls.append(1))}))
    monkeypatch.setattr(L, "_driver_kernels", {})
    monkeypatch.setattr(CompilerLikeKernel, "compiled", False)
    L._driver_kernel(object(), 0, [torch.zeros(2)], [], None)
    assert calls == []
    monkeypatch.setattr(CompilerLikeKernel, "compiled", True)
    L._driver_kernel(object(), 0, [torch.zeros(2)], [], None)
    assert calls == [1]


def test_bfloat16_arrays_compile_as_int16_and_need_no_view_on_the_driver_path(monkeypatch):
    # the driver path hands a bfloat16 tensor over as it is (pointer, size, item size) and the
    # kernel is compiled for its int16 bits; the other paths need the int16 view
    from snack.gpu import launch as L
    bf = torch.zeros(3, dtype=torch.bfloat16)
    sig = L._numba_sig([bf, torch.zeros(2)], [1, 0.5])
    assert [str(t.dtype) for t in sig[:2]] == ["int16", "float32"]
    assert [str(t) for t in sig[2:]] == ["int64", "float64"]
    monkeypatch.setattr(L, "_mode", "driver")
    assert L.as_kernel_array(bf) is bf
    monkeypatch.setattr(L, "_mode", "numba")
    v = L.as_kernel_array(bf)
    assert v.dtype == torch.int16 and v.data_ptr() == bf.data_ptr()


def test_bound_launch_per_call_scalars(monkeypatch):
    # scalars given as None are passed at every call (an optimizer's learning rate) and written
    # when they change; the fixed ones stay; a wrong count is refused
    from snack.gpu import launch as L
    seen = []
    x, c = torch.zeros(5), torch.zeros(2, dtype=torch.int32)
    bound, k, disp = _bound_with_fake_driver(monkeypatch, [None, c], [7, None, 3, None], seen)
    monkeypatch.setitem(L._driver_kernels, L._kernel_key(disp, 0, [x, c]), k)
    dev = torch.device("cuda", 0)
    for lr, n in ((0.5, 11), (0.5, 11), (0.25, 12), (-1.0, 12)):
        bound([x], dev, (lr, n))
        a = seen[-1]["args"]
        assert a[14:] == [7, int(np.float64(lr).view(np.int64)), 3, n]
        assert a[4] == x.data_ptr() and a[7 + 4] == c.data_ptr()
    with pytest.raises(ValueError, match="takes 2 scalars per call, got 1"):
        bound([x], dev, (0.5,))


def test_bound_launch_from_several_threads_keeps_each_calls_arrays(monkeypatch):
    from snack.gpu import launch as L
    seen = []
    fixed = torch.zeros(3)
    bound, k, disp = _bound_with_fake_driver(monkeypatch, [fixed, None], [], seen)
    tensors = [torch.zeros(i + 1) for i in range(4)]
    monkeypatch.setitem(L._driver_kernels, L._kernel_key(disp, 0, [fixed, tensors[0]]), k)
    mine = {}

    def worker(t):
        mine[threading.current_thread().name] = t.data_ptr()
        for _ in range(50):
            bound([t], torch.device("cuda", 0))

    threads = [threading.Thread(target=worker, args=(t,), name=f"w{i}") for i, t in enumerate(tensors)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(seen) == 200
    for call in seen:
        assert call["args"][7 + 4] == mine[call["thread"]], "a launch read another thread's arguments"
        assert call["args"][4] == fixed.data_ptr()


def test_bound_launch_deep_copy_binds_copies_of_its_fixed_arrays(monkeypatch):
    import copy
    seen = []
    fixed = torch.arange(5, dtype=torch.int32)
    bound, k, disp = _bound_with_fake_driver(monkeypatch, [fixed, None], [3], seen)
    memo = {}
    twin = copy.deepcopy(fixed, memo)
    other = copy.deepcopy(bound, memo)
    assert other is not bound and other.fixed[0] is twin  # the same copy as the rest of the deep copy
    assert other.fixed[1] is None and other.scalars == [3] and other.grid == bound.grid
    assert other._state == {} and other._lock is not bound._lock


@pytest.mark.gpu
def test_build_persistent_runs_on_its_worker_nests_and_raises():
    """build_persistent runs fn on its worker thread (outside any CUDA-graph pool of the caller's
    thread), a build within a build runs in place on that worker (no deadlock), results are
    ordered before the caller's later work, and fn's exceptions reach the caller."""
    from snack.gpu.launch import build_persistent
    main = threading.get_ident()

    def inner():
        return threading.get_ident(), torch.arange(5, device="cuda", dtype=torch.float32)

    def outer():
        return threading.get_ident(), build_persistent("cuda", inner)
    t_outer, (t_inner, a) = build_persistent("cuda", outer)
    assert t_outer != main and t_inner == t_outer
    assert torch.equal((a * 2).cpu(), torch.arange(5, dtype=torch.float32) * 2)

    def bad():
        raise ValueError("indices are not sorted")
    with pytest.raises(ValueError, match="not sorted"):
        build_persistent("cuda", bad)
    assert build_persistent("cpu", threading.get_ident) == main   # off the GPU: in place
    # fn ran on the builder's stream, which is none of the default-priority pool's streams (where
    # another thread's capture stream may come from)
    from snack.gpu import launch
    side = build_persistent("cuda", lambda: torch.cuda.current_stream().cuda_stream)
    assert side == launch._build_streams[torch.device("cuda")].cuda_stream
    assert side not in {torch.cuda.Stream().cuda_stream for _ in range(64)}
    assert launch.private_stream("cuda").priority == launch.PRIVATE_STREAM_PRIORITY < 0


def test_cluster_launch_config(monkeypatch):
    # the cuLaunchKernelEx config as the driver reads it: CUlaunchConfig (grid, block, shared
    # memory, stream at byte 32, attributes at 40, their count at 48) and one CUlaunchAttribute
    # (id 4 = cluster dimension, the dimensions at byte 8)
    import ctypes
    from snack.gpu import launch as L
    seen = []

    def fake_ex(addr, fn, params, extra):
        raw = ctypes.string_at(addr, 56)
        u = np.frombuffer(raw[:28], dtype=np.uint32).tolist()
        stream, attrs = np.frombuffer(raw[32:48], dtype=np.uint64).tolist()
        n_attrs = int(np.frombuffer(raw[48:52], dtype=np.uint32)[0])
        a = ctypes.string_at(attrs, 72)
        seen.append((u, stream, n_attrs, np.frombuffer(a[:4], dtype=np.uint32)[0],
                     np.frombuffer(a[8:20], dtype=np.uint32).tolist(), fn, params))
        return 0
    monkeypatch.setattr(L, "_launch_ex", fake_ex)
    assert ctypes.sizeof(L._cluster_structs()[0]) == 72 and ctypes.sizeof(L._cluster_structs()[1]) == 56
    f = L._cluster_launch((8, 3, 5), 512, 150000, 4)
    assert f(1234, 8, 3, 5, 512, 1, 1, 150000, 777, 4321, None) == 0
    f(1234, 8, 3, 5, 512, 1, 1, 150000, 778, 4321, None)
    assert seen[0] == ([8, 3, 5, 512, 1, 1, 150000], 777, 1, 4, [4, 1, 1], 1234, 4321)
    assert seen[1][1] == 778  # the stream is written at every call
