"""The CPU backend: SpMM, transposed SpMM and SDDMM on a COO weight, compiled with Numba.

    spmm(x, topo, values)    Y  (B, out) = X W^T     Y[b, r]  = sum_k v_k X[b, c_k]
    spmm(x, topo, values, bias=b)  Y + b, b added before half-precision results are rounded
    spmm_t(dy, topo, values) dX (B, in)  = dY W      dX[b, c] = sum_k v_k dY[b, r_k]
    sddmm(dy, x, topo)       dv (nnz,)               dv_k     = sum_b dY[b, r_k] X[b, c_k]
    spmm_t_sddmm(dy, x, topo, values, bias_grad=False)  (dX, dv[, db]): the backward in one call,
                             dY copied into its tiles once (the layers use it from B = 2)

Design: the batch is moved to the fast axis. X (B, in) is copied once per call into X^T, cut
into tiles of 8, 16, 32 or 64 batch columns (zero-padded) and stored tile-major: tile t is an
(in, w) block, 64-byte aligned, so that every non-zero gathers w contiguous elements (whole cache
lines) of X^T. The copy runs on the op's threads.
Accumulators are LLVM vector values (four small Numba intrinsics below): 64 float32 columns sit
in four 512-bit registers while a row's non-zeros stream by, one vector FMA per register per
non-zero. (Numba's own loop vectoriser keeps a short accumulator array in memory, and the
store/reload round trip per non-zero then makes the loop about 1.6x slower.)
- SpMM walks CSR order (`topo.row_ptr`, `topo.cols`); rows' results are staged 16 rows at a time
  and written to Y (B, out) as contiguous runs; in tiles of 8 or 16 batch columns (one or two
  registers) a row's products go into two chains of FMAs (even and odd non-zeros), so that each
  FMA need not wait for the one before. Up to 3 samples the forward reads X as it is:
  per row and sample a dot product taking 8 non-zeros per step (one gather of their x values, 8
  partial sums), each sample's result that of its own B = 1 call; dX and the SDDMM at B = 1
  gather 8 at a time too (dX scatters its 8 updated sums back: a row's columns are distinct).
  Parallel tasks: (chunk of rows of equal nnz, batch tile).
- dX = dY W, for B <= 16, also walks CSR order, so no permuted copy of the values (a random
  gather of all nnz per call) is needed: dX^T[c, :] += v_k dY^T[r_k, :], each task owning a range
  of columns c of equal nnz. Columns are sorted within a row, so a task's part of each row is one
  run, whose bounds are found once per topology and cached. A task scatters into its own rows of
  a scratch dX^T, with the row's dY^T tile in registers. Each non-zero then loads and stores a
  w-wide row of that scratch, which from w = 32 on costs more than the gather: for B > 16 the
  values are gathered into column order (one parallel pass, an nnz-sized temporary) and dX runs
  as the SpMM kernel on W^T (the topology's cached CSC arrays), with the same additions in the
  same order, so both ways give the same bits.
- SDDMM walks CSR order: per row, the dY^T tile stays in registers and each non-zero adds the
  tree sum of one elementwise product with a gathered X^T tile; 8 non-zeros at a time share the
  last three levels of their trees (transposing vector adds into one 8-vector of sums). Up to 3
  samples it reads dY and X as they are, 8 non-zeros per gather, in the same order of adds.
No two tasks write the same element (no atomics), and every output element is summed in a
fixed order: results do not depend on the thread count or on whether a call ran in parallel.
Numba's thread count follows torch.get_num_threads(); calls below about a million
multiply-adds run on the calling thread alone (see _PARALLEL_MIN_WORK). Topology-derived arrays
(int32 CSR arrays, chunk bounds) are cached in `topo.cache` under keys starting with "cpu_";
a topology is checked once (range, canonical order) before the unchecked kernels use it.

Trade-off: the X^T / dY^T copies cost B x (in + out) element moves per call (plus padding to
the tile width), small against the nnz x B multiply-adds at the sparsities this is for, and
they buy contiguous, register-blocked inner loops. Where they are not small (a batch of 2-7
samples, padded to 8, where the copy, in x 8 elements (in + out for the SDDMM), would move at
least the nnz x B elements the gathers read: a very wide layer with few non-zeros per column,
`_lopsided`), the forward and the SDDMM read X and dY as they are, as up to 3 samples do. (dX
keeps its tiles there: a tile of 8 costs it about what 8 single samples do, and scattering one
sample at a time measured 0.5-1.6x its time at B = 2-7.)
float32 and float64 are computed natively; float16 and bfloat16 are computed in float32 and
rounded once at the end (the forward's bias, when given, added before). Rounding: tiles of 32 and 64 sum a row's products in one chain in row
order (the order dX's scatter needs, whose bits the SpMM on W^T must give), so in float32 a row
of thousands of non-zeros carries a few times the error of torch.mm's blocked sums (3-9x on
random 2 x 3000 dense rows at B >= 17; tiles of 8 and 16 use two chains, B = 1 eight).
Kernels are compiled on first use (about 27 s for both dtypes on 2 cores) and cached on disk (Numba's cache, with
loads and saves under a lock file: `core/jit.py`): one specialisation per op and dtype. Helpers
are left to LLVM's inliner, except four that Numba inlines at its IR level (`inline="always"`):
the few-sample forward's row loop and dX's scatter (scalar, 8-wide and its task); with those too
left to LLVM dX at B = 2-16 was 7-12% slower, and with every helper inlined at the IR level the compile took 42 instead of 27 s (same bits).

Speed, 4096 x 4096 at 90% sparsity (nnz = 1.68 M), float32, 2 cores (Intel Xeon, torch 2.13
CPU; experiments/bench_cpu.py --rounds 15, results/bench_cpu.csv @ d9cb7b7), against dense torch.mm:
                 B = 1                   B = 32                 B = 128
    forward      0.31 ms vs 1.30 (4.1x)  1.24 vs 6.33 (5.1x)    4.20 vs 16.41 (3.9x)
    dX           0.94 vs 1.29 (1.4x)     1.94 vs 5.51 (2.8x)    5.18 vs 15.41 (3.0x)
    SDDMM        0.35 vs 2.23 (6.5x)     1.66 vs 3.44 (2.1x)    6.09 vs 16.51 (2.7x)
(SDDMM against the dense weight gradient dY^T X.) torch's MKL CSR matmul takes 2.10 / 2.01 /
7.64 ms for the forward. Medians of calls including the Python overhead and the X^T copy, every
output (SNACK's and dense's) allocated once, on a shared virtual machine (run-to-run spread
10-30%).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional, Tuple

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .coo import Topology, check_bias, check_out_grad, check_topology
from .jit import njit_cached

__all__ = ["spmm", "spmm_t", "sddmm", "spmm_t_sddmm", "fuses_backward", "supports", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_NATIVE = (torch.float32, torch.float64)
_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}
_CHUNKS_PER_THREAD = 4  # row chunks per thread (SpMM, SDDMM): evens out uneven rows
# Below this many multiply-adds (~0.5 ms on one core) a call runs on the calling thread alone:
# a parallel region costs tens of microseconds on an idle machine, and on a busy one (other
# processes, or torch's own OpenMP workers still spinning after a torch op) its fork-join can
# wait a scheduler tick or two (4-8 ms) for a descheduled worker.
_PARALLEL_MIN_WORK = 1 << 20
# dX runs as an SpMM on W^T (values gathered into column order per call) when a batch tile is at
# least this wide, i.e. B > 16; below, it scatters in CSR order (see the module docstring)
_TRANSPOSED_MIN_WIDTH = 32


def supports(dtype: torch.dtype) -> bool:
    """True for the dtypes this backend computes: float32, float64, float16, bfloat16."""
    return dtype in SUPPORTED_DTYPES


# ---- SIMD values -------------------------------------------------------------------------------
# Numba has no vector type and its SLP vectoriser is off, so a short accumulator array stays in
# memory: every non-zero would then reload and store it, and the store-to-load round trip (not
# the arithmetic) would bound the loop. These four intrinsics give a value of n elements held in
# vector registers (an LLVM <n x float>; n = 64 float32 is four 512-bit registers).
class _Vec(types.Type):
    """n elements of dtype, an SSA value in vector registers."""

    def __init__(self, dtype, n):
        self.dtype = dtype
        self.n = n
        super().__init__(name=f"SnackVec({dtype}, {n})")


@register_model(_Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        be = ir.VectorType(dmm.lookup(fe_type.dtype).get_value_type(), fe_type.n)
        super().__init__(dmm, fe_type, be)


def _elem_ptr(context, builder, arrty, arr, off, vt):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [off]), ir.PointerType(vt))


@intrinsic
def _vload(typingctx, arr, off, n):
    """arr[off:off + n] (1-D contiguous array, n a literal int) as a _Vec; no bounds check."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    vec = _Vec(arr.dtype, n.literal_value)

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], context.get_value_type(vec))
        return builder.load(ptr, align=context.get_abi_sizeof(context.get_value_type(arr.dtype)))
    return vec(arr, off, n), codegen


@intrinsic
def _vstore(typingctx, arr, off, v):
    """arr[off:off + n] = v; no bounds check."""
    if not isinstance(v, _Vec):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], args[2].type)
        builder.store(args[2], ptr, align=context.get_abi_sizeof(context.get_value_type(arr.dtype)))
        return context.get_dummy_value()
    return types.none(arr, off, v), codegen


@intrinsic
def _vzeros(typingctx, like, n):
    """A _Vec of n zeros of like's dtype (like: an array)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    vec = _Vec(like.dtype, n.literal_value)

    def codegen(context, builder, sig, args):
        return ir.Constant(context.get_value_type(vec), None)
    return vec(like, n), codegen


def _vec_suffix(vt) -> str:
    """LLVM's name suffix for vector type vt: v8f32, v4f64, ..."""
    return f"v{vt.count}f{64 if vt.element == ir.DoubleType() else 32}"


def _splat(builder, sc, vt):
    """The scalar sc (already of vt's element type) in every lane of vector type vt."""
    undef = ir.Constant(vt, ir.Undefined)
    lane = builder.insert_element(undef, sc, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(lane, undef, ir.Constant(ir.VectorType(ir.IntType(32), vt.count), [0] * vt.count))


def _fma_fn(builder, vt):
    """llvm.fma for vector type vt: fma(a, b, c) = a * b + c, rounded once."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.{_vec_suffix(vt)}")


@intrinsic
def _vfma(typingctx, acc, s, x):
    """acc + s * x, element by element (one fused multiply-add), s a scalar."""
    if not (isinstance(acc, _Vec) and acc == x):
        return None

    def codegen(context, builder, sig, args):
        a, sc, xv = args
        splat = _splat(builder, context.cast(builder, sc, sig.args[1], sig.args[0].dtype), a.type)
        return builder.call(_fma_fn(builder, a.type), [splat, xv, a])
    return acc(acc, s, x), codegen


def _halves(builder, v, n):
    """v (a vector of >= n lanes) summed pairwise as lo + hi halves down to n lanes."""
    i32 = ir.IntType(32)
    while v.type.count > n:
        h = v.type.count // 2
        undef = ir.Constant(v.type, ir.Undefined)
        lo = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(i32, h), list(range(h))))
        hi = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(i32, h), list(range(h, 2 * h))))
        v = builder.fadd(lo, hi)
    return v


def _lane_ptrs(context, builder, arrty, arr, iv, n):
    """<n x ptr> to arr[iv[0]], ..., arr[iv[n - 1]] (iv: <n x i32>)."""
    data = context.make_array(arrty)(context, builder, arr).data
    i64 = ir.IntType(64)
    v64 = ir.VectorType(i64, n)
    undef = ir.Constant(v64, ir.Undefined)
    base = builder.shuffle_vector(builder.insert_element(undef, builder.ptrtoint(data, i64), ir.Constant(ir.IntType(32), 0)),
                                  undef, ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))
    size = context.get_abi_sizeof(context.get_value_type(arrty.dtype))
    off = builder.mul(builder.sext(iv, v64), ir.Constant(v64, [size] * n))
    return builder.inttoptr(builder.add(base, off), ir.VectorType(data.type, n))


def _masked_call(context, builder, name, vt, ptrs, lead, tail):
    """Calls llvm.masked.<name> (gather or scatter) on all lanes of the <n x ptr> ptrs, for
    elements of vector type vt: arguments lead + (ptrs, alignment, all-true mask) + tail."""
    i32 = ir.IntType(32)
    mask = ir.VectorType(ir.IntType(1), vt.count)
    ret = vt if name == "gather" else ir.VoidType()
    args = [*lead, ptrs, ir.Constant(i32, context.get_abi_sizeof(vt.element)), ir.Constant(mask, [1] * vt.count), *tail]
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                        f"llvm.masked.{name}.{_vec_suffix(vt)}.v{vt.count}p0")
    return builder.call(fn, args)


@intrinsic
def _vgather(typingctx, arr, iv):
    """(arr[iv[0]], ..., arr[iv[n - 1]]) as a _Vec; iv a _Vec of int32 indices; no bounds check
    (one gather instruction where the CPU has one, else n loads)."""
    if not (isinstance(iv, _Vec) and iv.dtype == types.int32):
        return None
    vec = _Vec(arr.dtype, iv.n)

    def codegen(context, builder, sig, args):
        vt = context.get_value_type(vec)
        ptrs = _lane_ptrs(context, builder, sig.args[0], args[0], args[1], iv.n)
        return _masked_call(context, builder, "gather", vt, ptrs, (), (ir.Constant(vt, ir.Undefined),))
    return vec(arr, iv), codegen


@intrinsic
def _vscatter(typingctx, arr, iv, v):
    """arr[iv[i]] = v[i] for each lane i (indices distinct); no bounds check."""
    if not (isinstance(iv, _Vec) and iv.dtype == types.int32 and isinstance(v, _Vec) and v.n == iv.n):
        return None

    def codegen(context, builder, sig, args):
        ptrs = _lane_ptrs(context, builder, sig.args[0], args[0], args[1], iv.n)
        _masked_call(context, builder, "scatter", args[2].type, ptrs, (args[2],), ())
        return context.get_dummy_value()
    return types.none(arr, iv, v), codegen


@intrinsic
def _vfmav(typingctx, acc, a, b):
    """acc + a * b, element by element (one fused multiply-add), a and b _Vecs."""
    if not (isinstance(acc, _Vec) and acc == a and acc == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.call(_fma_fn(builder, args[0].type), [args[1], args[2], args[0]])
    return acc(acc, a, b), codegen


@intrinsic
def _vscale(typingctx, v, s):
    """v * s, element by element, s a scalar."""
    if not isinstance(v, _Vec):
        return None

    def codegen(context, builder, sig, args):
        sc = context.cast(builder, args[1], sig.args[1], sig.args[0].dtype)
        return builder.fmul(args[0], _splat(builder, sc, args[0].type))
    return v(v, s), codegen


@intrinsic
def _vsum(typingctx, v):
    """sum(v), summed as a balanced tree of halves (fixed order)."""
    if not isinstance(v, _Vec):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(_halves(builder, args[0], 1), ir.Constant(ir.IntType(32), 0))
    return v.dtype(v), codegen


# ---- kernels ----------------------------------------------------------------------------------
# Every kernel argument is a C-contiguous numpy view of a CPU tensor:
#   split  int32 (nchunk + 1,)  first row of each parallel chunk, chunks of about equal nnz
#   ptr    int32 (rows + 1,)    CSR row pointers
#   idx    int32 (nnz,)         column of each entry, CSR (canonical row-major) order
#   vals   float (nnz,)         values, canonical order
#   plan   int64 (ntile, 3)     batch tiles: (width w in 1, 8, 16, 32, 64; first column b0; real
#                               width nb <= w). w = 1 only for B = 1
#   src    float (m * Bp,)      X^T (m = in) or dY^T (m = out) in tile-major blocks: tile t is an
#                               (m, w) block at offset b0 * m, its columns nb .. w - 1 zero. A
#                               gathered row is then w contiguous elements (whole cache lines)
#   dst    float (B, n)         written fully: Y (n = out) or dX (n = in)
_WIDTHS = (8, 16, 32, 64)
# Results of _STAGE consecutive rows are staged and written to Y (B, out) as runs of _STAGE
# contiguous elements per batch column: writing a column Y[b0:b0 + 64, r] per row would touch 64
# cache lines a stride of `out` elements apart, which for out a multiple of 1024 (float32) all
# fall in one L1 set.
_STAGE = 16


@njit
def _flush(stage, w, n, dst, b0, nb, r):
    """dst[b0 + j, r - n + i] = stage[i * w + j] for i < n, j < nb."""
    for j in range(nb):
        for i in range(n):
            dst[b0 + j, r - n + i] = stage[i * w + j]


_LANES = 8  # non-zeros per step of the gathering kernels (one 8-wide gather of x / dX)
# Forward batches up to this size read X as it is, by gathers per sample (_rows_few): at 4096 x
# 4096, 90%, B = 2 / 3 took 0.44 / 0.69 ms instead of 0.98 / 1.01 through a zero-padded 8-wide
# tile; at B = 4 both took 1.0 ms. The SDDMM too (B = 2 / 3: 0.37 / 0.57 ms instead of 0.74 /
# 0.76). At least 1: B = 1 has no tiled path.
_FEW_MAX = 3


def _lopsided(B: int, m: int, nnz: int) -> bool:
    """Whether a batch narrower than the first tile (2 <= B < 8, zero-padded to 8) is better read
    as it is, by gathers per sample, than copied into tiles: where the copy, m elements per padded
    batch column (in for the forward, in + out for the SDDMM), would move at least as many
    elements as the gathers read (nnz x B). Layers with a very wide input and few non-zeros per
    input, such as 1 x 200000 at 50%: there B = 4 took 2.6 ms for the forward through a tile
    against 0.2 ms by gathers (2 cores; 4096 x 4096 at 90-99% keeps its tiles, which are 1.7-2.2x
    faster there at B = 4)."""
    return 1 < B < _WIDTHS[0] and m * _WIDTHS[0] >= nnz * B


@njit(fastmath={"contract"}, inline="always")
def _rows_few(r0, r1, ptr, idx, vals, x, dst):
    """dst[j, r] = <row r, x[j]> for the few rows j of x (B <= _FEW_MAX, X as it is, rows
    contiguous): per output row and sample, 8 non-zeros per step, their x values by one gather,
    8 partial sums (lane i: the row's non-zeros i, i + 8, ...) summed as a tree, then the row's
    last few added in order; the row's indices and values stay in L1 for the next sample. Each
    sample's result is what B = 1 gives for it."""
    for r in range(r0, r1):
        k0 = ptr[r]
        k1 = ptr[r + 1]
        for j in range(x.shape[0]):
            xj = x[j]
            acc = _vzeros(xj, _LANES)
            k = k0
            while k + _LANES <= k1:
                acc = _vfmav(acc, _vload(vals, k, _LANES), _vgather(xj, _vload(idx, k, _LANES)))
                k += _LANES
            s = _vsum(acc)
            while k < k1:
                s += vals[k] * xj[idx[k]]
                k += 1
            dst[j, r] = s


@njit_cached(parallel=True, nogil=True)
def _spmm_few_kernel(split, ptr, idx, vals, x, dst, parallel):
    """Y = X W^T for B <= _FEW_MAX (or a `_lopsided` batch): x = X (B, in) rows contiguous, dst =
    Y (B, out); tasks = row chunks."""
    if parallel:
        for ch in prange(split.shape[0] - 1):
            _rows_few(split[ch], split[ch + 1], ptr, idx, vals, x, dst)
    else:
        for ch in range(split.shape[0] - 1):
            _rows_few(split[ch], split[ch + 1], ptr, idx, vals, x, dst)


def _make_rows(w, chains):
    """The rows of one batch tile of width w, summing a row's products in one chain of FMAs
    (chains = 1: in row order, the order of the input gradient's scatter, whose bits the SpMM on
    W^T must give) or in two (chains = 2: non-zeros 0, 2, 4, ... and 1, 3, 5, ..., then the two
    sums added; for the forward at w <= 16, where one chain of a row's FMAs, each waiting for the
    last, bounds the loop: 4096 x 4096 at 90%, one thread, w = 8 1.94 -> 1.21 ms, w = 16
    2.06 -> 1.27; from w = 32 the row's vector registers are chains enough)."""
    @njit
    def rows(r0, r1, ptr, idx, vals, src, base, dst, b0, nb):
        """Batch columns b0 .. b0 + w - 1 of rows r0 .. r1 - 1, w accumulators in registers."""
        stage = np.empty(_STAGE * w, src.dtype)
        n = 0
        for r in range(r0, r1):
            acc = _vzeros(src, w)
            k = ptr[r]
            k1 = ptr[r + 1]
            if chains == 2:
                odd = _vzeros(src, w)
                while k + 2 <= k1:
                    acc = _vfma(acc, vals[k], _vload(src, base + idx[k] * w, w))
                    odd = _vfma(odd, vals[k + 1], _vload(src, base + idx[k + 1] * w, w))
                    k += 2
                if k < k1:
                    acc = _vfma(acc, vals[k], _vload(src, base + idx[k] * w, w))
                acc = _vadd(acc, odd)
            else:
                while k < k1:
                    acc = _vfma(acc, vals[k], _vload(src, base + idx[k] * w, w))
                    k += 1
            _vstore(stage, n * w, acc)
            n += 1
            if n == _STAGE:
                _flush(stage, w, n, dst, b0, nb, r + 1)
                n = 0
        _flush(stage, w, n, dst, b0, nb, r1)
    return rows


_rows8, _rows16, _rows32, _rows64 = (_make_rows(w, 1) for w in _WIDTHS)
_rows8x2, _rows16x2 = _make_rows(8, 2), _make_rows(16, 2)


@njit
def _spmm_task(it, split, ptr, idx, vals, src, m, dst, plan, forward):
    nchunk = split.shape[0] - 1
    t = it // nchunk
    ch = it - t * nchunk
    r0 = split[ch]
    r1 = split[ch + 1]
    w = plan[t, 0]
    b0 = plan[t, 1]
    nb = plan[t, 2]
    base = b0 * m
    if w == 64:
        _rows64(r0, r1, ptr, idx, vals, src, base, dst, b0, nb)
    elif w == 32:
        _rows32(r0, r1, ptr, idx, vals, src, base, dst, b0, nb)
    elif w == 16:
        if forward:
            _rows16x2(r0, r1, ptr, idx, vals, src, base, dst, b0, nb)
        else:
            _rows16(r0, r1, ptr, idx, vals, src, base, dst, b0, nb)
    elif forward:
        _rows8x2(r0, r1, ptr, idx, vals, src, base, dst, b0, nb)
    else:
        _rows8(r0, r1, ptr, idx, vals, src, base, dst, b0, nb)


@njit_cached(parallel=True, nogil=True)
def _spmm_kernel(split, ptr, idx, vals, src, m, dst, plan, parallel, forward):
    """Y = X W^T: src = X^T tiles (m = in), dst = Y (B, out); tasks = (row chunk, batch tile),
    run in parallel or, for small work, on the calling thread alone. forward: tiles of 8 or 16
    sum their rows in two chains (False: in row order, as the input gradient's scatter does)."""
    ntask = (split.shape[0] - 1) * plan.shape[0]
    if parallel:
        for it in prange(ntask):
            _spmm_task(it, split, ptr, idx, vals, src, m, dst, plan, forward)
    else:
        for it in range(ntask):
            _spmm_task(it, split, ptr, idx, vals, src, m, dst, plan, forward)


# dX = dY W in row order, without permuting the values: dX^T[c, :] += v_k dY^T[r_k, :].
# Parallel tasks own disjoint ranges of columns c (equal nnz per range). Within a row the columns
# are sorted, so the part of each row that falls in a task's column range is one contiguous run
# (found once per topology by binary search and cached); a task touches only its own non-zeros
# and accumulates into its rows of a scratch dX^T (tile-major like src), keeping the row's dY^T
# tile in registers, then writes its columns of dX. Each dX[b, c] is summed in row order whatever
# the thread count, and no copy of the values in column order is made.
@njit(fastmath={"contract"}, inline="always")
def _scatter_one(k0, k1, idx, vals, g, part):
    """part[c_k] += v_k g for k in k0 .. k1 - 1 (one row's run): a row's columns are distinct, so
    8 of them at a time are gathered, updated and scattered back; each part[c] still gets its
    rows' products one by one in row order, each rounded before the add as the scalar loop
    below does (the same bits as one at a time)."""
    k = k0
    while k + _LANES <= k1:
        iv = _vload(idx, k, _LANES)
        _vscatter(part, iv, _vadd(_vgather(part, iv), _vscale(_vload(vals, k, _LANES), g)))
        k += _LANES
    while k < k1:
        part[idx[k]] += vals[k] * g
        k += 1


def _make_scatter(w):
    @njit(inline="always")
    def scatter(k0, k1, idx, vals, src, so, part, pbase):
        """part[pbase + c_k * w + j] += v_k src[so + j] for k in k0 .. k1 - 1, j < w."""
        g = _vload(src, so, w)
        for k in range(k0, k1):
            o = pbase + idx[k] * w
            _vstore(part, o, _vfma(_vload(part, o, w), vals[k], g))
    return scatter


_scatter8, _scatter16, _scatter32, _scatter64 = (_make_scatter(w) for w in _WIDTHS)


@njit(inline="always")
def _spmm_t_task(it, csplit, bounds, idx, vals, src, part, dst, plan):
    nchunk = csplit.shape[0] - 1
    n_out = bounds.shape[1]
    n_in = dst.shape[1]
    t = it // nchunk
    ch = it - t * nchunk
    c0 = csplit[ch]
    c1 = csplit[ch + 1]
    if c0 == c1:
        return
    w = plan[t, 0]
    b0 = plan[t, 1]
    nb = plan[t, 2]
    sbase = b0 * n_out
    pbase = b0 * n_in
    zero = src.dtype.type(0)
    for i in range(pbase + c0 * w, pbase + c1 * w):
        part[i] = zero
    lo = bounds[ch]
    hi = bounds[ch + 1]
    for r in range(n_out):
        k0 = lo[r]
        k1 = hi[r]
        if k0 == k1:
            continue
        so = sbase + r * w
        if w == 64:
            _scatter64(k0, k1, idx, vals, src, so, part, pbase)
        elif w == 32:
            _scatter32(k0, k1, idx, vals, src, so, part, pbase)
        elif w == 16:
            _scatter16(k0, k1, idx, vals, src, so, part, pbase)
        elif w == 8:
            _scatter8(k0, k1, idx, vals, src, so, part, pbase)
        else:
            _scatter_one(k0, k1, idx, vals, src[r], part)
    for j in range(nb):
        for c in range(c0, c1):
            dst[b0 + j, c] = part[pbase + c * w + j]


@njit_cached(parallel=True, nogil=True)
def _gather_kernel(vals, perm, dst, parallel):
    """dst[i] = vals[perm[i]]: the values in column-major order, for dX as an SpMM on W^T."""
    if parallel:
        for i in prange(perm.shape[0]):
            dst[i] = vals[perm[i]]
    else:
        for i in range(perm.shape[0]):
            dst[i] = vals[perm[i]]


@njit_cached(parallel=True, nogil=True)
def _spmm_t_kernel(csplit, bounds, idx, vals, src, part, dst, plan, parallel):
    """dX = dY W. csplit int32 (nchunk + 1,): column ranges; bounds int32 (nchunk + 1, out):
    bounds[ch, r] is the first CSR position of row r whose column is >= csplit[ch]; src = dY^T
    tiles (m = out); part: scratch dX^T tiles (m = in), same layout; dst = dX (B, in)."""
    ntask = (csplit.shape[0] - 1) * plan.shape[0]
    if parallel:
        for it in prange(ntask):
            _spmm_t_task(it, csplit, bounds, idx, vals, src, part, dst, plan)
    else:
        for it in range(ntask):
            _spmm_t_task(it, csplit, bounds, idx, vals, src, part, dst, plan)


# SDDMM: dv_k = <dY^T[r_k, :], X^T[c_k, :]>, both operands in the same tile-major layout. Tasks
# are chunks of rows; within a chunk, tile by tile, each row keeps its dY^T tile in registers
# and every non-zero adds the pairwise (tree) sum of one elementwise product to dv_k.
@intrinsic
def _vdot(typingctx, a, b):
    """sum(a * b) of two _Vec, summed as a balanced tree of halves (fixed order)."""
    if not (isinstance(a, _Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        v = _halves(builder, builder.fmul(args[0], args[1]), 1)
        return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))
    return a.dtype(a, b), codegen


@intrinsic
def _vdot8(typingctx, g, x0, x1, x2, x3, x4, x5, x6, x7):
    """The 8 sums (sum(g * x0), ..., sum(g * x7)) as one _Vec of 8, each summed in _vdot's order.

    Each product is halved down to 8 lanes, then three transposing steps add the pairs of
    lanes _vdot adds (lanes i and i + 4, then i and i + 2, then i and i + 1), two vectors at a
    time: 7 vector adds for the last three levels of 8 trees instead of 24 single-lane ones, and
    the same bits."""
    xs = (x0, x1, x2, x3, x4, x5, x6, x7)
    if not (isinstance(g, _Vec) and g.n >= 8 and all(x == g for x in xs)):
        return None
    i32 = ir.IntType(32)

    def pairs(builder, vs, lo, hi):
        sel = lambda ix: ir.Constant(ir.VectorType(i32, 8), ix)  # noqa: E731
        return [builder.fadd(builder.shuffle_vector(a, b, sel(lo)), builder.shuffle_vector(a, b, sel(hi)))
                for a, b in zip(vs[0::2], vs[1::2])]

    def codegen(context, builder, sig, args):
        vs = [_halves(builder, builder.fmul(args[0], x), 8) for x in args[1:]]
        vs = pairs(builder, vs, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
        vs = pairs(builder, vs, [0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15])
        vs = pairs(builder, vs, [0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15])
        return vs[0]
    return _Vec(g.dtype, 8)(g, *xs), codegen


@intrinsic
def _vadd(typingctx, a, b):
    """a + b, element by element."""
    if not (isinstance(a, _Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return a(a, b), codegen


def _make_sddmm(w):
    @njit
    def sddmm_rows(r0, r1, ptr, idx, gsrc, gbase, xsrc, xbase, dv, first):
        for r in range(r0, r1):
            g = _vload(gsrc, gbase + r * w, w)
            k = ptr[r]
            k1 = ptr[r + 1]
            while k + 8 <= k1:  # 8 non-zeros at a time, their sums in one vector
                s = _vdot8(g, _vload(xsrc, xbase + idx[k] * w, w), _vload(xsrc, xbase + idx[k + 1] * w, w),
                           _vload(xsrc, xbase + idx[k + 2] * w, w), _vload(xsrc, xbase + idx[k + 3] * w, w),
                           _vload(xsrc, xbase + idx[k + 4] * w, w), _vload(xsrc, xbase + idx[k + 5] * w, w),
                           _vload(xsrc, xbase + idx[k + 6] * w, w), _vload(xsrc, xbase + idx[k + 7] * w, w))
                _vstore(dv, k, s if first else _vadd(_vload(dv, k, 8), s))
                k += 8
            for k in range(k, k1):
                if first:
                    dv[k] = _vdot(g, _vload(xsrc, xbase + idx[k] * w, w))
                else:
                    dv[k] += _vdot(g, _vload(xsrc, xbase + idx[k] * w, w))
    return sddmm_rows


_sddmm8, _sddmm16, _sddmm32, _sddmm64 = (_make_sddmm(w) for w in _WIDTHS)


@njit
def _sddmm_task(ch, split, ptr, idx, dyt, xt, n_in, dv, plan):
    r0 = split[ch]
    r1 = split[ch + 1]
    n_out = ptr.shape[0] - 1
    for t in range(plan.shape[0]):
        w = plan[t, 0]
        b0 = plan[t, 1]
        first = t == 0
        if w == 64:
            _sddmm64(r0, r1, ptr, idx, dyt, b0 * n_out, xt, b0 * n_in, dv, first)
        elif w == 32:
            _sddmm32(r0, r1, ptr, idx, dyt, b0 * n_out, xt, b0 * n_in, dv, first)
        elif w == 16:
            _sddmm16(r0, r1, ptr, idx, dyt, b0 * n_out, xt, b0 * n_in, dv, first)
        else:
            _sddmm8(r0, r1, ptr, idx, dyt, b0 * n_out, xt, b0 * n_in, dv, first)


@njit
def _sddmm_few_rows(r0, r1, ptr, idx, dy, x, dv):
    """dv_k = sum_j dy[j, r_k] x[j, c_k] for the few samples j (B <= _FEW_MAX, or a `_lopsided`
    batch; dy, x as they are, rows contiguous), 8 non-zeros per step by gathers of x[j]. Up to
    B = 3 the products are added as the 8-wide tile's tree adds them (B = 2: p0 + p1, B = 3:
    (p0 + p2) + p1), so the bits are those of the tiled kernel; above, in sample order."""
    B = x.shape[0]
    x0 = x[0]
    for r in range(r0, r1):
        g0 = dy[0, r]
        k = ptr[r]
        k1 = ptr[r + 1]
        if B == 1:
            while k + _LANES <= k1:
                _vstore(dv, k, _vscale(_vgather(x0, _vload(idx, k, _LANES)), g0))
                k += _LANES
            while k < k1:
                dv[k] = g0 * x0[idx[k]]
                k += 1
        elif B == 2:
            x1 = x[1]
            g1 = dy[1, r]
            while k + _LANES <= k1:
                iv = _vload(idx, k, _LANES)
                _vstore(dv, k, _vadd(_vscale(_vgather(x0, iv), g0), _vscale(_vgather(x1, iv), g1)))
                k += _LANES
            while k < k1:
                dv[k] = g0 * x0[idx[k]] + g1 * x1[idx[k]]
                k += 1
        elif B == 3:
            x1 = x[1]
            x2 = x[2]
            g1 = dy[1, r]
            g2 = dy[2, r]
            while k + _LANES <= k1:
                iv = _vload(idx, k, _LANES)
                p02 = _vadd(_vscale(_vgather(x0, iv), g0), _vscale(_vgather(x2, iv), g2))
                _vstore(dv, k, _vadd(p02, _vscale(_vgather(x1, iv), g1)))
                k += _LANES
            while k < k1:
                c = idx[k]
                p02 = g0 * x0[c] + g2 * x2[c]
                dv[k] = p02 + g1 * x1[c]
                k += 1
        else:  # a `_lopsided` batch (4 to 7 samples): the products added sample by sample
            while k + _LANES <= k1:
                iv = _vload(idx, k, _LANES)
                acc = _vscale(_vgather(x0, iv), g0)
                for j in range(1, B):
                    acc = _vadd(acc, _vscale(_vgather(x[j], iv), dy[j, r]))
                _vstore(dv, k, acc)
                k += _LANES
            while k < k1:
                c = idx[k]
                s = g0 * x0[c]
                for j in range(1, B):
                    s += dy[j, r] * x[j, c]
                dv[k] = s
                k += 1


@njit_cached(parallel=True, nogil=True)
def _sddmm_few_kernel(split, ptr, idx, dy, x, dv, parallel):
    """dv for B <= _FEW_MAX (or a `_lopsided` batch) from dy (B, out) and x (B, in) as they are;
    tasks = row chunks."""
    if parallel:
        for ch in prange(split.shape[0] - 1):
            _sddmm_few_rows(split[ch], split[ch + 1], ptr, idx, dy, x, dv)
    else:
        for ch in range(split.shape[0] - 1):
            _sddmm_few_rows(split[ch], split[ch + 1], ptr, idx, dy, x, dv)


@njit_cached(parallel=True, nogil=True)
def _sddmm_kernel(split, ptr, idx, dyt, xt, n_in, dv, plan, parallel):
    """dv[k] = <dY^T[r_k, :], X^T[c_k, :]>: dyt = dY^T tiles (m = out), xt = X^T tiles (m = in),
    dv (nnz,); tasks = row chunks."""
    nchunk = split.shape[0] - 1
    if parallel:
        for ch in prange(nchunk):
            _sddmm_task(ch, split, ptr, idx, dyt, xt, n_in, dv, plan)
    else:
        for ch in range(nchunk):
            _sddmm_task(ch, split, ptr, idx, dyt, xt, n_in, dv, plan)


def _plan(B: int):
    """Batch tiles of the SpMM kernels: (plan int64 (ntile, 3), padded width). 64-wide tiles
    while more than 32 columns remain, then one tile of 8, 16 or 32 (zero-padded)."""
    if B == 1:
        return np.array([[1, 0, 1]], np.int64), 1
    tiles = []
    b0 = 0
    while B - b0 > 32:
        tiles.append((64, b0, min(64, B - b0)))
        b0 += 64
    rem = B - b0
    if rem > 0:
        tiles.append((next(w for w in _WIDTHS if w >= rem), b0, rem))
    return np.array(tiles, np.int64), tiles[-1][1] + tiles[-1][0]


# ---- topology arrays (cached on the Topology) ---------------------------------------------------
def _np_i32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.int32).contiguous().numpy()


def _split(ptr: np.ndarray, nchunk: int) -> np.ndarray:
    """Boundaries (nchunk + 1,) cutting the rows (columns, for CSC pointers) into chunks of about
    equal nnz; empty chunks are allowed."""
    nnz = int(ptr[-1])
    targets = (np.arange(nchunk + 1, dtype=np.int64) * nnz) // max(nchunk, 1)
    s = np.searchsorted(ptr, targets, side="left").astype(np.int32)
    s[0] = 0
    s[-1] = ptr.shape[0] - 1
    return np.maximum.accumulate(s)


def _csr(topo: Topology, nchunk: int):
    """(split, row_ptr, cols): int32 numpy arrays cached on the topology; split cuts the rows
    into `nchunk` chunks of about equal nnz."""
    c = topo.cache.get("cpu_csr")
    if c is None:
        check_topology(topo)
        c = topo.cache["cpu_csr"] = {"ptr": _np_i32(topo.row_ptr), "idx": _np_i32(topo.cols)}
    s = c.get(nchunk)
    if s is None:
        s = c[nchunk] = _split(c["ptr"], nchunk)
    return s, c["ptr"], c["idx"]


def _csc(topo: Topology, nchunk: int):
    """(split, col_ptr, rows, perm): W^T in CSR form, int32 numpy arrays cached on the topology
    (perm: the canonical position of each column-major entry); split cuts the columns into
    `nchunk` chunks of about equal nnz."""
    c = topo.cache.get("cpu_csc")
    if c is None:
        check_topology(topo)
        rows, cols = topo.indices.numpy()
        # canonical order is row-major, so a stable sort by column keeps rows ascending per column
        # (int32 arrays only: the topology's own int64 col_perm would double what this costs)
        perm = np.argsort(cols, kind="stable").astype(np.int32)
        c = topo.cache["cpu_csc"] = {"ptr": _np_i32(topo.col_ptr), "idx": rows[perm], "perm": perm}
    s = c.get(nchunk)
    if s is None:
        s = c[nchunk] = _split(c["ptr"], nchunk)
    return s, c["ptr"], c["idx"], c["perm"]


def _col_bounds(topo: Topology, nchunk: int):
    """(csplit, bounds), cached: `nchunk` column ranges of about equal nnz (int32 (nchunk + 1,)),
    and for each range boundary and row the first CSR position at or past it (int32
    (nchunk + 1, rows))."""
    c = topo.cache.get("cpu_colbounds")
    if c is None:
        c = topo.cache["cpu_colbounds"] = {}
    got = c.get(nchunk)
    if got is None:
        rows, cols = topo.shape
        csplit = _split(_np_i32(topo.col_ptr), nchunk)
        idx = topo.indices.to(torch.int64)
        keys = (idx[0] * cols + idx[1]).numpy()  # increasing: canonical row-major order
        want = np.arange(rows, dtype=np.int64)[None, :] * cols + csplit.astype(np.int64)[:, None]
        bounds = np.searchsorted(keys, want.ravel(), side="left").reshape(want.shape)
        got = c[nchunk] = (csplit, bounds.astype(np.int32))
    return got


# Numba's parallel regions are run one at a time: its "workqueue" threading layer (what Numba
# uses when neither TBB nor OpenMP is installed) aborts the process when two Python threads enter
# a parallel region at once, and with the other layers two concurrent regions would only share
# the same cores. Single-threaded calls (small work) take no lock.
_PARALLEL_LOCK = threading.Lock()


def _parallel_lock(n: int):
    return _PARALLEL_LOCK if n > 1 else contextlib.nullcontext()


_pool_started = False


def _start_numba_pool() -> None:
    """Starts Numba's thread pool, keeping torch's intra-op thread count: with the "omp" threading
    layer Numba shares torch's OpenMP runtime, and starting its pool sets OpenMP's thread count
    to NUMBA_NUM_THREADS, which would silently undo a torch.set_num_threads(k) made before the
    first sparse call (and make torch's own ops use every core). Numba changes it only then."""
    global _pool_started
    if not _pool_started:
        keep = torch.get_num_threads()
        numba.get_num_threads()  # starts the pool
        if torch.get_num_threads() != keep:
            torch.set_num_threads(keep)
        _pool_started = True


def _threads(work: int) -> int:
    """Threads for a call doing `work` multiply-adds: torch.get_num_threads() (capped by Numba's
    pool), or 1 below _PARALLEL_MIN_WORK. Sets Numba's thread count to match."""
    _start_numba_pool()
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if work < _PARALLEL_MIN_WORK:
        return 1
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
    check_out_grad(out)


# ---- host side -----------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _NATIVE else torch.float32


_TILE_COLS = 64  # columns of t per task of _tile_kernel
_TB = 8  # rows and columns of the blocks that _transpose_block moves


def _transpose_masks(n: int, k: int):
    """Shuffle masks over a ++ b (two n-vectors) of one stage of an n x n transpose: rows i and
    i + k (i & k == 0) become lo = a and b interleaved by blocks of k, hi = the other blocks."""
    lo, hi = [], []
    for q in range(n // (2 * k)):
        lo += [q * 2 * k + e for e in range(k)] + [n + q * 2 * k + e for e in range(k)]
        hi += [q * 2 * k + k + e for e in range(k)] + [n + q * 2 * k + k + e for e in range(k)]
    return lo, hi


@intrinsic
def _transpose_block(typingctx, t, r0, c0, flat, o, w):
    """flat[o + j * w + i] = t[r0 + i, c0 + j] for i, j < _TB: eight vector loads along t's rows,
    three stages of shuffles, eight vector stores (t: 2-D with contiguous rows; no bounds
    check). The element-by-element copy stores one element per cache line: a (128, 784) float32
    X into its tiles took 62.8 us on one thread that way, 12.9 us this way (2-core Xeon)."""
    n = _TB

    def codegen(context, builder, sig, args):
        ta, r0v, c0v, fa, ov, wv = args
        tty, fty = sig.args[0], sig.args[3]
        vt = ir.VectorType(context.get_value_type(tty.dtype), n)
        align = context.get_abi_sizeof(vt.element)
        arr = context.make_array(tty)(context, builder, ta)
        i64 = ir.IntType(64)
        r0v, c0v = context.cast(builder, r0v, sig.args[1], types.intp), context.cast(builder, c0v, sig.args[2], types.intp)
        rows = []
        for i in range(n):
            ptr = cgutils.get_item_pointer(context, builder, tty, arr, [builder.add(r0v, ir.Constant(i64, i)), c0v],
                                           wraparound=False)
            rows.append(builder.load(builder.bitcast(ptr, ir.PointerType(vt)), align=align))
        i32 = ir.IntType(32)
        k = n // 2
        while k >= 1:
            lo, hi = _transpose_masks(n, k)
            for i in range(n):
                if i & k == 0:
                    a, b = rows[i], rows[i + k]
                    rows[i] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, n), lo))
                    rows[i + k] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, n), hi))
            k //= 2
        ov = context.cast(builder, ov, sig.args[4], types.intp)
        wv = context.cast(builder, wv, sig.args[5], types.intp)
        for j in range(n):
            off = builder.add(ov, builder.mul(wv, ir.Constant(i64, j)))
            builder.store(rows[j], _elem_ptr(context, builder, fty, fa, off, vt), align=align)
        return context.get_dummy_value()
    return types.none(t, r0, c0, flat, o, w), codegen


@njit
def _tile_task(q, nblk, t, plan, flat):
    """Task q of _tile_kernel: one tile of plan, columns c0 .. c0 + _TILE_COLS of t."""
    m = t.shape[1]
    ti = q // nblk
    c0 = (q % nblk) * _TILE_COLS
    c1 = min(c0 + _TILE_COLS, m)
    w = plan[ti, 0]
    b0 = plan[ti, 1]
    nb = plan[ti, 2]
    base = b0 * m
    nbb = nb - nb % _TB
    cb = c1 - (c1 - c0) % _TB  # the columns in whole blocks end here
    for j in range(0, nbb, _TB):  # whole blocks of 8 x 8 through registers
        for c in range(c0, cb, _TB):
            _transpose_block(t, b0 + j, c, flat, base + c * w + j, w)
        for c in range(cb, c1):
            for i in range(_TB):
                flat[base + c * w + j + i] = t[b0 + j + i, c]
    for j in range(nbb, nb):  # the rows left over, along t's rows
        for c in range(c0, c1):
            flat[base + c * w + j] = t[b0 + j, c]
    zero = flat.dtype.type(0)
    for c in range(c0, c1):
        for j in range(nb, w):
            flat[base + c * w + j] = zero


@njit_cached(parallel=True, nogil=True)
def _tile_kernel(t, plan, flat, parallel):
    """flat[b0 * m + c * w + j] = t[b0 + j, c] (0 for j >= nb) for each tile (w, b0, nb) of plan:
    t (B, m), rows contiguous, into the tile-major layout of the kernels' `src`; tasks = (tile,
    block of _TILE_COLS columns)."""
    nblk = (t.shape[1] + _TILE_COLS - 1) // _TILE_COLS
    if parallel:
        for q in prange(plan.shape[0] * nblk):
            _tile_task(q, nblk, t, plan, flat)
    else:
        for q in range(plan.shape[0] * nblk):
            _tile_task(q, nblk, t, plan, flat)


def _empty(n: int, dtype: torch.dtype) -> np.ndarray:
    """An uninitialised (n,) array from torch's allocator: 64-byte aligned, so that each w-wide row
    of a tile-major array starts on a cache line (numpy's own allocations are 16- or 32-byte
    aligned: a 64-wide float32 row 32 bytes off a line spans 5 lines instead of 4, and the forward
    at 4096 x 4096, 90%, took 7.9 instead of 4.3 ms at B = 128, 2.1 instead of 1.4 at B = 32)."""
    return torch.empty(n, dtype=dtype).numpy()


def _tiles(t: torch.Tensor, dtype: torch.dtype, plan: np.ndarray, width: int, parallel: bool) -> np.ndarray:
    """t (B, m) -> flat tile-major t^T of `dtype` (see the kernels' `src`), one copy (none for a
    plain contiguous B = 1 tensor of `dtype`). Run under the op's _parallel_lock: with `parallel`
    the copy is split over Numba's threads as the op's kernel is."""
    t = t.detach()
    B, m = t.shape
    if width == 1 and t.dtype == dtype and t.is_contiguous() and not t.is_neg():
        return t.reshape(m).numpy()
    if t.dtype == dtype and not t.is_neg() and (t.stride(1) == 1 or m == 1):
        # one compiled pass, on every thread the op uses (torch's transposing copy runs on one
        # here and costs as much as this loop does on one)
        flat = _empty(m * width, dtype)
        _tile_kernel(t.numpy(), plan, flat, parallel)
        return flat
    # another dtype (a conversion), a negative view, or columns not contiguous (column-major t:
    # a plain copy for torch)
    flat = torch.empty(m * width, dtype=dtype)
    for nw, b0, nb in plan.tolist():
        blk = flat[b0 * m:(b0 + nw) * m].view(m, nw)
        blk[:, :nb].copy_(t[b0:b0 + nb].t())
        if nw > nb:
            blk[:, nb:].zero_()
    return flat.numpy()


def _rows(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """t (B, m) as a numpy array of `dtype` with contiguous rows (a copy only where needed)."""
    t = t.detach()
    if t.dtype != dtype or t.stride(1) != 1 or t.is_neg():
        t = t.to(dtype).contiguous().resolve_neg()
    return t.numpy()


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


def _check_bias(bias, n_out: int, dtype: torch.dtype) -> None:
    check_bias(bias, n_out, dtype)
    if bias.device.type != "cpu":
        raise ValueError(f"bias must be a CPU tensor, got device {bias.device}")


def _add_bias(buf: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """buf (the kernel's sums, in the compute dtype) + bias, in place."""
    if bias is not None:
        with torch.no_grad():
            buf.add_(bias)
    return buf


def _finish(res: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if buf is not res:
        res.copy_(buf)
    return res


def _check_pair(dy, x, topo: Topology) -> None:
    """dy (B, out) and x (B, in) of W = topo: floating CPU tensors of one dtype and batch size."""
    _check_dense("dy", dy, topo.shape[0], "out = topo.shape[0]")
    _check_dense("x", x, topo.shape[1], "in = topo.shape[1]")
    if x.dtype != dy.dtype:
        raise TypeError(f"x must have dy's dtype {dy.dtype}, got {x.dtype}")
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"x and dy must have the same batch size, got x {tuple(x.shape)} and dy {tuple(dy.shape)}")


def spmm(x: torch.Tensor, topo: Topology, values: torch.Tensor,
         out: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y = X W^T (+ bias) on the CPU.

    Args:
        x: (B, in) CPU tensor, float32/float64/float16/bfloat16 (any strides).
        topo: `Topology` of W, shape (out, in), canonical row-major, indices on the CPU.
        values: (nnz,) CPU tensor of x's dtype, canonical row-major order.
        out: optional contiguous (B, out) CPU tensor of x's dtype, overwritten and returned.
        bias: optional (out,) CPU tensor of x's dtype, added to the float32 (float64) sums before
            float16 / bfloat16 results are rounded, so that they are rounded once, as F.linear's.
    Returns Y (B, out) of x's dtype. Not differentiable (the autograd Function calls the three ops).
    """
    _check_topo(topo)
    _check_dense("x", x, topo.shape[1], "in = topo.shape[1]")
    _check_values(values, topo, x.dtype)
    shape = (x.shape[0], topo.shape[0])
    if bias is not None:
        _check_bias(bias, shape[1], x.dtype)
    _check_out(out, shape, x.dtype)
    cdtype = _compute_dtype(x.dtype)
    res, buf = _result(out, shape, x.dtype, cdtype)
    if shape[0] == 0 or shape[1] == 0:
        return res
    if x.shape[1] == 0 or topo.nnz == 0:
        return res.zero_() if bias is None else res.copy_(bias.expand_as(res))
    if shape[0] <= _FEW_MAX or _lopsided(shape[0], x.shape[1], topo.nnz):  # X as it is, gathers per sample
        n = _threads(topo.nnz * shape[0])
        split, ptr, idx = _csr(topo, n * _CHUNKS_PER_THREAD if n > 1 else 1)
        with torch.no_grad(), _parallel_lock(n):
            _spmm_few_kernel(split, ptr, idx, _vector(values, cdtype), _rows(x, cdtype), buf.detach().numpy(), n > 1)
        return _finish(res, _add_bias(buf, bias))
    plan, width = _plan(shape[0])
    n = _threads(topo.nnz * width)
    split, ptr, idx = _csr(topo, n * _CHUNKS_PER_THREAD if n > 1 else 1)
    with torch.no_grad(), _parallel_lock(n):
        _spmm_kernel(split, ptr, idx, _vector(values, cdtype), _tiles(x, cdtype, plan, width, n > 1),
                     x.shape[1], buf.detach().numpy(), plan, n > 1, True)
    return _finish(res, _add_bias(buf, bias))


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
    dtype = dy.dtype
    cdtype = _compute_dtype(dtype)
    res, buf = _result(out, shape, dtype, cdtype)
    if shape[0] == 0 or shape[1] == 0:
        return res
    if dy.shape[1] == 0 or topo.nnz == 0:
        return res.zero_()
    plan, width = _plan(shape[0])
    n = _threads(topo.nnz * width)
    with torch.no_grad(), _parallel_lock(n):
        _spmm_t_run(_tiles(dy, cdtype, plan, width, n > 1), topo, values, cdtype, plan, width, n, buf)
    return _finish(res, buf)


def _spmm_t_run(src, topo: Topology, values, cdtype, plan, width: int, n: int, buf: torch.Tensor) -> None:
    """dX into buf (B, in) from src = dY^T in tiles; under the op's _parallel_lock(n)."""
    vals = _vector(values, cdtype)
    if int(plan[:, 0].max()) >= _TRANSPOSED_MIN_WIDTH:  # the SpMM on W^T, values gathered
        split, ptr, idx, perm = _csc(topo, n * _CHUNKS_PER_THREAD if n > 1 else 1)
        vt = np.empty_like(vals)
        _gather_kernel(vals, perm, vt, n > 1)
        _spmm_kernel(split, ptr, idx, vt, src, topo.shape[0], buf.detach().numpy(), plan, n > 1, False)
        return
    # one column range per thread: each range is one more pass over the rows
    _, _, idx = _csr(topo, 1)
    csplit, bounds = _col_bounds(topo, n)
    part = _empty(topo.shape[1] * width, cdtype)
    _spmm_t_kernel(csplit, bounds, idx, vals, src, part, buf.detach().numpy(), plan, n > 1)


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
    _check_pair(dy, x, topo)
    dtype = dy.dtype
    cdtype = _compute_dtype(dtype)
    shape = (topo.nnz,)
    _check_out(out, shape, dtype)
    res, buf = _result(out, shape, dtype, cdtype)
    if topo.nnz == 0:
        return res
    if dy.shape[0] == 0:
        return res.zero_()
    plan, width = _plan(dy.shape[0])
    # the few-sample path reads B values per non-zero, the tiled one a padded tile's width
    n = _threads(topo.nnz * (dy.shape[0] if _sddmm_gathers(dy.shape[0], topo) else width))
    with torch.no_grad(), _parallel_lock(n):
        _sddmm_run(dy, x, None, topo, cdtype, plan, width, n, buf)
    return _finish(res, buf)


def _sddmm_gathers(B: int, topo: Topology) -> bool:
    """Whether the SDDMM reads dY and X as they are (see _FEW_MAX and _lopsided)."""
    return B <= _FEW_MAX or _lopsided(B, sum(topo.shape), topo.nnz)


def _sddmm_run(dy, x, gsrc, topo: Topology, cdtype, plan, width: int, n: int, buf: torch.Tensor) -> None:
    """dv into buf (nnz,) from dy and x: B <= _FEW_MAX from them as they are, else from their
    tiles (gsrc: dY's, if already made); under _parallel_lock(n)."""
    split, ptr, idx = _csr(topo, n * _CHUNKS_PER_THREAD if n > 1 else 1)
    if _sddmm_gathers(dy.shape[0], topo):
        _sddmm_few_kernel(split, ptr, idx, _rows(dy, cdtype), _rows(x, cdtype), buf.detach().numpy(), n > 1)
        return
    if gsrc is None:
        gsrc = _tiles(dy, cdtype, plan, width, n > 1)
    _sddmm_kernel(split, ptr, idx, gsrc, _tiles(x, cdtype, plan, width, n > 1), topo.shape[1],
                  buf.detach().numpy(), plan, n > 1)


def fuses_backward(batch: int, topo: Topology) -> bool:
    """True where `spmm_t_sddmm` saves work over spmm_t and sddmm: from B = 2 (B = 1 copies
    nothing), on a topology with connections."""
    return batch > 1 and topo.nnz > 0


def spmm_t_sddmm(dy: torch.Tensor, x: torch.Tensor, topo: Topology, values: torch.Tensor, *,
                 bias_grad: bool = False):
    """The backward of Y = X W^T (+ b) on the CPU: (dX, dv), or (dX, dv, db) with bias_grad=True,
    db = dY.sum(0). The same bits as spmm_t and sddmm, with dY copied into its tiles once for both.

    Args as `spmm_t` and `sddmm` (dy (B, out), x (B, in), values (nnz,), all of dy's dtype)."""
    _check_topo(topo)
    _check_pair(dy, x, topo)
    _check_values(values, topo, dy.dtype)
    if topo.nnz == 0 or dy.shape[0] == 0 or 0 in topo.shape:
        dx, dv = spmm_t(dy, topo, values), sddmm(dy, x, topo)
    else:
        dtype = dy.dtype
        cdtype = _compute_dtype(dtype)
        dx, dx_buf = _result(None, (dy.shape[0], topo.shape[1]), dtype, cdtype)
        dv, dv_buf = _result(None, (topo.nnz,), dtype, cdtype)
        plan, width = _plan(dy.shape[0])
        n = _threads(topo.nnz * width)
        with torch.no_grad(), _parallel_lock(n):
            gsrc = _tiles(dy, cdtype, plan, width, n > 1)
            _spmm_t_run(gsrc, topo, values, cdtype, plan, width, n, dx_buf)
            _sddmm_run(dy, x, gsrc, topo, cdtype, plan, width, n, dv_buf)
        dx, dv = _finish(dx, dx_buf), _finish(dv, dv_buf)
    if bias_grad:
        return dx, dv, dy.detach().sum(0)
    return dx, dv
