"""The CPU backend: SpMM, transposed SpMM and SDDMM on a COO weight, compiled with Numba.

    spmm(x, topo, values)    Y  (B, out) = X W^T     Y[b, r]  = sum_k v_k X[b, c_k]
    spmm_t(dy, topo, values) dX (B, in)  = dY W      dX[b, c] = sum_k v_k dY[b, r_k]
    sddmm(dy, x, topo)       dv (nnz,)               dv_k     = sum_b dY[b, r_k] X[b, c_k]

Design: the batch is moved to the fast axis. X is copied once per call into X^T (in, B), so
the non-zeros of a row gather whole contiguous rows of X^T and the loop over the batch
vectorises. Each output row r keeps its accumulators for a tile of 64 batch columns in vector
registers while it streams its non-zeros (CSR order: `topo.row_ptr`, `topo.cols`) and writes
Y[:, r] once; rows are split into chunks of equal non-zero count, one parallel task each, so
no two threads ever write the same element (no atomics, results are deterministic and do not
depend on the thread count). dX = dY W is the same kernel run over the column-sorted order
(`topo.col_ptr`, `topo.rows_by_col`), reading values through the cached permutation
(`topo.col_perm`) so that no permuted copy of the values is made. SDDMM walks the rows in CSR
order, keeps dY^T[r, :] hot and takes one dot product with a gathered X^T[c, :] per non-zero.
B = 1 has its own loops (a plain dot product per row, four partial sums).

Trade-off: the X^T / dY^T copies cost B x (in + out) element moves per call, small against
the nnz x B multiply-adds at the sparsities this is for (>= 0.8), and they buy contiguous,
vectorised inner loops. float32 and float64 are computed natively; float16 and bfloat16 are
computed in float32 and rounded once at the end. Kernels are compiled on first use and cached
on disk (`cache=True`); one specialisation per op and dtype (float32, float64).

Speed: experiments/bench_cpu.py times the three ops against dense torch.mm at 4096 x 4096,
90% sparsity (nnz = 1.68 M), float32, and writes results/bench_cpu.csv.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numba
import numpy as np
import torch
from numba import njit, prange

from .coo import Topology

__all__ = ["spmm", "spmm_t", "sddmm", "supports", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_NATIVE = (torch.float32, torch.float64)
_TILE = 64  # batch columns per register tile; a literal so that LLVM keeps the tile in registers
_CHUNKS_PER_THREAD = 4


def supports(dtype: torch.dtype) -> bool:
    """True for the dtypes this backend computes: float32, float64, float16, bfloat16."""
    return dtype in SUPPORTED_DTYPES


# ---- kernels ----------------------------------------------------------------------------------
# Every kernel argument is a C-contiguous numpy view of a CPU tensor:
#   split  int32 (nchunk + 1,)  first row (or column) of each parallel chunk, equal nnz per chunk
#   ptr    int32 (n + 1,)       CSR row pointers (or CSC column pointers)
#   idx    int32 (nnz,)         column of each entry in CSR order (or row, in CSC order)
#   perm   int32 (nnz,) or (0,) position in `vals` of each entry (CSC order), or empty: identity
#   vals   float (nnz,)         values in canonical row-major order
#   src    float (m, B)         X^T (or dY^T): a row per input (output) feature
#   dst    float (B, n)         written fully: Y (or dX)

@njit(parallel=True, fastmath={"contract"}, cache=True, nogil=True)
def _spmm_kernel(split, ptr, idx, perm, vals, src, dst):
    B = src.shape[1]
    nchunk = split.shape[0] - 1
    use_perm = perm.shape[0] > 0
    zero = src.dtype.type(0)
    nfull = B // _TILE
    rem = B - nfull * _TILE
    for ch in prange(nchunk):
        r0 = split[ch]
        r1 = split[ch + 1]
        if B == 1:
            for r in range(r0, r1):
                s0 = zero
                s1 = zero
                s2 = zero
                s3 = zero
                k = ptr[r]
                k1 = ptr[r + 1]
                if use_perm:
                    while k + 4 <= k1:
                        s0 += vals[perm[k]] * src[idx[k], 0]
                        s1 += vals[perm[k + 1]] * src[idx[k + 1], 0]
                        s2 += vals[perm[k + 2]] * src[idx[k + 2], 0]
                        s3 += vals[perm[k + 3]] * src[idx[k + 3], 0]
                        k += 4
                    while k < k1:
                        s0 += vals[perm[k]] * src[idx[k], 0]
                        k += 1
                else:
                    while k + 4 <= k1:
                        s0 += vals[k] * src[idx[k], 0]
                        s1 += vals[k + 1] * src[idx[k + 1], 0]
                        s2 += vals[k + 2] * src[idx[k + 2], 0]
                        s3 += vals[k + 3] * src[idx[k + 3], 0]
                        k += 4
                    while k < k1:
                        s0 += vals[k] * src[idx[k], 0]
                        k += 1
                dst[0, r] = (s0 + s1) + (s2 + s3)
            continue
        acc = np.empty(_TILE, src.dtype)
        for t in range(nfull):
            b0 = t * _TILE
            for r in range(r0, r1):
                for j in range(_TILE):
                    acc[j] = zero
                for k in range(ptr[r], ptr[r + 1]):
                    v = vals[perm[k]] if use_perm else vals[k]
                    row = src[idx[k]]
                    for j in range(_TILE):
                        acc[j] += v * row[b0 + j]
                for j in range(_TILE):
                    dst[b0 + j, r] = acc[j]
        if rem > 0:
            b0 = nfull * _TILE
            for r in range(r0, r1):
                for j in range(rem):
                    acc[j] = zero
                for k in range(ptr[r], ptr[r + 1]):
                    v = vals[perm[k]] if use_perm else vals[k]
                    row = src[idx[k]]
                    for j in range(rem):
                        acc[j] += v * row[b0 + j]
                for j in range(rem):
                    dst[b0 + j, r] = acc[j]


# reassoc: lets LLVM vectorise the dot product over the batch (a fixed tree order per build;
# results still do not depend on the thread count).
@njit(parallel=True, fastmath={"contract", "reassoc"}, cache=True, nogil=True)
def _sddmm_kernel(split, ptr, idx, dyt, xt, dv):
    B = xt.shape[1]
    nchunk = split.shape[0] - 1
    zero = xt.dtype.type(0)
    for ch in prange(nchunk):
        r0 = split[ch]
        r1 = split[ch + 1]
        if B == 1:
            for r in range(r0, r1):
                g = dyt[r, 0]
                for k in range(ptr[r], ptr[r + 1]):
                    dv[k] = g * xt[idx[k], 0]
            continue
        for r in range(r0, r1):
            grow = dyt[r]
            for k in range(ptr[r], ptr[r + 1]):
                xrow = xt[idx[k]]
                s = zero
                for b in range(B):
                    s += grow[b] * xrow[b]
                dv[k] = s


# ---- topology arrays (cached on the Topology) ---------------------------------------------------
def _np_i32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.int32).contiguous().numpy()


def _split(ptr: np.ndarray, nchunk: int) -> np.ndarray:
    """Row boundaries (nchunk + 1,) cutting the rows into chunks of about equal nnz."""
    nnz = int(ptr[-1])
    targets = (np.arange(nchunk + 1, dtype=np.int64) * nnz) // max(nchunk, 1)
    s = np.searchsorted(ptr, targets, side="left").astype(np.int32)
    s[0] = 0
    s[-1] = ptr.shape[0] - 1
    return np.maximum.accumulate(s)


def _csr(topo: Topology, nchunk: int):
    c = topo.cache.get("cpu_csr")
    if c is None:
        ptr = _np_i32(topo.row_ptr)
        c = {"ptr": ptr, "idx": _np_i32(topo.cols), "perm": np.empty(0, np.int32)}
        topo.cache["cpu_csr"] = c
    s = c.get(nchunk)
    if s is None:
        s = c[nchunk] = _split(c["ptr"], nchunk)
    return s, c["ptr"], c["idx"], c["perm"]


def _csc(topo: Topology, nchunk: int):
    c = topo.cache.get("cpu_csc")
    if c is None:
        c = {"ptr": _np_i32(topo.col_ptr), "idx": _np_i32(topo.rows_by_col),
             "perm": _np_i32(topo.col_perm)}
        topo.cache["cpu_csc"] = c
    s = c.get(nchunk)
    if s is None:
        s = c[nchunk] = _split(c["ptr"], nchunk)
    return s, c["ptr"], c["idx"], c["perm"]


def _threads() -> int:
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


# ---- validation ---------------------------------------------------------------------------------
def _check_topo(topo) -> None:
    if not isinstance(topo, Topology):
        raise TypeError(f"topo must be a snack.core.Topology, got {type(topo).__name__}")
    if topo.device.type != "cpu":
        raise ValueError(f"topo must be on the CPU for snack.core.cpu, got indices on {topo.device}")


def _check_float(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor for snack.core.cpu, got device {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_dense(name: str, t, cols: int, what: str) -> None:
    _check_float(name, t, 2)
    if t.shape[1] != cols:
        raise ValueError(f"{name} must have shape (B, {cols}) ({what}), got {tuple(t.shape)}")


def _check_values(values, topo: Topology, dtype: torch.dtype) -> None:
    _check_float("values", values, 1)
    if values.shape[0] != topo.nnz:
        raise ValueError(f"values must have shape ({topo.nnz},) to match topo (nnz = {topo.nnz}), "
                         f"got {tuple(values.shape)}")
    if values.dtype != dtype:
        raise TypeError(f"values must have the dtype of the dense operand {dtype}, got {values.dtype}")


def _check_out(out, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {out.dtype}")
    if out.device.type != "cpu":
        raise ValueError(f"out must be a CPU tensor, got device {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()} for shape {tuple(out.shape)}")


# ---- host side -----------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _NATIVE else torch.float32


def _transposed(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """t (B, n) -> C-contiguous (n, B) numpy array of `dtype` (one copy; none when B = 1)."""
    t = t.detach()
    if t.shape[0] == 1 and t.dtype == dtype and t.is_contiguous() and not t.is_neg() and not t.is_conj():
        return t.reshape(t.shape[1], 1).numpy()
    buf = torch.empty((t.shape[1], t.shape[0]), dtype=dtype)
    buf.copy_(t.t())
    return buf.numpy()


def _vector(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    t = t.detach()
    if t.dtype != dtype or not t.is_contiguous() or t.is_neg():
        t = t.to(dtype).contiguous().resolve_neg()
    return t.numpy()


def _result(out: Optional[torch.Tensor], shape, dtype: torch.dtype, cdtype: torch.dtype):
    """(tensor to return, buffer the kernel writes into)."""
    if out is None:
        res = torch.empty(shape, dtype=dtype)
    else:
        res = out
    buf = res if dtype == cdtype else torch.empty(shape, dtype=cdtype)
    return res, buf


def _finish(res: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if buf is not res:
        res.copy_(buf)
    return res


def _spmm_any(src_t: torch.Tensor, values: torch.Tensor, out, shape, arrays) -> torch.Tensor:
    dtype = src_t.dtype
    cdtype = _compute_dtype(dtype)
    res, buf = _result(out, shape, dtype, cdtype)
    if shape[0] == 0:
        return res
    if shape[1] == 0 or src_t.shape[1] == 0 or values.shape[0] == 0:
        return res.zero_()
    split, ptr, idx, perm = arrays
    with torch.no_grad():
        src = _transposed(src_t, cdtype)
        vals = _vector(values, cdtype)
        _spmm_kernel(split, ptr, idx, perm, vals, src, buf.detach().numpy())
    return _finish(res, buf)


def spmm(x: torch.Tensor, topo: Topology, values: torch.Tensor,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y = X W^T on the CPU.

    Args:
        x: (B, in) CPU tensor, float32/float64/float16/bfloat16 (any strides).
        topo: `Topology` of W, shape (out, in), canonical row-major, indices on the CPU.
        values: (nnz,) CPU tensor of x's dtype, canonical row-major order.
        out: optional contiguous (B, out) CPU tensor of x's dtype, overwritten and returned.
    Returns Y (B, out) of x's dtype. Not differentiable (the autograd Function calls the three ops).
    """
    _check_topo(topo)
    _check_dense("x", x, topo.shape[1], "in = topo.shape[1]")
    _check_values(values, topo, x.dtype)
    shape = (x.shape[0], topo.shape[0])
    _check_out(out, shape, x.dtype)
    return _spmm_any(x, values, out, shape, _csr(topo, _threads() * _CHUNKS_PER_THREAD))


def spmm_t(dy: torch.Tensor, topo: Topology, values: torch.Tensor,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dX = dY W on the CPU (the input gradient of Y = X W^T).

    Args:
        dy: (B, out) CPU tensor, float32/float64/float16/bfloat16 (any strides).
        topo: `Topology` of W, shape (out, in), indices on the CPU.
        values: (nnz,) CPU tensor of dy's dtype, canonical row-major order.
        out: optional contiguous (B, in) CPU tensor of dy's dtype, overwritten and returned.
    Returns dX (B, in) of dy's dtype.
    """
    _check_topo(topo)
    _check_dense("dy", dy, topo.shape[0], "out = topo.shape[0]")
    _check_values(values, topo, dy.dtype)
    shape = (dy.shape[0], topo.shape[1])
    _check_out(out, shape, dy.dtype)
    return _spmm_any(dy, values, out, shape, _csc(topo, _threads() * _CHUNKS_PER_THREAD))


def sddmm(dy: torch.Tensor, x: torch.Tensor, topo: Topology,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dv_k = sum_b dY[b, r_k] X[b, c_k] on the CPU (the value gradient of Y = X W^T).

    Args:
        dy: (B, out) CPU tensor, float32/float64/float16/bfloat16 (any strides).
        x: (B, in) CPU tensor of dy's dtype.
        topo: `Topology` of W, shape (out, in), indices on the CPU.
        out: optional contiguous (nnz,) CPU tensor of dy's dtype, overwritten and returned.
    Returns dv (nnz,) of dy's dtype, in canonical row-major order.
    """
    _check_topo(topo)
    _check_dense("dy", dy, topo.shape[0], "out = topo.shape[0]")
    _check_dense("x", x, topo.shape[1], "in = topo.shape[1]")
    if x.dtype != dy.dtype:
        raise TypeError(f"x must have dy's dtype {dy.dtype}, got {x.dtype}")
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"x and dy must have the same batch size, got x {tuple(x.shape)} and dy {tuple(dy.shape)}")
    dtype = dy.dtype
    cdtype = _compute_dtype(dtype)
    shape = (topo.nnz,)
    _check_out(out, shape, dtype)
    res, buf = _result(out, shape, dtype, cdtype)
    if topo.nnz == 0:
        return res
    if dy.shape[0] == 0:
        return res.zero_()
    split, ptr, idx, _ = _csr(topo, _threads() * _CHUNKS_PER_THREAD)
    with torch.no_grad():
        _sddmm_kernel(split, ptr, idx, _transposed(dy, cdtype), _transposed(x, cdtype),
                      buf.detach().numpy())
    return _finish(res, buf)
