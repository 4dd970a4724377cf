"""SNACK-COO CUDA kernels (Numba): SpMM (Y = X W^T), transposed SpMM (dX = dY W) and SDDMM.

Design ("per-SM batch tiling"). W is (n_rows x n_cols) in CSR order (row pointers, column index,
value). The batch is cut into tiles of BT columns; a block owns one batch tile and a range of
rows. It first stages its tile of the dense operand in shared memory (fp32, whatever the input
dtype) as xs[j * (n_cols | 1) + c] = X[b0 + j, c], then each warp walks rows:
 - the warp's 32 lanes form G = 32 / BT groups of BT lanes; lane (g, j) handles batch column
   b0 + j of the non-zeros k = base + g, base + g + G, ... of the row, so one row's non-zeros are
   streamed once per tile, 32 at a time with coalesced loads, and broadcast to the groups by
   shuffles; each shared-memory read serves BT batch columns of one non-zero;
 - at the end of the row the G partial sums are added with xor-shuffles and group 0 writes
   Y[b0 + j, r] once (one write per output element, no atomics);
 - the next 32 non-zeros are loaded before the current ones are used (software pipelining).
BT = 1 is the classic CSR-vector kernel (lanes over non-zeros) for B = 1.
The lane-owned variant (`make_spmm_own_kernel`, the default for BT = 4 and 8) drops the groups:
every lane owns its two non-zeros of a warp step and keeps BT accumulators, reading the BT
staged values of its column; no shuffle per non-zero (the MIO pipe was the limit: ncu at 95 %,
B = 8, had MIO throttle as the first stall reason), and a transposing butterfly per row. It
stages the tile column by column (a column's BT values side by side, read with vector loads)
except at BT = 2 and 4 on dense-ish matrices (`ops.OWN_COLS_MAX_DENSITY`).
The transposed SpMM is the same kernel run on the column-sorted order (CSC of W = CSR of W^T),
with the values read through the column permutation (`perm`), so no per-call gather.
SDDMM uses the same staging (column by column on sparse matrices, `make_sddmm_kernel(cols=True)`);
each lane owns a non-zero and takes the dot product of its column's BT staged values with the
row's dY values, broadcast once per row into registers; batch tiles are visited by the same block
in turn and accumulated in the output, so no atomics are needed and the result is deterministic.

Arrays (all on the GPU, C-contiguous):
  x     (B, n_cols)  float32 / float16 / bfloat16 (passed as int16 bits)   dense operand
  ptr   (n_rows + 1,) int32       row pointers of the CSR order
  idx   (nnz,) int32              column of each entry in CSR order (uint16 for the `idx16`
                                  SpMM variants: same code, a dispatcher of their own; the
                                  transposed SpMM's row index when W has <= 65536 rows)
  val   (nnz,) like x             values; read as val[perm[k]] when `perm` is given
  perm  (nnz,) int32              (transposed SpMM only) position of CSR entry k in `val`
  y     (B, n_rows) like x        output, every element written exactly once
  bias  (n_rows,) like x          (forward SpMM with bias only) added to every output row
Dtype kinds: 0 = float32, 1 = float16, 2 = bfloat16 (int16 bits). Accumulation is always fp32.
The SpMMs take `vkind`, the kind of `val` and `bias` when it is not x's: float32 values with
float16 / bfloat16 activations (mixed precision: fp32 weights, half activations and outputs).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

from numba import config, cuda, float32, float64, int16, int32, int64, uint32, uint64
from numba.types import float16

FULL_MASK = 0xFFFFFFFF
_SIM = config.ENABLE_CUDASIM


# Device functions are inlined into their kernels. `_inlined` leaves that to NVVM (an
# `alwaysinline` attribute, forceinline=True); `_ir_inlined` copies the function's Numba IR into
# every call site (inline="always"), which costs compile time (most of a kernel's compile went
# there) but gave different PTX for a few functions: the loads and conversions of half-precision
# values (bfloat16 conversions took more instructions) and the wide kernels' quad staging (a
# bfloat16 transposed SpMM 3-7 % slower at B = 128 on an H100). See gpu/PERFORMANCE.md.
_inlined = cuda.jit(device=True) if _SIM else cuda.jit(device=True, forceinline=True)
_ir_inlined = cuda.jit(device=True, inline="always")


def _jit(fn, **opts):
    """cuda.jit with compile options (e.g. launch bounds) that the simulator does not take."""
    return cuda.jit(fn) if _SIM else cuda.jit(fn, **opts)
KINDS = {0: "float32", 1: "float16", 2: "bfloat16"}
BATCH_TILES = (1, 2, 4, 8, 16, 32)


if _SIM:
    @_inlined
    def _loads_before_stores():
        pass  # the simulator has no syncwarp and no instruction scheduling
else:
    @_inlined
    def _loads_before_stores():
        """A warp barrier between a staging round's global loads and its shared-memory stores:
        the compiler cannot move a store above it, so every load of the round is in flight
        before the first store waits for its value (without it the JIT interleaved loads and
        stores, ~4 loads in flight; H200, 90 %, B = 32 forward 22.9 -> 22.0 us)."""
        cuda.syncwarp()


if _SIM:
    def _cluster_sync():
        raise NotImplementedError("thread-block clusters need a GPU (the simulator runs blocks one at a time)")

    def _cluster_ld_f32(arr, i, rank):
        raise NotImplementedError("thread-block clusters need a GPU (the simulator runs blocks one at a time)")
else:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.cuda.extending import intrinsic as _intrinsic

    def _elem_addr(context, builder, aty, a, iv):
        """The generic 64-bit address of element iv of array a (LLVM values), for inline PTX
        (a shared array's is turned into its shared-window address there by cvta.to.shared)."""
        i64 = _ir.IntType(64)
        data = context.make_array(aty)(context, builder, a).data
        iv = builder.zext(iv, i64) if iv.type.width < 64 else iv
        return builder.ptrtoint(builder.gep(data, [iv]), i64)

    @_intrinsic
    def _cluster_sync(typingctx):
        """barrier.cluster (arrive + wait): every thread of every block of the thread-block
        cluster gets here before any goes on; shared-memory writes before it are visible to the
        cluster's blocks after it."""
        def codegen(context, builder, signature, args):
            builder.asm(_ir.FunctionType(_ir.VoidType(), []),
                        "barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;", "~{memory}", [],
                        side_effect=True)
            return context.get_dummy_value()
        return _types.void(), codegen

    @_intrinsic
    def _cluster_ld_f32(typingctx, arr, i, rank):
        """arr[i] of block `rank` of the cluster, for a float32 shared-memory array `arr`: the
        same offset in that block's shared memory (distributed shared memory: mapa +
        ld.shared::cluster)."""
        def codegen(context, builder, signature, args):
            a, iv, rv = args
            i64 = _ir.IntType(64)
            i32 = _ir.IntType(32)
            addr = _elem_addr(context, builder, signature.args[0], a, iv)
            rv = builder.trunc(rv, i32) if rv.type.width > 32 else rv
            return builder.asm(
                _ir.FunctionType(_ir.FloatType(), [i64, i32]),
                "{\n\t.reg .u64 snk_a;\n\t.reg .u32 snk_s;\n\tcvta.to.shared.u64 snk_a, $1;\n\t"
                "cvt.u32.u64 snk_s, snk_a;\n\tmapa.shared::cluster.u32 snk_s, snk_s, $2;\n\t"
                "ld.shared::cluster.f32 $0, [snk_s];\n\t}", "=f,l,r,~{memory}", [addr, rv], side_effect=True)
        return _types.float32(arr, i, rank), codegen


# The wide kernels' atomic flush adds 4 consecutive outputs with one 16-byte reduction
# (red.global.add.v4.f32, compute capability >= 9.0) where y's base is 16-byte aligned.
if _SIM:
    def _aligned16(arr):
        return True  # (the simulator's adds below are scalar: any alignment does)

    def _red4(arr, i, a, b, c, d):
        i = int(i)
        cuda.atomic.add(arr, i, a)
        cuda.atomic.add(arr, i + 1, b)
        cuda.atomic.add(arr, i + 2, c)
        cuda.atomic.add(arr, i + 3, d)
else:
    @_intrinsic
    def _aligned16(typingctx, arr):
        """Whether the array's first element is 16-byte aligned."""
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            a = builder.ptrtoint(data, _ir.IntType(64))
            low = builder.and_(a, _ir.Constant(_ir.IntType(64), 15))
            return builder.icmp_unsigned("==", low, _ir.Constant(_ir.IntType(64), 0))
        return _types.boolean(arr), codegen

    @_intrinsic
    def _red4(typingctx, arr, i, a, b, c, d):
        """arr[i + k] += (a, b, c, d)[k], k < 4, for a float32 global array, as one 16-byte
        atomic reduction (relaxed, GPU scope, as cuda.atomic.add's); arr's element i must be
        16-byte aligned."""
        def codegen(context, builder, signature, args):
            addr = _elem_addr(context, builder, signature.args[0], args[0], args[1])
            f = _ir.FloatType()
            builder.asm(_ir.FunctionType(_ir.VoidType(), [_ir.IntType(64), f, f, f, f]),
                        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f,~{memory}",
                        [addr] + list(args[2:]), side_effect=True)
            return context.get_dummy_value()
        return _types.void(arr, i, a, b, c, d), codegen


# The gathering SpMM reads the lines of X's transposed batch tiles with 16-byte read-only loads.
if _SIM:
    def _ldg4(arr, i):
        i = int(i)
        return arr[i], arr[i + 1], arr[i + 2], arr[i + 3]

    def _ldg4_f16(arr, i):
        i = int(i)
        return float32(arr[i]), float32(arr[i + 1]), float32(arr[i + 2]), float32(arr[i + 3])

    def _ldg4_bf16(arr, i):
        i = int(i)
        return _ld_bf16(arr, i), _ld_bf16(arr, i + 1), _ld_bf16(arr, i + 2), _ld_bf16(arr, i + 3)
else:
    @_intrinsic
    def _ldg4(typingctx, arr, i):
        """(arr[i], arr[i + 1], arr[i + 2], arr[i + 3]) of a float32 global array, i a multiple of
        4 (16-byte aligned): one 16-byte load through the read-only path (ld.global.nc.v4)."""
        ret = _types.UniTuple(_types.float32, 4)

        def codegen(context, builder, signature, args):
            a = _elem_addr(context, builder, signature.args[0], args[0], args[1])
            f = _ir.FloatType()
            st = builder.asm(_ir.FunctionType(_ir.LiteralStructType([f] * 4), [_ir.IntType(64)]),
                             "ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", [a],
                             side_effect=False)
            return context.make_tuple(builder, ret, [builder.extract_value(st, k) for k in range(4)])
        return ret(arr, i), codegen

    def _ldg4_half(asm):
        """An intrinsic (arr, i) -> the four 16-bit values arr[i .. i + 3] of a global array
        widened to float32, i a multiple of 4 (8-byte aligned): one 8-byte read-only load, then
        `asm` (PTX from the two loaded words snk_u0, snk_u1 into the outputs $0-$3)."""
        @_intrinsic
        def ldg(typingctx, arr, i):
            ret = _types.UniTuple(_types.float32, 4)

            def codegen(context, builder, signature, args):
                a = _elem_addr(context, builder, signature.args[0], args[0], args[1])
                f = _ir.FloatType()
                st = builder.asm(_ir.FunctionType(_ir.LiteralStructType([f] * 4), [_ir.IntType(64)]),
                                 "{\n\t.reg .b32 snk_u0, snk_u1, snk_w;\n\t.reg .b16 snk_h0, snk_h1;\n\t"
                                 "ld.global.nc.v2.b32 {snk_u0, snk_u1}, [$4];\n\t" + asm + "}",
                                 "=f,=f,=f,=f,l", [a], side_effect=False)
                return context.make_tuple(builder, ret, [builder.extract_value(st, k) for k in range(4)])
            return ret(arr, i), codegen
        return ldg

    # float16: each word's halves split (mov.b32 {lo, hi}) and converted; bfloat16: a value's
    # bits are the high half of its float32 (the low half shifted up, the high half masked)
    _ldg4_f16 = _ldg4_half("".join(
        f"mov.b32 {{snk_h0, snk_h1}}, snk_u{w};\n\tcvt.f32.f16 ${2 * w}, snk_h0;\n\t"
        f"cvt.f32.f16 ${2 * w + 1}, snk_h1;\n\t" for w in range(2)))
    _ldg4_bf16 = _ldg4_half("".join(
        f"shl.b32 snk_w, snk_u{w}, 16;\n\tmov.b32 ${2 * w}, snk_w;\n\t"
        f"and.b32 snk_w, snk_u{w}, 0xFFFF0000;\n\tmov.b32 ${2 * w + 1}, snk_w;\n\t" for w in range(2)))


@_ir_inlined
def _ld_f32(a, i):
    return a[i]


@_ir_inlined
def _ld_f16(a, i):
    return float32(a[i])


@_ir_inlined
def _ld_bf16(a, i):
    return cuda.libdevice.int_as_float(int32(a[i]) << 16)


@_ir_inlined
def _cv_f32(f):
    return f


@_ir_inlined
def _cv_f16(f):
    return float16(f)


@_ir_inlined
def _cv_bf16(f):
    """f (fp32) to bfloat16 bits, rounded to nearest even; a NaN stays a (quiet) NaN of its sign.
    (Rounding the GPU's NaN, 0x7FFFFFFF, by the same addition would carry into the sign bit and
    give -0.)"""
    u = cuda.libdevice.float_as_int(f)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return int16((u >> 16) | 0x40)
    u = u + 0x7FFF + ((u >> 16) & 1)  # round to nearest even
    return int16(u >> 16)


_LOADERS = {0: _ld_f32, 1: _ld_f16, 2: _ld_bf16}
_LDG4 = {0: _ldg4, 1: _ldg4_f16, 2: _ldg4_bf16}  # the gathering SpMM's line reads, per kind of its tiles
_CONVERTERS = {0: _cv_f32, 1: _cv_f16, 2: _cv_bf16}


def _vkind_suffix(vkind) -> str:
    """Kernel-name suffix for values of another kind than x's (vkind normalized by `_vkind`)."""
    return "" if vkind is None else f"_v{KINDS[vkind]}"


def _check_bt(bt: int) -> int:
    if bt not in BATCH_TILES:
        raise ValueError(f"batch tile must be one of {BATCH_TILES}, got {bt}")
    return 32 // bt


@_inlined
def _row_count(n_cols):
    return n_cols | 1  # odd row stride: the BT lanes of a group hit BT different banks


@_inlined
def _bounds(p, i, ok):
    """(p[i], p[i + 1]) when ok, else (0, 0): where row (or row segment) i starts and ends, for a
    warp that may have no row left."""
    s = int32(0)
    e = int32(0)
    if ok:
        s = int32(p[uint32(i)])
        e = int32(p[uint32(i + 1)])
    return s, e


@_inlined
def _half(lo, hi, up, off):
    """One stage of a transposing butterfly on a pair of values: lanes with the stage's bit
    (`up`) keep `hi`, the others `lo`; each adds the other one of its partner `off` lanes away."""
    keep = hi if up else lo
    send = lo if up else hi
    return keep + cuda.shfl_xor_sync(FULL_MASK, send, off)


def _make_stage(BT, ld, cols=False):
    U = max(1, 8 // BT)  # columns per thread per round: U * BT = 8 loads in flight
    COLS = cols
    H = min(BT, 4)  # values per shared-memory store with COLS

    @_inlined
    def stage(xs, buf, x, b0, batch, n_cols, stride, tid, nthreads):
        """xs[j * stride + c] = X[b0 + j, c] (0 past the batch): a straight copy of BT rows; with
        `cols` (BT >= 2) xs[_col_base(c, BT) ^ j] instead (stride unused): column c's BT batch
        values side by side, written with BT-wide shared-memory stores.

        Fast path (whole batch tile, U columns in range): each thread loads U columns x BT rows
        (8 values, coalesced per row) with no per-element test, then stores them; the tail and
        a partial batch tile go element by element.
        """
        c = int32(tid)
        nt = int32(nthreads)
        if b0 + BT <= batch:
            # 32-bit offsets, advanced by addition (Numba would compute every address in int64)
            n32 = int32(n_cols)
            s32 = int32(stride)
            g = int32(b0 * n_cols) + c
            last = n32 - int32((U - 1) * nthreads)
            up = int32(31 - (tid & 31))  # c + up: the warp's last lane (the loop is warp-uniform)
            while c + up < last:
                # unsigned offsets: Numba adds no negative-index wraparound to unsigned indices
                for u in range(U):
                    for j in range(BT):
                        buf[u * BT + j] = ld(x, uint32(g + int32(j * n32 + u * nt)))
                _loads_before_stores()  # the loop is warp-uniform
                for u in range(U):
                    if COLS:
                        p = _col_base(c + int32(u * nt), BT)
                        for h in range(0, BT, H):
                            q = uint32(p ^ h)
                            xs[q] = buf[u * BT + h]
                            xs[q + 1] = buf[u * BT + h + 1]
                            if BT >= 4:
                                xs[q + 2] = buf[u * BT + h + 2]
                                xs[q + 3] = buf[u * BT + h + 3]
                    else:
                        for j in range(BT):
                            xs[uint32(c + int32(j * s32 + u * nt))] = buf[u * BT + j]
                c = int32(c + int32(U) * nt)
                g = int32(g + int32(U) * nt)
        while c < n_cols:
            for j in range(BT):
                v = float32(0.0)
                if b0 + j < batch:
                    v = ld(x, (b0 + j) * n_cols + c)
                if COLS:
                    xs[uint32(_col_base(c, BT) ^ j)] = v
                else:
                    xs[j * stride + c] = v
            c += nt
    return stage


def _make_load_nz(ld, has_perm):
    """(idx, val, perm, k, end) -> (column, value as float32) of CSR entry k (the value read with
    `ld`, through perm when has_perm), or (0, 0) past the row's end."""
    HAS_PERM = has_perm

    @_inlined
    def load_nz(idx, val, perm, k, end):
        c = int32(0)
        v = float32(0.0)
        if k < end:
            c = int32(idx[uint32(k)])
            if HAS_PERM:
                v = ld(val, uint32(perm[uint32(k)]))
            else:
                v = ld(val, uint32(k))
        return c, v
    return load_nz


def _make_load_step(ld, has_perm):
    load_nz = _make_load_nz(ld, has_perm)

    @_inlined
    def load_step(idx, val, perm, k, end):
        """A lane's two non-zeros of a 64-entry warp step (entries k and k + 32):
        (column, value, column, value)."""
        ca, va = load_nz(idx, val, perm, k, end)
        cb, vb = load_nz(idx, val, perm, k + 32, end)
        return ca, va, cb, vb
    return load_step


def _vkind(kind, vkind):
    """vkind as the cached factories take it: None when it is x's kind."""
    return None if vkind is None or int(vkind) == int(kind) else int(vkind)


def make_spmm_kernel(bt: int, kind: int, has_perm: bool, has_bias: bool = False, idx16: bool = False,
                     vkind: Optional[int] = None):
    """Y[b, r] = sum_k val[k] X[b, idx[k]] (+ bias[r]) over the CSR rows r; see the module docstring
    (`vkind`: the kind of val and bias, None for x's).

    Signature: (x, ptr, idx, val, perm, y, bias, n_rows, n_cols, batch). `perm` is ignored (pass
    any int32 array) unless has_perm, `bias` (n_rows,) like x unless has_bias. Launch: grid
    (n_batch_tiles, n_row_blocks), block a multiple of 32 threads, dynamic shared memory
    bt * (n_cols | 1) * 4 bytes.
    Each warp step takes 64 non-zeros (two per lane) and loads the next 64 before using them.
    """
    return _spmm_kernel(int(bt), int(kind), bool(has_perm), bool(has_bias), bool(idx16), _vkind(kind, vkind))


@functools.lru_cache(maxsize=None)
def _spmm_kernel(bt, kind, has_perm, has_bias, idx16, vkind):
    """make_spmm_kernel, cached on its arguments however they were passed."""
    G = _check_bt(bt)
    BT = bt
    ld = _LOADERS[kind]
    vld = _LOADERS[kind if vkind is None else vkind]
    cv = _CONVERTERS[kind]
    load_step = _make_load_step(vld, has_perm)
    HAS_BIAS = has_bias
    stage = _make_stage(BT, ld)

    def spmm(x, ptr, idx, val, perm, y, bias, n_rows, n_cols, batch):
        xs = cuda.shared.array(0, dtype=float32)
        buf = cuda.local.array(8, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        b0 = cuda.blockIdx.x * BT
        stride = _row_count(n_cols)
        lane = tid & 31
        g = lane // BT
        j = lane - g * BT
        jrow = j * stride
        nwarps = nthreads >> 5
        r = cuda.blockIdx.y * nwarps + (tid >> 5)
        rstride = cuda.gridDim.y * nwarps
        # the first row's bounds and non-zeros are requested before the staging, which hides
        # their latency; later rows are requested while the previous one is processed
        start, end = _bounds(ptr, r, r < n_rows)
        ca, va, cb, vb = load_step(idx, val, perm, start + lane, end)
        stage(xs, buf, x, b0, batch, n_cols, stride, tid, nthreads)
        cuda.syncthreads()

        while r < n_rows:
            rn = r + rstride
            nstart, nend = _bounds(ptr, rn, rn < n_rows)
            acc0 = float32(0.0)
            acc1 = float32(0.0)
            base = start
            while base < end:
                nb = base + 64
                na, nva, nbb, nvb = load_step(idx, val, perm, nb + lane, end)
                if G == 32:
                    # BT == 1: each lane owns its non-zeros, no broadcast needed
                    acc0 += va * xs[uint32(ca)]
                    acc1 += vb * xs[uint32(cb)]
                else:
                    for t in range(0, 32, G):
                        c0 = cuda.shfl_sync(FULL_MASK, ca, t + g)
                        v0 = cuda.shfl_sync(FULL_MASK, va, t + g)
                        c1 = cuda.shfl_sync(FULL_MASK, cb, t + g)
                        v1 = cuda.shfl_sync(FULL_MASK, vb, t + g)
                        acc0 += v0 * xs[uint32(jrow + c0)]
                        acc1 += v1 * xs[uint32(jrow + c1)]
                ca = na
                va = nva
                cb = nbb
                vb = nvb
                base = nb
            ca, va, cb, vb = load_step(idx, val, perm, nstart + lane, nend)
            acc = acc0 + acc1
            off = BT
            while off < 32:
                acc += cuda.shfl_xor_sync(FULL_MASK, acc, off)
                off *= 2
            b = b0 + j
            if g == 0 and b < batch:
                if HAS_BIAS:
                    acc += vld(bias, uint32(r))
                y[b * n_rows + r] = cv(acc)
            start = nstart
            end = nend
            r = rn

    spmm.__name__ = (f"snack_spmm_bt{bt}_{KINDS[kind]}{'_perm' if has_perm else ''}{'_bias' if has_bias else ''}"
                     f"{'_idx16' if idx16 else ''}{_vkind_suffix(vkind)}")
    return cuda.jit(spmm)


@_inlined
def _col_base(c, bt):
    """Where column c's BT staged values start in the lane-owned kernels' layout: c * BT, with
    the two 4-value halves swapped when bit 2 of c is set for BT = 8 (batch column j of column c
    sits at _col_base(c, BT) ^ j). A lane reads its non-zero's BT values with BT / 4 16-byte
    reads (BT = 2: one 8-byte read); the 8 lanes of a quarter warp (a 16-byte read's unit of
    bank conflicts) then land on 8 bank quads set by c mod 8 (c mod 4 alone for BT = 8 without
    the swap), and a staging warp's 16-byte stores (consecutive columns) are conflict-free."""
    if bt == 8:
        return uint32((c << 3) | (c & 4))
    elif bt == 4:
        return uint32(c << 2)
    return uint32(c << 1)


def make_spmm_own_kernel(bt: int, kind: int, has_perm: bool, has_bias: bool = False, idx16: bool = False,
                         cols: bool = True, vkind: Optional[int] = None):
    """The tiled SpMM of make_spmm_kernel (same signature, launch and shared memory) for BT in
    {2, 4, 8}, with lanes that own their non-zeros: each lane keeps BT accumulators (one per
    batch column of the tile) and multiplies its own two non-zeros of a warp step by the BT
    staged X values of their columns, so no shuffle broadcasts a non-zero; at the end of a row a
    transposing butterfly (BT - 1 + 5 - log2 BT shuffles) leaves the sum of batch column j in
    lanes j * 32 / BT, which write Y.
    With `cols` the tile is staged column by column (`_col_base`): a non-zero's BT values are
    one (BT = 2, 4) or two (BT = 8) vector reads, whose bank conflicts are set by the columns
    mod 8. Without it, batch row by batch row with an odd stride (as make_spmm_kernel): BT
    scalar reads per non-zero, nearly conflict-free when a row's consecutive non-zeros have
    nearby columns (dense-ish rows), like random ones otherwise.
    """
    return _own_kernel(int(bt), int(kind), bool(has_perm), bool(has_bias), bool(idx16), bool(cols),
                       _vkind(kind, vkind))


@functools.lru_cache(maxsize=None)
def _own_kernel(bt, kind, has_perm, has_bias, idx16, cols, vkind=None):
    """make_spmm_own_kernel, cached on its arguments however they were passed."""
    if bt not in (2, 4, 8):
        raise ValueError(f"batch tile must be 2, 4 or 8, got {bt}")
    BT = bt
    ld = _LOADERS[kind]
    vld = _LOADERS[kind if vkind is None else vkind]
    cv = _CONVERTERS[kind]
    load_step = _make_load_step(vld, has_perm)
    HAS_BIAS = has_bias
    COLS = cols
    stage = _make_stage(BT, ld, cols)
    # the butterfly stage that halves BT accumulators to `h` exchanges across lanes `off` apart
    OFF4 = 16                                      # 8 -> 4 (BT = 8 only)
    OFF2 = 16 if BT == 4 else 8                    # 4 -> 2
    OFF1 = 16 if BT == 2 else (8 if BT == 4 else 4)  # 2 -> 1; then plain halving below OFF1

    def spmm(x, ptr, idx, val, perm, y, bias, n_rows, n_cols, batch):
        xs = cuda.shared.array(0, dtype=float32, alignment=16)
        buf = cuda.local.array(8, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        b0 = cuda.blockIdx.x * BT
        lane = tid & 31
        nwarps = nthreads >> 5
        r = cuda.blockIdx.y * nwarps + (tid >> 5)
        rstride = cuda.gridDim.y * nwarps
        stride = _row_count(n_cols)
        s1 = uint32(stride)
        s2 = uint32(2 * stride)
        s3 = uint32(3 * stride)
        s4 = uint32(4 * stride)
        start, end = _bounds(ptr, r, r < n_rows)
        ca, va, cb, vb = load_step(idx, val, perm, start + lane, end)
        stage(xs, buf, x, b0, batch, n_cols, stride, tid, nthreads)
        cuda.syncthreads()
        j = lane // OFF1
        while r < n_rows:
            rn = r + rstride
            nstart, nend = _bounds(ptr, rn, rn < n_rows)
            # accumulator k: batch column b0 + k (k < BT; the others stay 0 and unused)
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            a4 = float32(0.0)
            a5 = float32(0.0)
            a6 = float32(0.0)
            a7 = float32(0.0)
            base = start
            while base < end:
                nb = base + 64
                na, nva, nbb, nvb = load_step(idx, val, perm, nb + lane, end)
                if COLS:
                    pa = _col_base(ca, BT)
                    pb = _col_base(cb, BT)
                    a0 += va * xs[pa]
                    a1 += va * xs[pa + 1]
                    a0 += vb * xs[pb]
                    a1 += vb * xs[pb + 1]
                    if BT >= 4:
                        a2 += va * xs[pa + 2]
                        a3 += va * xs[pa + 3]
                        a2 += vb * xs[pb + 2]
                        a3 += vb * xs[pb + 3]
                    if BT == 8:
                        qa = pa ^ 4
                        qb = pb ^ 4
                        a4 += va * xs[qa]
                        a5 += va * xs[qa + 1]
                        a6 += va * xs[qa + 2]
                        a7 += va * xs[qa + 3]
                        a4 += vb * xs[qb]
                        a5 += vb * xs[qb + 1]
                        a6 += vb * xs[qb + 2]
                        a7 += vb * xs[qb + 3]
                else:
                    xa = uint32(ca)
                    xb = uint32(cb)
                    a0 += va * xs[xa] + vb * xs[xb]
                    a1 += va * xs[xa + s1] + vb * xs[xb + s1]
                    if BT >= 4:
                        a2 += va * xs[xa + s2] + vb * xs[xb + s2]
                        a3 += va * xs[xa + s3] + vb * xs[xb + s3]
                    if BT == 8:
                        xa4 = xa + s4
                        xb4 = xb + s4
                        a4 += va * xs[xa4] + vb * xs[xb4]
                        a5 += va * xs[xa4 + s1] + vb * xs[xb4 + s1]
                        a6 += va * xs[xa4 + s2] + vb * xs[xb4 + s2]
                        a7 += va * xs[xa4 + s3] + vb * xs[xb4 + s3]
                ca = na
                va = nva
                cb = nbb
                vb = nvb
                base = nb
            ca, va, cb, vb = load_step(idx, val, perm, nstart + lane, nend)
            # transposing butterfly: each stage halves the accumulators a lane keeps
            if BT == 8:
                up = (lane & OFF4) != 0
                a0 = _half(a0, a4, up, OFF4)
                a1 = _half(a1, a5, up, OFF4)
                a2 = _half(a2, a6, up, OFF4)
                a3 = _half(a3, a7, up, OFF4)
            if BT >= 4:
                up = (lane & OFF2) != 0
                a0 = _half(a0, a2, up, OFF2)
                a1 = _half(a1, a3, up, OFF2)
            tot = _half(a0, a1, (lane & OFF1) != 0, OFF1)
            off = OFF1 >> 1
            while off > 0:
                tot += cuda.shfl_xor_sync(FULL_MASK, tot, off)
                off >>= 1
            b = b0 + j
            if (lane & (OFF1 - 1)) == 0 and b < batch:
                if HAS_BIAS:
                    tot += vld(bias, uint32(r))
                y[b * n_rows + r] = cv(tot)
            start = nstart
            end = nend
            r = rn

    spmm.__name__ = (f"snack_spmm_own_bt{bt}_{KINDS[kind]}{'_perm' if has_perm else ''}"
                     f"{'_bias' if has_bias else ''}{'_idx16' if idx16 else ''}{'' if cols else '_rowstaged'}"
                     f"{_vkind_suffix(vkind)}")
    return cuda.jit(spmm)


def _make_tile_out(cv):
    @_inlined
    def tile_out(out, acc, i, t, first, last):
        """Element i's part t from one batch tile (a dv entry, a db row): kept in the fp32 acc
        until the last tile, which writes the total to out (the same thread visits the tiles
        in turn: no atomics, deterministic)."""
        if not first:
            t += acc[uint32(i)]
        if last:
            out[uint32(i)] = cv(t)
        else:
            acc[uint32(i)] = t
    return tile_out


def make_sddmm_kernel(bt: int, kind: int, with_db: bool = False, cols: bool = False):
    """dv[k] = sum_b dY[b, r_k] X[b, idx[k]] for the CSR rows r of W (and, `with_db`, the bias
    gradient db[r] = sum_b dY[b, r], from the dY values each row loads anyway).

    Signature: (x, dy, ptr, idx, dv, dvacc, db, dbacc, n_rows, n_cols, batch); x (B, n_cols),
    dy (B, n_rows), dv (nnz,), dvacc fp32 (nnz,) scratch when B > bt (else any fp32 array); db
    (n_rows,) like dy and dbacc fp32 (n_rows,) likewise, read only `with_db`. Launch: grid
    (1, n_row_blocks), dynamic shared memory bt * (n_cols | 1) * 4 bytes.
    Lanes own non-zeros (32 per warp step); the row's dY[b0:b0 + bt, r] is broadcast once per
    row into registers; the block visits the batch tiles in turn (re-staging X) and keeps the
    partial sums of earlier tiles in dvacc (same thread, same entry: no atomics, deterministic).
    With `cols` (BT = 2, 4, 8) the tile is staged column by column as in the lane-owned SpMMs
    (`_col_base`): a non-zero's BT values in one or two vector reads instead of BT scalar ones.
    """
    return _sddmm_kernel(int(bt), int(kind), bool(with_db), bool(cols) and bt > 1)


@functools.lru_cache(maxsize=None)
def _sddmm_kernel(bt, kind, with_db, cols):
    """make_sddmm_kernel, cached on its arguments however they were passed."""
    _check_bt(bt)
    BT = bt
    COLS = cols
    H = min(BT, 4)  # values per vector read with COLS
    WITH_DB = with_db
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]
    stage = _make_stage(BT, ld, cols)
    tile_out = _make_tile_out(cv)

    def sddmm(x, dy, ptr, idx, dv, dvacc, db, dbacc, n_rows, n_cols, batch):
        xs = cuda.shared.array(0, dtype=float32, alignment=16)
        ds = cuda.local.array(BT, dtype=float32)
        buf = cuda.local.array(8, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        lane = tid & 31
        nwarps = nthreads >> 5
        stride = _row_count(n_cols)
        ntiles = (batch + BT - 1) // BT
        for tile in range(ntiles):
            b0 = tile * BT
            if tile > 0:
                cuda.syncthreads()
            stage(xs, buf, x, b0, batch, n_cols, stride, tid, nthreads)
            cuda.syncthreads()
            first = tile == 0
            last = tile == ntiles - 1
            r = cuda.blockIdx.y * nwarps + (tid >> 5)
            rstride = cuda.gridDim.y * nwarps
            while r < n_rows:
                dl = float32(0.0)
                if lane < BT and b0 + lane < batch:
                    dl = ld(dy, (b0 + lane) * n_rows + r)
                for jj in range(BT):
                    ds[jj] = cuda.shfl_sync(FULL_MASK, dl, jj)
                if WITH_DB:
                    tb = float32(0.0)
                    for jj in range(BT):
                        tb += ds[jj]
                    if lane == 0:
                        tile_out(db, dbacc, r, tb, first, last)
                start = ptr[r]
                end = ptr[r + 1]
                base = start
                while base < end:
                    ka = base + lane
                    kb = base + 32 + lane
                    ca = int32(0)
                    cb = int32(0)
                    if ka < end:
                        ca = idx[uint32(ka)]
                    if kb < end:
                        cb = idx[uint32(kb)]
                    sa = float32(0.0)
                    sb = float32(0.0)
                    if COLS:
                        pa = _col_base(ca, BT)
                        pb = _col_base(cb, BT)
                        for h in range(0, BT, H):
                            qa = uint32(pa ^ h)
                            qb = uint32(pb ^ h)
                            for i in range(H):
                                sa += ds[h + i] * xs[qa + i]
                                sb += ds[h + i] * xs[qb + i]
                    else:
                        for jj in range(BT):
                            sa += ds[jj] * xs[uint32(jj * stride + ca)]
                            sb += ds[jj] * xs[uint32(jj * stride + cb)]
                    if ka < end:
                        tile_out(dv, dvacc, ka, sa, first, last)
                    if kb < end:
                        tile_out(dv, dvacc, kb, sb, first, last)
                    base += 64
                r += rstride

    sddmm.__name__ = f"snack_sddmm_bt{bt}_{KINDS[kind]}{'_db' if with_db else ''}{'_cols' if cols else ''}"
    return cuda.jit(sddmm)


# ---------------------------------------------------------------------------------------------
# Wide batch tiles (32 batch columns per block) with column chunks.
#
# For B >= 16 the BT <= 8 kernels above read shared memory with bank conflicts (groups of a
# warp hit random banks) and stream W once per 8 batch columns. Here a block stages a chunk of
# `cw` columns of X for 32 batch columns as 128-byte rows, one per column, made of eight 16-byte
# chunks (batch columns 4K..4K+3), chunk K stored at position K ^ (column & 7) so that the
# staging stores are conflict-free. A warp splits into 4 groups of 8 lanes; at each step group g
# takes one non-zero and lane k of the group reads chunk k of that non-zero's column (one
# 16-byte read; the 8 lanes of a quarter-warp read one whole row: conflict-free), 128 products
# per warp instruction.
# The CSR order is kept: the non-zeros of row r in chunk ch are the contiguous range
# seg[r * nch + ch] .. seg[r * nch + ch + 1] (canonical order is column-sorted within a row).
# A block consumes one or several chunks; when the chunks of a row are split over several
# blocks, partial rows are added into a zeroed fp32 output with atomics.
# ---------------------------------------------------------------------------------------------
WIDE = 32


def _check_sums(sums: Optional[str], cluster: bool = False):
    """(atomic, parts) for a wide kernel's `sums`: how its blocks add partial results: None
    (each result written once), "atomic" (fp32 atomics into a zeroed buffer), "parts" (each
    part in an fp32 buffer of its own, summed in order by the caller) or, where `cluster` (the
    wide SpMMs), "cluster" (the blocks of a thread-block cluster add their parts through
    distributed shared memory)."""
    allowed = (None, "atomic", "parts", "cluster") if cluster else (None, "atomic", "parts")
    if sums not in allowed:
        raise ValueError(f"sums must be one of {', '.join(map(repr, allowed))}, got {sums!r}")
    return sums == "atomic", sums == "parts"


@_inlined
def _quad_row(c):
    """Offset of column c's row in the staged chunk with its swizzle bits: c * 32 | (c & 7) * 4.
    Lane k of a group reads its 16-byte chunk k ^ (c & 7) at offset _quad_row(c) ^ 4k."""
    return int32((c << 5) | ((c & 7) << 2))


@_inlined
def _quad_step(xs, qa, va, src, k4, a0, a1, a2, a3):
    """Group g takes the non-zero (row offset qa, value va) held by lane `src` and adds its
    products with this lane's 4 batch columns 4k..4k+3 (one 16-byte shared-memory read)."""
    q = cuda.shfl_sync(FULL_MASK, qa, src)
    v = cuda.shfl_sync(FULL_MASK, va, src)
    p = uint32((q ^ k4) & -4)  # a multiple of 4 (16-byte aligned): one vector read
    return (a0 + v * xs[p], a1 + v * xs[p + 1], a2 + v * xs[p + 2], a3 + v * xs[p + 3])


@_inlined
def _quad_step_dot(xs, qa, va, src, k4, a0, a1, a2, a3, x0, x1, x2, x3):
    """_quad_step, and also the dot product of the same 4 staged values with (x0..x3): this
    lane's 4 batch columns of the non-zero's part of an SDDMM."""
    q = cuda.shfl_sync(FULL_MASK, qa, src)
    v = cuda.shfl_sync(FULL_MASK, va, src)
    p = uint32((q ^ k4) & -4)
    d0 = xs[p]
    d1 = xs[p + 1]
    d2 = xs[p + 2]
    d3 = xs[p + 3]
    return a0 + v * d0, a1 + v * d1, a2 + v * d2, a3 + v * d3, (x0 * d0 + x1 * d1) + (x2 * d2 + x3 * d3)


@_inlined
def _group_sum8(p0, p1, p2, p3, p4, p5, p6, p7, kq):
    """Transposing butterfly over the 8 lanes of a group (lane kq = lane & 7 of the group):
    lane kq returns the group's total of p_kq (7 shuffles for 8 sums; every lane takes part in
    every shuffle)."""
    up4 = (kq & 4) != 0
    up2 = (kq & 2) != 0
    r0 = _half(_half(p0, p4, up4, 4), _half(p2, p6, up4, 4), up2, 2)
    r1 = _half(_half(p1, p5, up4, 4), _half(p3, p7, up4, 4), up2, 2)
    return _half(r0, r1, (kq & 1) != 0, 1)


def _make_col4(ld):
    @_inlined
    def col4(a, bb, width, r, batch, ok):
        """(a[bb + i, r] for i = 0..3), 0 past the batch or when not ok: a lane's 4 batch columns
        of column r of a (batch, width) operand."""
        v0 = float32(0.0)
        v1 = float32(0.0)
        v2 = float32(0.0)
        v3 = float32(0.0)
        if ok:
            if bb < batch:
                v0 = ld(a, uint32(bb * width + r))
            if bb + 1 < batch:
                v1 = ld(a, uint32((bb + 1) * width + r))
            if bb + 2 < batch:
                v2 = ld(a, uint32((bb + 2) * width + r))
            if bb + 3 < batch:
                v3 = ld(a, uint32((bb + 3) * width + r))
        return v0, v1, v2, v3
    return col4


def _make_xor_perm(width: int):
    """perm(buf, o, u): the 8 groups of `width` values buf[o + width * i ..] <- group i ^ u, for
    i = 0..7 (u < 8): 3 stages of conditional swaps (selects only), so that a register array is
    permuted by a lane-dependent amount without local memory."""
    W = width

    @_inlined
    def stage(buf, o, bit, sw):
        """Group i <- group i ^ bit for i = 0..7 when sw, else unchanged."""
        for i in range(8):
            if (i & bit) == 0:
                for e in range(W):
                    a = buf[o + W * i + e]
                    b = buf[o + W * (i | bit) + e]
                    buf[o + W * i + e] = b if sw else a
                    buf[o + W * (i | bit) + e] = a if sw else b

    @_inlined
    def perm(buf, o, u):
        stage(buf, o, 1, (u & 1) != 0)
        stage(buf, o, 2, (u & 2) != 0)
        stage(buf, o, 4, (u & 4) != 0)
    return perm


_xor_perm8 = _make_xor_perm(1)  # buf[o + i] <- buf[o + (i ^ u)]
_xor_perm_quads = _make_xor_perm(4)  # quad i (buf[o + 4i .. o + 4i + 3]) <- quad i ^ u


def _make_stage_quad(ld, plain=False):
    PLAIN = plain

    @_ir_inlined
    def stage(xs, buf, x, b0, c0, width, batch, n_cols, tid, nthreads):
        """xs[cl * 32 + 4 * ((j >> 2) ^ (cl & 7)) + (j & 3)] = X[b0 + j, c0 + cl] (0 past the batch).

        The 16-byte chunk of batch columns 4K..4K+3 of column cl sits at chunk K ^ (cl & 7), so
        a reader taking the 8 chunks of one column hits 8 distinct bank quads. `buf` holds 32
        values (registers).
        Fast path (a whole batch tile): whole 32-column groups. Warp w takes groups w,
        w + nwarps, ...; lane l column 32 q + l of the group and its 32 batch rows, all 32 loads
        in flight, so that every load instruction reads 32 consecutive columns of one row (one
        128-byte line; with the checked loop's pattern below, 4 rows x 8 columns per instruction,
        the same 128 KB took twice as long: H200, 4096 x 4096, B = 32, 95 %, forward 16.3 ->
        13.3 us). Store t
        writes chunk t as 4 values at quad t ^ (cl & 7): the 8 lanes of a quarter warp hit 8
        distinct bank quads, 16 bytes each.
        The columns left (fewer than 32), and partial tiles: lane (r, u) of a warp takes column
        8 * m + u of batch rows 4K + r, K = 0..7 (8 loads in flight), store K to 32 distinct banks.

        With `plain` (the lane-owned wide kernels): xs[cl * 32 + j] = X[b0 + j, c0 + cl], column
        cl's 32 batch values in order, every column's chunk K at the same 4 banks. Same loads and
        store addresses; before the stores each lane permutes its values in registers (selects:
        `_xor_perm_quads` on the fast path, chunk t ^ (cl & 7) into quad t; `_xor_perm8` in the
        checked loop), so that every warp store still hits distinct banks.
        """
        lane = tid & 31
        warp = tid >> 5
        nwarps = nthreads >> 5
        w32 = int32(width)
        nb = batch - b0  # valid rows in this tile
        start = int32(0)
        if nb >= WIDE:
            nq = max(w32, int32(0)) >> 5  # (a last chunk may start past the columns)
            q = warp
            col0 = uint64(uint32(b0 * n_cols + c0 + lane))
            nc64 = uint64(n_cols)
            while q < nq:
                cq = int32((q << 5) + lane)
                p0 = col0 + uint64(uint32(q << 5))
                for j in range(32):
                    buf[j] = ld(x, p0 + uint64(j) * nc64)
                _loads_before_stores()  # the loop is warp-uniform
                sw = cq & 7
                if PLAIN:  # chunk K goes to quad K: store t takes chunk t ^ sw from quad t
                    _xor_perm_quads(buf, 0, sw)
                for t in range(8):
                    o = uint32((cq << 5) | ((t ^ sw) << 2))
                    xs[o] = buf[4 * t]
                    xs[o + 1] = buf[4 * t + 1]
                    xs[o + 2] = buf[4 * t + 2]
                    xs[o + 3] = buf[4 * t + 3]
                q += nwarps
            start = int32(nq << 5)
        r = lane >> 3
        u = lane & 7
        cl = int32(start + warp * 8 + u)
        step = int32(nwarps * 8)
        rs = int32(4 * n_cols)
        src = int32(b0 + r) * int32(n_cols) + int32(c0) + cl
        dst = (cl << 5) | r
        while cl - u < w32:
            inc = cl < w32
            for kk in range(8):
                v = float32(0.0)
                if inc and 4 * kk + r < nb:
                    v = ld(x, uint32(src + int32(kk) * rs))
                buf[kk] = v
            if inc:
                if PLAIN:
                    _xor_perm8(buf, 0, u)
                for kk in range(8):
                    xs[uint32(dst | ((kk ^ u) << 2))] = buf[kk]
            cl = int32(cl + step)
            src = int32(src + step)
            dst = int32(dst + (step << 5))
    return stage


def make_spmm_wide_kernel(kind: int, has_perm: bool, sums: Optional[str] = None, has_bias: bool = False,
                          idx16: bool = False, fused: bool = False, with_db: bool = False,
                          rows4: bool = False, own: bool = False, threads: int = 1024, per_lane: int = 4,
                          probe: int = 0, vkind: Optional[int] = None, red4: bool = True, order: bool = False):
    """Y = X W^T (+ bias) for 32-column batch tiles and column chunks (see the comment above).

    Signature: (x, seg, idx, val, perm, y, bias, xf, dv, db, n_rows, n_cols, batch, nch, cw,
    rows_per_block, cps); bias (n_rows,) like x, read only with has_bias (added by the blocks of
    the first column-chunk group when partial rows are added with atomics); xf, dv, db are read
    only when `fused` (pass any arrays of x's type otherwise).
    `fused` (transposed order only: has_perm, no bias, batch <= 32): the whole backward of
    Y = X W^T in one pass over W's column-major order, with x = dY and y = dX: besides
    dX = dY W it writes the value gradient dv[perm[k]] = sum_b dY[b, r_k] X[b, c_k] (xf = the
    forward's X (B, n_rows), dv (nnz,) like x) for every entry, from the dY values the step
    reads anyway and X's column c held in registers for the column's whole segment (group g's
    lane k takes X[4k..4k+3, c]); and with `with_db` the bias gradient db[r] = sum_b dY[b, r]
    (db (n_cols,) like x), summed from the staged chunks by the first block of each chunk.
    x (B, n_cols); seg int32 (n_rows * nch + 1,); idx int32 (nnz,) global column of each entry;
    val (nnz,), read through perm when has_perm; y (B, n_rows): with sums="atomic" an fp32
    buffer that must be zero (partial sums are added), with sums="parts" an fp32 buffer
    (nsplit, B, n_rows) in which the blocks of chunk group j write part j of every element
    (plain stores, summed in order by the caller: deterministic), with sums=None written once
    per element; with sums="cluster" y has x's dtype and each element is written once: the
    nsplit blocks of a row block and batch tile form one thread-block cluster (launched with
    cluster dimensions (nsplit, 1, 1), nsplit <= 8; a GPU of compute capability >= 9.0, not the
    simulator), and after their rows block j sums its share of the row block from every block's
    output tile through distributed shared memory, in block order (deterministic, no zeroed
    buffer, no atomics).
    Launch: grid (nsplit, n_batch_tiles, ceil(n_rows / rows_per_block)) with
    nsplit = ceil(nch / cps) (`sums` given iff nsplit > 1), dynamic shared memory
    (cw * 32 + rows_per_block * 33) * 4 bytes. A block owns rows_per_block consecutive rows and
    cps consecutive column chunks, which it stages and consumes in turn; the rows' partial
    outputs add up in a shared-memory tile that is written once at the end, consecutive threads
    on consecutive rows (coalesced; with "atomic", one coalesced atomic add per element).
    A warp step takes 4 non-zeros of a row segment, one per group of 8 lanes (one shuffle of
    the column and one of the value serve all 4 groups); lane k of a group reads batch columns
    4k..4k+3 of its non-zero's column in one 16-byte shared-memory read (conflict-free: the 8
    lanes read the 8 chunks of one 128-byte row). A step stops at the segment's end.
    `rows4` (for short segments; not with `fused`): each group of 8 lanes takes a row of its
    own, so a warp works on 4 rows at once and needs no sum over groups at the row's end; a
    group walks its segment 8 non-zeros per round (one load per lane, then 8 sub-steps taking
    them in turn by shuffles), for as many sub-steps as the warp's longest segment needs.
    `own` (not with `fused` or `rows4`): lanes own their non-zeros. Each group of 8 lanes takes a
    row of its own (as `rows4`), lane k of a group the entries 8i + k of the row's segment, and
    keeps 32 accumulators, one per batch column: a non-zero costs the lane 8 16-byte
    shared-memory reads and 32 FMAs, with no shuffle. The chunk is staged without the swizzle
    (`_make_stage_quad(plain=True)`: chunk K of every column at the same 4 banks), and lane k reads chunk
    i ^ k at its i-th read, so the 8 lanes of a quarter warp hit 8 distinct bank quads whatever
    their columns (conflict-free, 4 wavefronts per warp read); accumulator chunk i then holds
    batch columns 4 (i ^ k) .. 4 (i ^ k) + 3, and a transposing butterfly over the group's 8 lanes
    (28 shuffles, no selects: the rotation by k is the butterfly's own pairing) leaves batch
    columns 4k .. 4k + 3 of the row's sum in lane k. `threads` is the launch bound (block size
    the kernel is compiled for: 64 registers at 1024, 128 at 512); `per_lane` (own): entries each
    lane takes per round (their loads in flight together, one round ahead).
    `probe` (timing decomposition only, results wrong): bits leave phases out, 1 the staging,
    2 the rows, 4 the output flush, 8 the lane-owned products, 16 the lane-owned products'
    shared-memory reads (their FMAs kept, on a value made from the entry's column). `vkind`: the kind of val and
    bias, None for x's (dv and db keep x's kind). `red4` (sums="atomic"): the flush adds rows
    4k .. 4k + 3 of a column with one 16-byte atomic (red.global.add.v4.f32) where y's row
    count is a multiple of 4 and its base 16-byte aligned (the rows of a block outside whole
    quads one by one); False: one scalar atomic per element.
    `order` (`rows4` or `own`): the groups take the rows of a row block in an order given per
    (column chunk, row block) instead of rows r0 + 4 (w + m nwarps) + g. seg then holds, after its
    n_rows * nch + 1 segment starts, a table of nch x gridDim.z x P rows (P = rows_per_block
    rounded up to a multiple of 4; entry (ch, z, p) = the row that block z's position p takes in
    chunk ch, a row of that row block, each once, or -1 for none). Group g of warp w takes
    positions 4 (w + m nwarps) + g, m = 0, 1, ...; a table that puts rows of similar segment
    lengths in the same warp and spreads the long ones over the warps (ops._seg_order) cuts what
    the warps' lock-step and the block's slowest warp cost.
    """
    return _spmm_wide_kernel(int(kind), bool(has_perm), sums, bool(has_bias), bool(idx16), bool(fused),
                             bool(with_db), bool(rows4), bool(own), int(threads), int(per_lane), int(probe),
                             _vkind(kind, vkind), bool(red4), bool(order))


@functools.lru_cache(maxsize=None)
def _spmm_wide_kernel(kind, has_perm, sums, has_bias, idx16, fused, with_db, rows4, own, threads, per_lane,
                      probe, vkind, red4, order):
    """make_spmm_wide_kernel, cached on its arguments however they were passed."""
    if order and not (rows4 or own):
        raise ValueError("order is an option of the rows4 and own variants")
    if own and (fused or rows4):
        raise ValueError("own is a variant of the plain SpMMs, without fused or rows4")
    if fused and (not has_perm or has_bias):
        raise ValueError("the fused backward runs on the transposed order (has_perm) without a bias")
    if with_db and not fused:
        raise ValueError("with_db needs fused")
    if rows4 and fused:
        raise ValueError("rows4 is a variant of the plain SpMMs, not of the fused backward")
    ATOMIC, PARTS = _check_sums(sums, cluster=True)
    CLUSTER = sums == "cluster"
    ld = _LOADERS[kind]
    vld = _LOADERS[kind if vkind is None else vkind]
    cv = _CONVERTERS[kind]
    HAS_PERM = has_perm
    HAS_BIAS = has_bias
    FUSED = fused
    WITH_DB = with_db
    ROWS4 = rows4
    OWN = own
    U = per_lane if own else 1
    ROWG = rows4 or own  # a row per group of 8 lanes
    ORDER = order
    V4 = ATOMIC and red4  # the atomic flush by 16-byte reductions where y allows
    P_STAGE = (probe & 1) == 0
    P_ROWS = (probe & 2) == 0
    P_FLUSH = (probe & 4) == 0
    P_FMA = (probe & 8) == 0
    P_READS = (probe & 16) == 0
    stage = _make_stage_quad(ld, plain=own)
    col4 = _make_col4(ld)

    @_inlined
    def row_at(seg, ob, p, pw):
        """(order) the row at position p of the block's table (starting at seg[ob]), -1 past
        its pw positions or where the table has none."""
        ra = int32(-1)
        if p < pw:
            ra = int32(seg[uint32(ob + p)])
        return ra

    @_inlined
    def load_nz(idx, val, perm, k, end, c0):
        """(column of entry k, value) for k < end, else (c0, 0). The column's row offset in the
        staged chunk (`_quad_row(column - c0)`) is taken only when the entry is used, so that a
        prefetch does not wait for its load."""
        c = int32(c0)
        v = float32(0.0)
        if k < end:
            c = int32(idx[uint32(k)])
            if HAS_PERM:
                v = vld(val, uint32(perm[uint32(k)]))
            else:
                v = vld(val, uint32(k))
        return c, v

    def spmm_wide(x, seg, idx, val, perm, y, bias, xf, dv, db, n_rows, n_cols, batch, nch, cw, rows_per_block,
                  cps):
        xs = cuda.shared.array(0, dtype=float32, alignment=16)
        buf = cuda.local.array(32, dtype=float32)
        acc = cuda.local.array(32, dtype=float32)  # (own) the lane's row sums, chunk i ^ kq in i
        crs = cuda.local.array(U, dtype=int32)  # (own) the lane's next U entries: columns, values
        vas = cuda.local.array(U, dtype=float32)
        ccur = cuda.local.array(U, dtype=int32)  # (own) the current ones (row offsets, values)
        vcur = cuda.local.array(U, dtype=float32)
        tid = int32(cuda.threadIdx.x)
        nthreads = int32(cuda.blockDim.x)
        ch0 = int32(cuda.blockIdx.x) * int32(cps)
        ch1 = min(ch0 + int32(cps), int32(nch))
        b0 = int32(cuda.blockIdx.y) * WIDE
        r0 = int32(cuda.blockIdx.z) * int32(rows_per_block)
        r1 = min(r0 + int32(rows_per_block), int32(n_rows))
        ybase = int32(cw) * 32  # the block's output tile ybuf[(r - r0) * 33 + col] follows xs
        e = tid
        while e < rows_per_block * 33:
            xs[uint32(ybase + e)] = float32(0.0)
            e += nthreads

        lane = tid & 31
        g = lane >> 3
        kq = lane & 7
        k4 = kq << 2
        kme = 4 * kq + g  # (fused) the entry of a step whose dv this lane stores
        up4 = (kq & 4) != 0  # (fused) this lane's side in the butterfly's stages
        up2 = (kq & 2) != 0
        up1 = (kq & 1) != 0
        hi8 = (lane & 8) != 0
        hi16 = (lane & 16) != 0
        nwarps = nthreads >> 5
        # rows: warp w takes rows r0 + w, r0 + w + nwarps, ...; with ROWS4 (short segments) group
        # g of warp w takes rows r0 + 4 * (w + m * nwarps) + g, m = 0, 1, ..., so a warp works on
        # 4 rows at a time and needs no sum over groups; a load of a row's first non-zeros takes
        # 32 per warp (lane l: entry l), or with ROWS4 8 per group (lane k of a group: entry k)
        for ch in range(ch0, ch1):
            c0 = int32(ch * cw)
            width = min(int32(cw), int32(n_cols) - c0)
            # rows are software-pipelined: the first row's segment bounds and first non-zeros
            # are requested before the staging; the next row's bounds when a row starts, and
            # its first non-zeros with the row's last step (one stream of steps across the rows)
            r = int32(r0 + 4 * (tid >> 5) + g) if ROWG else int32(r0 + (tid >> 5))
            if ORDER:  # r: a position; ra: its row
                pw = int32((rows_per_block + 3) & -4)
                rend = int32(r0 + pw)
                ob = int32(n_rows * nch + 1) + (int32(ch) * int32(cuda.gridDim.z) + int32(cuda.blockIdx.z)) * pw
                ra = row_at(seg, ob, int32(r - r0), pw)
                ok = ra >= 0
            else:
                rend = r1
                ra = r
                ok = r < r1
            s0, s1 = _bounds(seg, ra * nch + ch, ok)
            if OWN:
                for u in range(U):
                    crs[u], vas[u] = load_nz(idx, val, perm, int32(s0 + kq + 8 * u), s1, c0)
            else:
                cr, va = load_nz(idx, val, perm, int32(s0 + (kq if ROWS4 else lane)), s1, c0)
            if ch > ch0:
                cuda.syncthreads()  # the previous chunk is consumed
            if P_STAGE:
                stage(xs, buf, x, b0, c0, width, batch, n_cols, tid, nthreads)
            cuda.syncthreads()
            if WITH_DB and cuda.blockIdx.z == 0:
                # db over the chunk's columns: the sum of a staged 128-byte row is the sum over
                # the batch whatever the swizzle; lane l starts at word l (conflict-free)
                cl = tid
                while cl < width:
                    tb = float32(0.0)
                    for i in range(32):
                        tb += xs[uint32((cl << 5) | ((cl + i) & 31))]
                    db[uint32(c0 + cl)] = cv(tb)
                    cl += nthreads
            while P_ROWS and (r - g if ROWG else r) < rend:  # (ROWG: the warp's first row of the four)
                rn = int32(r + (4 * nwarps if ROWG else nwarps))
                if ORDER:
                    rna = row_at(seg, ob, int32(rn - r0), pw)
                    nok = rna >= 0
                else:
                    rna = rn
                    nok = rn < r1
                ns0, ns1 = _bounds(seg, rna * nch + ch, nok)
                a0 = float32(0.0)
                a1 = float32(0.0)
                a2 = float32(0.0)
                a3 = float32(0.0)
                if OWN:
                    # lane kq of a group takes entries 8i + kq of its row, U per round (entries
                    # t + 8u + kq, u < U), the next round's U loaded during the current one; the
                    # warp runs as many sub-steps as its longest segment needs
                    ng = int32(s1 - s0)
                    n = max(ng, cuda.shfl_xor_sync(FULL_MASK, ng, 8))
                    n = max(n, cuda.shfl_xor_sync(FULL_MASK, n, 16))
                    for j in range(32):
                        acc[j] = float32(0.0)
                    t = int32(0)
                    while t < n:
                        for u in range(U):
                            ccur[u] = int32((int32(crs[u] - c0) << 5) | k4)
                            vcur[u] = float32(0.0)
                        if t < ng:
                            more = t + int32(8 * U) < ng
                            e0 = int32((s0 + t + int32(8 * U) if more else ns0) + kq)
                            e1 = int32(s1 if more else ns1)
                            for u in range(U):
                                vcur[u] = vas[u]
                                crs[u], vas[u] = load_nz(idx, val, perm, int32(e0 + int32(8 * u)), e1, c0)
                        for u in range(U):
                            if P_FMA and (u == 0 or t + int32(8 * u) < n):  # warp-uniform
                                ca = ccur[u]
                                vc = vcur[u]
                                if P_READS:
                                    for i in range(8):
                                        p = uint32((ca ^ (i << 2)) & -4)  # chunk i ^ kq: a multiple of 4
                                        acc[4 * i] += vc * xs[p]
                                        acc[4 * i + 1] += vc * xs[p + 1]
                                        acc[4 * i + 2] += vc * xs[p + 2]
                                        acc[4 * i + 3] += vc * xs[p + 3]
                                else:  # (probe 16) the products without their shared-memory reads
                                    fa = float32(ca)
                                    for j in range(32):
                                        acc[j] += vc * fa
                        t = int32(t + int32(8 * U))
                    if n > 0:  # warp-uniform: every lane takes part in the shuffles
                        # lane kq holds chunk c in acc chunk c ^ kq; its partner kq ^ 4 holds it in
                        # chunk c ^ kq ^ 4: adding the partner's chunks 4..7 to one's own 0..3 keeps
                        # the chunks whose bit 2 is kq's; likewise bits 1 and 0
                        for j in range(16):
                            acc[j] += cuda.shfl_xor_sync(FULL_MASK, acc[j + 16], 4)
                        for j in range(8):
                            acc[j] += cuda.shfl_xor_sync(FULL_MASK, acc[j + 8], 2)
                        for j in range(4):
                            acc[j] += cuda.shfl_xor_sync(FULL_MASK, acc[j + 4], 1)
                elif ROWS4:
                    # a group walks its row 8 entries per round (lane k of the group loads entry
                    # 8i + k, the 8 sub-steps take them in turn), for as many rounds as the
                    # warp's longest segment needs (entries past a segment's end have value 0)
                    src8 = lane & 24
                    ng = int32(s1 - s0)
                    n = max(ng, cuda.shfl_xor_sync(FULL_MASK, ng, 8))
                    n = max(n, cuda.shfl_xor_sync(FULL_MASK, n, 16))
                    t = int32(0)
                    while t < n:
                        ca = _quad_row(int32(cr - c0))
                        vc = float32(0.0)
                        if t < ng:
                            vc = va
                            # this group's next 8 entries, or the next row's first 8
                            more = t + 8 < ng
                            cr, va = load_nz(idx, val, perm, int32((s0 + t + 8 if more else ns0) + kq),
                                             s1 if more else ns1, c0)
                        if t + 8 <= n:  # a whole round for the longest segment: no test per sub-step
                            for i in range(8):
                                a0, a1, a2, a3 = _quad_step(xs, ca, vc, src8 + i, k4, a0, a1, a2, a3)
                        else:
                            i = int32(0)
                            while t + i < n:
                                a0, a1, a2, a3 = _quad_step(xs, ca, vc, src8 + i, k4, a0, a1, a2, a3)
                                i = int32(i + 1)
                        t = int32(t + 8)
                else:
                    if FUSED:  # X[b0 + 4k .. 4k + 3, r]: this lane's batch columns of X's column r
                        x0, x1, x2, x3 = col4(xf, int32(b0 + k4), n_rows, r, batch, s0 < s1)
                    base = s0
                    while base < s1:
                        ca = _quad_row(int32(cr - c0))
                        nb = int32(base + 32)
                        # the next step: this row's next 32 non-zeros, or the next row's first 32
                        nk = nb if nb < s1 else ns0
                        ne = s1 if nb < s1 else ns1
                        left = int32(s1 - base)
                        if FUSED:
                            # where this lane's dv goes, requested before the step that computes it
                            pos = int32(0)
                            if kme < left:
                                pos = int32(perm[uint32(base + kme)])
                        cr, vn = load_nz(idx, val, perm, int32(nk + lane), ne, c0)
                        if FUSED:
                            # every step whole (entries past the end have value 0 and are not
                            # stored): group g's sums of entries 4i + g, i = 0..7, then the
                            # butterfly leaves entry 4 * kq + g's total in this lane
                            # (in the butterfly's pairing order, so that few partial sums are live)
                            a0, a1, a2, a3, p0 = _quad_step_dot(xs, ca, va, g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            a0, a1, a2, a3, p4 = _quad_step_dot(xs, ca, va, 16 + g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            q0 = _half(p0, p4, up4, 4)
                            a0, a1, a2, a3, p2 = _quad_step_dot(xs, ca, va, 8 + g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            a0, a1, a2, a3, p6 = _quad_step_dot(xs, ca, va, 24 + g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            h0 = _half(q0, _half(p2, p6, up4, 4), up2, 2)
                            a0, a1, a2, a3, p1 = _quad_step_dot(xs, ca, va, 4 + g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            a0, a1, a2, a3, p5 = _quad_step_dot(xs, ca, va, 20 + g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            q1 = _half(p1, p5, up4, 4)
                            a0, a1, a2, a3, p3 = _quad_step_dot(xs, ca, va, 12 + g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            a0, a1, a2, a3, p7 = _quad_step_dot(xs, ca, va, 28 + g, k4, a0, a1, a2, a3, x0, x1, x2, x3)
                            tot = _half(h0, _half(q1, _half(p3, p7, up4, 4), up2, 2), up1, 1)
                            if kme < left:
                                dv[uint32(pos)] = cv(tot)
                        elif left >= 32:  # whole step: no per-step test
                            for t in range(0, 32, 4):
                                a0, a1, a2, a3 = _quad_step(xs, ca, va, t + g, k4, a0, a1, a2, a3)
                        else:
                            t = int32(0)
                            while t < left:
                                a0, a1, a2, a3 = _quad_step(xs, ca, va, t + g, k4, a0, a1, a2, a3)
                                t = int32(t + 4)
                        va = vn
                        base = nb
                if s0 < s1:
                    if OWN:  # batch columns 4kq .. 4kq + 3 of the group's own row
                        o = uint32(ybase + (ra - r0) * 33 + k4)
                        xs[o] += acc[0]
                        xs[o + 1] += acc[1]
                        xs[o + 2] += acc[2]
                        xs[o + 3] += acc[3]
                    elif ROWS4:  # the group's own row: each lane adds its 4 batch columns
                        o = uint32(ybase + (ra - r0) * 33 + k4)
                        xs[o] += a0
                        xs[o + 1] += a1
                        xs[o + 2] += a2
                        xs[o + 3] += a3
                    else:
                        # sum over the 4 groups (transposing: each lane ends with one batch
                        # column, 4k + 2 * bit3 + bit4 of its lane)
                        s0k = a2 if hi8 else a0
                        s0s = a0 if hi8 else a2
                        s1k = a3 if hi8 else a1
                        s1s = a1 if hi8 else a3
                        s0k += cuda.shfl_xor_sync(FULL_MASK, s0s, 8)
                        s1k += cuda.shfl_xor_sync(FULL_MASK, s1s, 8)
                        tk = s1k if hi16 else s0k
                        ts = s0k if hi16 else s1k
                        tk += cuda.shfl_xor_sync(FULL_MASK, ts, 16)
                        col = k4 + (2 if hi8 else 0) + (1 if hi16 else 0)
                        xs[uint32(ybase + (r - r0) * 33 + col)] += tk
                else:  # an empty segment requested nothing: the next row's first entries
                    if OWN:
                        for u in range(U):
                            crs[u], vas[u] = load_nz(idx, val, perm, int32(ns0 + kq + 8 * u), ns1, c0)
                    else:
                        cr, va = load_nz(idx, val, perm, int32(ns0 + (kq if ROWS4 else lane)), ns1, c0)
                s0 = ns0
                s1 = ns1
                r = rn
                ra = rna
        cuda.syncthreads()
        # flush the output tile, consecutive threads on consecutive rows (coalesced): rows are
        # padded to a power of two, 2^sh >= nr, so that (col, row) = (tid >> sh, tid & mask)
        qa = int32(0)
        qb = int32(r1 - r0)
        if CLUSTER:
            # the cluster's blocks (its chunk groups, cluster rank = blockIdx.x) share the row
            # block: block j sums rows [qa, qb) of every block's tile, in rank order, into its own
            # tile (which no other block reads there), consecutive threads on consecutive words
            # of a row (coalesced remote reads: a warp reads 128 bytes of a block's tile; warps
            # reading columns, 33 words apart, took 6.7 us instead of 3.1 at 90 %, B = 32 on the
            # H200), four reads in flight
            _cluster_sync()
            nsp = int32(cuda.gridDim.x)
            rank = int32(cuda.blockIdx.x)
            qa = int32((qb * rank) // nsp)
            qb = int32((qb * (rank + 1)) // nsp)
            e = tid
            ne = (qb - qa) << 5
            while P_FLUSH and e < ne:
                oq = uint32(ybase + (qa + (e >> 5)) * 33 + (e & 31))
                v = float32(0.0)
                j = int32(0)
                while j + 4 <= nsp:
                    p0 = _cluster_ld_f32(xs, oq, j)
                    p1 = _cluster_ld_f32(xs, oq, j + 1)
                    p2 = _cluster_ld_f32(xs, oq, j + 2)
                    p3 = _cluster_ld_f32(xs, oq, j + 3)
                    v = ((v + p0) + p1 + p2) + p3
                    j += 4
                while j < nsp:
                    v += _cluster_ld_f32(xs, oq, j)
                    j += 1
                xs[oq] = v
                e += nthreads
            cuda.syncthreads()
        nr = qb - qa
        sh = int32(0)
        while (int32(1) << sh) < nr:
            sh += 1
        ncol = min(int32(WIDE), int32(batch) - b0)
        if (int32(1) << sh) <= nthreads:
            col = tid >> sh
            rr = tid & ((int32(1) << sh) - 1)
            dcol = nthreads >> sh
            if col >= dcol:
                # a block size that is not a multiple of 2^sh (e.g. 640 threads, 256 rows): the
                # threads past the last whole group of 2^sh would repeat the columns of the first
                # (an atomic sum would add those elements twice); they stay out
                col = ncol
        else:  # more rows than threads: each thread loops over rows, one column at a time
            col = int32(0)
            rr = tid
            dcol = int32(1)
        with_bias = HAS_BIAS and (not (ATOMIC or PARTS) or cuda.blockIdx.x == 0)
        part = int64(0)
        if PARTS:  # this chunk group's part of y: (B, n_rows) elements
            part = int64(cuda.blockIdx.x) * int64(y.shape[0] // cuda.gridDim.x)
        if V4 and (int32(n_rows) & 3) == 0 and _aligned16(y):  # block-uniform
            # the block's rows in quads of 4 aligned in y (rows 4k .. 4k + 3), one 16-byte atomic
            # each: 8 consecutive threads take 32 consecutive rows of a column (one 128-byte
            # line of y), a warp 4 columns; the tile reads (rows 33 words apart) fall on 32
            # distinct banks. Unit u: quad 8 (u >> 8) + (u & 7) of column (u >> 3) & 31. The rows
            # before the first whole quad and after the last (at most 3 each) go one by one
            ka = (r0 + 3) >> 2
            kb = r1 >> 2
            nq = max(kb - ka, int32(0))
            nu = ((nq + 7) >> 3) << 8
            u = tid
            while P_FLUSH and u < nu:
                cq = (u >> 3) & 31
                qd = ((u >> 8) << 3) | (u & 7)
                if cq < ncol and qd < nq:
                    q = ((ka + qd) << 2) - r0
                    oq = uint32(ybase + q * 33 + cq)
                    v0 = xs[oq]
                    v1 = xs[oq + 33]
                    v2 = xs[oq + 66]
                    v3 = xs[oq + 99]
                    if with_bias:
                        v0 += vld(bias, uint32(r0 + q))
                        v1 += vld(bias, uint32(r0 + q + 1))
                        v2 += vld(bias, uint32(r0 + q + 2))
                        v3 += vld(bias, uint32(r0 + q + 3))
                    _red4(y, uint32((b0 + cq) * int32(n_rows) + r0 + q), v0, v1, v2, v3)
                u += nthreads
            head = min(ka << 2, r1)  # rows [r0, head) and [tail, r1) one by one
            tail = max(kb << 2, head)
            e = tid
            while P_FLUSH and e < 6 * 32:
                cq = e & 31
                s = e >> 5
                rq = r0 + s if s < 3 else tail + s - 3
                if cq < ncol and ((s < 3 and rq < head) or (s >= 3 and rq < r1)):
                    v = xs[uint32(ybase + (rq - r0) * 33 + cq)]
                    if with_bias:
                        v += vld(bias, uint32(rq))
                    cuda.atomic.add(y, uint32((b0 + cq) * int32(n_rows) + rq), v)
                e += nthreads
            col = ncol  # done: no other flush
        while P_FLUSH and col < ncol:
            q = rr + qa
            while q < qb:
                v = xs[uint32(ybase + q * 33 + col)]
                if with_bias:
                    v += vld(bias, uint32(r0 + q))
                o = uint32((b0 + col) * int32(n_rows) + r0 + q)
                if ATOMIC:
                    cuda.atomic.add(y, o, v)
                elif PARTS:
                    y[part + int64(o)] = v
                else:
                    y[o] = cv(v)
                q += nthreads
            col += dcol
        if CLUSTER:
            _cluster_sync()  # no block leaves while another reads its tile

    spmm_wide.__name__ = (f"snack_spmm_wide_{KINDS[kind]}{'_perm' if has_perm else ''}"
                          f"{'_' + sums if sums else ''}{'_bias' if has_bias else ''}"
                          f"{'_idx16' if idx16 else ''}{'_fused' if fused else ''}{'_db' if with_db else ''}"
                          f"{'_rows4' if rows4 else ''}{'_own' if own else ''}{'_ord' if order else ''}"
                          f"{'' if threads == 1024 else f'_t{threads}'}{f'_u{per_lane}' if own else ''}"
                          f"{'' if red4 or not ATOMIC else '_red1'}{f'_probe{probe}' if probe else ''}{_vkind_suffix(vkind)}")
    return _jit(spmm_wide, launch_bounds=(threads,))


@functools.lru_cache(maxsize=None)
def make_sddmm_wide_kernel(kind: int, with_db: bool = False, rows4: bool = False, sums: Optional[str] = None):
    """dv[k] = sum_b dY[b, r_k] X[b, idx[k]] with 32-column batch tiles and column chunks (and,
    `with_db`, db[r] = sum_b dY[b, r], summed by the blocks of the first chunk).

    Signature: (x, dy, seg, idx, dv, dvacc, db, dbacc, n_rows, n_cols, batch, nch, cw); db
    (n_rows,) like dy, read only `with_db`; with sums="atomic" (several batch tiles) the parts
    are added into dvacc fp32 (nnz,) and dbacc fp32 (n_rows,), zero before the launch, and dv,
    db are not used; with sums="parts" batch tile z writes its part of every entry into row z
    of dvacc fp32 (n_batch_tiles, nnz) and dbacc fp32 (n_batch_tiles, n_rows) with plain stores
    (summed in order by the caller: deterministic); with sums=None (one batch tile) dv and db
    are written once and the accumulators are not used.
    Launch: grid (nch, n_row_blocks, n_batch_tiles), shared memory cw * 32 * 4 bytes: block z
    takes batch tile z only, so that each tile's chunk is staged by its share of the blocks, as
    in the forward (visiting the tiles in turn in every block staged B / 32 times as much: 4x at
    B = 128, where the SDDMM took 2.4x the forward's time at 99 %).
    X is staged as in the wide SpMM (16-byte chunks, swizzled). A warp takes 32 non-zeros of a
    row segment at a time in 8 steps; at step i group g takes non-zero 4i + g and lane k of the
    group multiplies batch columns 4k..4k+3 (one 16-byte read) with dY[4k..4k+3, r] (kept in
    registers for the row); a transposing butterfly over the group's 8 lanes (7 shuffles for
    8 sums) then leaves the total of non-zero 4 * (lane & 7) + g in lane `lane`.
    `rows4` (short segments): each group of 8 lanes takes a row of its own (a warp works on 4
    rows) and walks its segment 8 non-zeros per round: lane k loads entry 8t + k's column, 8
    sub-steps by shuffles compute the group's 8 partial dot products, the butterfly leaves entry
    8t + k's total in lane k; every group runs as many rounds as the warp's longest segment.
    """
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]
    WITH_DB = with_db
    ROWS4 = rows4
    ATOMIC, PARTS = _check_sums(sums)
    stage = _make_stage_quad(ld)
    col4 = _make_col4(ld)

    @_inlined
    def part_out(out, acc, i, t):
        """Element i's part t from this block's batch tile (a dv entry, a db row)."""
        if ATOMIC:
            cuda.atomic.add(acc, uint32(i), t)
        elif PARTS:
            acc[int64(cuda.blockIdx.z) * int64(acc.shape[0] // cuda.gridDim.z) + int64(i)] = t
        else:
            out[uint32(i)] = cv(t)

    def sddmm_wide(x, dy, seg, idx, dv, dvacc, db, dbacc, n_rows, n_cols, batch, nch, cw):
        xs = cuda.shared.array(0, dtype=float32, alignment=16)
        p = cuda.local.array(8, dtype=float32)
        buf = cuda.local.array(32, dtype=float32)  # the staging's registers
        tid = int32(cuda.threadIdx.x)
        nthreads = int32(cuda.blockDim.x)
        ch = cuda.blockIdx.x
        c0 = int32(ch * cw)
        width = min(int32(cw), int32(n_cols) - c0)
        lane = tid & 31
        g = lane >> 3
        kq = lane & 7
        k4 = kq << 2
        src8 = lane & 24
        nwarps = nthreads >> 5
        b0 = int32(cuda.blockIdx.z) * WIDE
        # warp mode: after the butterfly, lane (g, kq) holds the sum of step i = kq: non-zero 4 * kq + g
        kme = 4 * kq + g
        if ROWS4:
            kme = kq
        with_db = WITH_DB and ch == 0  # block-uniform
        stage(xs, buf, x, b0, c0, width, batch, n_cols, tid, nthreads)
        cuda.syncthreads()
        if ROWS4:  # group g's row; the warp goes on while its first group has a row
            r = int32((int32(cuda.blockIdx.y) * nwarps + (tid >> 5)) * 4 + g)
            rstride = int32(int32(cuda.gridDim.y) * nwarps * 4)
            lead = g
        else:
            r = int32(int32(cuda.blockIdx.y) * nwarps + (tid >> 5))
            rstride = int32(int32(cuda.gridDim.y) * nwarps)
            lead = 0
        while r - lead < n_rows:  # warp-uniform
            ok = r < n_rows
            s0, s1 = _bounds(seg, r * nch + ch, ok)
            if not ROWS4 and s0 == s1 and not with_db:
                r = int32(r + rstride)
                continue
            # dY[b0 + 4k + i, r] for this lane's 4 batch columns
            d0, d1, d2, d3 = col4(dy, int32(b0 + k4), n_rows, r, batch, ok)
            if with_db:  # the 8 lanes of a group hold the tile's 32 batch columns
                tb = (d0 + d1) + (d2 + d3)
                tb += cuda.shfl_xor_sync(FULL_MASK, tb, 1)
                tb += cuda.shfl_xor_sync(FULL_MASK, tb, 2)
                tb += cuda.shfl_xor_sync(FULL_MASK, tb, 4)
                if ok and (kq == 0 if ROWS4 else lane == 0):
                    part_out(db, dbacc, r, tb)
            if ROWS4:  # the warp's longest segment
                n = int32(s1 - s0)
                n = max(n, cuda.shfl_xor_sync(FULL_MASK, n, 8))
                n = max(n, cuda.shfl_xor_sync(FULL_MASK, n, 16))
                end = int32(s0 + n)
                step = int32(8)
                first_k = int32(s0 + kq)
            else:
                end = s1
                step = int32(32)
                first_k = int32(s0 + lane)
            base = s0
            cl = int32(0)
            if first_k < s1:
                cl = _quad_row(int32(idx[uint32(first_k)]) - c0)
            while base < end:
                kn = int32(first_k + step)
                cn = c0  # the next column; its row offset is taken after this step
                if kn < s1:
                    cn = int32(idx[uint32(kn)])
                for i in range(8):
                    if ROWS4:
                        src = src8 + i
                    else:
                        src = 4 * i + g
                    q = uint32((cuda.shfl_sync(FULL_MASK, cl, src) ^ k4) & -4)
                    p[i] = d0 * xs[q] + d1 * xs[q + 1] + d2 * xs[q + 2] + d3 * xs[q + 3]
                # lane kq ends with the sum of step (sub-step) kq
                tot = _group_sum8(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], kq)
                k = int32(base + kme)
                if k < s1:
                    part_out(dv, dvacc, k, tot)
                base = int32(base + step)
                first_k = kn
                cl = _quad_row(cn - c0)
            r = int32(r + rstride)

    sddmm_wide.__name__ = (f"snack_sddmm_wide_{KINDS[kind]}{'_db' if with_db else ''}"
                           f"{'_rows4' if rows4 else ''}{'_' + sums if sums else ''}")
    return _jit(sddmm_wide, launch_bounds=(1024,))


# ---- optimizer ------------------------------------------------------------------------------------
ADAM_THREADS = 256


GATHER_ROWS = 32  # rows per block of the gathering SpMM (a group of 8 lanes per row)
GATHER_SMEM = GATHER_ROWS * 33 * 4  # its output tile
TILES_T_SMEM = 32 * 33 * 4  # the square of the kernel that writes its input (make_tiles_t_kernel)


@functools.lru_cache(maxsize=None)
def make_spmm_gather_kernel(has_perm: bool, has_bias: bool = False, prefetch: bool = True, min_blocks: int = 0,
                            kind: int = 0, vkind: Optional[int] = None):
    """Y = X W^T (+ bias), reading X as transposed batch tiles from global memory instead of
    staging it: for very sparse W, where a staged chunk would serve few non-zeros. `kind` is
    X's and Y's kind (float32, float16, bfloat16), `vkind` the values' and the bias's (None: X's);
    sums in float32, Y rounded once.

    Signature: (x, ptr, idx, val, perm, y, bias, n_rows, n_cols, batch), as `make_spmm_kernel`
    but for x: X's batch tiles transposed, in X's kind (ceil(B / 32), n_cols, 32) with zeros past
    the batch (`make_tiles_t_kernel`), so that the 32 batch values of column c in tile t are one
    line (128 bytes in float32, 64 in half precision). A block takes GATHER_ROWS consecutive rows
    of one batch tile, a group of 8 lanes a row: the group loads 8 of the row's entries at a time
    (one per lane), then for each of them every lane reads its 4 batch values of that column's
    line (one 16-byte, or in half precision 8-byte, read-only load; the group reads the whole
    line) and keeps 4 sums. No shared-memory staging, no column
    chunks (any number of columns), no zeroed output or atomics: each row's sums go to a shared
    output tile, written to y once, consecutive threads on consecutive rows.
    Launch: grid (ceil(n_rows / GATHER_ROWS), ceil(B / 32)), 256 threads, GATHER_SMEM bytes of
    dynamic shared memory. As the transposed SpMM: idx W's row index in column-major order
    (int32 or uint16), val read through perm.
    With `prefetch`, a lane loads its entry of the next round (index and value) before the
    round's lines, so that only the first round waits for two loads in a row. `min_blocks`
    (0: none) is the launch bound's blocks per SM (registers capped at 65536 / (256 min_blocks)).
    """
    HAS_BIAS = has_bias
    PREFETCH = prefetch
    vkind = _vkind(kind, vkind)
    bld = _LOADERS[kind if vkind is None else vkind]
    entry = _make_load_nz(bld, has_perm)  # a lane's entry: (column, value), (0, 0) past the row
    ldg4 = _LDG4[kind]
    cv = _CONVERTERS[kind]

    def gather(x, ptr, idx, val, perm, y, bias, n_rows, n_cols, batch):
        ys = cuda.shared.array(0, dtype=float32, alignment=16)  # ys[row * 33 + batch column]
        xb = cuda.local.array(32, dtype=float32)  # (registers) a round's 8 x 4 batch values
        vs = cuda.local.array(8, dtype=float32)  # and its 8 values
        tid = int32(cuda.threadIdx.x)
        lane = tid & 31
        grp = tid >> 3
        kq = lane & 7
        k4 = kq << 2
        gb = lane & 24  # the group's first lane
        r0 = int32(cuda.blockIdx.x) * GATHER_ROWS
        t = int32(cuda.blockIdx.y)
        r = r0 + grp
        s0 = int32(0)
        s1 = int32(0)
        if r < n_rows:
            s0 = int32(ptr[uint32(r)])
            s1 = int32(ptr[uint32(r + 1)])
        ng = s1 - s0
        n = max(ng, cuda.shfl_xor_sync(FULL_MASK, ng, 8))
        n = max(n, cuda.shfl_xor_sync(FULL_MASK, n, 16))
        tb = uint64(t) * uint64(n_cols) * uint64(32) + uint64(k4)
        a0 = float32(0.0)
        a1 = float32(0.0)
        a2 = float32(0.0)
        a3 = float32(0.0)
        i0 = int32(0)
        cn = int32(0)
        vn = float32(0.0)
        if PREFETCH:
            cn, vn = entry(idx, val, perm, s0 + kq, s1)
        while i0 < n:  # warp-uniform: the longest of the warp's four rows
            k = s0 + i0 + kq
            if PREFETCH:
                c = cn
                v = vn
                cn, vn = entry(idx, val, perm, k + 8, s1)
            else:
                c, v = entry(idx, val, perm, k, s1)
            # the 8 entries' lines are all requested before any is used (entries past a row's
            # end have value 0 and read column 0's line, which the L1 keeps)
            for i in range(8):
                ci = cuda.shfl_sync(FULL_MASK, c, gb + i)
                vs[i] = cuda.shfl_sync(FULL_MASK, v, gb + i)
                xv = ldg4(x, tb + (uint64(uint32(ci)) << 5))
                xb[4 * i] = xv[0]
                xb[4 * i + 1] = xv[1]
                xb[4 * i + 2] = xv[2]
                xb[4 * i + 3] = xv[3]
            for i in range(8):
                a0 += vs[i] * xb[4 * i]
                a1 += vs[i] * xb[4 * i + 1]
                a2 += vs[i] * xb[4 * i + 2]
                a3 += vs[i] * xb[4 * i + 3]
            i0 += 8
        if HAS_BIAS and r < n_rows:
            bv = bld(bias, uint32(r))
            a0 += bv
            a1 += bv
            a2 += bv
            a3 += bv
        o = uint32(grp * 33 + k4)
        ys[o] = a0
        ys[o + 1] = a1
        ys[o + 2] = a2
        ys[o + 3] = a3
        cuda.syncthreads()
        rl = lane
        rr = r0 + rl
        for jj in range(4):
            j = (tid >> 5) + 8 * jj
            b = t * 32 + j
            if b < batch and rr < n_rows:
                y[uint32(b * int32(n_rows) + rr)] = cv(ys[uint32(rl * 33 + j)])

    gather.__name__ = (f"snack_spmm_gather_{KINDS[kind]}{_vkind_suffix(vkind)}{'_perm' if has_perm else ''}"
                       f"{'_bias' if has_bias else ''}{'' if prefetch else '_noprefetch'}"
                       f"{f'_mb{min_blocks}' if min_blocks else ''}")
    return _jit(gather, launch_bounds=(256, min_blocks) if min_blocks else (256,))


@functools.lru_cache(maxsize=None)
def make_tiles_t_kernel(kind: int, native: bool = False):
    """The input of the gathering SpMM, X as transposed batch tiles: xt[t, c, j] = X[32 t + j, c]
    (0 past the batch), as float32, or with `native` in X's own kind.

    Signature: (x, xt, batch, n_cols); x (batch, n_cols) of kind `kind` (bfloat16 as int16
    bits), xt (ceil(batch / 32) * n_cols * 32,) float32 or, with `native`, of x's kind.
    Launch: grid (ceil(n_cols / 32), ceil(batch / 32)), 256 threads, TILES_T_SMEM bytes of
    dynamic shared memory: a block moves a 32 x 32 square through shared memory (rows read and
    written 128 bytes at a time; the odd row stride keeps the transposed reads conflict-free).
    """
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind if native else 0]  # (exact: the values came from that kind)

    def tiles_t(x, xt, batch, n_cols):
        sq = cuda.shared.array(0, dtype=float32)  # 32 x 33 (dynamic: TILES_T_SMEM bytes)
        tid = int32(cuda.threadIdx.x)
        lane = tid & 31
        row = tid >> 5
        c0 = int32(cuda.blockIdx.x) * 32
        t = int32(cuda.blockIdx.y)
        c = c0 + lane
        for i in range(4):
            j = row + 8 * i
            b = t * 32 + j
            v = float32(0.0)
            if b < batch and c < n_cols:
                v = ld(x, uint32(b * int32(n_cols) + c))
            sq[j * 33 + lane] = v
        cuda.syncthreads()
        for i in range(4):
            cc = row + 8 * i
            if c0 + cc < n_cols:
                xt[(int64(t) * int64(n_cols) + int64(c0 + cc)) * 32 + int64(lane)] = cv(sq[lane * 33 + cc])

    tiles_t.__name__ = f"snack_tiles_t_{KINDS[kind]}{'_native' if native and kind else ''}"
    return _jit(tiles_t)

@functools.lru_cache(maxsize=None)
def make_adam_kernel(decoupled: bool):
    """One Adam step on one or two fp32 tensors, elementwise, as torch.optim.Adam computes it
    (AdamW's decoupled weight decay when `decoupled`):
        g += wd p (Adam) | p *= 1 - lr wd (AdamW);  m += (1 - b1)(g - m);  v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^s) * m / (sqrt(v) / sqrt(1 - b2^s) + eps)
    with s the tensor's step count: step[0] + inc.

    Signature: (p, g, m, v, step, p2, g2, m2, v2, step2, counter, n, n2, inc, lr, beta1, beta2,
    eps, wd, lb1, lb2) with lb = log(beta) (-inf for beta = 0); p, g, m, v fp32 (n,), the second
    tensor's p2.. (n2,) (n2 < 0: no second tensor; pass the first tensor's arrays), step and step2 fp32 (1,), counter int32 (1,), zero before the launch and
    after it. With inc = 1 the kernel also stores s into step (and step2): every block reads the
    step counts first; the last block to finish (found with `counter`, which it resets) writes
    them, so no block can read an updated count.
    Launch: 1-D grid-stride, ADAM_THREADS threads per block, one element per thread and round
    (32 registers: full occupancy; on the H200, four elements in flight per thread took 68
    registers and were slower, 25.9 vs 17.6 us for a 1.7 M + 4 K step).
    """
    DECOUPLED = decoupled

    @_inlined
    def coefficients(s, lr, lb1, lb2):
        """(lr / (1 - b1^s), sqrt(1 - b2^s)) for step count s, from lb = log(b): 1 - b^s =
        -expm1(s log b) in float32 (no cancellation for b near 1; relative error ~1e-7). Every
        thread computes them: float64 pow cost ~230 FP64 instructions per warp before its first load."""
        bc1 = -math.expm1(float32(s * lb1))
        bc2 = -math.expm1(float32(s * lb2))
        return float32(lr) / bc1, math.sqrt(bc2)

    @_inlined
    def update(p, g, m, v, i, step_size, bc2_sqrt, w1, b2, w2, epsf, wdf, decay):
        gi = g[i]
        pi = p[i]
        if DECOUPLED:
            pi *= decay
        elif wdf != 0:
            gi += wdf * pi
        mi = m[i]
        mi += w1 * (gi - mi)
        vi = v[i] * b2 + w2 * gi * gi
        m[i] = mi
        v[i] = vi
        p[i] = pi - step_size * mi / (math.sqrt(vi) / bc2_sqrt + epsf)

    def adam(p, g, m, v, step, p2, g2, m2, v2, step2, counter, n, n2, inc, lr, beta1, beta2, eps, wd, lb1, lb2):
        s = float64(step[0]) + float64(inc)
        ss1, bc1 = coefficients(s, lr, lb1, lb2)
        s2, ss2, bc2 = s, ss1, bc1  # no second tensor: nothing more to compute
        if n2 >= 0:
            s2 = float64(step2[0]) + float64(inc)
            ss2, bc2 = coefficients(s2, lr, lb1, lb2)
        w1 = float32(1.0 - beta1)
        b2 = float32(beta2)
        w2 = float32(1.0 - beta2)
        epsf = float32(eps)
        wdf = float32(wd)
        decay = float32(1.0 - lr * wd)
        # one index space over both tensors (the grid shares them evenly: no block does the
        # second tensor after its share of the first)
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        total = n + max(n2, 0)
        while i < total:
            if i < n:
                update(p, g, m, v, i, ss1, bc1, w1, b2, w2, epsf, wdf, decay)
            else:
                update(p2, g2, m2, v2, i - n, ss2, bc2, w1, b2, w2, epsf, wdf, decay)
            i += stride
        if inc != 0:
            cuda.syncthreads()  # the whole block has read the step counts
            if cuda.threadIdx.x == 0:
                cuda.threadfence()
                if cuda.atomic.add(counter, 0, 1) == cuda.gridDim.x - 1:
                    step[0] = float32(s)
                    if n2 >= 0:
                        step2[0] = float32(s2)
                    counter[0] = 0

    adam.__name__ = f"snack_adam{'w' if decoupled else ''}_f32"
    # 8 blocks of 256 per SM: <= 32 registers (the grid is sized for full occupancy)
    return _jit(adam, launch_bounds=(ADAM_THREADS, 2048 // ADAM_THREADS))
