"""Backend dispatch for the three sparse ops, and the topology cache of the layers.

    spmm(x, topo, values, out=None, bias=None)  x (B, in) contiguous  -> Y (B, out) = X W^T (+ bias)
    spmm_t(dy, topo, values, out=None) dy (B, out) contiguous -> dX (B, in) = dY W
    sddmm(dy, x, topo, out=None)       -> dv (nnz,), dv_k = sum_b dY[b, r_k] X[b, c_k]
    sddmm(dy, x, topo, bias_grad=True) -> (dv, db), db (out,) = sum_b dY[b, :] (one launch on the GPU)
    backward(dy, x, topo, values, bias_grad) -> (dX, dv, db or None) in one call where the
                                       backend fuses them (`fuses_backward`), else None

with W = topo.shape = (out, in) a canonical row-major `snack.core.Topology` and values (nnz,).
CUDA tensors go to `snack.gpu` (Numba CUDA kernels on torch's current stream), CPU tensors to
`snack.core.cpu`; both are imported on first use. A backend that is missing (not installed
yet, no usable GPU) or that declares `supports(dtype) == False` (e.g. float64) is replaced by
`snack.core.reference`, plain torch index ops that run on any device and dtype but allocate
(B, nnz) temporaries; `backend_name()` says which one a call would use.

`get_topology(indices, shape)` builds a Topology once and caches it on the indices tensor,
keyed (weakly, by identity) by the tensor and checked against its version counter, storage pointer and the shape: validation (range,
duplicates, row-major order: one sort and a host sync) happens only when the indices change,
so a steady-state call costs a few attribute reads and no device work, which keeps it usable
inside `torch.cuda.graph` capture (build the topology with one call before capturing). When the
same tensor is changed in place (dynamic sparse training) keeping its nnz, the rebuilt pattern is
copied into the old topology's arrays (`Topology.refresh_from`): kernels recorded in a CUDA graph
keep those arrays' addresses, so a graph captured before the change replays the new pattern once
`get_topology` has run (`snack.dst` calls it right after each update).
Trade-off: an in-place change of the indices that bypasses the version counter (writing
through `.data` or from outside torch) is not seen; change indices with ordinary in-place ops.
"""
from __future__ import annotations

import contextlib
import threading
import importlib
import inspect
import weakref
import warnings
from types import SimpleNamespace
from typing import Optional, Tuple

import torch

from snack.core import Topology, canonicalize, validate_coo, INDEX_DTYPE
from snack.core.coo import check_out_grad
from snack.core.reference import spmm_reference, spmm_t_reference, sddmm_reference

__all__ = ["spmm", "spmm_t", "sddmm", "backward", "get_topology", "backend_name", "force_backend"]

# id(indices) -> (weakref to indices, key, Topology); an entry leaves when its tensor dies. Kept
# off the tensor's own __dict__ so that pickling a module (torch.save(model)) never drags backend
# caches along, and a plain dict so that a lookup costs well under a microsecond.
_TOPOLOGIES = {}


def _forget(tid: int, ref) -> None:
    e = _TOPOLOGIES.get(tid)
    if e is not None and e[0] is ref:
        del _TOPOLOGIES[tid]


# ---- topology cache --------------------------------------------------------------------------
def _version_of(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter
        return -1


def get_topology(indices: torch.Tensor, shape: Tuple[int, int]) -> Topology:
    """The cached `Topology` of `indices` for a weight of shape (out, in).

    indices: integer tensor (2, nnz) on the device of the computation, canonical row-major
    ([0] row = output index, [1] column = input index, sorted by row then column, each
    coordinate once). It is validated when the topology is (re)built, i.e. on first use and
    after every in-place change of `indices`: a bad dtype or shape raises TypeError/ValueError,
    an index out of [0, out) x [0, in) or a duplicated coordinate raises ValueError, and
    indices that are not sorted raise ValueError (sort them once with
    `idx, vals, _ = snack.core.canonicalize(indices, shape, values)`).
    int64 indices are accepted and converted once to int32 (the copy is cached).
    """
    cached = _TOPOLOGIES.get(id(indices))
    if cached is not None:  # the steady state, without building a key (about 0.5 us less per call)
        key = cached[1]
        try:
            if cached[0]() is indices and key[0] == indices._version and key[1] == indices.data_ptr() \
                    and key[2][0] == shape[0] and key[2][1] == shape[1]:
                return cached[2]
        except RuntimeError:  # an inference tensor (no version counter): the path below
            pass
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    shape = (int(shape[0]), int(shape[1]))
    version = _version_of(indices)
    if version < 0:
        # an inference tensor (made under torch.inference_mode) has no version counter, so an
        # in-place change could not be seen: its topology is rebuilt, and validated, every call
        _warn_once("inference-indices",
                   "indices is an inference tensor (created under torch.inference_mode): it has no "
                   "version counter, so its topology is rebuilt and validated on every call (slow); "
                   "create the layer or indices outside inference_mode to have it cached")
        return _build_persistent(indices, _build_topology, indices, shape)
    key = (version, indices.data_ptr(), shape)
    tid = id(indices)
    cached = _TOPOLOGIES.get(tid)
    if cached is not None and cached[1] == key and cached[0]() is indices:
        return cached[2]
    topo = _build_persistent(indices, _build_topology, indices, shape)
    if cached is not None and cached[0]() is indices and cached[1][1:] == key[1:] \
            and cached[2].refresh_from(topo):
        # the same tensor changed in place (dynamic sparse training): the old topology's arrays
        # take the new pattern, so CUDA graphs captured with them replay the new pattern
        topo = cached[2]
    ref = weakref.ref(indices, lambda r, tid=tid: _forget(tid, r))
    _TOPOLOGIES[tid] = (ref, key, topo)
    return topo


def _build_persistent(t: torch.Tensor, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) through snack.gpu's `build_persistent` for a CUDA tensor t (what it builds is
    kept across calls and must stay out of any CUDA-graph pool), else in place."""
    if t.is_cuda and _load("cuda") is not _REFERENCE:
        return importlib.import_module("snack.gpu.launch").build_persistent(t.device, fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _build_topology(indices: torch.Tensor, shape: Tuple[int, int]) -> Topology:
    validate_coo(indices, None, shape)
    nnz = indices.shape[1]
    if nnz <= 1:
        idx32 = indices.to(INDEX_DTYPE).contiguous()
    else:
        idx32, _, already_sorted = canonicalize(indices, shape, check=False)  # raises on duplicates
        if not already_sorted:
            raise ValueError(
                f"indices (2, {nnz}) for a weight of shape {shape} are not in canonical row-major "
                "order (sorted by row, then column); sort them once with "
                "`indices, values, _ = snack.core.canonicalize(indices, shape, values)` and keep "
                "values in the same order")
    if idx32 is indices:
        # an alias, not the tensor itself: the cache entry must not keep `indices` alive
        idx32 = indices.detach()
    return Topology(idx32, shape, checked=True)


def invalidate_topology(indices: torch.Tensor) -> None:
    """Drops the cached topology of `indices` (after a change the version counter misses)."""
    e = _TOPOLOGIES.get(id(indices))
    if e is not None and e[0]() is indices:
        del _TOPOLOGIES[id(indices)]


# ---- backends ---------------------------------------------------------------------------------
def _ref_spmm(x, topo, values, out=None):
    y = spmm_reference(x, topo.indices, values, topo.shape[0])
    return out.copy_(y) if out is not None else y


def _ref_spmm_t(dy, topo, values, out=None):
    dx = spmm_t_reference(dy, topo.indices, values, topo.shape[1])
    return out.copy_(dx) if out is not None else dx


def _ref_sddmm(dy, x, topo, out=None):
    dv = sddmm_reference(dy, x, topo.indices)
    return out.copy_(dv) if out is not None else dv


_REFERENCE = SimpleNamespace(name="reference", spmm=_ref_spmm, spmm_t=_ref_spmm_t, sddmm=_ref_sddmm,
                             supports=lambda dtype: True, fused_bias=False, fused_bias_grad=False,
                             fuses_backward=None, spmm_t_sddmm=None, mixed_values=False)
_loaded = {}          # device type -> backend namespace, or _REFERENCE
_forced: Optional[str] = None
_warned = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


# dtypes assumed when a backend module does not say (no `supports(dtype)` function)
_DEFAULT_DTYPES = {"gpu": (torch.float32, torch.float16, torch.bfloat16),
                   "cpu": (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def _wrap(mod, name):
    supports = getattr(mod, "supports", None)
    if not callable(supports):
        dtypes = tuple(getattr(mod, "SUPPORTED_DTYPES", _DEFAULT_DTYPES[name]))
        supports = dtypes.__contains__
    # a backend whose spmm takes bias= adds it itself (the GPU kernels, as they write Y)
    try:
        fused = "bias" in inspect.signature(mod.spmm).parameters
    except (TypeError, ValueError):  # no introspectable signature (a builtin): add the bias here
        fused = False
    try:  # an sddmm that takes bias_grad= returns the bias gradient with dv (the GPU kernels)
        fused_db = "bias_grad" in inspect.signature(mod.sddmm).parameters
    except (TypeError, ValueError):
        fused_db = False
    return SimpleNamespace(name=name, spmm=mod.spmm, spmm_t=mod.spmm_t, sddmm=mod.sddmm,
                           supports=supports, fused_bias=fused, fused_bias_grad=fused_db,
                           fuses_backward=getattr(mod, "fuses_backward", None),
                           spmm_t_sddmm=getattr(mod, "spmm_t_sddmm", None),
                           # spmm / spmm_t / spmm_t_sddmm take float32 values (and bias) with
                           # float16 / bfloat16 activations
                           mixed_values=bool(getattr(mod, "MIXED_VALUES", False)))


def _load(device_type: str):
    b = _loaded.get(device_type)
    if b is not None:
        return b
    if device_type == "cuda":
        mod = importlib.import_module("snack.gpu")  # lazy: numba.cuda is slow to import
        ok = all(hasattr(mod, f) for f in ("spmm", "spmm_t", "sddmm"))
        avail = getattr(mod, "is_available", None)
        if ok and (avail is None or avail()):
            b = _wrap(mod, "gpu")
        else:
            _warn_once("cuda", "snack.gpu kernels are not usable here; CUDA tensors fall back to "
                               "snack.core.reference (slow, allocates (B, nnz) temporaries)")
            b = _REFERENCE
    elif device_type == "cpu":
        try:
            mod = importlib.import_module("snack.core.cpu")
        except ModuleNotFoundError as e:
            if e.name not in ("snack.core.cpu",):
                raise
            b = _REFERENCE
        else:
            b = _wrap(mod, "cpu")
    else:
        b = _REFERENCE
    _loaded[device_type] = b
    return b


def _backend(t: torch.Tensor):
    if _forced == "reference":
        return _REFERENCE
    b = _load(t.device.type)
    if b is not _REFERENCE and not b.supports(t.dtype):
        return _REFERENCE
    return b


def backend_name(device="cpu", dtype: torch.dtype = torch.float32) -> str:
    """'gpu', 'cpu' or 'reference': the backend a call on (device, dtype) would use."""
    if _forced == "reference":
        return "reference"
    b = _load(torch.device(device).type)
    return b.name if b.supports(dtype) else "reference"


_forcing = []  # (token, backend forced or None for 'auto') of the blocks open now, oldest first
_forcing_lock = threading.Lock()


@contextlib.contextmanager
def force_backend(name: str):
    """Within the block every op uses backend `name`: 'reference' or 'auto' (the default).

    The setting is process-wide, so that autograd's worker threads (which run CUDA backward
    passes) see it too: while blocks are open, in any threads, the most recently entered one
    decides. Each block removes its own entry on exit, so blocks of several threads may close in
    any order and the setting then returns to the default."""
    global _forced
    if name not in ("reference", "auto"):
        raise ValueError(f"name must be 'reference' or 'auto', got {name!r}")
    token = object()
    with _forcing_lock:
        _forcing.append((token, None if name == "auto" else name))
        _forced = _forcing[-1][1]
    try:
        yield
    finally:
        with _forcing_lock:
            _forcing[:] = [e for e in _forcing if e[0] is not token]
            _forced = _forcing[-1][1] if _forcing else None


# ---- the three ops -------------------------------------------------------------------------------
def _out_or_new(out: Optional[torch.Tensor], like: torch.Tensor, shape) -> torch.Tensor:
    """The result tensor of an op with nothing to compute: `out` (refused where it requires grad,
    as the backends refuse it) or a new one like `like`."""
    if out is None:
        return like.new_empty(shape)
    check_out_grad(out)
    return out


def spmm(x: torch.Tensor, topo: Topology, values: torch.Tensor, out: Optional[torch.Tensor] = None,
         bias: Optional[torch.Tensor] = None):
    """Y (B, out) = X W^T (+ bias) for x (B, in) contiguous; values (nnz,) and bias (out,) of x's
    dtype and device. The GPU kernels add the bias as they write Y; other backends add it after."""
    if topo.nnz == 0 or x.shape[0] == 0 or x.shape[1] == 0:
        y = _out_or_new(out, x, (x.shape[0], topo.shape[0]))
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    b = _backend(x)
    if bias is not None and b.fused_bias:
        return b.spmm(x, topo, values, out=out, bias=bias)
    y = b.spmm(x, topo, values, out=out)
    return y if bias is None else y.add_(bias)


def spmm_t(dy: torch.Tensor, topo: Topology, values: torch.Tensor, out: Optional[torch.Tensor] = None):
    """dX (B, in) = dY W for dy (B, out) contiguous."""
    if topo.nnz == 0 or dy.shape[0] == 0 or dy.shape[1] == 0:
        dx = _out_or_new(out, dy, (dy.shape[0], topo.shape[1]))
        return dx.zero_()
    return _backend(dy).spmm_t(dy, topo, values, out=out)


def sddmm(dy: torch.Tensor, x: torch.Tensor, topo: Topology, out: Optional[torch.Tensor] = None,
          bias_grad: bool = False):
    """dv (nnz,) with dv_k = sum_b dY[b, r_k] X[b, c_k]; dy (B, out), x (B, in) contiguous.
    With bias_grad=True returns (dv, db), db (out,) = sum_b dY[b, :] in dy's dtype: from the
    same launch on the GPU, dy.sum(0) elsewhere."""
    if topo.nnz == 0 or dy.shape[0] == 0:
        dv = _out_or_new(out, dy, (topo.nnz,))
        dv.zero_()
        return (dv, dy.sum(0)) if bias_grad else dv
    b = _backend(dy)
    if not bias_grad:
        return b.sddmm(dy, x, topo, out=out)
    if b.fused_bias_grad:
        return b.sddmm(dy, x, topo, out=out, bias_grad=True)
    return b.sddmm(dy, x, topo, out=out), dy.sum(0)


def backward(dy: torch.Tensor, x: torch.Tensor, topo: Topology, values: torch.Tensor, bias_grad: bool = False):
    """(dX, dv, db) (db None unless bias_grad) from one call when dy's backend fuses the backward
    for this batch and matrix (the GPU kernels: one launch from B = 9 to 32 on matrices up to 25%
    dense, `snack.gpu.fuses_backward`; the CPU backend from B = 2: dY copied into its tiles once,
    `snack.core.cpu.fuses_backward`), else None: the caller then uses spmm_t and sddmm."""
    b = _backend(dy)
    if b.fuses_backward is None or topo.nnz == 0 or not b.fuses_backward(dy.shape[0], topo):
        return None
    res = b.spmm_t_sddmm(dy, x, topo, values, bias_grad=bias_grad)
    return res if bias_grad else res + (None,)
