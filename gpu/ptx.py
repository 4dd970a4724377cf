"""Compiles every SNACK kernel variant to PTX for a given compute capability, without a GPU.

`compile_all(cc=(9, 0))` returns {kernel name: PTX text} for every variant the launchers can
pick (batch tiles x dtypes x permuted/atomic/bias flags, and the Adam step), so that a machine without a GPU (CI)
catches typing errors that Numba's simulator lets through. Needs numba-cuda's NVVM
(`pip install numba-cuda[cu13]`) and must run with the simulator off.
Usage: python -m snack.gpu.ptx [--cc 9.0] [--workers N]  (prints one line per kernel with its PTX size and
whether it uses local memory).
"""
from __future__ import annotations

import argparse
import contextlib
import re
from typing import Dict, Tuple

from . import kernels

_ELEM = {0: "float32", 1: "float16", 2: "int16"}


def _sig(arrays, n_scalars):
    from numba import types
    tys = [types.Array(getattr(types, a), 1, "C") for a in arrays]
    return tuple(tys + [types.int64] * n_scalars)


# how a wide kernel adds partial results: written once, fp32 atomics, fp32 parts; the wide
# SpMMs also through a thread-block cluster's shared memory (written once, in y's dtype)
SUMS = (None, "atomic", "parts")
SPMM_SUMS = SUMS + ("cluster",)


def _fp32_sums(sums) -> bool:
    """Whether a wide kernel with these `sums` writes its output to an fp32 buffer."""
    return sums in ("atomic", "parts")
# the wide SpMMs' row modes (rows4, own): a warp per row, a row per group of 8 lanes, lane-owned
_WIDE_MODES = ((False, False), (True, False), (False, True))


def _threads(own: bool) -> int:
    """The launch bound a wide SpMM is compiled with, as the ops build it."""
    from . import ops
    return ops.WIDE_OWN_THREADS if own else 1024


def _per_lane() -> int:
    from . import ops
    return ops.WIDE_OWN_PER_LANE


# (perm, bias, uint16 index) of the gathering SpMMs (x as transposed batch tiles): the forward
# without and with a bias, the transposed SpMM with an int32 and a uint16 row index; each in
# every dtype and with float32 values beside half activations
_GATHER_ORDERS = ((False, False, False), (False, True, False), (True, False, False), (True, False, True))
_GATHER_KINDS = ((0, None), (1, None), (2, None), (1, 0), (2, 0))  # (x's kind, the values' kind)


def variants():
    """(name, dispatcher, numba signature) for every kernel variant."""
    out = []
    for kind, el in _ELEM.items():
        for bt in (1, 2, 4, 8):
            for perm, bias in ((False, False), (True, False), (False, True)):
                d = kernels.make_spmm_kernel(bt, kind, perm, bias)
                out.append((d.py_func.__name__, d,
                            _sig([el, "int32", "int32", el, "int32", el, el], 3)))
                # lane-owned: staged column by column, and (BT = 2, 4) batch row by batch row
                for cols in ((True, False) if bt in (2, 4) else (True,)) if bt > 1 else ():
                    d = kernels.make_spmm_own_kernel(bt, kind, perm, bias, cols=cols)
                    out.append((d.py_func.__name__, d,
                                _sig([el, "int32", "int32", el, "int32", el, el], 3)))
            for with_db in (False, True):
                for cols in ((False, True) if bt > 1 else (False,)):
                    d = kernels.make_sddmm_kernel(bt, kind, with_db, cols)
                    out.append((d.py_func.__name__, d,
                                _sig([el, el, "int32", "int32", el, "float32", el, "float32"], 3)))
        for perm, bias in ((False, False), (True, False), (False, True)):
            for sums in SPMM_SUMS:
                for rows4, own in _WIDE_MODES:
                    # the forward's lane-group variants also with their row order (from B = 33; the
                    # same code in every dtype: float32's compiled)
                    orders = (False, True) if (rows4 or own) and not perm and kind == 0 else (False,)
                    for order in orders:
                        d = kernels.make_spmm_wide_kernel(kind, perm, sums, bias, rows4=rows4, own=own, order=order,
                                                          threads=_threads(own), per_lane=_per_lane())
                        yel = "float32" if _fp32_sums(sums) else el
                        out.append((d.py_func.__name__, d,
                                    _sig([el, "int32", "int32", el, "int32", yel, el, el, el, el], 7)))
        for sums in SPMM_SUMS:  # the fused backward (dX, dv and optionally db in one pass)
            for with_db in (False, True):
                for i16 in ((False, True) if kind == 0 else (False,)):
                    d = kernels.make_spmm_wide_kernel(kind, True, sums, False, i16, True, with_db)
                    out.append((d.py_func.__name__, d,
                                _sig([el, "int32", "uint16" if i16 else "int32", el, "int32",
                                      "float32" if _fp32_sums(sums) else el, el, el, el, el], 7)))
        if kind == 0:  # the transposed SpMMs with a uint16 row index (same code, other index type)
            for bt in (1, 2, 4, 8):
                for make in ((kernels.make_spmm_kernel,) + ((kernels.make_spmm_own_kernel,) if bt > 1 else ())):
                    d = make(bt, kind, True, False, True)
                    out.append((d.py_func.__name__, d, _sig([el, "int32", "uint16", el, "int32", el, el], 3)))
            for sums in SPMM_SUMS:
                for rows4, own in _WIDE_MODES:
                    d = kernels.make_spmm_wide_kernel(kind, True, sums, False, True, rows4=rows4, own=own,
                                                      threads=_threads(own), per_lane=_per_lane())
                    out.append((d.py_func.__name__, d,
                                _sig([el, "int32", "uint16", el, "int32", "float32" if _fp32_sums(sums) else el, el,
                                      el, el, el], 7)))
        if kind:  # the transposed SpMMs with a uint16 row index in half precision and mixed (float32
            # values): one variant per family, the one dX takes by default (the code is float32's
            # but for the dtypes, which these compile)
            for vk, vel in ((None, el), (0, "float32")):
                d = kernels.make_spmm_own_kernel(8, kind, True, False, True, vkind=vk)
                out.append((d.py_func.__name__, d, _sig([el, "int32", "uint16", vel, "int32", el, vel], 3)))
                d = kernels.make_spmm_wide_kernel(kind, True, "atomic", False, True, vkind=vk)
                out.append((d.py_func.__name__, d, _sig([el, "int32", "uint16", vel, "int32", "float32", vel,
                                                         el, el, el], 7)))
                d = kernels.make_spmm_wide_kernel(kind, True, "atomic", False, True, True, True, vkind=vk)
                out.append((d.py_func.__name__, d, _sig([el, "int32", "uint16", vel, "int32", "float32", el,
                                                         el, el, el], 7)))
        if kind:  # mixed precision: float32 values (and bias) with half x / dy, in the three SpMMs
            for perm, bias in ((False, False), (True, False), (False, True)):
                vb = "float32"  # the bias argument (the values stand in for it without a bias)
                for bt in (1, 2, 4, 8):
                    makes = [kernels.make_spmm_kernel] + ([kernels.make_spmm_own_kernel] if bt > 1 else [])
                    for make in makes:
                        d = make(bt, kind, perm, bias, vkind=0)
                        out.append((d.py_func.__name__, d, _sig([el, "int32", "int32", "float32", "int32", el, vb], 3)))
                for sums in SPMM_SUMS:
                    for rows4, own in _WIDE_MODES:
                        d = kernels.make_spmm_wide_kernel(kind, perm, sums, bias, rows4=rows4, own=own,
                                                          threads=_threads(own), per_lane=_per_lane(), vkind=0)
                        out.append((d.py_func.__name__, d,
                                    _sig([el, "int32", "int32", "float32", "int32", "float32" if _fp32_sums(sums) else el, vb,
                                          el, el, el], 7)))
            for sums in SPMM_SUMS:
                for with_db in (False, True):
                    d = kernels.make_spmm_wide_kernel(kind, True, sums, False, False, True, with_db, vkind=0)
                    out.append((d.py_func.__name__, d,
                                _sig([el, "int32", "int32", "float32", "int32", "float32" if _fp32_sums(sums) else el, el, el, el,
                                      el], 7)))
        for with_db in (False, True):
            for rows4 in (False, True):
                for sums in SUMS:
                    d = kernels.make_sddmm_wide_kernel(kind, with_db, rows4, sums)
                    out.append((d.py_func.__name__, d,
                                _sig([el, el, "int32", "int32", el, "float32", el, "float32"], 5)))
    from . import ops
    for kind, vkind in _GATHER_KINDS:
        el, vel = _ELEM[kind], _ELEM[kind if vkind is None else vkind]
        for perm, bias, i16 in _GATHER_ORDERS:
            d = ops._gather_kernel(perm, bias, kind, vkind)  # the gathering SpMMs as ops launches them
            out.append((d.py_func.__name__ + ("_idx16" if i16 else ""), d,
                        _sig([el, "int32", "uint16" if i16 else "int32", vel, "int32", el, vel], 3)))
    for kind, el in _ELEM.items():  # the gathering SpMMs' transposed input tiles (float32, or x's dtype)
        for native in ((False, True) if kind else (False,)):
            d = kernels.make_tiles_t_kernel(kind, native)
            out.append((d.py_func.__name__, d, _sig([el, el if native else "float32"], 2)))
    from numba import types
    for decoupled in (False, True):
        d = kernels.make_adam_kernel(decoupled)
        out.append((d.py_func.__name__, d, _sig(["float32"] * 10 + ["int32"], 3) + (types.float64,) * 7))
    return out


@contextlib.contextmanager
def _device_functions_for(cc: Tuple[int, int]):
    """Compile device functions for compute capability `cc`. numba-cuda compiles a device function
    that NVVM inlines (forceinline=True) for the current GPU's compute capability, which
    compile_ptx's `cc` does not reach, and without a GPU there is no current device; so, inside
    this block, numba-cuda's dispatcher sees a device of capability `cc`."""
    from numba.cuda import dispatcher

    class _Device:
        compute_capability = tuple(cc)

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = _Device
    try:
        yield
    finally:
        dispatcher.get_current_device = saved


def _compile_slice(args) -> Dict[str, str]:
    """{name: PTX} of variants()[part::parts] for compute capability cc, each with the launch
    bounds its dispatcher is compiled with (`.maxntid`, `.minnctapersm`); args = (cc, part, parts)."""
    from numba import cuda
    cc, part, parts = args
    res = {}
    with _device_functions_for(cc):
        for name, d, sig in variants()[part::parts]:
            bounds = d.targetoptions.get("launch_bounds")
            ptx, _ = cuda.compile_ptx(d.py_func, sig, cc=cc, **({"launch_bounds": bounds} if bounds else {}))
            res[name] = ptx
    return res


def compile_all(cc: Tuple[int, int] = (9, 0), workers: int = 1) -> Dict[str, str]:
    """{kernel name: PTX} for every variant, compiled for compute capability `cc`, in `workers`
    processes (each compiles every workers-th variant; one: in this process)."""
    if workers <= 1:
        return _compile_slice((cc, 0, 1))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    res = {}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        for part in ex.map(_compile_slice, [(cc, i, workers) for i in range(workers)]):
            res.update(part)
    return res


def uses_local_memory(ptx: str) -> bool:
    """True when the PTX declares local (per-thread, off-chip) memory: an array that did not
    become registers."""
    return re.search(r"\.local\s", ptx) is not None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cc", default="9.0")
    ap.add_argument("--workers", type=int, default=1, help="processes compiling in parallel")
    args = ap.parse_args(argv)
    cc = tuple(int(v) for v in args.cc.split("."))
    for name, ptx in compile_all(cc, args.workers).items():
        print(f"{name:45s} {len(ptx):8d} chars  local memory: {'yes' if uses_local_memory(ptx) else 'no'}")


if __name__ == "__main__":
    main()
