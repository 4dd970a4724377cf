"""Launchers for the SNACK-COO kernels: validate, allocate, pick the variant and grid, launch.

    spmm(x, topo, values, out=None, *, bias=None)   Y (B, out) = X W^T (+ bias)   x (B, in)
    spmm_t(dy, topo, values, out=None)  dX (B, in) = dY W           dy (B, out)
    sddmm(dy, x, topo, out=None)        dv (nnz,), dv_k = sum_b dY[b, r_k] X[b, c_k]
    sddmm(dy, x, topo, *, bias_grad=True)  (dv, db): also db (out,) = sum_b dY[b, :] (same launch)
    spmm_t_sddmm(dy, x, topo, values, *, bias_grad=False)   (dX, dv[, db]): the whole backward, one
                                        fused launch where `fuses_backward` says so (9 <= B <= 32, density <= 25 %), else spmm_t and sddmm
W is the (out, in) matrix of `topo` (a snack.core.Topology on the same device, canonical
row-major) with `values` (nnz,) in that order. x, dy, values: float32, float16 or bfloat16, one
dtype per call, on one CUDA device (CPU tensors under the Numba simulator); results have the
inputs' dtype, accumulated in fp32. Mixed precision: with float16 / bfloat16 x or dy, `values`
(and `bias`) may be float32 in spmm, spmm_t and spmm_t_sddmm (`MIXED_VALUES`; fp32 weights read
as they are, which `snack.functional.sparse_linear` does under torch.autocast on the GPU); results keep x's
or dy's dtype, dv and db included. Launches go to torch's current stream (graph-capturable).

Variant choice: the batch tile BT is the smallest power of two >= B, at most 8; for BT = 4 and 8
(and BT = 2 in the transposed SpMM, `LANE_OWNED_TILES`) each lane owns its non-zeros and keeps BT
accumulators, reading a non-zero's BT staged values with vector loads (the tile staged column by
column; batch row by batch row at BT = 2 and 4 above `OWN_COLS_MAX_DENSITY`, and in the tiled
SDDMM at any BT above it), otherwise a warp
holds 32 / BT groups that stream different non-zeros of a row; the
shared-memory tile (in * BT * 4 bytes) must fit the block's limit (227 KB on H100/H200), else BT
is halved; if even BT = 1 does not fit (in > ~58000) the op falls back to torch index ops.
Blocks own a batch tile and a range of rows; the grid is sized to fill every SM once. The
32-wide kernels (column chunks, conflict-free 16-byte shared-memory reads, one block per chunk
with atomics across chunks by default) are taken where they measured faster (`WIDE_FROM`, `WIDE_DENSITY`, `WIDE_MIN_NNZ`: the
SpMMs from B = 32 (the transposed one from B = 17) at >= 3 % density with >= 150 K non-zeros below
B = 64, and from B = 96 at any;
the SDDMM from B = 16 at >= 3 % and from B = 32) or when asked (`wide=True`; `chunks=` and
`split=` shape the 32-wide kernels wherever they run, and are ignored by the batch-tiled ones;
`bt=` forces the batch tile of the tiled kernels and `threads=` the block size: keyword-only
tuning options, the defaults choose; `out=` takes a preallocated result of the right shape,
dtype and device that shares no memory with an input);
their column chunks are as wide as shared memory allows, or at most
`WIDE_CHUNK_COLS` columns for B <= 64 when several chunks are needed anyway; where rows hold
fewer than `WIDE_ROWS4_BELOW` non-zeros per chunk on average, each group of 8 lanes takes a row
of its own (`rows4`) instead of a warp per row (the SDDMM also when rows are many,
`_sddmm_rows4`); elsewhere the wide forward runs with lanes that own whole non-zeros (`own`,
512-thread blocks, `WIDE_OWN`). From B = 32 on, a W at most `GATHER_MAX_DENSITY` (2.5 %)
dense, or with half-precision activations `GATHER_MAX_DENSITY_HALF` (3.5 %), takes neither: the
SpMMs gather each non-zero's column from X's batch tiles (in X's dtype), written transposed by
one more launch (`WIDE_GATHER`, `kernels.make_spmm_gather_kernel`; no
staging, no atomics, deterministic). The wide SDDMM gives each 32-column batch tile its own blocks; above B = 32
the tiles' parts add up with fp32 atomics (its result may then differ in the last bits from
run to run; every other op, and the SDDMM up to B = 32, is deterministic apart from the
SpMMs' atomics across column chunks).

Determinism: under `torch.use_deterministic_algorithms(True)` (or with PARTIAL_SUMS = "parts")
every op gives bit-identical results from run to run: where the wide kernels would add partial
results with atomics, the SpMMs' chunk groups of a row block run as one thread-block cluster and
add their partial rows in order through distributed shared memory (`CLUSTER_SUMS`; compute
capability >= 9.0, up to 8 groups, when every cluster fits on the GPU at once), and otherwise
(the SDDMM's batch tiles too) each part is written to an fp32 buffer of its own and the parts
are summed in order by one torch reduction.

Host time: a spmm, spmm_t, sddmm or spmm_t_sddmm call like an earlier one on the same topology
(operands of the same dtypes, shapes and devices, contiguous; the same bias_grad; default launch
options; no `out=`) takes that call's plan straight away, without repeating the checks it passed
(`FAST_PATH`; setting any attribute of this module, such as the knobs above, makes the next
calls check and plan again).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import types
from numbers import Integral
from typing import Optional

import torch

from snack.core.coo import REBUILD, Topology, _byte_range, check_bias, check_out_grad, check_topology
from . import kernels
from .launch import (BoundLaunch, as_kernel_array, device_properties, launch_mode, build_persistent,
                     zero, clusters_supported, max_active_clusters)

__all__ = ["spmm", "spmm_t", "sddmm", "spmm_t_sddmm", "fuses_backward", "choose_tile", "wide_chunks", "WIDE_FROM",
           "WIDE_DENSITY", "MIXED_VALUES"]

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TORCH_KIND = tuple(_KIND)  # kind -> dtype
# The SpMMs (forward, transposed, fused backward) take float32 values and bias with float16 or
# bfloat16 activations (see the module docstring).
MIXED_VALUES = True
_THREADS = 32 if launch_mode() == "sim" else 1024  # the simulator runs one OS thread per CUDA thread
_SIM = launch_mode() == "sim"
_GPU_ONLY = not _SIM  # the simulator takes CPU tensors
_BF16_VIEWS = launch_mode() != "driver"  # bfloat16 tensors need int16 views (see as_kernel_array)


def _check_device(name: str, t: torch.Tensor, device: torch.device):
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the sparse matrix is on {device}")


def _check_common(name: str, t, dev: torch.device):
    """t is a 2-D float32/float16/bfloat16 tensor on dev, the sparse matrix's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _KIND:
        raise TypeError(f"{name} must be float32, float16 or bfloat16 on the GPU, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (B, features), got shape {tuple(t.shape)}")
    if _GPU_ONLY and dev.type != "cuda":
        raise ValueError(f"the sparse matrix must be on a CUDA device for snack.gpu, got {dev}")
    _check_device(name, t, dev)


def _check_values(values, nnz: int, dtype, dev: torch.device):
    """values (nnz,) on dev, of the dense operand's dtype or float32 with a half one (mixed)."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 1 or values.shape[0] != nnz:
        raise ValueError(f"values must have shape ({nnz},), got {tuple(values.shape)}")
    if values.dtype != dtype and values.dtype != torch.float32:
        raise TypeError(f"values has dtype {values.dtype} but the dense operand has {dtype} "
                        "(values must have its dtype, or be float32 with a float16/bfloat16 operand)")
    _check_device("values", values, dev)


def _shares(a: torch.Tensor, ra, b: torch.Tensor, rb) -> bool:
    """overlaps(a, b) given their `_byte_range`s: the ranges are compared first, the storages
    looked up (~1 us each) only when they meet."""
    if ra is None or rb is None or not (ra[0] < rb[1] and rb[0] < ra[1]):
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether tensors a and b may share memory (same storage, intersecting byte ranges)."""
    return _shares(a, _byte_range(a), b, _byte_range(b))


def _check_no_overlap(out: torch.Tensor, **inputs) -> None:
    """ValueError when `out` shares memory with one of the named input tensors: the kernels read
    the inputs while other blocks write the output. (out's range is found once.)"""
    ro = _byte_range(out)
    for name, t in inputs.items():
        if t is not None and _shares(out, ro, t, _byte_range(t)):
            raise ValueError(f"out shares memory with {name}; give an output buffer of its own")


def _check_topo(topo) -> None:
    if not isinstance(topo, Topology):
        hint = " (for a snack.core.COO pass coo.topology)" if hasattr(topo, "topology") else ""
        raise TypeError(f"topo must be a snack.core.Topology{hint}, got {type(topo).__name__}")


def _check_options(bt, threads, wide, chunks, split) -> None:
    """The launch options of the ops (all optional; see the module docstring)."""
    if bt is not None and (isinstance(bt, bool) or not isinstance(bt, Integral) or bt not in kernels.BATCH_TILES):
        raise ValueError(f"bt must be None or one of {kernels.BATCH_TILES}, got {bt!r}")
    if isinstance(threads, bool) or not isinstance(threads, Integral) or threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")
    if wide is not None and not isinstance(wide, bool):
        raise TypeError(f"wide must be None, True or False, got {wide!r}")
    for name, v in (("chunks", chunks), ("split", split)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, Integral) or v < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")


def _check_flag(name: str, v) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {v!r}")


def _check_out(out, shape, dtype, device):
    if out is None:
        return torch.empty(*shape, dtype=dtype, device=device)  # (sizes as arguments: faster to parse)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be a {tuple(shape)} {dtype} tensor on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    check_out_grad(out)
    return out


def choose_tile(batch: int, n_cols: int, device: torch.device, bt: Optional[int] = None):
    """(BT, dynamic shared-memory bytes) for a dense operand of `batch` x `n_cols`, or
    (None, 0) when even one batch column does not fit in shared memory."""
    max_smem = device_properties(device)[1]
    if bt is None:
        bt = 1
        while bt < batch and bt < 8:
            bt *= 2
    stride = n_cols | 1
    while bt >= 1 and stride * bt * 4 > max_smem:
        bt //= 2
    if bt < 1:
        return None, 0
    return bt, stride * bt * 4


# Registers per thread the wide kernels may use (their launch bound is 1024 threads): with them
# an SM holds 65536 // (64 * threads) blocks at most, whatever the shared memory allows.
_WIDE_REGS = 64


@functools.lru_cache(maxsize=4096)
def _grid_rows(n_rows: int, nblocks_x: int, smem: int, device, threads: int, regs: int = 0):
    """Blocks along the rows so that nblocks_x * rows fills every SM once: as many blocks per
    SM as threads, shared memory and (given `regs` per thread) registers allow."""
    n_sm, _, smem_sm = device_properties(device)
    per_sm = min(2048 // threads, (smem_sm - 1024) // max(smem + 1024, 1))
    if regs:
        per_sm = min(per_sm, 65536 // (regs * threads))
    per_sm = max(1, per_sm)
    target = max(1, (n_sm * per_sm) // max(nblocks_x, 1))
    nwarps = threads // 32
    return max(1, min(target, -(-n_rows // nwarps)))


# Widest column chunk of the wide kernels for B <= 64 once the columns need several chunks
# anyway: a smaller chunk is staged sooner by each of the blocks that share it. Measured on the
# H200 (4096 x 4096, B = 32, four chunks of 1024 columns against three of 1368): forward at 90 /
# 95 / 99 % 24.4 -> 22.5, 19.3 -> 17.4, 14.7 -> 13.3 us, dX 27.9 -> 26.1 us at 90 %; from B = 128
# the forward is faster with the widest chunks (90 %: 60.4 vs 62.3 us).
WIDE_CHUNK_COLS = 1024
WIDE_CHUNK_COLS_UP_TO_B = 64


def wide_chunks(n_cols: int, device, chunks: Optional[int] = None, batch: Optional[int] = None):
    """(number of column chunks, chunk width, shared-memory bytes of the X chunk) for the wide
    kernels; 16 KB of the block's shared memory is left for the output tile. Without `chunks`:
    as few chunks as fit, or chunks of at most WIDE_CHUNK_COLS columns when that takes several
    anyway and batch <= WIDE_CHUNK_COLS_UP_TO_B."""
    max_smem = device_properties(device)[1] - 16 * 1024
    cw_max = (max_smem // (kernels.WIDE * 4)) // 8 * 8
    nch = chunks if chunks else max(1, -(-n_cols // cw_max))
    if not chunks and nch > 1 and batch is not None and batch <= WIDE_CHUNK_COLS_UP_TO_B:
        nch = max(nch, -(-n_cols // WIDE_CHUNK_COLS))
    cw = -(-(-(-n_cols // nch)) // 8) * 8
    return nch, cw, cw * kernels.WIDE * 4


def _wide_plan(n_rows, n_cols, batch, device, threads, chunks=None, split=None, regs=_WIDE_REGS):
    """Launch plan of the wide SpMM: (nch, cw, cps, nsplit, grid rows, rows per block, shared
    memory bytes), or None when a chunk does not fit. The columns are cut into nch chunks of cw;
    `split` groups of chunks go to different blocks (partial rows added with atomics), each
    block consuming its cps = ceil(nch / split) chunks in turn."""
    nch, cw, smem = wide_chunks(n_cols, device, chunks, batch)
    max_smem = device_properties(device)[1]
    if smem > max_smem:
        return None
    nsplit = nch if split is None else max(1, min(int(split), nch))
    cps = -(-nch // nsplit)
    nsplit = -(-nch // cps)
    ntiles = -(-batch // kernels.WIDE)
    gy = _grid_rows(n_rows, nsplit * ntiles, smem, device, threads, regs)
    rpb = -(-n_rows // gy)
    while smem + rpb * 33 * 4 > max_smem:
        gy += 1
        rpb = -(-n_rows // gy)
    gy = -(-n_rows // rpb)
    return nch, cw, cps, nsplit, gy, rpb, smem + rpb * 33 * 4


def _seg(topo: Topology, transposed: bool, nch: int, cw: int) -> torch.Tensor:
    """int32 (n_rows * nch + 1,): start of each (row, column chunk) run in the op's CSR order."""
    key = ("seg", transposed, nch, cw)
    seg = topo.cache.get(key)
    if seg is None:
        if transposed:
            # the CSC order's "row" (a column of W) from col_ptr: Topology.cols_by_col would
            # rebuild and cache the int64 column permutation (12 bytes per connection)
            n_rows = topo.shape[1]
            c = _rows_by_col(topo)
            r = torch.repeat_interleave(torch.arange(n_rows, device=topo.device),
                                        topo.col_ptr.diff().to(torch.int64), output_size=topo.nnz)
        else:
            r, c, n_rows = topo.indices[0], topo.indices[1], topo.shape[0]
        k = r.to(torch.int64) * nch + torch.div(c.to(torch.int64), cw, rounding_mode="floor")
        counts = torch.bincount(k, minlength=n_rows * nch)
        seg = torch.zeros(n_rows * nch + 1, dtype=torch.int64, device=topo.device)
        torch.cumsum(counts, 0, out=seg[1:])
        seg = seg.to(torch.int32)
        topo.cache[key] = seg
    return seg


def _snake_slots(n_sets: int, nwarps: int) -> list:
    """The slots (a warp's m-th set of 4 positions is slot w + m * nwarps) in the order that deals
    sets to warps as a snake: warps 0, 1, .., nwarps - 1, then nwarps - 1, .., 0, and so on."""
    slots = []
    for m in range(-(-n_sets // nwarps)):
        for w in (range(nwarps) if m % 2 == 0 else reversed(range(nwarps))):
            if w + m * nwarps < n_sets:
                slots.append(w + m * nwarps)
    return slots


def _seg_order(topo: Topology, transposed: bool, nch: int, cw: int, gy: int, rpb: int, nwarps: int) -> torch.Tensor:
    """int32: `_seg` followed by the row order of the wide kernels built with order=True
    (kernels.make_spmm_wide_kernel), for gy row blocks of rpb rows and blocks of nwarps warps.
    In each (column chunk, row block) the rows are sorted by segment length, longest first, cut
    into sets of 4 (a warp's four groups then walk segments of about the same length in
    lock-step), and the sets are dealt to the warps' slots as a snake (the longest sets spread
    over the warps, each warp's total about the same)."""
    key = ("seg_order", transposed, nch, cw, gy, rpb, nwarps)
    out = topo.cache.get(key)
    if out is None:
        seg = _seg(topo, transposed, nch, cw)
        n_rows = (seg.numel() - 1) // nch
        pw = -(-rpb // 4) * 4
        dev = seg.device
        j = torch.arange(pw, device=dev)
        rows = torch.arange(gy, device=dev)[:, None] * rpb + j  # (gy, pw): the block's rows
        valid = (j < rpb) & (rows < n_rows)
        rows = torch.where(valid, rows, torch.full_like(rows, -1))
        lens = seg.diff().to(torch.int64).view(n_rows, nch).t()  # (nch, n_rows)
        lt = torch.where(valid, lens[:, rows.clamp(min=0)], torch.full((), -1, device=dev, dtype=torch.int64))
        by_len = torch.sort(lt, dim=2, descending=True, stable=True).indices  # (nch, gy, pw)
        ordered = rows.expand(nch, gy, pw).gather(2, by_len).view(nch, gy, pw // 4, 4)
        slots = torch.tensor(_snake_slots(pw // 4, nwarps), device=dev)
        table = torch.empty_like(ordered)
        table[:, :, slots] = ordered  # sorted set k goes to slot slots[k]
        out = torch.cat([seg, table.reshape(-1).to(torch.int32)])
        topo.cache[key] = out
    return out


# The transposed SpMM's index (the row of each entry in column-major order) as uint16 when W
# has at most this many rows: 2 bytes per connection instead of 4 (4096 x 4096 at 90 %: 3.4 MB);
# and at most IDX16_MAX_DENSITY of its entries are non-zero: on dense-ish matrices the tiled
# kernels read it more slowly. Measured on the H200 (4096 x 4096, dX graph medians, us, uint16
# vs int32): 50 % density B = 1 / 2 / 4 / 8 42.8 / 43.3 / 44.7 / 51.2 vs 30.5 / 32.9 / 39.0 /
# 51.0; 20 %: 12.7 / 13.1 / 16.0 / 22.0 vs 13.6 / 13.2 / 15.4 / 22.9; 10 % and 5 %: within 0.3.
IDX16_MAX_ROWS = 65536
IDX16_MAX_DENSITY = 0.25


def _density(topo: Topology) -> float:
    """The fraction of W's entries that are connections (0 for an empty shape)."""
    n_rows, n_cols = topo.shape
    return topo.nnz / max(1, n_rows * n_cols)


def _rows_by_col(topo: Topology) -> torch.Tensor:
    """Topology.rows_by_col for the kernels: uint16 when W has <= IDX16_MAX_ROWS rows and a
    density <= IDX16_MAX_DENSITY (the int32 copy is then dropped from the topology's cache),
    else int32."""
    r = topo.cache.get("rows_by_col_u16")
    if r is not None:
        return r
    if topo.shape[0] > IDX16_MAX_ROWS or _density(topo) > IDX16_MAX_DENSITY:
        return topo.rows_by_col
    _perm32(topo)  # builds rows_by_col and col_ptr from the int64 permutation, then drops it
    r = topo.rows_by_col.to(torch.uint16)
    topo.cache["rows_by_col_u16"] = r
    topo.cache.pop("rows_by_col", None)  # Topology.rows_by_col rebuilds it on demand
    return r


def _perm32(topo: Topology) -> torch.Tensor:
    p = topo.cache.get("col_perm_i32")
    if p is None:
        p = topo.col_perm.to(torch.int32).contiguous()
        _ = topo.rows_by_col, topo.col_ptr  # built from the int64 permutation, before it goes
        topo.cache["col_perm_i32"] = p
        # the int64 permutation (8 bytes per connection) is not needed by the kernels: drop it
        # from the cache (Topology.col_perm rebuilds it on demand)
        topo.cache.pop("col_perm", None)
    return p


# The ops' fast path for calls like an earlier one (`_fast_lookup`; False: every call
# checked and planned, for A/B runs of the host time).
FAST_PATH = True
# Any attribute of this module set from outside (a knob such as WIDE_OWN, or monkeypatch.setattr)
# or by `wide_mode` changes `_generation`, part of the fast path's key (`_fast_lookup`): calls then
# plan again under the knobs' new values.
_generation = 0


class _OpsModule(types.ModuleType):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name != "_generation":
            self.__dict__["_generation"] = self.__dict__["_generation"] + 1


sys.modules[__name__].__class__ = _OpsModule


# Refreshing a topology in place after its pattern changed (Topology.refresh_from, so that a
# captured CUDA graph replays the new pattern): the arrays these ops cache are rebuilt, the launch
# plans kept (they depend only on the shape and nnz and hold the arrays by address).
REBUILD.update({"seg": lambda t, key: _seg(t, *key[1:]),
                "seg_order": lambda t, key: _seg_order(t, *key[1:]),
                "rows_by_col_u16": lambda t, key: _rows_by_col(t),
                "col_perm_i32": lambda t, key: _perm32(t),
                "spmm_plan": None, "sddmm_plan": None, "fused_plan": None, "spmm_fast": None,
                "sddmm_fast": None, "fused_fast": None})

_dummies = {}


def dummy_array(device, dtype=torch.float32) -> torch.Tensor:
    """A 1-element array (fp32 unless told) for a kernel argument that the launch never touches;
    one per device and dtype, never one of the call's own tensors (the simulator copies every
    argument back after the kernel)."""
    d = _dummies.get((device, dtype))
    if d is None:
        d = _dummies[(device, dtype)] = build_persistent(device, torch.zeros, 1, dtype=dtype, device=device)
    return d


# When the 32-wide kernels are used by default: {op: (B from which they are used when rows hold
# at least WIDE_DENSITY of the columns, B from which they are used at any density)}. Measured on
# the H200 (4096 x 4096, experiments/tune_kernels.py): forward at B = 32, 90 %: 23 us wide vs
# 40 us tiled, 99 %: 14 vs 11; at B = 128, 99 %: 26 vs 31. SDDMM at B = 16, 90 %: 22 vs 24,
# 99 %: 12 vs 10.5; from B = 32 the wide SDDMM wins at every sparsity (99 %: 13 vs 20).
# Below B = WIDE_SMALL_BELOW_B the wide SpMMs also need WIDE_MIN_NNZ non-zeros: every block
# stages a whole chunk of X, a fixed cost that a small matrix does not pay back (H200, 90 %,
# B = 32, forward tiled vs wide: 768 x 768 5.4 vs 9.0 us, 1024 x 1024 5.9 vs 10.5, 2304 x 768
# (177 K non-zeros) 12.5 vs 10.1, 768 x 2304 9.3 vs 9.8, 2048 x 2048 (419 K) 16.3 vs 12.9).
# The transposed SpMM goes wide from B = 17, where the tiled one needs a third batch tile
# (column-staged lane-owned kernels, bf3e7d9; dX tiled vs wide: 90 %, B = 16 23.2 vs 23.0,
# B = 24 32.8 vs 23.7; 95 %, B = 16 16.7 vs 16.6, B = 24 22.1 vs 17.4; the forward stays tiled
# to B = 31: 90 %, B = 24 20.8 vs 21.8).
WIDE_FROM = {"spmm": (32, 96), "spmm_t": (17, 96), "sddmm": (16, 32)}
WIDE_DENSITY = 0.03
WIDE_MIN_NNZ = 150_000
WIDE_SMALL_BELOW_B = 64


def _use_wide(batch: int, wide: Optional[bool], op: str, topo: Topology) -> bool:
    if wide is not None:
        return bool(wide)
    dense_from, any_from = WIDE_FROM[op]
    if op != "sddmm" and batch < WIDE_SMALL_BELOW_B and topo.nnz < WIDE_MIN_NNZ:
        return False
    return batch >= any_from or (batch >= dense_from and _density(topo) >= WIDE_DENSITY)


_NO_PLAN = object()


def _cached_plan(topo, key, build, *args):
    """topo.cache[key], built once by build(topo, *args) (a plan may be None: no kernel variant
    fits)."""
    plan = topo.cache.get(key, _NO_PLAN)
    if plan is _NO_PLAN:
        # the kernels do not bounds-check: a hand-built Topology is checked before the first plan
        # built from it (the library's own are checked when made: a no-op for them), except under
        # CUDA-graph capture, where nothing can be read back
        if not (topo.checked or (topo.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            check_topology(topo)
        # the arrays it builds outlive any CUDA graph: outside the graphs' pools
        plan = topo.cache[key] = build_persistent(topo.device, build, topo, *args)
    return plan


def _plan_kind(dtype, values_dtype) -> int:
    """A plan's `kind`: 0-2 for one dtype (float32, float16, bfloat16), 3 + the activations'
    kind for float32 values with half activations (see `_kinds`)."""
    return _KIND[dtype] + (3 if values_dtype != dtype else 0)


def _kinds(kind: int):
    """(x's kind, the values' kind or None when the same) from a plan's `kind` (`_plan_kind`)."""
    return (kind, None) if kind < 3 else (kind - 3, 0)


def _spmm_plan(topo, transposed, batch, kind, device, bt, threads, wide, chunks, split, has_bias):
    """What the SpMM launch needs beyond the per-call tensors, cached on the topology per
    (order, batch, dtype, options, bias or not, `_sum_mode`): (BoundLaunch, how partial rows add
    up) (see `_spmm_launch`), or None when no variant fits in shared memory (torch fallback)."""
    mode = _sum_mode()
    return _cached_plan(topo, ("spmm_plan", transposed, batch, kind, bt, threads, wide, chunks, split, has_bias, mode,
                               CLUSTER_SUMS,
                               WIDE_OWN, WIDE_OWN_THREADS, WIDE_OWN_PER_LANE, WIDE_OWN_BOUND, WIDE_RED4, WIDE_ORDER,
                               WIDE_ROWS4_BELOW, WIDE_PROBE,
                               WIDE_GATHER, GATHER_PREFETCH, GATHER_MIN_BLOCKS),
                        _build_spmm_plan, transposed, batch, kind, device, bt, threads, wide, chunks, split,
                        has_bias, mode)


# Mean non-zeros per (row, column chunk) segment below which the wide SpMMs give each group of 8
# lanes a row of its own (kernels.make_spmm_wide_kernel(rows4=True)) instead of a warp per row.
# Measured on the H200 (graph medians, forward / dX, warp per row -> rows4, us): 4096 x 4096 at
# 99 %, B = 128 (14 per segment) 23.6 -> 20.8 / 25.4 -> 23.4, B = 64 (10) 16.6 -> 14.3 /
# 17.6 -> 15.4; 98 %, B = 128 (27) 26.9 -> 25.7 / 31.7 -> 30.9; 97 %, B = 128 (41) 30.6 -> 30.6 /
# 36.1 -> 38.1; 95 %, B = 32 (51) 16.4 -> 16.9 / 18.0 -> 18.5.
WIDE_ROWS4_BELOW = 32


# The wide SpMMs with lane-owned non-zeros (kernels.make_spmm_wide_kernel(own=True)): a lane
# takes whole non-zeros (32 accumulators; 8 conflict-free 16-byte shared-memory reads and 32 FMAs
# each) instead of the 8 lanes of a group sharing each one. WIDE_OWN: None (default) for the
# forward on long segments (not the rows4 case), True for both SpMMs always, False never.
# Measured on the H200 (4096 x 4096, graph medians, us, warp per row -> own): forward at 90 %,
# B = 32 21.8 -> 20.5, B = 128 58.8 -> 53.3; 95 %, B = 32 16.6 -> 16.5, B = 128 38.9 -> 36.8; but
# dX at 90 %, B = 32 24.3 -> 24.9-25.1, B = 128 79.5 -> 83.8, and at 99 % (short segments,
# against rows4) forward B = 32 11.6 -> 12.5, B = 128 20.6 -> 23.0. Compiled for blocks of
# WIDE_OWN_THREADS threads (94-109 registers at 512; a bound of 1024 threads, 64 registers with
# spills, was 3-13 % slower; 640 and 768, with 4-6 chunks, 0-11 % slower at 90-95 %, B = 32 and
# 128: gpu/PERFORMANCE.md) and launched with as many, or with the op's `threads` where fewer;
# WIDE_OWN_PER_LANE entries per lane and round (1, 2 or 4: within 3 %).
WIDE_OWN: Optional[bool] = None
WIDE_OWN_THREADS = 512
WIDE_OWN_PER_LANE = 4
WIDE_OWN_BOUND = None  # the launch bound it is compiled with (None: WIDE_OWN_THREADS)
# The wide SpMMs' and the fused backward's atomic flush adds rows 4k .. 4k + 3 of a column with
# one 16-byte reduction (red.global.add.v4.f32) where y's row count is a multiple of 4 and its
# base 16-byte aligned; False: one scalar atomic per element (for A/B runs).
WIDE_RED4 = True
# From two batch tiles on (B > 32), the forward's wide SpMMs whose groups of 8 lanes each take a
# row (own, rows4) take a row block's rows longest segment first, in sets of 4 dealt to the warps
# as a snake (`_seg_order`), instead of in index order; False: in index order everywhere (for A/B
# runs). Measured on an H100 (4096 x 4096, graph medians of 3 rounds, forward, index order ->
# this order, us; default mode / WIDE_OWN = True): 90 %, B = 64 28.40 -> 27.74 / 28.45 -> 27.92,
# B = 128 49.04 -> 47.82 / 48.97 -> 48.07; 95 %, B = 128 32.78 -> 32.07 / 32.65 -> 32.18; 97 %,
# B = 128 (rows4) 26.06 -> 26.03. At B = 32 no gain (90 % 17.44 -> 17.31 / 17.37 -> 17.39, 95 %
# 13.32 -> 13.39 / 13.26 -> 13.43): index order there. The transposed SpMM keeps index order: its
# lane-owned variant was slower in this order (90 %, B = 64 34.00 -> 35.31, B = 128 78.60 ->
# 81.05) and rows4 unchanged.
WIDE_ORDER = True

# The gathering SpMMs (kernels.make_spmm_gather_kernel): x goes in as transposed batch tiles of
# its dtype (one more launch, kernels.make_tiles_t_kernel) and each non-zero reads its column's
# line of them (128 bytes in float32) from global memory (L2 / L1), with no staging, no column
# chunks and no zeroed output: for very sparse W, where a staged chunk serves few non-zeros.
# WIDE_GATHER: None (default) where W is at most GATHER_MAX_DENSITY dense (half-precision x:
# GATHER_MAX_DENSITY_HALF) from B = GATHER_FROM_B on, unless the call names `wide`; True wherever
# the 32-wide kernels would run; False never. Measured in float32 on an H100
# (4096 x 4096, graph medians with the transposing launch, us, default -> gather; cuSPARSE CSR
# alongside): forward at 99 %, B = 128 19.41 -> 13.44 (22.21), B = 64 13.31 -> 9.31 (19.37),
# B = 32 8.76 -> 7.77 (18.99); 98 %, B = 128 24.48 -> 20.40 (31.70), B = 64 17.81 -> 13.10;
# 97 %, B = 128 27.58 -> 27.79: no gain; dX at 99 %, B = 128 22.22 -> 17.70, 98 % 30.18 -> 26.49
# (gpu/PERFORMANCE.md). The forward prefetches each round's entries (GATHER_PREFETCH: 19.0 ->
# 17.5 us at 99 %, B = 128 without the launch bound; dX is 0.4-0.6 us faster without) and is
# compiled for GATHER_MIN_BLOCKS blocks per SM (64 registers instead of 73: the 512 blocks of
# B = 128 in one wave on 132 SMs; 17.5 -> 13.4 us).
WIDE_GATHER: Optional[bool] = None
GATHER_MAX_DENSITY = 0.025
GATHER_FROM_B = 32
GATHER_PREFETCH: Optional[bool] = None  # None: the forward prefetches, dX does not
GATHER_MIN_BLOCKS = 4
# With half-precision activations (float16 / bfloat16, values of that dtype or float32) the tiles
# are in x's dtype and a non-zero reads a 64-byte line; there gathering also wins at 97 %. H100,
# 4096 x 4096, bfloat16 (float16 alike), forward / dX, staged -> gather, us: 99 %, B = 128
# 20.71 -> 13.76 / 23.77 -> 17.86 (cuSPARSE 24.99, dense 13.94), B = 64 14.10 -> 9.84,
# B = 32 9.34 -> 8.80; 98 %, B = 128 26.11 -> 20.43, B = 64 18.40 -> 14.09; 97 %, B = 128
# 29.38 -> 26.50 / 37.54 -> 34.14; 96 % 33.23 -> 32.71 (float16 33.33 -> 34.13); 95 % 36.39 -> 39.64;
# float32 values with bfloat16 x: 99 %, B = 128 21.93 -> 13.51, 97 % 29.10 -> 25.65.
GATHER_MAX_DENSITY_HALF = 0.035


# Timing decomposition only (results are wrong when set): the 32-wide SpMMs are built with
# kernels.make_spmm_wide_kernel(probe=WIDE_PROBE), which leaves out the phases its bits name
# (1 staging, 2 rows, 4 output flush, 8 the lane-owned products, 16 their shared-memory reads).
# experiments/decompose_wide.py.
WIDE_PROBE = 0


def _wide_own(transposed: bool, short: bool) -> bool:
    """Whether a wide SpMM runs lane-owned (see WIDE_OWN)."""
    if WIDE_OWN is not None:
        return bool(WIDE_OWN)
    return not transposed and not short


WIDE_MODES = ("auto", "warp", "rows4", "own", "gather")


@contextlib.contextmanager
def wide_mode(mode: str, sddmm: bool = False):
    """Within the block, the 32-wide SpMMs take their rows in mode `mode`: "auto" (the defaults:
    WIDE_OWN, WIDE_ROWS4_BELOW, and WIDE_GATHER's rule), "warp" (a warp per row), "rows4" (a row
    per group of 8 lanes), "own" (a row per group of 8 lanes, lanes owning whole non-zeros) or
    "gather" (no staging: each non-zero reads its column of X's transposed batch tiles from
    global memory, float32, wherever the 32-wide kernels would run); "warp", "rows4" and "own"
    never gather. The fused backward keeps its own. With `sddmm` the wide SDDMM follows too
    (SDDMM_ROWS4): a row per group of 8 lanes in "rows4", a warp per row in "warp" and "own" (it
    has no lane-owned mode), its rule in "auto"; without, it keeps its rule (`_sddmm_rows4`,
    which reads WIDE_ROWS4_BELOW too). For A/B runs (experiments/tune_kernels.py --wide-modes),
    tests and the sanitizer run; it sets this module's knobs, so it is not meant for threads
    running ops at the same time."""
    global WIDE_OWN, WIDE_ROWS4_BELOW, SDDMM_ROWS4, WIDE_GATHER, _generation
    if mode not in WIDE_MODES:
        raise ValueError(f"mode must be one of {WIDE_MODES}, got {mode!r}")
    saved = WIDE_OWN, WIDE_ROWS4_BELOW, SDDMM_ROWS4, WIDE_GATHER
    _generation += 1
    if mode == "warp":
        WIDE_OWN, WIDE_ROWS4_BELOW = False, 0
    elif mode == "rows4":
        WIDE_OWN, WIDE_ROWS4_BELOW = False, 10 ** 9
    elif mode == "own":
        WIDE_OWN = True
    WIDE_GATHER = {"auto": WIDE_GATHER, "gather": True}.get(mode, False)
    if sddmm and mode != "auto":
        SDDMM_ROWS4 = mode == "rows4"
    try:
        yield
    finally:
        WIDE_OWN, WIDE_ROWS4_BELOW, SDDMM_ROWS4, WIDE_GATHER = saved
        _generation += 1


def _short_segments(topo, n_rows: int, nch: int) -> bool:
    """Whether the op's rows (n_rows of them, cut into nch column chunks) hold fewer than
    WIDE_ROWS4_BELOW non-zeros per segment on average: the wide kernels' rows4 mode."""
    return topo.nnz < WIDE_ROWS4_BELOW * n_rows * nch


# Batch tiles whose tiled SpMM (forward; transposed) runs with lanes that own their non-zeros
# (kernels.make_spmm_own_kernel: no shuffle per non-zero). Measured on the H200 at 4096 x 4096
# against the shuffle-broadcast kernel, graph medians: forward at 90 / 95 / 99 % and B = 8
# 13.6 -> 11.2, 9.6 -> 8.3, 6.0 -> 5.7 us, dX 17.7 -> 15.2, 12.4 -> 10.9, 7.1 -> 6.6 us; at B = 2
# the forward is not faster (95 %: 4.8 / 4.8, 99 %: 3.5 / 3.8) while dX is (10.9 -> 10.1 at 90 %).
LANE_OWNED_TILES = {False: (4, 8), True: (2, 4, 8)}

# The lane-owned kernels stage their tile column by column (a non-zero's BT values in one or two
# vector reads, kernels.make_spmm_own_kernel(cols=True)) at BT = 8, and at BT = 2 and 4 on
# matrices of density <= OWN_COLS_MAX_DENSITY; else batch row by batch row, whose scalar reads
# are nearly conflict-free when a row's consecutive non-zeros have nearby columns. Measured on
# the H200 (4096 x 4096, graph medians, us, rows -> cols), forward / dX: B = 8 at 90 %
# 11.35 -> 9.64 / 15.01 -> 13.56, 95 % 8.41 -> 7.34 / 10.92 -> 10.06, 99 % 5.93 -> 5.48 /
# 6.46 -> 6.11, 50 % 28.8 -> 28.5 / 51.3 -> 45.9; B = 16 at 90 % 18.07 -> 14.87 / 24.98 -> 22.29;
# B = 4 at 90 % 7.47 -> 6.95 / 11.11 -> 10.49, 80 % 10.15 -> 9.52 / 16.02 -> 14.78, 70 % (dX)
# 26.1 -> 32.3, 50 % 21.9 -> 32.6 / 39.0 -> 49.9; B = 2 (dX) within 1 % at 80-99 %.
OWN_COLS_MAX_DENSITY = 0.25
# The tiled SDDMM reads X like the lane-owned SpMMs (each lane a non-zero, BT values of its column)
# and stages it column by column (kernels.make_sddmm_kernel(cols=True)) on matrices of density
# <= OWN_COLS_MAX_DENSITY, whatever the tile (`_sddmm_column_staged`). Measured on the H200 at
# c73f343 (4096 x 4096, with the bias gradient, graph medians, us, rows -> cols): 90 % B = 2 / 4 /
# 8 / 12 7.04 -> 6.84, 8.97 -> 7.42, 12.93 -> 10.73, 26.04 -> 23.83; 95 % 5.35 -> 5.18,
# 6.67 -> 5.84, 9.39 -> 8.23, 18.63 -> 17.36; 99 % B = 8 / 16 / 24 6.18 -> 5.81, 10.85 -> 10.18,
# 15.64 -> 14.76; 75 % B = 4 / 8 14.53 -> 12.05, 21.89 -> 17.49, B = 12 53.3 -> 55.6; but at 50 %
# B = 12 (two tiles of 8) 105.9 -> 119.5 and B = 8 38.5 -> 38.3: rows above the bound at any tile.
SDDMM_COLUMN_STAGING = True


def _column_staged(tile: int, topo: Topology) -> bool:
    """Whether a lane-owned tiled kernel of batch tile `tile` (2, 4 or 8) stages its tile column
    by column (see OWN_COLS_MAX_DENSITY)."""
    return tile == 8 or _density(topo) <= OWN_COLS_MAX_DENSITY


def _sddmm_column_staged(tile: int, topo: Topology) -> bool:
    """Whether the tiled SDDMM of batch tile `tile` stages X column by column (see
    SDDMM_COLUMN_STAGING)."""
    return SDDMM_COLUMN_STAGING and tile > 1 and _density(topo) <= OWN_COLS_MAX_DENSITY


def _gathers(batch: int, wide: Optional[bool], op: str, kind: int, topo: Topology) -> bool:
    """Whether an SpMM of plan kind `kind` gathers (see WIDE_GATHER)."""
    if WIDE_GATHER is not None:
        return bool(WIDE_GATHER) and _use_wide(batch, wide, op, topo)
    limit = GATHER_MAX_DENSITY if _kinds(kind)[0] == 0 else GATHER_MAX_DENSITY_HALF
    return wide is None and batch >= GATHER_FROM_B and _density(topo) <= limit


def _gather_kernel(transposed: bool, has_bias: bool, kind: int = 0, vkind: Optional[int] = None):
    """The gathering SpMM for x of kind `kind` and values of kind `vkind` (None: x's) as the plans
    launch it (see GATHER_PREFETCH, GATHER_MIN_BLOCKS); the transposed one reads its values
    through the permutation."""
    prefetch = not transposed if GATHER_PREFETCH is None else GATHER_PREFETCH
    return kernels.make_spmm_gather_kernel(transposed, has_bias, prefetch, GATHER_MIN_BLOCKS, kind, vkind)


def _build_spmm_plan(topo, transposed, batch, kind, device, bt, threads, wide, chunks, split, has_bias, mode):
    kind, vkind = _kinds(kind)
    if transposed:
        n_rows, n_cols = topo.shape[1], topo.shape[0]
        ptr, idx, perm = topo.col_ptr, _rows_by_col(topo), _perm32(topo)
    else:
        n_rows, n_cols = topo.shape
        ptr, idx, perm = topo.row_ptr, topo.indices[1], None
    third = perm if perm is not None else ptr
    idx16 = idx.dtype == torch.uint16
    op = "spmm_t" if transposed else "spmm"
    if _gathers(batch, wide, op, kind, topo):
        grid = (-(-n_rows // kernels.GATHER_ROWS), -(-batch // kernels.WIDE))
        plan = _spmm_launch(_gather_kernel(transposed, has_bias, kind, vkind), grid, 256, kernels.GATHER_SMEM, [ptr, idx, third],
                            [n_rows, n_cols, batch], None)
        plan[0].tiles_transposed = _tiles_t_launch(kind, batch, n_cols)
        return plan
    if _use_wide(batch, wide, op, topo):
        nch = wide_chunks(n_cols, device, chunks, batch)[0]
        own = _wide_own(transposed, _short_segments(topo, n_rows, nch))
        bound = (WIDE_OWN_BOUND or WIDE_OWN_THREADS) if own else 1024
        wthreads = min(threads, WIDE_OWN_THREADS, bound) if own else threads
        wp = _wide_plan(n_rows, n_cols, batch, device, wthreads, chunks, split, 65536 // bound)
        if wp is not None:
            nch, cw, cps, nsplit, gy, rpb, smem = wp
            ntiles = -(-batch // kernels.WIDE)
            rows4 = not own and _short_segments(topo, n_rows, nch)  # a row per lane group
            order = WIDE_ORDER and (own or rows4) and not transposed and batch > kernels.WIDE

            def make(sums):
                return kernels.make_spmm_wide_kernel(kind, perm is not None, sums, has_bias, idx16, rows4=rows4,
                                                     own=own, threads=bound, per_lane=WIDE_OWN_PER_LANE,
                                                     probe=WIDE_PROBE, vkind=vkind, red4=WIDE_RED4, order=order)
            kern, sums, gy, rpb, smem = _wide_kernel_and_sums(
                make, mode, wp, ntiles, n_rows, wthreads, device,
                _wide_dtypes(kind, vkind, idx.dtype, fused=False))
            d = _kind_dummy(device, kind)  # the fused backward's arrays, unread here
            seg = (_seg_order(topo, transposed, nch, cw, gy, rpb, wthreads // 32) if order
                   else _seg(topo, transposed, nch, cw))
            return _spmm_launch(kern, (nsplit, ntiles, gy), wthreads, smem,
                                [seg, idx, third],
                                [n_rows, n_cols, batch, nch, cw, rpb, cps], sums, [d, d, d])
    tile, smem = choose_tile(batch, n_cols, device, bt)
    if tile is None:
        return None
    ntiles = -(-batch // tile)
    gy = _grid_rows(n_rows, ntiles, smem, device, threads)
    if tile in LANE_OWNED_TILES[transposed]:
        kern = kernels.make_spmm_own_kernel(tile, kind, perm is not None, has_bias, idx16,
                                            _column_staged(tile, topo), vkind)
    else:
        kern = kernels.make_spmm_kernel(tile, kind, perm is not None, has_bias, idx16, vkind)
    return _spmm_launch(kern, (ntiles, gy), threads, smem, [ptr, idx, third], [n_rows, n_cols, batch], None)


def _tiles_t_launch(kind: int, batch: int, n_cols: int) -> BoundLaunch:
    """The launch that writes x (batch, n_cols) of dtype kind `kind` as transposed batch tiles of
    its own dtype (kernels.make_tiles_t_kernel), taking [x, tiles] per call."""
    return BoundLaunch(kernels.make_tiles_t_kernel(kind, kind != 0), (-(-n_cols // kernels.WIDE), -(-batch // kernels.WIDE)),
                       256, kernels.TILES_T_SMEM, [None, None], [batch, n_cols])


def _spmm_launch(kern, grid, threads, smem, index, scalars, sums, extra=()):
    """The plan: (BoundLaunch of `kern` with the index arrays (and the wide kernels' `extra`
    arrays) bound, taking [x, values, output, bias or values] per call; how the chunk groups'
    partial rows add up: None (one group), "atomic" or "parts" (see `_partial_target`))."""
    a1, a2, a3 = index
    return BoundLaunch(kern, grid, threads, smem, [None, a1, a2, None, a3, None, None] + list(extra), scalars,
                       cluster=grid[0] if sums == "cluster" else 1), sums


# Thread-block clusters for the wide SpMMs' chunk groups: where the column chunks of a row block
# go to several blocks (nsplit > 1), those blocks form one thread-block cluster and add their
# partial rows through distributed shared memory (sums="cluster": no zeroed buffer, no atomics,
# no reduction, deterministic; y written once in its own dtype). Possible on GPUs of compute
# capability >= 9.0 with the driver launch path, for nsplit <= CLUSTER_MAX, when every cluster
# fits on the GPU at once. CLUSTER_SUMS: True, wherever possible; "deterministic" (default),
# where possible in place of the parts (`_sum_mode() == "parts"`: under
# torch.use_deterministic_algorithms(True) or PARTIAL_SUMS = "parts"); False, never.
CLUSTER_SUMS = "deterministic"
CLUSTER_MAX = 8  # the portable cluster size


def _chunk_sums(mode: str, nsplit: int, device) -> Optional[str]:
    """How the wide SpMMs' nsplit chunk groups add up: None (one group), "cluster", or `mode`."""
    if CLUSTER_SUMS not in (True, False, "deterministic"):
        raise ValueError(f"snack.gpu.ops.CLUSTER_SUMS must be True, False or 'deterministic', got {CLUSTER_SUMS!r}")
    if nsplit <= 1:
        return None
    wanted = CLUSTER_SUMS is True or (CLUSTER_SUMS == "deterministic" and mode == "parts")
    if wanted and nsplit <= CLUSTER_MAX and clusters_supported(device):
        return "cluster"
    return mode


def _cluster_fit(kern, wp, ntiles: int, n_rows: int, threads: int, device, dtypes):
    """(grid rows, rows per block, shared memory) of the wide plan `wp` (`_wide_plan`) for `kern`
    built with sums="cluster", with at most as many clusters as the GPU runs at once (fewer,
    taller row blocks when needed), or None when its clusters cannot run. dtypes: the torch
    dtypes of the kernel's array arguments (`_wide_dtypes`)."""
    nch, cw, cps, nsplit, gy, rpb, smem = wp
    base = smem - rpb * 33 * 4  # the X chunk
    arrays = [dummy_array(device, d) for d in dtypes]

    def active(sm):
        return max_active_clusters(kern, arrays, [n_rows, 0, 0, nch, cw, rpb, cps], device, nsplit, threads, sm)
    n = active(smem)
    if n < 1:
        return None
    if ntiles * gy > n:
        gy = max(1, n // ntiles)
        rpb = -(-n_rows // gy)
        gy = -(-n_rows // rpb)
        smem = base + rpb * 33 * 4
        if smem > device_properties(device)[1] or active(smem) < min(n, ntiles * gy):
            return None
    return gy, rpb, smem


def _wide_dtypes(kind: int, vkind, idx_dtype, fused: bool) -> list:
    """The torch dtypes of a wide SpMM kernel's ten array arguments (x, segments, index, values,
    permutation, y, bias, xf, dv, db; the fused backward's unread bias of x's kind) as the ops
    pass them, for `_cluster_fit`; vkind: the values' kind, None when it is x's."""
    xd = _TORCH_KIND[kind]
    vd = xd if vkind is None else _TORCH_KIND[vkind]
    return [xd, torch.int32, idx_dtype, vd, torch.int32, xd, xd if fused else vd, xd, xd, xd]


def _wide_kernel_and_sums(make, mode: str, wp, ntiles: int, n_rows: int, threads: int, device, dtypes):
    """(kernel, sums, grid rows, rows per block, shared memory) of a wide SpMM plan `wp`
    (`_wide_plan`): make(sums) builds the kernel; clusters where `_chunk_sums` says so and
    `_cluster_fit` finds them a grid, else `mode` (dtypes: `_wide_dtypes`)."""
    gy, rpb, smem = wp[4:]
    sums = _chunk_sums(mode, wp[3], device)
    kern = make(sums)
    if sums == "cluster":
        fit = _cluster_fit(kern, wp, ntiles, n_rows, threads, device, dtypes)
        if fit is None:
            sums = mode
            kern = make(sums)
        else:
            gy, rpb, smem = fit
    return kern, sums, gy, rpb, smem


def _kind_dummy(device, kind: int) -> torch.Tensor:
    """dummy_array of dtype kind `kind` as the kernels take it (bfloat16 as int16)."""
    return as_kernel_array(dummy_array(device, (torch.float32, torch.float16, torch.int16)[kind]))


# How the wide kernels add partial results (the SpMMs' chunk groups, the SDDMM's batch tiles):
# "atomic", fp32 atomics into a zeroed sum (the order of the additions varies from run to run),
# or "parts", each part written to an fp32 buffer of its own and the parts summed in order by one
# torch reduction (bit-identical from run to run). torch.use_deterministic_algorithms(True)
# selects "parts" whatever this says.
PARTIAL_SUMS = "atomic"


def _sum_mode() -> str:
    if torch.are_deterministic_algorithms_enabled():
        return "parts"
    if PARTIAL_SUMS not in ("atomic", "parts"):
        raise ValueError(f"snack.gpu.ops.PARTIAL_SUMS must be 'atomic' or 'parts', got {PARTIAL_SUMS!r}")
    return PARTIAL_SUMS


def _partial_target(y, sums, nparts: int, dev):
    """Where a wide kernel writes y: y itself (sums None); with "atomic" a zeroed fp32 buffer
    (y itself when y is fp32); with "parts" an fp32 buffer (nparts, *y.shape). `_finish_partial`
    then makes y from it."""
    if sums is None or sums == "cluster":
        return y
    if sums == "parts":
        return torch.empty((nparts,) + tuple(y.shape), dtype=torch.float32, device=dev)
    target = y if y.dtype == torch.float32 else torch.empty(y.shape, dtype=torch.float32, device=dev)
    return zero(target)


def _finish_partial(y, target, sums) -> None:
    """y from `_partial_target(y, sums, ...)`'s buffer: the parts summed in order ("parts"), or
    the fp32 sum copied ("atomic" into a buffer other than y)."""
    if target is y:
        return
    if sums == "parts":
        if y.dtype == torch.float32:
            torch.sum(target, 0, out=y)
        else:
            y.copy_(target.sum(0))
    else:
        y.copy_(target)


def _run_spmm(x, topo, transposed, values, y, bias, bt, threads, wide, chunks, split, dev):
    """Launches the SpMM (+ bias, added by the kernel) on the CSR order (transposed: the CSC
    order) of topo into y; dev is the tensors' device. Returns (plan, kind), or None when no
    kernel variant fits (nothing launched)."""
    kind = _plan_kind(x.dtype, values.dtype)
    plan = _spmm_plan(topo, transposed, x.shape[0], kind, dev, bt, threads, wide, chunks, split, bias is not None)
    if plan is None:
        return None
    _launch_spmm(plan, kind, x, values, y, bias, dev)
    return plan, kind


def _launch_spmm(plan, kind, x, values, y, bias, dev) -> None:
    """Launches an SpMM plan (`_spmm_plan`) of dtype kind `kind` on x, values and bias into y."""
    bound, sums = plan
    target = _partial_target(y, sums, bound.grid[0], dev)
    views = _SIM or (kind % 3 == 2 and _BF16_VIEWS)  # bfloat16 as int16 bits; 1-D numpy views under the simulator
    prep = bound.tiles_transposed
    if prep is not None:  # (the gathering SpMM) the kernel reads x's batch tiles transposed
        xt = torch.empty(prep.grid[1] * x.shape[1] * kernels.WIDE, dtype=x.dtype, device=dev)
        prep([as_kernel_array(x), as_kernel_array(xt)] if views else [x, xt], dev)
        x = xt
    # without a bias, `values` stands in for the unread argument
    if views:
        vals = as_kernel_array(values)
        bound([as_kernel_array(x), vals, as_kernel_array(target), vals if bias is None else as_kernel_array(bias)],
              dev)
    else:
        bound([x, values, target, values if bias is None else bias], dev)
    _finish_partial(y, target, sums)


# The kernels index the dense operands with 32-bit offsets: larger batches go in slices.
MAX_ELEMENTS = 2 ** 31 - 1


def _batch_slices(batch: int, width: int):
    if batch * width <= MAX_ELEMENTS:
        return ((0, batch),)
    step = max(1, MAX_ELEMENTS // max(1, width))
    return [(b, min(batch, b + step)) for b in range(0, batch, step)]


def _check_bias(bias, n_out: int, dtype, device):
    """bias (n_out,) of `dtype`, the values' dtype."""
    check_bias(bias, n_out, dtype)
    _check_device("bias", bias, device)
    return bias.contiguous()


def _sig(t):
    """(dtype, shape, device) of a contiguous torch tensor, or None (no fast path for it)."""
    if isinstance(t, torch.Tensor) and t.is_contiguous():
        return t.dtype, t.shape, t.device
    return None


def _fast_lookup(enabled, topo, name, flag, a, b, c=None):
    """(key, cached entry or None) of the ops' fast path for op `name` with `flag` (spmm: whether
    transposed; sddmm and spmm_t_sddmm: bias_grad): the signatures of its operands a and b and of
    c when given (spmm: x or dy, values, bias; sddmm: dy, x; spmm_t_sddmm: dy, x, values), the
    deterministic-algorithms flag and this module's `_generation`. The key is None when the call
    cannot take the fast path (not `enabled`: options not the defaults or an out=; `flag` not a
    bool; an operand not a contiguous torch tensor). Entries are written only by calls that passed the checks, so a
    key made from bad input finds nothing and the call takes the checked path."""
    if not (FAST_PATH and enabled and type(flag) is bool and isinstance(topo, Topology)):
        return None, None
    sa, sb = _sig(a), _sig(b)
    sc = None if c is None else _sig(c)
    if sa is None or sb is None or (sc is None and c is not None):
        return None, None
    key = (name, flag, sa, sb, sc, torch.are_deterministic_algorithms_enabled(), _generation)
    return key, topo.cache.get(key)


def _spmm_op(name, a, topo, values, out, transposed, bt, threads, wide, chunks, split, bias=None):
    """Shared body of spmm (a = x, W) and spmm_t (a = dy, W^T): validate, allocate, launch.

    Fast path: a call with the default launch options and no out= whose operands match an
    earlier call's in dtype, shape, device and contiguity (`_fast_lookup`, whose key also holds
    the deterministic-algorithms flag and this module's `_generation`) passed the same checks
    then, so it goes straight to that call's plan: a few microseconds less host time per call."""
    default_options = bt is None and threads == _THREADS and wide is None and chunks is None and split is None
    fast, hit = _fast_lookup(out is None and default_options, topo, "spmm_fast", transposed, a, values, bias)
    if hit is not None:
        plan, kind, n_res = hit
        res = torch.empty(a.shape[0], n_res, dtype=a.dtype, device=a.device)
        _launch_spmm(plan, kind, a, values, res, bias, a.device)
        return res
    _check_topo(topo)
    if not default_options:
        _check_options(bt, threads, wide, chunks, split)
    dev = topo.device
    _check_common(name, a, dev)
    n_out, n_in = topo.shape
    n_a, n_res, what = (n_out, n_in, "out_features") if transposed else (n_in, n_out, "in_features")
    if a.shape[1] != n_a:
        raise ValueError(f"{name} must have {n_a} columns ({what}), got shape {tuple(a.shape)}")
    nnz = topo.nnz
    _check_values(values, nnz, a.dtype, dev)
    if bias is not None:
        bias = _check_bias(bias, n_res, values.dtype, dev)
    batch = a.shape[0]
    res = _check_out(out, (batch, n_res), a.dtype, dev)
    if out is not None:
        _check_no_overlap(out, **{name: a, "values": values, "bias": bias})
    if batch == 0 or n_res == 0:
        return res
    if nnz == 0:
        return res.zero_() if bias is None else res.copy_(bias.expand_as(res))
    if not a.is_contiguous():
        a = a.contiguous()
    if not values.is_contiguous():
        values = values.contiguous()
    slices = _batch_slices(batch, max(n_a, n_res))
    for b0, b1 in slices:
        sa, sr = (a, res) if len(slices) == 1 else (a[b0:b1], res[b0:b1])
        ran = _run_spmm(sa, topo, transposed, values, sr, bias, bt, threads, wide, chunks, split, dev)
        if ran is not None:
            if fast is not None and len(slices) == 1:
                # (after the launch: a call that raised there leaves no entry; a is x itself, as
                # are values and bias: the key's contiguity held)
                topo.cache[fast] = (*ran, n_res)
        else:
            from snack.core import reference
            ref = reference.spmm_t_reference if transposed else reference.spmm_reference
            sr.copy_(ref(sa.float(), topo.indices, values.float(), n_res))
            if bias is not None:
                sr.add_(bias)
    return res


def spmm(x: torch.Tensor, topo: Topology, values: torch.Tensor, out: Optional[torch.Tensor] = None,
         *, bias: Optional[torch.Tensor] = None, bt: Optional[int] = None, threads: int = _THREADS,
         wide: Optional[bool] = None, chunks: Optional[int] = None, split: Optional[int] = None) -> torch.Tensor:
    """Y (B, out_features) = X W^T (+ bias, (out_features,) of the values' dtype, added by the kernel
    when it writes Y) on the GPU; see the module docstring."""
    return _spmm_op("x", x, topo, values, out, False, bt, threads, wide, chunks, split, bias)


def spmm_t(dy: torch.Tensor, topo: Topology, values: torch.Tensor, out: Optional[torch.Tensor] = None,
           *, bt: Optional[int] = None, threads: int = _THREADS, wide: Optional[bool] = None,
           chunks: Optional[int] = None, split: Optional[int] = None) -> torch.Tensor:
    """dX (B, in_features) = dY W on the GPU; see the module docstring."""
    return _spmm_op("dy", dy, topo, values, out, True, bt, threads, wide, chunks, split)


def _check_pair(dy, x, topo: Topology) -> None:
    """dy (B, out) and x (B, in) for W = topo: the SDDMM's (and the fused backward's) operands."""
    _check_topo(topo)
    _check_common("dy", dy, topo.device)
    _check_common("x", x, topo.device)
    n_out, n_in = topo.shape
    if dy.shape[1] != n_out:
        raise ValueError(f"dy must have {n_out} columns (out_features), got shape {tuple(dy.shape)}")
    if x.shape[1] != n_in:
        raise ValueError(f"x must have {n_in} columns (in_features), got shape {tuple(x.shape)}")
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"x and dy must have the same batch size, got {x.shape[0]} and {dy.shape[0]}")
    if x.dtype != dy.dtype:
        raise TypeError(f"x has dtype {x.dtype} but dy has {dy.dtype}")


def sddmm(dy: torch.Tensor, x: torch.Tensor, topo: Topology, out: Optional[torch.Tensor] = None,
          *, bias_grad: bool = False, bt: Optional[int] = None, threads: int = _THREADS,
          wide: Optional[bool] = None, chunks: Optional[int] = None):
    """dv (nnz,), dv_k = sum_b dY[b, r_k] X[b, c_k], on the GPU; see the module docstring.
    With bias_grad=True returns (dv, db), db (out,) = sum_b dY[b, :] (dy's dtype, summed in fp32)
    computed by the same launch from the dY values it reads anyway."""
    default_options = bt is None and threads == _THREADS and wide is None and chunks is None
    fast, plan = _fast_lookup(out is None and default_options, topo, "sddmm_fast", bias_grad, dy, x)
    if plan is not None:
        dv = torch.empty(topo.nnz, dtype=x.dtype, device=x.device)
        return _launch_sddmm(plan, dy, x, dv, bias_grad, topo.shape[0])
    _check_pair(dy, x, topo)
    _check_flag("bias_grad", bias_grad)
    if not default_options:
        _check_options(bt, threads, wide, chunks, None)
    n_out, n_in = topo.shape
    dv = _check_out(out, (topo.nnz,), x.dtype, x.device)
    if out is not None:
        _check_no_overlap(out, dy=dy, x=x)
    batch = x.shape[0]

    def done(db=None):
        if not bias_grad:
            return dv
        return dv, (db if db is not None else dy.sum(0, dtype=torch.float32).to(dy.dtype))
    if dv.numel() == 0:
        return done()
    if batch == 0 or n_in == 0:
        dv.zero_()
        return done()
    x = x.contiguous()
    dy = dy.contiguous()
    slices = _batch_slices(batch, max(n_in, n_out))
    if len(slices) > 1:  # sum of per-slice results, in fp32
        total = torch.zeros(topo.nnz, dtype=torch.float32, device=x.device)
        part = torch.empty_like(dv)
        for b0, b1 in slices:
            sddmm(dy[b0:b1], x[b0:b1], topo, out=part, bt=bt, threads=threads, wide=wide, chunks=chunks)
            total += part.float()
        dv.copy_(total)
        return done()
    plan = _sddmm_plan(topo, batch, _KIND[x.dtype], x.device, bt, threads, wide, chunks, bool(bias_grad))
    if plan is None:
        from snack.core.reference import sddmm_reference
        dv.copy_(sddmm_reference(dy.float(), x.float(), topo.indices))
        return done()
    if fast is not None:
        topo.cache[fast] = plan
    return _launch_sddmm(plan, dy, x, dv, bias_grad, n_out)


def _launch_sddmm(plan, dy, x, dv, bias_grad, n_out):
    """Launches an SDDMM plan (`_sddmm_plan`) on contiguous dy and x into dv (and a new db);
    returns (dv, db) with bias_grad, else dv."""
    bound, mode = plan
    db = torch.empty(n_out, dtype=dy.dtype, device=dy.device) if bias_grad else None
    if mode in ("atomic", "parts"):
        # the tiles' parts are added into zeroed fp32 sums (dv and db themselves when fp32), or
        # written to fp32 parts summed in order; the kernel leaves its dv and db arguments unread
        acc = _partial_target(dv, mode, bound.grid[2], x.device)
        dbacc = _partial_target(db, mode, bound.grid[2], x.device) if bias_grad else None
        kdv, kdb = _kind_dummy(x.device, _KIND[dv.dtype]), _kind_dummy(x.device, _KIND[dy.dtype])
    else:
        # "acc": fp32 partial sums across batch tiles (never aliased with dv: the simulator
        # copies each argument back separately)
        acc = torch.empty(dv.numel(), dtype=torch.float32, device=x.device) if mode == "acc" else dummy_array(x.device)
        dbacc = torch.empty(n_out, dtype=torch.float32, device=x.device) if bias_grad and mode == "acc" else None
        kdv = as_kernel_array(dv)
        kdb = as_kernel_array(db) if bias_grad else _kind_dummy(x.device, _KIND[dy.dtype])
    bound([as_kernel_array(x), as_kernel_array(dy), kdv, as_kernel_array(acc), kdb,
           as_kernel_array(dbacc) if dbacc is not None else dummy_array(x.device)], x.device)
    if mode in ("atomic", "parts"):  # dv and db from the sums or the parts
        _finish_partial(dv, acc, mode)
        if bias_grad:
            _finish_partial(db, dbacc, mode)
    return (dv, db) if bias_grad else dv


def _sddmm_plan(topo, batch, kind, device, bt, threads, wide, chunks, with_db):
    """The SDDMM's launch beyond the per-call tensors, cached on the topology like `_spmm_plan`:
    (BoundLaunch, how the batch tiles add up) (see `_sddmm_launch`) or None."""
    mode = _sum_mode()
    return _cached_plan(topo, ("sddmm_plan", batch, kind, bt, threads, wide, chunks, with_db, mode,
                               WIDE_ROWS4_BELOW, SDDMM_ROWS4),
                        _build_sddmm_plan, batch, kind, device, bt, threads, wide, chunks, with_db, mode)


def _build_sddmm_plan(topo, batch, kind, device, bt, threads, wide, chunks, with_db, mode):
    n_out, n_in = topo.shape
    if _use_wide(batch, wide, "sddmm", topo):
        nch, cw, smem = wide_chunks(n_in, device, chunks, batch)
        if smem <= device_properties(device)[1]:
            ntiles = -(-batch // kernels.WIDE)
            rows4 = _sddmm_rows4(topo, nch, ntiles, threads, device)
            gy = _grid_rows(-(-n_out // 4) if rows4 else n_out, nch * ntiles, smem, device, threads, _WIDE_REGS)
            sums = mode if ntiles > 1 else None
            kern = kernels.make_sddmm_wide_kernel(kind, with_db, rows4, sums)
            return _sddmm_launch(kern, (nch, gy, ntiles),
                                 threads, smem, [_seg(topo, False, nch, cw), topo.indices[1]],
                                 [n_out, n_in, batch, nch, cw], sums)
    tile, smem = choose_tile(batch, n_in, device, bt)
    if tile is None:
        return None
    ntiles = -(-batch // tile)
    gy = _grid_rows(n_out, 1, smem, device, threads)
    cols = _sddmm_column_staged(tile, topo)
    return _sddmm_launch(kernels.make_sddmm_kernel(tile, kind, with_db, cols), (1, gy), threads, smem,
                         [topo.row_ptr, topo.indices[1]], [n_out, n_in, batch], "acc" if ntiles > 1 else None)


# The wide SDDMM takes a row per group of 8 lanes (kernels.make_sddmm_wide_kernel(rows4=True))
# for short segments (as the wide SpMMs), and also for long ones when there are rows enough for
# blocks of 4 rows per warp to fill at least half the SMs: a warp then issues 4 rows' dY loads
# at once. Measured on the H200 (graph medians, us, with db, warp per row -> rows4; B = 128 with
# the batch tiles in the grid): 4096 x 4096 at 99 % B = 128 31.3 -> 18.8, B = 32 14.1 -> 9.3; 95 %
# B = 128 46.5 -> 39.4, B = 32 17.2 -> 14.4; 90 % B = 128 68.4 -> 64.8, B = 32 22.6 -> 20.8,
# B = 512 312 -> 295; 768 x 3072 at 99 % B = 128 13.9 -> 12.1; 3072 x 768 at 99 % 13.4 -> 9.7,
# 90 % 18.7 -> 18.5; but 768 x 768 at 90 % B = 128 (77 per segment, 24 blocks of rows4) 11.0 -> 17.8.
# (Before the batch tiles went to the grid, every block visited the 4 tiles of B = 128 in turn:
# 99 % 48.9 us warp / 38.5 rows4, 95 % 65.8 / 69.5, 90 % 89.2 / 106.2.)
SDDMM_ROWS4: Optional[bool] = None  # None: the rule above; True / False: forced (see wide_mode)


def _sddmm_rows4(topo, nch, ntiles, threads, device):
    """Whether the wide SDDMM takes a row per group of 8 lanes (see above)."""
    if SDDMM_ROWS4 is not None:
        return SDDMM_ROWS4
    n_out = topo.shape[0]
    busy = -(-n_out // (4 * (threads // 32))) * nch * ntiles
    return _short_segments(topo, n_out, nch) or 2 * busy >= device_properties(device)[0]


def _sddmm_launch(kern, grid, threads, smem, index, scalars, mode):
    """The plan: (BoundLaunch of `kern` with the index arrays bound, taking [x, dy, dv, acc, db,
    dbacc] per call; how the batch tiles' parts add up: None (one tile), "acc" (the tiled kernel:
    the same thread visits the tiles in turn, through fp32 accumulators), "atomic" (the wide
    kernel: a tile per block, fp32 atomics into zeroed sums) or "parts" (the wide kernel: a tile
    per block, each tile's part in an fp32 buffer of its own, summed in order; `_partial_target`))."""
    a1, a2 = index
    return BoundLaunch(kern, grid, threads, smem, [None, None, a1, a2, None, None, None, None], scalars), mode


# ---- the fused backward ---------------------------------------------------------------------------
# Batch sizes whose backward (dX, dv and db) runs as one pass of the fused wide kernel
# (kernels.make_spmm_wide_kernel(fused=True)): FUSED_FROM_B <= B <= FUSED_MAX_B (one 32-column
# batch tile: the kernel keeps no partial sums across tiles), on any matrix of density up to
# FUSED_MAX_DENSITY (below). Measured on the H200
# (graph medians, us, fused vs spmm_t + sddmm with db, each op's default kernel):
# 4096 x 4096 at 90 %: B = 8 38.6 vs 28.2, B = 16 38.8 vs 46.2, B = 32 40.6 vs 46.6; at 99 %:
# B = 8 15.9 vs 12.6, B = 16 16.4 vs 19.4, B = 32 18.4 vs 25.1. GPT-2's shapes at B = 16 / 32
# (out x in, 90 % / 99 %): 2304 x 768 13.2 / 13.7 vs 18.0 / 19.1, 8.8 / 9.4 vs 10.8 / 12.3;
# 768 x 768 12.0 / 12.3 vs 13.2 / 13.4, 7.8 / 8.4 vs 9.6 / 10.0; 3072 x 768 16.3 / 16.4 vs
# 20.1 / 21.0; 768 x 3072 13.1 / 14.5 vs 18.9 / 20.8, 8.0 / 9.6 vs 15.7 / 14.6: the fused pass
# wins from B = 16 whatever the size (a wide block's staging of a whole chunk is paid once
# instead of twice). At B = 8 it loses on square matrices (768 x 768 at 90 %: 11.9 vs 10.0).
# Re-measured at 6f0f1fa, after the separate SDDMM got faster (rows4, batch tiles in the grid):
# fused still wins at every point, 4096 x 4096 at 90 % B = 16 / 24 / 32 38.8 / 39.4 / 40.6 vs
# 44.4 / 55.0 / 44.6, at 99 % 16.5 / 17.3 / 19.3 vs 19.3 / 25.6 / 20.6; GPT-2's shapes by 1-7 us.
# But not on dense-ish matrices (at 63be895, 4096 x 4096, B = 16 / 32, fused vs separate, us):
# 20 % density 66.5 / 69.0 vs 78.6 / 72.6; 30 % 111.3 / 115.4 vs 109.8 / 99.4; 50 % 234.2 /
# 236.0 vs 166.1 / 149.3; 70 % 306.4 / 307.2 vs 224.3 / 199.1: fused up to FUSED_MAX_DENSITY.
# From B = 9 since f03c0e6, where the separate tiled ops need two batch tiles of 8 (fused vs
# separate with db, one stream, us, B = 8 / 9 / 12 / 15): 4096 x 4096 at 90 % 38.7 / 38.7 / 38.5 /
# 39.0 vs 24.6 / 45.8 / 48.1 / 51.0, at 95 % 26.4 / 26.5 / 26.5 / 26.7 vs 18.2 / 31.5 / 33.8 /
# 37.2, at 99 % 15.8 / 16.0 / 16.1 / 16.4 vs 12.0 / 19.8 / 22.0 / 24.8; 768 x 768 at 90 %
# 11.8 / 12.1 / 11.9 / 11.8 vs 9.0 / 12.6 / 13.2 / 13.8; 3072 x 768 at 99 % 9.8 / 9.9 / 9.9 / 10.0
# vs 8.6 / 12.0 / 12.6 / 13.2; 768 x 3072 at 90 % 12.5 / 12.6 / 12.8 / 12.9 vs 13.5 / 25.4 /
# 27.1 / 29.2 (the one shape where fused also wins at B = 8). The layer's captured training step
# (snack.optim.Adam, B = 9 / 12 / 15, FUSED_FROM_B 16 -> 9): 4096 x 4096 at 90 % 76.1 -> 67.9,
# 78.7 -> 69.2, 81.4 -> 69.2; at 99 % 32.4 -> 29.1, 34.7 -> 29.5, 37.2 -> 29.6; 768 x 3072 at 90 %
# 31.7 -> 27.2, 33.6 -> 27.6, 35.8 -> 28.2.
FUSED_FROM_B = 9
FUSED_MAX_B = kernels.WIDE
FUSED_MAX_DENSITY = 0.25


def fuses_backward(batch: int, topo: Topology, fused: Optional[bool] = None) -> bool:
    """Whether spmm_t_sddmm computes a batch of `batch` rows with the fused kernel (else it
    calls spmm_t and sddmm): from FUSED_FROM_B rows on matrices of density <= FUSED_MAX_DENSITY.
    fused=True asks for it wherever it applies (1 <= batch <= 32), fused=False never."""
    if batch < 1 or batch > FUSED_MAX_B or topo.nnz == 0 or fused is False:
        return False
    if fused:
        return True
    return batch >= FUSED_FROM_B and _density(topo) <= FUSED_MAX_DENSITY


def spmm_t_sddmm(dy: torch.Tensor, x: torch.Tensor, topo: Topology, values: torch.Tensor, *,
                 bias_grad: bool = False, threads: int = _THREADS, chunks: Optional[int] = None,
                 split: Optional[int] = None, fused: Optional[bool] = None):
    """The backward of Y = X W^T (+ b): (dX, dv), or (dX, dv, db) with bias_grad=True, where
    dX (B, in) = dY W, dv (nnz,) dv_k = sum_b dY[b, r_k] X[b, c_k], db (out,) = sum_b dY[b, :].

    Where `fuses_backward` says so, one launch computes all of them in one pass over W's
    column-major order (dY read once, no second staging); otherwise spmm_t (with `chunks` and
    `split`, which mean the same column chunks of dY there) and sddmm (its own defaults). Results
    have dy's dtype; x, dy, values: one dtype, on W's device."""
    default_options = threads == _THREADS and chunks is None and split is None
    fast, plan = _fast_lookup(default_options and fused is None, topo, "fused_fast", bias_grad, dy, x, values)
    if plan is False:  # not fused here: the two ops, each through its own fast path
        return _unfused_backward(dy, x, topo, values, bias_grad)
    if plan is not None:
        return _launch_fused(plan, dy, x, topo, values, bias_grad)
    _check_pair(dy, x, topo)
    _check_flag("bias_grad", bias_grad)
    if not default_options:
        _check_options(None, threads, None, chunks, split)
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be None, True or False, got {fused!r}")
    n_out, n_in = topo.shape
    _check_values(values, topo.nnz, dy.dtype, topo.device)
    batch = dy.shape[0]
    kind = _plan_kind(dy.dtype, values.dtype)
    plan = None
    if fuses_backward(batch, topo, fused) and n_in > 0:
        mode = _sum_mode()
        plan = _cached_plan(topo, ("fused_plan", batch, kind, threads, chunks, split, bool(bias_grad), mode,
                                   CLUSTER_SUMS, WIDE_RED4),
                            _build_fused_plan, batch, kind, topo.device, threads, chunks, split, bool(bias_grad),
                            mode)
    if fast is not None:
        topo.cache[fast] = False if plan is None else plan
    if plan is None:
        return _unfused_backward(dy, x, topo, values, bias_grad, threads, chunks, split)
    return _launch_fused(plan, dy.contiguous(), x.contiguous(), topo, values.contiguous(), bias_grad)


def _unfused_backward(dy, x, topo, values, bias_grad, threads=_THREADS, chunks=None, split=None):
    dx = spmm_t(dy, topo, values, threads=threads, chunks=chunks, split=split)
    res = sddmm(dy, x, topo, bias_grad=bias_grad, threads=threads)
    return (dx,) + res if bias_grad else (dx, res)


def _launch_fused(plan, dy, x, topo, values, bias_grad):
    """Launches a fused backward plan (`_build_fused_plan`) on contiguous dy, x and values:
    (dX, dv, db) with bias_grad, else (dX, dv)."""
    dev = topo.device
    batch = dy.shape[0]
    n_out, n_in = topo.shape
    kind = _plan_kind(dy.dtype, values.dtype)
    bound, sums = plan
    dx = torch.empty(batch, n_in, dtype=dy.dtype, device=dev)
    target = _partial_target(dx, sums, bound.grid[0], dev)
    dv = torch.empty(topo.nnz, dtype=dy.dtype, device=dev)
    db = torch.empty(n_out, dtype=dy.dtype, device=dev) if bias_grad else dummy_array(dev, dy.dtype)
    if not _SIM and (kind % 3 != 2 or not _BF16_VIEWS):
        bound([dy, values, target, x, dv, db], dev)
    else:
        bound([as_kernel_array(dy), as_kernel_array(values), as_kernel_array(target), as_kernel_array(x),
               as_kernel_array(dv), as_kernel_array(db)], dev)
    _finish_partial(dx, target, sums)
    return (dx, dv, db) if bias_grad else (dx, dv)


def _build_fused_plan(topo, batch, kind, device, threads, chunks, split, with_db, mode):
    """(BoundLaunch of the fused backward taking [dy, values, dX, x, dv, db] per call, how the
    chunk groups' partial rows of dX add up (as `_spmm_launch`)) or None when its chunks do not
    fit."""
    kind, vkind = _kinds(kind)
    n_rows, n_cols = topo.shape[1], topo.shape[0]
    idx, perm = _rows_by_col(topo), _perm32(topo)
    wp = _wide_plan(n_rows, n_cols, batch, device, threads, chunks, split)
    if wp is None:
        return None
    nch, cw, cps, nsplit, gy, rpb, smem = wp

    def make(sums):
        return kernels.make_spmm_wide_kernel(kind, True, sums, False, idx.dtype == torch.uint16, True, with_db,
                                             vkind=vkind, red4=WIDE_RED4)
    kern, sums, gy, rpb, smem = _wide_kernel_and_sums(
        make, mode, wp, 1, n_rows, threads, device, _wide_dtypes(kind, vkind, idx.dtype, fused=True))
    return BoundLaunch(kern, (nsplit, 1, gy), threads, smem,
                       [None, _seg(topo, True, nch, cw), idx, None, perm, None, _kind_dummy(device, kind),
                        None, None, None], [n_rows, n_cols, batch, nch, cw, rpb, cps],
                       cluster=nsplit if sums == "cluster" else 1), sums
