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

from numba import cuda, float32, int16, int32, uint32
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


@cuda.jit(device=True, inline=True)
def _row_count(n_cols):
    return n_cols | 1  # odd row stride: the BT lanes of a group hit BT different banks


def _make_stage(BT, ld):
    U = max(1, 8 // BT)  # columns per thread per round: U * BT = 8 loads in flight

    @cuda.jit(device=True, inline=True)
    def stage(xs, buf, x, b0, batch, n_cols, stride, tid, nthreads):
        """xs[j * stride + c] = X[b0 + j, c] (0 past the batch): a straight copy of BT rows.

        Fast path (whole batch tile, U columns in range): each thread loads U columns x BT rows
        (8 values, coalesced per row) with no per-element test, then stores them; the tail and
        a partial batch tile go element by element.
        """
        c = int32(tid)
        if b0 + BT <= batch:
            # 32-bit offsets, advanced by addition (Numba would compute every address in int64)
            n32 = int32(n_cols)
            s32 = int32(stride)
            nt = int32(nthreads)
            g = int32(b0 * n_cols) + c
            last = n32 - int32((U - 1) * nthreads)
            while c < last:
                # unsigned offsets: Numba adds no negative-index wraparound to unsigned indices
                for u in range(U):
                    for j in range(BT):
                        buf[u * BT + j] = ld(x, uint32(g + int32(j * n32 + u * nt)))
                for u in range(U):
                    for j in range(BT):
                        xs[uint32(c + int32(j * s32 + u * nt))] = buf[u * BT + j]
                c = int32(c + int32(U) * nt)
                g = int32(g + int32(U) * nt)
        while c < n_cols:
            for j in range(BT):
                v = float32(0.0)
                if b0 + j < batch:
                    v = ld(x, (b0 + j) * n_cols + c)
                xs[j * stride + c] = v
            c += nthreads
    return stage


@functools.lru_cache(maxsize=None)
def make_spmm_kernel(bt: int, kind: int, has_perm: bool):
    """Y[b, r] = sum_k val[k] X[b, idx[k]] over the CSR rows r; see the module docstring.

    Signature: (x, ptr, idx, val, perm, y, n_rows, n_cols, batch). `perm` is ignored (pass any
    int32 array) unless has_perm. Launch: grid (n_batch_tiles, n_row_blocks), block a multiple
    of 32 threads, dynamic shared memory bt * (n_cols | 1) * 4 bytes.
    Each warp step takes 64 non-zeros (two per lane) and loads the next 64 before using them.
    """
    G = _check_bt(bt)
    BT = bt
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]
    HAS_PERM = has_perm
    stage = _make_stage(BT, ld)

    @cuda.jit(device=True, inline=True)
    def load_nz(idx, val, perm, k, end):
        c = int32(0)
        v = float32(0.0)
        if k < end:
            c = idx[uint32(k)]
            if HAS_PERM:
                v = ld(val, uint32(perm[uint32(k)]))
            else:
                v = ld(val, uint32(k))
        return c, v

    def spmm(x, ptr, idx, val, perm, y, n_rows, n_cols, batch):
        xs = cuda.shared.array(0, dtype=float32)
        buf = cuda.local.array(8, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        b0 = cuda.blockIdx.x * BT
        stride = _row_count(n_cols)
        stage(xs, buf, x, b0, batch, n_cols, stride, tid, nthreads)
        cuda.syncthreads()

        lane = tid & 31
        g = lane // BT
        j = lane - g * BT
        jrow = j * stride
        nwarps = nthreads >> 5
        r = cuda.blockIdx.y * nwarps + (tid >> 5)
        rstride = cuda.gridDim.y * nwarps
        while r < n_rows:
            start = ptr[r]
            end = ptr[r + 1]
            acc0 = float32(0.0)
            acc1 = float32(0.0)
            ca, va = load_nz(idx, val, perm, start + lane, end)
            cb, vb = load_nz(idx, val, perm, start + 32 + lane, end)
            base = start
            while base < end:
                nb = base + 64
                na, nva = load_nz(idx, val, perm, nb + lane, end)
                nbb, nvb = load_nz(idx, val, perm, nb + 32 + lane, end)
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
            acc = acc0 + acc1
            off = BT
            while off < 32:
                acc += cuda.shfl_xor_sync(FULL_MASK, acc, off)
                off *= 2
            b = b0 + j
            if g == 0 and b < batch:
                y[b * n_rows + r] = cv(acc)
            r += rstride

    spmm.__name__ = f"snack_spmm_bt{bt}_{KINDS[kind]}{'_perm' if has_perm else ''}"
    return cuda.jit(spmm)


@functools.lru_cache(maxsize=None)
def make_sddmm_kernel(bt: int, kind: int):
    """dv[k] = sum_b dY[b, r_k] X[b, idx[k]] for the CSR rows r of W.

    Signature: (x, dy, ptr, idx, dv, dvacc, n_rows, n_cols, batch); x (B, n_cols), dy (B, n_rows),
    dv (nnz,), dvacc fp32 (nnz,) scratch when B > bt (else any fp32 array). Launch: grid
    (1, n_row_blocks), dynamic shared memory bt * (n_cols | 1) * 4 bytes.
    Lanes own non-zeros (32 per warp step); the row's dY[b0:b0 + bt, r] is broadcast once per
    row into registers; the block visits the batch tiles in turn (re-staging X) and keeps the
    partial sums of earlier tiles in dvacc (same thread, same entry: no atomics, deterministic).
    """
    _check_bt(bt)
    BT = bt
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]
    stage = _make_stage(BT, ld)

    def sddmm(x, dy, ptr, idx, dv, dvacc, n_rows, n_cols, batch):
        xs = cuda.shared.array(0, dtype=float32)
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
                    for jj in range(BT):
                        sa += ds[jj] * xs[uint32(jj * stride + ca)]
                        sb += ds[jj] * xs[uint32(jj * stride + cb)]
                    if ka < end:
                        if not first:
                            sa += dvacc[uint32(ka)]
                        if last:
                            dv[uint32(ka)] = cv(sa)
                        else:
                            dvacc[uint32(ka)] = sa
                    if kb < end:
                        if not first:
                            sb += dvacc[uint32(kb)]
                        if last:
                            dv[uint32(kb)] = cv(sb)
                        else:
                            dvacc[uint32(kb)] = sb
                    base += 64
                r += rstride

    sddmm.__name__ = f"snack_sddmm_bt{bt}_{KINDS[kind]}"
    return cuda.jit(sddmm)


# ---------------------------------------------------------------------------------------------
# Wide batch tiles (32 batch columns per block) with column chunks.
#
# For B >= 16 the BT <= 8 kernels above read shared memory with bank conflicts (groups of a
# warp hit random banks) and stream W once per 8 batch columns. Here a block stages a chunk of
# `cw` columns of X for 32 batch columns, xs[cl * 32 + (j ^ (cl & 7))] = X[b0 + j, c0 + cl]
# (the xor swizzle makes the staging stores conflict-free), and a warp splits into 4 groups of
# 8 lanes; lane (g, jj) covers batch columns 8 * ((g + q) & 3) + jj for q = 0..3, so at every
# step the 4 groups read 4 different 8-bank windows: conflict-free, 32 products per read.
# The CSR order is kept: the non-zeros of row r in chunk ch are the contiguous range
# seg[r * nch + ch] .. seg[r * nch + ch + 1] (canonical order is column-sorted within a row).
# With several chunks, partial rows are added into a zeroed fp32 output with atomics.
# ---------------------------------------------------------------------------------------------
WIDE = 32


@cuda.jit(device=True, inline=True)
def _windows(g):
    """First batch column of the 8-column window that group g reads at steps q = 0..3."""
    return ((g + 0) & 3) * 8, ((g + 1) & 3) * 8, ((g + 2) & 3) * 8, ((g + 3) & 3) * 8


def _make_stage_wide(ld):
    @cuda.jit(device=True, inline=True)
    def stage(xs, buf, x, b0, c0, width, batch, n_cols, tid, nthreads):
        """xs[cl * 32 + (j ^ (cl & 7))] = X[b0 + j, c0 + cl] for cl < width (0 past the batch).

        A warp instruction covers 8 consecutive columns x 4 batch rows (4 full 32-byte sectors
        read, 32 distinct banks written). Fast path (whole batch tile): 8 items are loaded into
        `buf` (registers) with no per-element test before they are stored; then a checked tail.
        """
        lane = tid & 31
        warp = tid >> 5
        nwarps = nthreads >> 5
        jb = lane >> 3
        cli = lane & 7
        n_items = ((width + 7) >> 3) * 8
        item = warp
        if b0 + WIDE <= batch:
            # fast path: whole batch tile, 8 complete column groups per round, no tests
            n_full = (width >> 3) * 8
            while item + 7 * nwarps < n_full:
                for u in range(8):
                    it = item + u * nwarps
                    buf[u] = ld(x, (b0 + jb * 8 + (it & 7)) * n_cols + c0 + (it >> 3) * 8 + cli)
                for u in range(8):
                    it = item + u * nwarps
                    cl = (it >> 3) * 8 + cli
                    xs[cl * 32 + ((jb * 8 + (it & 7)) ^ (cl & 7))] = buf[u]
                item += 8 * nwarps
        while item < n_items:
            cl = (item >> 3) * 8 + cli
            j = jb * 8 + (item & 7)
            if cl < width:
                v = float32(0.0)
                if b0 + j < batch:
                    v = ld(x, (b0 + j) * n_cols + c0 + cl)
                xs[cl * 32 + (j ^ (cl & 7))] = v
            item += nwarps
    return stage


@functools.lru_cache(maxsize=None)
def make_spmm_wide_kernel(kind: int, has_perm: bool, atomic: bool):
    """Y = X W^T for 32-column batch tiles and column chunks (see the comment above).

    Signature: (x, seg, idx, val, perm, y, n_rows, n_cols, batch, nch, cw, rows_per_block).
    x (B, n_cols); seg int32 (n_rows * nch + 1,); idx int32 (nnz,) global column of each entry;
    val (nnz,), read through perm when has_perm; y (B, n_rows): with `atomic` an fp32 buffer
    that must be zero (partial sums are added), else written once per element.
    Launch: grid (nch * n_batch_tiles, ceil(n_rows / rows_per_block)), dynamic shared memory
    (cw * 32 + rows_per_block * 33) * 4 bytes. Each block owns rows_per_block consecutive rows,
    keeps their outputs in shared memory and writes them at the end, consecutive threads on
    consecutive rows (coalesced; with `atomic`, one coalesced atomic add per element).
    """
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]
    HAS_PERM = has_perm
    ATOMIC = atomic
    stage = _make_stage_wide(ld)

    @cuda.jit(device=True, inline=True)
    def load_nz(idx, val, perm, k, end, cdef):
        c = cdef
        v = float32(0.0)
        if k < end:
            c = idx[k]
            if HAS_PERM:
                v = ld(val, perm[k])
            else:
                v = ld(val, k)
        return c, v

    def spmm_wide(x, seg, idx, val, perm, y, n_rows, n_cols, batch, nch, cw, rows_per_block):
        xs = cuda.shared.array(0, dtype=float32)
        buf = cuda.local.array(8, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        ch = cuda.blockIdx.x % nch
        b0 = (cuda.blockIdx.x // nch) * WIDE
        c0 = ch * cw
        width = min(cw, n_cols - c0)
        r0 = cuda.blockIdx.y * rows_per_block
        r1 = min(r0 + rows_per_block, n_rows)
        ybase = cw * 32  # the block's output tile ybuf[(r - r0) * 33 + col] follows xs
        e = tid
        while e < rows_per_block * 33:
            xs[ybase + e] = float32(0.0)
            e += nthreads
        stage(xs, buf, x, b0, c0, width, batch, n_cols, tid, nthreads)
        cuda.syncthreads()

        lane = tid & 31
        g = lane >> 3
        jj = lane & 7
        w0, w1, w2, w3 = _windows(g)
        nwarps = nthreads >> 5
        r = r0 + (tid >> 5)
        while r < r1:
            s0 = seg[r * nch + ch]
            s1 = seg[r * nch + ch + 1]
            if s0 == s1:
                r += nwarps
                continue
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            ca, va = load_nz(idx, val, perm, s0 + lane, s1, c0)
            cb, vb = load_nz(idx, val, perm, s0 + 32 + lane, s1, c0)
            base = s0
            while base < s1:
                nb = base + 64
                na, nva = load_nz(idx, val, perm, nb + lane, s1, c0)
                nbb, nvb = load_nz(idx, val, perm, nb + 32 + lane, s1, c0)
                for t in range(0, 32, 4):
                    c = cuda.shfl_sync(FULL_MASK, ca, t + g) - c0
                    v = cuda.shfl_sync(FULL_MASK, va, t + g)
                    cc = cuda.shfl_sync(FULL_MASK, cb, t + g) - c0
                    vv = cuda.shfl_sync(FULL_MASK, vb, t + g)
                    p = c * 32 + (jj ^ (c & 7))
                    pp = cc * 32 + (jj ^ (cc & 7))
                    a0 += v * xs[p + w0] + vv * xs[pp + w0]
                    a1 += v * xs[p + w1] + vv * xs[pp + w1]
                    a2 += v * xs[p + w2] + vv * xs[pp + w2]
                    a3 += v * xs[p + w3] + vv * xs[pp + w3]
                ca = na
                va = nva
                cb = nbb
                vb = nvb
                base = nb
            # window w = (g + q) & 3 is in a_q; sum each window over the 4 groups
            mine = float32(0.0)
            for w in range(4):
                q = (w - g) & 3
                sw = a3
                if q == 0:
                    sw = a0
                elif q == 1:
                    sw = a1
                elif q == 2:
                    sw = a2
                sw += cuda.shfl_xor_sync(FULL_MASK, sw, 8)
                sw += cuda.shfl_xor_sync(FULL_MASK, sw, 16)
                if w == g:
                    mine = sw
            xs[ybase + (r - r0) * 33 + g * 8 + jj] = mine
            r += nwarps
        cuda.syncthreads()
        # flush the output tile: consecutive threads take consecutive rows (coalesced)
        nr = r1 - r0
        e = tid
        while e < nr * WIDE:
            col = e // nr
            rr = e - col * nr
            b = b0 + col
            if b < batch:
                v = xs[ybase + rr * 33 + col]
                if ATOMIC:
                    cuda.atomic.add(y, b * n_rows + r0 + rr, v)
                else:
                    y[b * n_rows + r0 + rr] = cv(v)
            e += nthreads

    spmm_wide.__name__ = f"snack_spmm_wide_{KINDS[kind]}{'_perm' if has_perm else ''}{'_atomic' if atomic else ''}"
    return cuda.jit(spmm_wide)


@functools.lru_cache(maxsize=None)
def make_sddmm_wide_kernel(kind: int):
    """dv[k] = sum_b dY[b, r_k] X[b, idx[k]] with 32-column batch tiles and column chunks.

    Signature: (x, dy, seg, idx, dv, dvacc, n_rows, n_cols, batch, nch, cw); dvacc fp32 (nnz,)
    scratch when B > 32. Launch: grid (nch, n_row_blocks), shared memory cw * 32 * 4 bytes.
    A warp takes 32 non-zeros at a time; group g multiplies non-zeros 8g .. 8g + 7 over its
    lanes' 4 x 8 batch columns (conflict-free reads as in the SpMM), then a transposing
    butterfly (7 shuffles for 8 sums) leaves the total of non-zero base + lane in lane `lane`.
    Batch tiles are visited in turn by the same block (same thread, same entry: no atomics).
    """
    ld = _LOADERS[kind]
    cv = _CONVERTERS[kind]
    stage = _make_stage_wide(ld)

    def sddmm_wide(x, dy, seg, idx, dv, dvacc, n_rows, n_cols, batch, nch, cw):
        xs = cuda.shared.array(0, dtype=float32)
        p = cuda.local.array(8, dtype=float32)
        buf = cuda.local.array(8, dtype=float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        ch = cuda.blockIdx.x
        c0 = ch * cw
        width = min(cw, n_cols - c0)
        lane = tid & 31
        g = lane >> 3
        jj = lane & 7
        w0, w1, w2, w3 = _windows(g)
        nwarps = nthreads >> 5
        ntiles = (batch + WIDE - 1) // WIDE
        for tile in range(ntiles):
            b0 = tile * WIDE
            if tile > 0:
                cuda.syncthreads()
            stage(xs, buf, x, b0, c0, width, batch, n_cols, tid, nthreads)
            cuda.syncthreads()
            first = tile == 0
            last = tile == ntiles - 1
            r = cuda.blockIdx.y * nwarps + (tid >> 5)
            rstride = cuda.gridDim.y * nwarps
            while r < n_rows:
                s0 = seg[r * nch + ch]
                s1 = seg[r * nch + ch + 1]
                if s0 == s1:
                    r += rstride
                    continue
                # dY[b, r] for this lane's 4 batch columns
                d0 = float32(0.0)
                d1 = float32(0.0)
                d2 = float32(0.0)
                d3 = float32(0.0)
                if b0 + w0 + jj < batch:
                    d0 = ld(dy, (b0 + w0 + jj) * n_rows + r)
                if b0 + w1 + jj < batch:
                    d1 = ld(dy, (b0 + w1 + jj) * n_rows + r)
                if b0 + w2 + jj < batch:
                    d2 = ld(dy, (b0 + w2 + jj) * n_rows + r)
                if b0 + w3 + jj < batch:
                    d3 = ld(dy, (b0 + w3 + jj) * n_rows + r)
                base = s0
                k = base + lane
                cl = c0
                if k < s1:
                    cl = idx[k]
                while base < s1:
                    kn = base + 32 + lane
                    cn = c0
                    if kn < s1:
                        cn = idx[kn]
                    for i in range(8):
                        c = cuda.shfl_sync(FULL_MASK, cl, g * 8 + i) - c0
                        q = c * 32 + (jj ^ (c & 7))
                        p[i] = d0 * xs[q + w0] + d1 * xs[q + w1] + d2 * xs[q + w2] + d3 * xs[q + w3]
                    # transposing butterfly over the group's 8 lanes (branch-free: every lane
                    # takes part in every shuffle)
                    up4 = (jj & 4) != 0
                    for i in range(4):
                        lo = p[i]
                        hi = p[i + 4]
                        keep = hi if up4 else lo
                        send = lo if up4 else hi
                        p[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, 4)
                    up2 = (jj & 2) != 0
                    for i in range(2):
                        lo = p[i]
                        hi = p[i + 2]
                        keep = hi if up2 else lo
                        send = lo if up2 else hi
                        p[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, 2)
                    up1 = (jj & 1) != 0
                    keep = p[1] if up1 else p[0]
                    send = p[0] if up1 else p[1]
                    tot = keep + cuda.shfl_xor_sync(FULL_MASK, send, 1)
                    if k < s1:
                        if not first:
                            tot += dvacc[k]
                        if last:
                            dv[k] = cv(tot)
                        else:
                            dvacc[k] = tot
                    base += 32
                    k = kn
                    cl = cn
                r += rstride

    sddmm_wide.__name__ = f"snack_sddmm_wide_{KINDS[kind]}"
    return cuda.jit(sddmm_wide)
