"""SNACK-COO CUDA kernels (Numba): SpMM (Y = X W^T), transposed SpMM (dX = dY W) and SDDMM.

Design ("per-SM batch tiling"). W is (n_rows x n_cols) in CSR order (row pointers, column index,
value). The batch is cut into tiles of BT columns; a block owns one batch tile and a range of
rows. It first stages its tile of the dense operand, transposed, in shared memory as
xs[c * BT + j] = X[b0 + j, c] (fp32, whatever the input dtype), then each warp walks rows:
 - the warp's 32 lanes form G = 32 / BT groups of BT lanes; lane (g, j) handles batch column
   b0 + j of the non-zeros k = base + g, base + g + G, ... of the row, so one row's non-zeros are
   streamed once per tile, 32 at a time with coalesced loads, and broadcast to the groups by
   shuffles; each shared-memory read serves BT batch columns of one non-zero;
 - at the end of the row the G partial sums are added with xor-shuffles and group 0 writes
   Y[b0 + j, r] once (one write per output element, no atomics);
 - the next 32 non-zeros are loaded before the current ones are used (software pipelining).
BT = 1 is the classic CSR-vector kernel (lanes over non-zeros) for B = 1.
The transposed SpMM is the same kernel run on the column-sorted order (CSC of W = CSR of W^T),
with the values read through the column permutation (`perm`), so no per-call gather.
SDDMM uses the same staging; each group owns one non-zero at a time, multiplies its BT batch
columns and reduces them with shuffles; batch tiles are visited by the same block in turn and
accumulated in the output, so no atomics are needed and the result is deterministic.

Arrays (all on the GPU, C-contiguous):
  x     (B, n_cols)  float32 / float16 / bfloat16 (passed as int16 bits)   dense operand
  ptr   (n_rows + 1,) int32       row pointers of the CSR order
  idx   (nnz,) int32              column of each entry in CSR order
  val   (nnz,) like x             values; read as val[perm[k]] when `perm` is given
  perm  (nnz,) int32              (transposed SpMM only) position of CSR entry k in `val`
  y     (B, n_rows) like x        output, every element written exactly once
Dtype kinds: 0 = float32, 1 = float16, 2 = bfloat16 (int16 bits). Accumulation is always fp32.
"""
from __future__ import annotations

import functools

from numba import cuda, float32, int32, int16
from numba.types import float16

FULL_MASK = 0xFFFFFFFF
KINDS = {0: "float32", 1: "float16", 2: "bfloat16"}
BATCH_TILES = (1, 2, 4, 8, 16, 32)


@cuda.jit(device=True, inline=True)
def _ld_f32(a, i):
    return a[i]


@cuda.jit(device=True, inline=True)
def _ld_f16(a, i):
    return float32(a[i])


@cuda.jit(device=True, inline=True)
def _ld_bf16(a, i):
    return cuda.libdevice.int_as_float(int32(a[i]) << 16)


@cuda.jit(device=True, inline=True)
def _cv_f32(f):
    return f


@cuda.jit(device=True, inline=True)
def _cv_f16(f):
    return float16(f)


@cuda.jit(device=True, inline=True)
def _cv_bf16(f):
    u = cuda.libdevice.float_as_int(f)
    u = u + 0x7FFF + ((u >> 16) & 1)  # round to nearest even
    return int16(u >> 16)


_LOADERS = {0: _ld_f32, 1: _ld_f16, 2: _ld_bf16}
_CONVERTERS = {0: _cv_f32, 1: _cv_f16, 2: _cv_bf16}


def _check_bt(bt: int) -> int:
    if bt not in BATCH_TILES:
        raise ValueError(f"batch tile must be one of {BATCH_TILES}, got {bt}")
    return 32 // bt


@functools.lru_cache(maxsize=None)
def make_spmm_kernel(bt: int, kind: int, has_perm: bool):
    """Y[b, r] = sum_k val[k] X[b, idx[k]] over the CSR rows r; see the module docstring.

    Signature: (x, ptr, idx, val, perm, y, n_rows, n_cols, batch). `perm` is ignored (pass any
    int32 array) unless has_perm. Launch: grid (n_batch_tiles, n_row_blocks), block a multiple
    of 32 threads, dynamic shared memory n_cols * bt * 4 bytes.
    """
    G = _check_bt(bt)
    BT = bt
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]
    HAS_PERM = has_perm

    def spmm(x, ptr, idx, val, perm, y, n_rows, n_cols, batch):
        xs = cuda.shared.array(0, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        b0 = cuda.blockIdx.x * BT
        # stage the batch tile, transposed: xs[c * BT + j] = X[b0 + j, c]
        total = n_cols * BT
        for e in range(tid, total, nthreads):
            j = e // n_cols
            c = e - j * n_cols
            b = b0 + j
            v = float32(0.0)
            if b < batch:
                v = ld(x, b * n_cols + c)
            xs[c * BT + j] = v
        cuda.syncthreads()

        lane = tid & 31
        g = lane // BT
        j = lane - g * BT
        nwarps = nthreads >> 5
        r = cuda.blockIdx.y * nwarps + (tid >> 5)
        rstride = cuda.gridDim.y * nwarps
        while r < n_rows:
            start = ptr[r]
            end = ptr[r + 1]
            acc = float32(0.0)
            acc2 = float32(0.0)
            k = start + lane
            cl = int32(0)
            vl = float32(0.0)
            if k < end:
                cl = idx[k]
                if HAS_PERM:
                    vl = ld(val, perm[k])
                else:
                    vl = ld(val, k)
            base = start
            while base < end:
                kn = base + 32 + lane
                cn = int32(0)
                vn = float32(0.0)
                if kn < end:
                    cn = idx[kn]
                    if HAS_PERM:
                        vn = ld(val, perm[kn])
                    else:
                        vn = ld(val, kn)
                if G == 32:
                    # BT == 1: each lane owns its non-zero, no broadcast needed
                    acc += vl * xs[cl]
                else:
                    for t in range(0, 32, 2 * G):
                        c0 = cuda.shfl_sync(FULL_MASK, cl, t + g)
                        v0 = cuda.shfl_sync(FULL_MASK, vl, t + g)
                        c1 = cuda.shfl_sync(FULL_MASK, cl, t + G + g)
                        v1 = cuda.shfl_sync(FULL_MASK, vl, t + G + g)
                        acc += v0 * xs[c0 * BT + j]
                        acc2 += v1 * xs[c1 * BT + j]
                cl = cn
                vl = vn
                base += 32
            acc += acc2
            off = BT
            while off < 32:
                acc += cuda.shfl_xor_sync(FULL_MASK, acc, off)
                off *= 2
            b = b0 + j
            if g == 0 and b < batch:
                y[b * n_rows + r] = cv(acc)
            r += rstride

    if G == 1:
        # one group: every iteration of the unrolled loop covers one non-zero
        def spmm(x, ptr, idx, val, perm, y, n_rows, n_cols, batch):  # noqa: F811
            xs = cuda.shared.array(0, dtype=float32)
            tid = cuda.threadIdx.x
            nthreads = cuda.blockDim.x
            b0 = cuda.blockIdx.x * BT
            total = n_cols * BT
            for e in range(tid, total, nthreads):
                j = e // n_cols
                c = e - j * n_cols
                b = b0 + j
                v = float32(0.0)
                if b < batch:
                    v = ld(x, b * n_cols + c)
                xs[c * BT + j] = v
            cuda.syncthreads()
            lane = tid & 31
            nwarps = nthreads >> 5
            r = cuda.blockIdx.y * nwarps + (tid >> 5)
            rstride = cuda.gridDim.y * nwarps
            while r < n_rows:
                start = ptr[r]
                end = ptr[r + 1]
                acc = float32(0.0)
                acc2 = float32(0.0)
                base = start
                while base < end:
                    k = base + lane
                    cl = int32(0)
                    vl = float32(0.0)
                    if k < end:
                        cl = idx[k]
                        if HAS_PERM:
                            vl = ld(val, perm[k])
                        else:
                            vl = ld(val, k)
                    n = min(32, end - base)
                    t = 0
                    while t + 1 < n:
                        c0 = cuda.shfl_sync(FULL_MASK, cl, t)
                        v0 = cuda.shfl_sync(FULL_MASK, vl, t)
                        c1 = cuda.shfl_sync(FULL_MASK, cl, t + 1)
                        v1 = cuda.shfl_sync(FULL_MASK, vl, t + 1)
                        acc += v0 * xs[c0 * BT + lane]
                        acc2 += v1 * xs[c1 * BT + lane]
                        t += 2
                    if t < n:
                        c0 = cuda.shfl_sync(FULL_MASK, cl, t)
                        v0 = cuda.shfl_sync(FULL_MASK, vl, t)
                        acc += v0 * xs[c0 * BT + lane]
                    base += 32
                b = b0 + lane
                if b < batch:
                    y[b * n_rows + r] = cv(acc + acc2)
                r += rstride

    spmm.__name__ = f"snack_spmm_bt{bt}_{KINDS[kind]}{'_perm' if has_perm else ''}"
    return cuda.jit(spmm)


@functools.lru_cache(maxsize=None)
def make_sddmm_kernel(bt: int, kind: int):
    """dv[k] = sum_b dY[b, r_k] X[b, idx[k]] for the CSR rows r of W.

    Signature: (x, dy, ptr, idx, dv, n_rows, n_cols, batch); x (B, n_cols), dy (B, n_rows),
    dv (nnz,). Launch: grid (1, n_row_blocks), dynamic shared memory n_cols * bt * 4 bytes.
    The block visits the batch tiles in turn (re-staging X) and accumulates dv in registers
    per row pass, writing each dv[k] once at the last tile (read back for earlier tiles).
    """
    G = _check_bt(bt)
    BT = bt
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]

    def sddmm(x, dy, ptr, idx, dv, dvacc, n_rows, n_cols, batch):
        xs = cuda.shared.array(0, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        lane = tid & 31
        g = lane // BT
        j = lane - g * BT
        nwarps = nthreads >> 5
        ntiles = (batch + BT - 1) // BT
        for tile in range(ntiles):
            b0 = tile * BT
            if tile > 0:
                cuda.syncthreads()
            total = n_cols * BT
            for e in range(tid, total, nthreads):
                jj = e // n_cols
                c = e - jj * n_cols
                b = b0 + jj
                v = float32(0.0)
                if b < batch:
                    v = ld(x, b * n_cols + c)
                xs[c * BT + jj] = v
            cuda.syncthreads()
            b = b0 + j
            r = cuda.blockIdx.y * nwarps + (tid >> 5)
            rstride = cuda.gridDim.y * nwarps
            while r < n_rows:
                d = float32(0.0)
                if b < batch:
                    d = ld(dy, b * n_rows + r)
                start = ptr[r]
                end = ptr[r + 1]
                base = start
                while base < end:
                    k = base + lane
                    cl = int32(0)
                    if k < end:
                        cl = idx[k]
                    # group g handles entries base + t + g for t in 0, G, 2G, ...
                    for t in range(0, 32, G):
                        c0 = cuda.shfl_sync(FULL_MASK, cl, t + g)
                        p = d * xs[c0 * BT + j]
                        off = 1
                        while off < BT:
                            p += cuda.shfl_xor_sync(FULL_MASK, p, off)
                            off *= 2
                        kk = base + t + g
                        if j == 0 and kk < end:
                            if tile == 0:
                                prev = float32(0.0)
                            else:
                                prev = dvacc[kk]
                            tot = prev + p
                            if tile == ntiles - 1:
                                dv[kk] = cv(tot)
                            else:
                                dvacc[kk] = tot
                    base += 32
                r += rstride

    sddmm.__name__ = f"snack_sddmm_bt{bt}_{KINDS[kind]}"
    return cuda.jit(sddmm)
