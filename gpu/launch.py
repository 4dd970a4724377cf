"""Launching Numba-compiled kernels on torch tensors with little host overhead.

Three paths, chosen once per process:
- "driver" (default on a GPU): the kernel is compiled by Numba once per signature (or loaded from
  the on-disk cache of compiled kernels, `snack.gpu.cache`), then launched
  with `cuda.bindings.driver.cuLaunchKernel` from a prebuilt parameter block (Numba's ABI: a 1-D
  array argument is 7 machine words: meminfo, parent, nitems, itemsize, data, shape, stride).
  Per call only the pointers and sizes are written into the block: a few microseconds of host
  time instead of the 60-150 us of Numba's dispatcher. The stream is torch's *current* stream,
  looked up at every call, so launches land inside `torch.cuda.graph` capture.
- "numba": Numba's dispatcher on `cuda.as_cuda_array` views and `cuda.external_stream`, the
  slow but simple reference path (SNACK_LAUNCH=numba selects it, for debugging).
- "sim": Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) on CPU tensors viewed as numpy arrays;
  used by the tests on machines without a GPU.
Every kernel argument is a 1-D C-contiguous array or a scalar (a Python int is passed as int64, a
Python float as float64); bfloat16 tensors are read as their int16 bits (Numba has no bfloat16
array type): the kernel is compiled for int16, and the driver path takes the bfloat16 tensor itself
(`as_kernel_array` makes the int16 view the other paths need).
Trade-off: the driver path relies on Numba's kernel ABI and its compiled-kernel handle; there is
no start-up check of it: a mismatch (a numba-cuda release changing the ABI) would show as wrong
results in the GPU tests, which run every kernel through this path against float64 references,
and SNACK_LAUNCH=numba then falls back to the dispatcher.
"""
from __future__ import annotations

import gc
import os
import threading

import numpy as np
import torch

__all__ = ["launch_mode", "launch", "BoundLaunch", "zero", "as_kernel_array", "device_properties",
           "build_persistent", "clusters_supported", "max_active_clusters"]

_SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
_lock = threading.Lock()
_mode = None


def launch_mode() -> str:
    """'sim', 'driver' or 'numba' (see the module docstring)."""
    global _mode
    if _mode is None:
        if _SIM:
            from .simulator import install
            install()
            _mode = "sim"
        else:
            _mode = os.environ.get("SNACK_LAUNCH", "driver")
            if _mode not in ("driver", "numba"):
                raise ValueError(f"SNACK_LAUNCH must be 'driver' or 'numba', got {_mode!r}")
    return _mode


def as_kernel_array(t: torch.Tensor) -> torch.Tensor:
    """`t` as kernels take it (a contiguous tensor, read as 1-D): bfloat16 as int16 bits (the
    driver path takes bfloat16 tensors as they are: it reads their pointer and size, and compiles
    for int16). Under the simulator the tensor is also flattened (numpy needs the 1-D shape)."""
    if t.dtype == torch.bfloat16 and (_mode or launch_mode()) != "driver":
        t = t.view(torch.int16)
    if _SIM:
        t = t.reshape(-1)
    return t


# Streams SNACK keeps for itself (the builder's below, the captured backward's side streams in
# layers/functional) come from torch's high-priority pool. torch.cuda.Stream() hands out the 32
# streams of a pool per priority in turn, so a stream kept from the default-priority pool, where
# torch.cuda.graph's capture stream and a user's streams come from, is sooner or later the very
# stream another thread captures on. The high-priority pool is disjoint from it (and hands out 32
# distinct streams before it repeats one).
PRIVATE_STREAM_PRIORITY = -1


def private_stream(device) -> "torch.cuda.Stream":
    """A new stream on `device` for SNACK's own use, never one of the default-priority pool's."""
    return torch.cuda.Stream(device, priority=PRIVATE_STREAM_PRIORITY)


_build_streams = {}
_builder = None
_on_builder = threading.local()  # .active: this thread is the builder (a nested call runs in place)


def build_persistent(device, fn, /, *args, **kwargs):
    """fn(*args, **kwargs), for a function that builds CUDA tensors meant to be kept across calls (a
    topology's arrays, launch plans' arrays, dummy arguments), so that they come from torch's
    ordinary allocator and never from a CUDA-graph pool: torch.compile's CUDA-graph trees route
    every allocation of the thread that warms a graph up to their pool, and refuse pool memory
    that outlives the graph's outputs. fn runs on a worker thread of its own, on a side stream
    that first waits for the caller's current stream and that the caller's stream then waits
    for; its exceptions reach the caller. Under stream capture (where building anything would be
    captured), off the GPU and when called from the worker itself (a build within a build) fn runs
    in place."""
    global _builder
    device = torch.device(device)
    if _SIM or device.type != "cuda" or getattr(_on_builder, "active", False) \
            or torch.cuda.is_current_stream_capturing():
        return fn(*args, **kwargs)
    with _lock:
        if _builder is None:
            from concurrent.futures import ThreadPoolExecutor
            _builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snack-build")
        side = _build_streams.get(device)
        if side is None:
            side = _build_streams[device] = private_stream(device)
    cur = torch.cuda.current_stream(device)
    side.wait_stream(cur)

    def work():
        _on_builder.active = True
        try:
            with torch.cuda.device(device), torch.cuda.stream(side):
                return fn(*args, **kwargs)
        finally:
            _on_builder.active = False
    try:
        return _builder.submit(work).result()
    finally:
        cur.wait_stream(side)


_props_cache = {}


def device_properties(device: torch.device):
    """(multiprocessor count, max dynamic shared memory per block, shared memory per SM)."""
    if launch_mode() == "sim":
        return (2, 227 * 1024, 228 * 1024)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    p = _props_cache.get(idx)
    if p is None:
        props = torch.cuda.get_device_properties(idx)
        optin = getattr(props, "shared_memory_per_block_optin", 48 * 1024)
        per_sm = getattr(props, "shared_memory_per_multiprocessor", optin)
        p = (props.multi_processor_count, int(optin), int(per_sm))
        _props_cache[idx] = p
    return p


class _DriverKernel:
    """One compiled kernel with a reusable parameter block. A lock per kernel keeps two threads
    from rewriting the block at once: the driver reads it during cuLaunchKernel, which ctypes
    calls without holding the GIL."""

    def __init__(self, dispatcher, sig, n_arrays: int, n_scalars: int, max_smem: int):
        from cuda.bindings import driver
        from .cache import kernel_handle
        handle, self.compiled = kernel_handle(dispatcher, sig)
        self.n_arrays = n_arrays
        self.slots, self.ptrs, self.params = _param_block(7 * n_arrays + n_scalars)
        self.last = [None] * (n_arrays + n_scalars)
        err = _set_max_dynamic_smem(handle, max_smem)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot set the shared-memory limit of a SNACK kernel: {err}")
        mt = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        if isinstance(handle, driver.CUkernel):
            err, self.max_threads = driver.cuKernelGetAttribute(mt, handle, torch.cuda.current_device())
        else:
            err, self.max_threads = driver.cuFuncGetAttribute(mt, handle)
        if err != driver.CUresult.CUDA_SUCCESS:
            self.max_threads = 256
        self.handle = handle
        self.fn = int(handle)
        self._launch = _libcuda_launch()
        self.lock = threading.Lock()

    def __call__(self, grid, block, smem, arrays, scalars, stream_ptr):
        with self.lock:
            s = self.slots
            last = self.last
            i = 0
            for a, t in enumerate(arrays):
                key = (t.data_ptr(), t.numel(), t.element_size())
                if last[a] != key:  # rewrite only what changed since the previous launch
                    ptr, n, isz = key
                    s[i + 2] = n
                    s[i + 3] = isz
                    s[i + 4] = ptr
                    s[i + 5] = n
                    s[i + 6] = isz
                    last[a] = key
                i += 7
            for a, v in enumerate(scalars):
                if last[self.n_arrays + a] != v:
                    s[i] = _scalar_bits(v)
                    last[self.n_arrays + a] = v
                i += 1
            if block > self.max_threads:  # register-heavy variants: fewer threads, same result
                block = self.max_threads
            gz = grid[2] if len(grid) > 2 else 1
            err = self._launch(self.fn, grid[0], grid[1], gz, block, 1, 1, smem, stream_ptr, self.params, None)
            if err != 0:
                raise RuntimeError(f"SNACK kernel launch failed with CUDA driver error {err}")


def _param_block(n: int):
    """(slots, pointers, params) for n 8-byte kernel arguments: slots int64 (n,) holds the
    values, pointers uint64 (n,) the address of each slot (kept alive with the slots), params the
    address of the pointer array, as cuLaunchKernel takes it."""
    slots = np.zeros(n, dtype=np.int64)
    ptrs = np.array([slots.ctypes.data + 8 * i for i in range(n)], dtype=np.uint64)
    return slots, ptrs, int(ptrs.ctypes.data)


def _kernel_key(dispatcher, idx: int, arrays) -> tuple:
    """What a compiled kernel is cached under: the dispatcher, the device and the dtype of every
    array argument (one kernel compiled for int32 indices must never read uint16 ones)."""
    return (id(dispatcher), idx) + tuple(t.dtype for t in arrays)


def _driver_kernel(dispatcher, idx: int, arrays, scalars, device) -> "_DriverKernel":
    """The _DriverKernel of `dispatcher` for these arguments' dtypes on device idx, built once
    (per device: the shared-memory limit is a per-device attribute of a kernel)."""
    key = _kernel_key(dispatcher, idx, arrays)
    k = _driver_kernels.get(key)
    if k is None:
        compiled = False
        with _lock:
            k = _driver_kernels.get(key)
            if k is None:
                from numba import cuda
                sig = _numba_sig(arrays, scalars)
                with cuda.gpus[idx]:  # Numba loads the module into this device's context
                    k = _DriverKernel(dispatcher, sig, len(arrays), len(scalars), device_properties(device)[1])
                _driver_kernels[key] = k
                compiled = k.compiled  # False when loaded from the on-disk cache (snack.gpu.cache)
        if compiled and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            # Numba's compiler leaves garbage cycles of its frames, which hold (through f_back)
            # the frames of the call that compiled, e.g. a training step's forward: collected
            # now, the step's output and autograd graph go when the step is done, not whenever
            # the cyclic collector next runs (a capture reusing that graph's AccumulateGrad
            # nodes, made on another stream, fails; see layers.functional.settle_autograd).
            # Not under capture, where finalizers could make calls a capture does not allow.
            gc.collect()
    return k


_libcuda = None


def _libcuda_fn(name: str, argtypes):
    """The driver function `name` from libcuda through ctypes, returning a CUresult (int)."""
    import ctypes
    f = getattr(ctypes.CDLL("libcuda.so.1"), name)
    f.argtypes = argtypes
    f.restype = ctypes.c_int
    return f


def _libcuda_launch():
    """cuLaunchKernel from libcuda through ctypes: about 1 us per call from Python."""
    global _libcuda
    if _libcuda is None:
        import ctypes
        u = ctypes.c_uint
        _libcuda = _libcuda_fn("cuLaunchKernel", [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p,
                                                  ctypes.c_void_p, ctypes.c_void_p])
    return _libcuda


# Thread-block clusters (compute capability >= 9.0): a launch through cuLaunchKernelEx with the
# cluster-dimension attribute, from a config struct built once per launch configuration.
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


def _cluster_structs():
    import ctypes

    class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad, 64-byte value union
        _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("x", ctypes.c_uint),
                    ("y", ctypes.c_uint), ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                    ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                    ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                    ("attrs", ctypes.POINTER(LaunchAttribute)), ("n_attrs", ctypes.c_uint)]
    return LaunchAttribute, LaunchConfig


_launch_ex = None


def _cluster_launch(grid, block: int, smem: int, cluster: int):
    """A launch function with cuLaunchKernel's arguments that launches through cuLaunchKernelEx
    with thread-block clusters of `cluster` blocks along x, for this grid, block and shared
    memory (fixed when it is made); a call writes only the stream into the config."""
    import ctypes
    global _launch_ex
    if _launch_ex is None:
        _launch_ex = _libcuda_fn("cuLaunchKernelEx", [ctypes.c_void_p] * 4)
    attr_t, cfg_t = _cluster_structs()
    attr = attr_t(id=_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, x=cluster, y=1, z=1)
    cfg = cfg_t(gx=grid[0], gy=grid[1], gz=grid[2], bx=block, by=1, bz=1, smem=smem, n_attrs=1)
    cfg.attrs = ctypes.pointer(attr)
    addr = ctypes.addressof(cfg)
    f = _launch_ex

    def launch(fn, gx, gy, gz, bx, by, bz, sm, stream, params, extra):
        cfg.stream = stream
        return f(addr, fn, params, extra)
    launch.keep = (attr, cfg)  # the structs live as long as the function
    return launch


def clusters_supported(device) -> bool:
    """Whether launches on `device` can use thread-block clusters: the driver launch path on a
    GPU of compute capability >= 9.0 (not the simulator, not Numba's dispatcher)."""
    if launch_mode() != "driver" or not torch.cuda.is_available():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx) >= (9, 0)


def max_active_clusters(dispatcher, arrays, scalars, device, cluster: int, block: int, smem: int) -> int:
    """How many clusters of `cluster` blocks (of `block` threads and `smem` bytes of dynamic
    shared memory) of `dispatcher`, compiled for these arguments' dtypes, the device runs at
    once (cuOccupancyMaxActiveClusters; 0 when such a cluster cannot run)."""
    from cuda.bindings import driver
    from numba import cuda
    idx = device.index if device.index is not None else _current_device()
    k = _driver_kernel(dispatcher, idx, arrays, scalars, device)
    with cuda.gpus[idx]:
        h = k.handle
        if isinstance(h, driver.CUkernel):
            err, h = driver.cuKernelGetFunction(h)
            if err != driver.CUresult.CUDA_SUCCESS:
                return 0
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = min(block, k.max_threads), 1, 1
        cfg.sharedMemBytes = smem
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        err, n = driver.cuOccupancyMaxActiveClusters(h, cfg)
    return int(n) if err == driver.CUresult.CUDA_SUCCESS else 0


_driver_kernels = {}
_numba_streams = {}
_memset = None


def zero(t: torch.Tensor) -> torch.Tensor:
    """t.zero_() for a contiguous tensor of 4-byte elements, on the driver path as one
    cuMemsetD32Async on torch's current stream (about 1 us of host time instead of the ~10 us of
    a torch op; capturable like a kernel)."""
    if launch_mode() != "driver" or t.element_size() != 4 or not t.is_contiguous() or not t.is_cuda:
        return t.zero_()
    global _memset
    if _memset is None:
        import ctypes
        _memset = _libcuda_fn("cuMemsetD32Async", [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p])
    n = t.numel()
    if n:
        cur = _current_device()
        idx = t.device.index if t.device.index is not None else cur
        if idx != cur:
            with torch.cuda.device(idx):
                return zero(t)
        err = _memset(t.data_ptr(), 0, n, _raw_stream(idx))
        if err != 0:
            raise RuntimeError(f"SNACK memset failed with CUDA driver error {err}")
    return t


def _scalar_bits(v) -> int:
    """The 8 bytes of a kernel's scalar argument as an int64 (a float as its float64 bits)."""
    if isinstance(v, float):
        return int(np.float64(v).view(np.int64))
    return v


def _scalar(v):
    """A scalar argument as Numba's dispatcher takes it: float64 for a float, else int64."""
    return np.float64(v) if isinstance(v, float) else np.int64(v)


def _numba_sig(arrays, scalars):
    from numba import types
    from numba.np.numpy_support import from_dtype
    tys = []
    for t in arrays:
        # bfloat16 as its int16 bits (Numba has no bfloat16 array type)
        npdt = np.dtype("int16" if t.dtype == torch.bfloat16 else str(t.dtype).replace("torch.", ""))
        tys.append(types.Array(from_dtype(npdt), 1, "C"))
    tys += [types.float64 if isinstance(v, float) else types.int64 for v in scalars]
    return tuple(tys)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda idx: torch.cuda.current_stream(idx).cuda_stream)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def launch(dispatcher, grid, block, smem, arrays, scalars, device):
    """Launches `dispatcher` (a numba.cuda.jit kernel) on torch's current stream.

    arrays: 1-D contiguous tensors (see `as_kernel_array`); scalars: Python ints (int64 args) or floats
    (float64 args).
    grid: (gx, gy) or (gx, gy, gz); block: threads per block (1-D); smem: dynamic shared memory in bytes.
    """
    mode = launch_mode()
    if mode == "sim":
        nps = [t.detach().numpy() for t in arrays]
        dispatcher[grid, block, 0, smem](*nps, *[_scalar(v) for v in scalars])
        return
    cur = _current_device()
    idx = device.index if device.index is not None else cur
    if idx != cur:
        # the driver launches in the calling thread's current context: make it the tensors' GPU
        with torch.cuda.device(idx):
            return launch(dispatcher, grid, block, smem, arrays, scalars, device)
    stream_ptr = _raw_stream(idx)
    if mode == "driver":
        _driver_kernel(dispatcher, idx, arrays, scalars, device)(grid, block, smem, arrays, scalars, stream_ptr)
        return
    from numba import cuda
    st = _numba_streams.get(stream_ptr)
    if st is None:
        st = cuda.external_stream(stream_ptr)
        _numba_streams[stream_ptr] = st
    cas = [cuda.as_cuda_array(t.detach()) for t in arrays]
    if smem > 48 * 1024:
        _numba_raise_smem(dispatcher, _numba_sig(arrays, scalars), device)
    dispatcher[grid, block, st, smem](*cas, *[_scalar(v) for v in scalars])


class BoundLaunch:
    """One launch configuration of a kernel with its fixed arguments bound once: the grid, the
    block, the shared memory, the scalars and the arrays that stay the same from call to call
    (an op's cached index arrays). A call passes only the other arrays, in argument order, and
    the scalars given as None here (e.g. an optimizer's learning rate), in argument order.

    On the driver path each device gets a parameter block of its own in which the fixed
    arguments are written once; a call rewrites the pointer and length of a per-call array only
    when they changed, then launches: about half the host time of `launch`, which looks up the
    kernel and compares every argument. The other paths go through `launch`.
    The per-call arrays must keep the dtypes of the first call (the kernel is compiled for them).
    """

    def __init__(self, dispatcher, grid, block: int, smem: int, arrays, scalars, cluster: int = 1):
        """arrays: the kernel's array arguments, None at the positions given per call; scalars
        likewise (a per-call scalar must keep the Python type, int or float, of the first call).
        cluster > 1: thread-block clusters of that many blocks along x (the driver path only;
        grid[0] a multiple of it)."""
        self.dispatcher = dispatcher
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = block
        self.smem = smem
        self.cluster = int(cluster)
        if self.cluster > 1 and self.grid[0] % self.cluster:
            raise ValueError(f"grid[0] = {self.grid[0]} is not a multiple of cluster = {self.cluster}")
        self.fixed = list(arrays)
        self.scalars = list(scalars)
        self.dyn = [i for i, a in enumerate(arrays) if a is None]
        self.dyn_scalars = [j for j, v in enumerate(scalars) if v is None]
        self._state = {}
        self._lock = threading.Lock()
        # (the gathering SpMM) None, or the launch that writes x's batch tiles transposed
        # (kernels.make_tiles_t_kernel), which the kernel then reads in x's place
        self.tiles_transposed = None

    def __deepcopy__(self, memo):
        """A copy bound to copies of the fixed arrays (through `memo`, so a deep-copied cache's
        plan and its index arrays stay the same objects), with no parameter block yet."""
        import copy
        dup = BoundLaunch(self.dispatcher, self.grid, self.block, self.smem,
                          [None if a is None else copy.deepcopy(a, memo) for a in self.fixed], self.scalars,
                          self.cluster)
        dup.tiles_transposed = copy.deepcopy(self.tiles_transposed, memo)
        return dup

    def _full(self, arrays):
        full = list(self.fixed)
        for i, t in zip(self.dyn, arrays):
            full[i] = t
        return full

    def _full_scalars(self, scalars):
        if not self.dyn_scalars:
            return self.scalars
        if len(scalars) != len(self.dyn_scalars):
            raise ValueError(f"this launch takes {len(self.dyn_scalars)} scalars per call, got {len(scalars)}")
        full = list(self.scalars)
        for j, v in zip(self.dyn_scalars, scalars):
            full[j] = v
        return full

    def _setup(self, idx, arrays, scalars, device):
        full = self._full(arrays)
        full_s = self._full_scalars(scalars)
        k = _driver_kernel(self.dispatcher, idx, full, full_s, device)
        slots, ptrs, params = _param_block(7 * len(full) + len(full_s))
        for a, t in enumerate(full):
            slots[7 * a + 3] = slots[7 * a + 6] = t.element_size()
            if a not in self.dyn:
                slots[7 * a + 2] = slots[7 * a + 5] = t.numel()
                slots[7 * a + 4] = t.data_ptr()
        for j, v in enumerate(full_s):
            if j not in self.dyn_scalars:
                slots[7 * len(full) + j] = _scalar_bits(v)
        block = min(self.block, k.max_threads)  # register-heavy variants: fewer threads, same result
        launch_fn = k._launch if self.cluster == 1 else _cluster_launch(self.grid, block, self.smem, self.cluster)
        # per call: [slots, pointer array (kept alive), params, offsets of the per-call arrays,
        # their last pointers and lengths, kernel handle, block, launch function, lock, offsets
        # of the per-call scalars, their last values]
        nd = len(self.dyn)
        st = [slots, ptrs, params, [7 * a for a in self.dyn], [None] * nd, [None] * nd,
              k.fn, block, launch_fn, threading.Lock(), [7 * len(full) + j for j in self.dyn_scalars],
              [None] * len(self.dyn_scalars)]
        with self._lock:
            self._state.setdefault(idx, st)
        return self._state[idx]

    def __call__(self, arrays, device, scalars=()) -> None:
        mode = _mode or launch_mode()
        if mode != "driver":
            if self.cluster > 1:
                raise RuntimeError("thread-block cluster launches need the driver launch path")
            return launch(self.dispatcher, self.grid, self.block, self.smem, self._full(arrays),
                          self._full_scalars(scalars), device)
        cur = _current_device()
        idx = device.index if device.index is not None else cur
        if idx != cur:
            with torch.cuda.device(idx):
                return self(arrays, device, scalars)
        st = self._state.get(idx)
        if st is None:
            st = self._setup(idx, arrays, scalars, device)
        slots, _, params, offs, last_p, last_n, fn, block, launch_fn, lock, soffs, last_s = st
        if len(scalars) != len(soffs):
            raise ValueError(f"this launch takes {len(soffs)} scalars per call, got {len(scalars)}")
        gx, gy, gz = self.grid
        with lock:
            j = 0
            for t in arrays:
                p = t.data_ptr()
                n = t.numel()
                if p != last_p[j] or n != last_n[j]:
                    o = offs[j]
                    slots[o + 2] = slots[o + 5] = n
                    slots[o + 4] = p
                    last_p[j] = p
                    last_n[j] = n
                j += 1
            j = 0
            for v in scalars:
                if v != last_s[j]:
                    slots[soffs[j]] = _scalar_bits(v)
                    last_s[j] = v
                j += 1
            err = launch_fn(fn, gx, gy, gz, block, 1, 1, self.smem, _raw_stream(idx), params, None)
        if err != 0:
            raise RuntimeError(f"SNACK kernel launch failed with CUDA driver error {err}")


_numba_smem_done = set()


def _kernel_handle(dispatcher, sig):
    """The driver handle (CUkernel or CUfunction) of `dispatcher` compiled for `sig` (Numba's own,
    the one its dispatcher launches: not through the on-disk cache)."""
    from .cache import compiled_library
    return compiled_library(dispatcher, sig).get_cufunc().handle


def _set_max_dynamic_smem(handle, max_smem: int):
    """Lets the kernel take up to `max_smem` bytes of dynamic shared memory; returns the CUresult."""
    from cuda.bindings import driver
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, driver.CUkernel):
        err, = driver.cuKernelSetAttribute(attr, max_smem, handle, torch.cuda.current_device())
    else:
        err, = driver.cuFuncSetAttribute(handle, attr, max_smem)
    return err


def _numba_raise_smem(dispatcher, sig, device):
    key = (id(dispatcher), sig, device.index)
    if key in _numba_smem_done:
        return
    from numba import cuda
    with cuda.gpus[device.index if device.index is not None else _current_device()]:
        _set_max_dynamic_smem(_kernel_handle(dispatcher, sig), device_properties(device)[1])
    _numba_smem_done.add(key)
