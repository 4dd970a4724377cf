"""The COO format: a sparse (rows x cols) matrix stored as its non-zero connections only.

`COO` holds `indices` (int32, shape (2, nnz): [0] row, [1] column), `values` (nnz,) and the
shape. It is always canonical: sorted row-major (by row, then column), no coordinate twice,
every index in range. Topology metadata (row pointers, the permutation that sorts by column,
column pointers) is computed on first use and cached on a `Topology` object shared by every
COO with the same indices, so it is rebuilt only when the connection pattern changes.

Trade-off: indices are int32 (half the bytes of torch's int64 COO) which caps each dimension
at 2**31 - 1; validation costs a sort and a pass over the indices, so hot paths construct
with `check=False` from indices that are already canonical.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

__all__ = ["COO", "Topology", "validate_coo", "canonicalize", "INDEX_DTYPE"]

INDEX_DTYPE = torch.int32
_MAX_DIM = 2**31 - 1
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _seed_from_torch() -> int:
    """A seed drawn from torch's global generator, so that torch.manual_seed makes it repeatable
    (unlike torch.seed(), which would reseed the global generator non-deterministically)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _generator_from(seed, generator) -> torch.Generator:
    """The CPU torch.Generator a random pattern is drawn with (`COO.random`, `uniform_indices`):
    `generator` itself, or a new one seeded with `seed`, or by default with a seed drawn from
    torch's global generator (`_seed_from_torch`). At most one of them may be given.

    seed: an int (numpy integers too) in [-2**63, 2**64), the range torch.Generator.manual_seed
    takes (a negative seed is wrapped modulo 2**64, as torch does); generator: a CPU
    torch.Generator (the pattern is drawn on the CPU whatever the device of the result).
    Checked here, so that a bad one is named instead of failing in torch (manual_seed's
    "Overflow when unpacking long long", randint's list of signatures for a non-generator).
    """
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU torch.Generator (the pattern is drawn on the CPU), "
                             f"got one on {generator.device}")
        return generator
    if seed is None:
        return torch.Generator().manual_seed(_seed_from_torch())
    return torch.Generator().manual_seed(check_seed(seed))


def check_seed(seed) -> int:
    """`seed` (an int or numpy integer, not a bool) as an int in [-2**63, 2**64), the range
    torch.Generator.manual_seed takes; TypeError / ValueError naming `seed` otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    seed = int(seed)  # (torch.Generator.manual_seed refuses numpy integers)
    if not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must fit in 64 bits (torch.Generator.manual_seed takes [-2**63, 2**64)), "
                         f"got {seed}")
    return seed


def _check_shape(shape) -> Tuple[int, int]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    elif isinstance(shape, (np.ndarray, torch.Tensor)) and shape.ndim == 1:
        shape = tuple(shape.tolist())
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        raise ValueError(f"shape must be a pair (rows, cols), got {shape!r}")
    out = []
    for name, s in zip(("rows", "cols"), shape):
        if isinstance(s, (torch.Tensor, np.ndarray)) and s.ndim == 0:
            s = s.item()                           # a 0-d tensor or array (a float one is refused below)
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"shape[{name}] must be an int, got {type(s).__name__}")
        s = int(s)
        if s < 0 or s > _MAX_DIM:
            raise ValueError(f"shape[{name}] must be in [0, 2**31 - 1], got {s}")
        out.append(s)
    return out[0], out[1]


def _byte_range(t: torch.Tensor):
    """(first byte, end byte) of the memory t's elements may touch, or None when t is empty."""
    if t.numel() == 0:
        return None
    if t.is_contiguous():
        extent = t.numel()
    else:
        extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def _span(t: torch.Tensor):
    """(storage address, first byte, end byte) of the memory t's elements may touch."""
    r = _byte_range(t)
    return None if r is None else (t.untyped_storage().data_ptr(), *r)


def check_out_grad(out: torch.Tensor) -> None:
    """ValueError where an op's `out=` tensor requires grad: the ops write into it outside
    autograd (the CPU and GPU backends and the dispatcher's empty-work returns all refuse it)."""
    if out.requires_grad:
        raise ValueError("out must not require grad: the ops write into it outside autograd")


def check_bias(bias, n_out: int, dtype: torch.dtype) -> None:
    """TypeError / ValueError where an op's `bias` is not a tensor of shape (n_out,) (out_features)
    and of the values' dtype (the CPU and GPU backends; each checks its device itself)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias must have shape ({n_out},) (out_features), got {tuple(bias.shape)}")
    if bias.dtype != dtype:
        raise TypeError(f"bias has dtype {bias.dtype} but values have {dtype}")


def check_device(device, name: str = "device") -> Optional[torch.device]:
    """`device` (None, a torch.device, a string or an index) as a torch.device; TypeError/ValueError
    naming `name` where it is not one, or is a CUDA device that torch cannot reach."""
    if device is None:
        return None
    try:
        if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
            dev = torch.device("cuda", int(device))  # an index names a CUDA device, as in torch
        else:
            dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise (ValueError if isinstance(device, (str, int, np.integer)) else TypeError)(
            f"{name} must be a torch.device or a name such as 'cpu' or 'cuda:0', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r}, but torch sees no CUDA GPU (torch.cuda.is_available() is False: "
                             "a CPU build of torch, or no driver)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={device!r}, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_mask(mask, shape, what: str = "dense") -> torch.Tensor:
    """`mask` (bool, or any dtype holding only 0 and 1) of shape `shape` as a bool tensor on its
    own device; raises TypeError/ValueError naming `mask` and what is wrong (`what` names the
    tensor whose shape it must have)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have the shape of {what} {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.is_meta:
        raise ValueError("mask is on the meta device: it holds no entries to keep")
    if mask.dtype == torch.bool:
        return mask
    odd = ~((mask == 0) | (mask == 1))
    if bool(odd.any()):
        raise ValueError("mask must be bool or hold only 0 and 1, got the value "
                         f"{mask[odd].flatten()[0].item()!r} (e.g. at {tuple(odd.nonzero()[0].tolist())})")
    return mask != 0


def validate_coo(indices: torch.Tensor, values: Optional[torch.Tensor], shape) -> Tuple[int, int]:
    """Checks indices/values/shape and raises ValueError/TypeError naming what is wrong.

    indices: (2, nnz) integer tensor; values: (nnz,) floating tensor on the same device (or None).
    Duplicates are not checked here (that needs a sort): see `canonicalize`.
    Meta tensors (a shape, no data) are refused with ValueError: there is no index to check.
    Returns the shape as a pair of ints.
    """
    rows, cols = _check_shape(shape)
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise TypeError(f"indices must have an integer dtype (int32, int64, int16 or uint8), got {indices.dtype}")
    if indices.dim() != 2 or indices.shape[0] != 2:
        raise ValueError(f"indices must have shape (2, nnz), got {tuple(indices.shape)}")
    nnz = indices.shape[1]
    if values is not None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"values must be a floating tensor (float16/bfloat16/float32/float64), got {values.dtype}")
        if values.dim() != 1 or values.shape[0] != nnz:
            raise ValueError(f"values must have shape ({nnz},) to match indices (2, {nnz}), got {tuple(values.shape)}")
        if values.device != indices.device:
            raise ValueError(f"values is on {values.device} but indices is on {indices.device}")
    if indices.is_meta:
        # checked before the range, whose min/max would be copied out of a tensor with no data
        # (torch's NotImplementedError); refused even when empty, as COO.from_dense and
        # check_mask refuse meta tensors: a checked COO or topology is one whose indices were read
        raise ValueError("indices is on the meta device: it holds no index to check; build a COO of "
                         "meta tensors (shapes only) with check=False")
    if nnz > 0:
        mins = indices.min(dim=1).values
        maxs = indices.max(dim=1).values
        lo_r, lo_c, hi_r, hi_c = (int(v) for v in torch.stack([mins, maxs]).flatten().cpu())
        if lo_r < 0 or hi_r >= rows:
            raise ValueError(f"indices[0] (rows) must lie in [0, {rows}), got values in [{lo_r}, {hi_r}]")
        if lo_c < 0 or hi_c >= cols:
            raise ValueError(f"indices[1] (columns) must lie in [0, {cols}), got values in [{lo_c}, {hi_c}]")
    if nnz > _MAX_DIM:
        raise ValueError(f"nnz must be below 2**31, got {nnz}")
    return rows, cols


def canonicalize(indices: torch.Tensor, shape, values: Optional[torch.Tensor] = None, *,
                 check: bool = True):
    """Sorts (indices, values) row-major; raises ValueError on a duplicated coordinate.

    Returns (indices int32 (2, nnz), values or None, already_sorted: bool). The input is checked
    first as by `validate_coo` (dtype, shapes, indices in range), unless `check=False` (callers
    that have just validated it).
    """
    rows, cols = validate_coo(indices, values, shape) if check else _check_shape(shape)
    idx64 = indices.to(torch.int64)
    key = idx64[0] * max(cols, 1) + idx64[1]
    if key.numel() <= 1 or bool((key[1:] > key[:-1]).all()):
        return indices.to(INDEX_DTYPE).contiguous(), values, True
    key_sorted, order = torch.sort(key, stable=True)
    if key_sorted.numel() > 1:
        dup = key_sorted[1:] == key_sorted[:-1]
        if bool(dup.any()):
            first = int(key_sorted[1:][dup][0])
            ndup = int(dup.sum())
            raise ValueError(
                f"indices holds {ndup} duplicated coordinate(s), e.g. (row {first // max(cols, 1)}, "
                f"column {first % max(cols, 1)}); each connection must appear once (duplicates are not summed)")
    new_idx = idx64[:, order].to(INDEX_DTYPE).contiguous()
    new_val = values[order].contiguous() if values is not None else None
    return new_idx, new_val, False


def check_topology(topo: "Topology") -> None:
    """For backends, before they use a topology's pattern (their kernels do not bounds-check):
    indices in range, row-major sorted, no coordinate twice; TypeError/ValueError naming `topo`
    otherwise. Once per topology: a checked one (`Topology.checked`, also set where the library
    builds one from indices it has just validated) returns at once."""
    if topo.checked:
        return
    try:
        validate_coo(topo.indices, None, topo.shape)
    except (TypeError, ValueError) as e:
        raise type(e)(f"topo: {e}") from None
    idx = topo.indices.to(torch.int64)
    key = idx[0] * max(topo.shape[1], 1) + idx[1]
    if key.numel() > 1 and not bool((key[1:] > key[:-1]).all()):
        raise ValueError(f"topo: indices (2, {topo.nnz}) must be canonical: sorted by row, then "
                         "column, each coordinate once (build it through snack.core.COO or canonicalize)")
    topo.checked = True


class Topology:
    """The connection pattern of a COO matrix and its cached metadata.

    indices: int32 (2, nnz), row-major sorted, unique. Metadata is built lazily:
      row_ptr   int32 (rows + 1,)  CSR row pointers into the row-major order
      col_perm  int64 (nnz,)       positions of the entries in column-major order
      col_ptr   int32 (cols + 1,)  CSC column pointers into the column-major order
      rows_by_col int32 (nnz,)     row index of each entry in column-major order
    Backends may store their own derived arrays in `cache` (keyed by name).
    `checked`: whether the indices are known to be valid (`check_topology`); pass True only for
    indices just validated. A hand-built topology is checked by the backends before first use.
    """

    __slots__ = ("indices", "shape", "cache", "checked", "_nnz", "_device")

    def __init__(self, indices: torch.Tensor, shape: Tuple[int, int], *, checked: bool = False):
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dim() != 2 or indices.shape[0] != 2:
            raise ValueError(f"indices must have shape (2, nnz), got {tuple(indices.shape)}")
        self.shape = _check_shape(shape)
        self.checked = checked
        # fixed once built: nnz and device are read from it here. The kernels take the two rows
        # as flat arrays, so a strided tensor (e.g. a transposed (nnz, 2) table) is stored as a copy.
        self.indices = indices.contiguous()
        self.cache = {}
        self._nnz = int(indices.shape[1])
        self._device = indices.device

    @property
    def nnz(self) -> int:
        return self._nnz

    @property
    def device(self) -> torch.device:
        return self._device

    def _get(self, name, build):
        v = self.cache.get(name)
        if v is None:
            v = build()
            self.cache[name] = v
        return v

    @property
    def rows(self) -> torch.Tensor:
        return self.indices[0]

    @property
    def cols(self) -> torch.Tensor:
        return self.indices[1]

    @property
    def row_ptr(self) -> torch.Tensor:
        def build():
            counts = torch.bincount(self.indices[0].to(torch.int64), minlength=self.shape[0])
            ptr = torch.zeros(self.shape[0] + 1, dtype=torch.int64, device=self.device)
            torch.cumsum(counts, 0, out=ptr[1:])
            return ptr.to(INDEX_DTYPE)
        return self._get("row_ptr", build)

    @property
    def col_perm(self) -> torch.Tensor:
        def build():
            idx = self.indices.to(torch.int64)
            key = idx[1] * max(self.shape[0], 1) + idx[0]
            return torch.argsort(key, stable=True)
        return self._get("col_perm", build)

    @property
    def col_ptr(self) -> torch.Tensor:
        def build():
            counts = torch.bincount(self.indices[1].to(torch.int64), minlength=self.shape[1])
            ptr = torch.zeros(self.shape[1] + 1, dtype=torch.int64, device=self.device)
            torch.cumsum(counts, 0, out=ptr[1:])
            return ptr.to(INDEX_DTYPE)
        return self._get("col_ptr", build)

    @property
    def rows_by_col(self) -> torch.Tensor:
        return self._get("rows_by_col", lambda: self.indices[0][self.col_perm].contiguous())

    @property
    def cols_by_col(self) -> torch.Tensor:
        return self._get("cols_by_col", lambda: self.indices[1][self.col_perm].contiguous())

    def to(self, device) -> "Topology":
        device = torch.device(device)
        if device == self.device:
            return self
        return Topology(self.indices.to(device), self.shape, checked=self.checked)

    def refresh_from(self, new: "Topology") -> bool:
        """Takes `new`'s pattern (same shape and nnz) into this topology's own arrays, in place.

        Every cached tensor is rebuilt on `new` and copied into the existing tensor, so kernels
        recorded in a CUDA graph (which keep the arrays' addresses) see the new pattern when
        replayed; launch plans, which depend only on the shape and nnz, are kept. Returns False
        and changes nothing when some cache entry cannot be rebuilt that way (an entry without a
        registered rebuild, see `REBUILD`, or one whose shape or dtype would change); the caller
        then uses `new` instead. All new arrays are built before the first copy. A `new` not yet
        checked (`check_topology`) is checked first: TypeError/ValueError naming `new`, nothing
        changed.
        """
        if new.shape != self.shape or new.nnz != self.nnz or new.device != self.device:
            return False
        try:  # the kernels' cached plans skip the checks of a first call: check a hand-built one here
            check_topology(new)
        except (TypeError, ValueError) as e:
            raise type(e)("new" + str(e)[len("topo"):]) from None
        copies = []
        for key, old in self.cache.items():
            name = key if isinstance(key, str) else key[0]
            if name not in REBUILD:
                return False
            rebuild = REBUILD[name]
            if rebuild is None:  # independent of the pattern (a launch plan)
                continue
            if not isinstance(old, torch.Tensor):
                return False
            fresh = rebuild(new, key)
            if fresh.shape != old.shape or fresh.dtype != old.dtype:
                return False
            copies.append((old, fresh))
        if new.indices.data_ptr() != self.indices.data_ptr():  # a converted copy of the indices
            if new.indices.dtype != self.indices.dtype:
                return False
            copies.append((self.indices, new.indices))
        for old, fresh in copies:
            old.copy_(fresh)
        self.checked = new.checked
        return True


def _property(topo: Topology, key: str) -> torch.Tensor:
    return getattr(topo, key)


# How each kind of `Topology.cache` entry is rebuilt on another topology of the same shape and nnz
# (`Topology.refresh_from`), by the entry's name (the key, or its first element for tuple keys):
# a function (topology, key) -> tensor, or None for entries that do not depend on the pattern.
# Backends register the entries they cache.
REBUILD = {name: _property for name in ("row_ptr", "col_perm", "col_ptr", "rows_by_col", "cols_by_col")}


class COO:
    """A sparse matrix of shape (rows, cols) stored as (indices, values), canonical row-major.

    Args:
        indices: integer tensor (2, nnz); [0] row, [1] column. Any order; stored sorted as int32,
                 in a tensor of the COO's own (never the caller's) unless check=False.
        values:  floating tensor (nnz,) on the same device, matching `indices` entry for entry;
                 kept as given (no copy) when `indices` is already canonical, else reordered
                 (a copy).
        shape:   (rows, cols).
        check:   validate dtype/shape/range/duplicates and sort (default). Pass False only for
                 indices known to be canonical int32 (a hot path); nothing is checked then.
        topology: an existing `Topology` to share (`indices` and `shape` are then not read;
                 with check=True `values` is checked against it, and its index range, not its
                 order); for conversions that keep one topology for several value tensors.
    Raises ValueError/TypeError naming the argument for a bad shape, dtype, device, an index out
    of range or a duplicated coordinate. Meta tensors hold no index to check: check=True refuses
    them (ValueError naming `indices`); a COO of shapes only is built with check=False (as
    `SparseLinear.to_coo` does for a meta layer).
    """

    __slots__ = ("topology", "values")

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, shape, *, check: bool = True,
                 topology: Optional[Topology] = None):
        if topology is not None:
            self.topology = topology
            self.values = values
            if check:
                validate_coo(topology.indices, values, topology.shape)
            return
        if check:
            if values is None:
                raise TypeError("values must be a floating tensor (nnz,), got None")
            shape = validate_coo(indices, values, shape)
            given = indices
            indices, values, _ = canonicalize(indices, shape, values, check=False)
            if indices.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
                # canonical int32 input comes back as is: own a copy, so that a later change of
                # the caller's tensor cannot reach the validated pattern (kernels trust it)
                indices = indices.clone()
        self.topology = Topology(indices, shape, checked=check)
        self.values = values

    # ---- basic properties ----------------------------------------------------------------
    @property
    def indices(self) -> torch.Tensor:
        return self.topology.indices

    @property
    def shape(self) -> Tuple[int, int]:
        return self.topology.shape

    @property
    def nnz(self) -> int:
        return self.topology.nnz

    @property
    def density(self) -> float:
        n = self.shape[0] * self.shape[1]
        return self.nnz / n if n else 0.0

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def __repr__(self) -> str:
        return (f"COO(shape={self.shape}, nnz={self.nnz}, sparsity={self.sparsity:.4f}, "
                f"dtype={self.dtype}, device={self.device})")

    def with_values(self, values: torch.Tensor) -> "COO":
        """A COO with the same topology (and cached metadata) and new values (nnz,)."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"values must be a floating tensor (float16/bfloat16/float32/float64), got {values.dtype}")
        if values.device != self.topology.device:
            raise ValueError(f"values is on {values.device} but the indices are on {self.topology.device}")
        if values.shape != (self.nnz,):
            raise ValueError(f"values must have shape ({self.nnz},), got {tuple(values.shape)}")
        return COO(None, values, None, check=False, topology=self.topology)

    def to(self, device=None, dtype=None) -> "COO":
        """A COO on `device` and/or with values of floating `dtype` (either may be None: kept);
        like torch, `coo.to(torch.float64)` takes a dtype given first."""
        if isinstance(device, torch.dtype):
            if dtype is not None:
                raise TypeError("give the dtype once (to(dtype) or to(device, dtype))")
            device, dtype = None, device
        if dtype is not None and dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating dtype (float16/bfloat16/float32/float64), got {dtype!r}")
        device = check_device(device)
        topo = self.topology.to(device) if device is not None else self.topology
        vals = self.values.to(device=device if device is not None else self.values.device,
                              dtype=dtype if dtype is not None else self.values.dtype)
        return COO(None, vals, None, check=False, topology=topo)

    # ---- conversions ---------------------------------------------------------------------
    @classmethod
    def from_dense(cls, dense: torch.Tensor, mask: Optional[torch.Tensor] = None) -> "COO":
        """Keeps the entries where `mask` (bool, or 0 and 1) is true (default: where `dense` is
        non-zero)."""
        if not isinstance(dense, torch.Tensor):
            raise TypeError(f"dense must be a torch.Tensor, got {type(dense).__name__}")
        if dense.dim() != 2:
            raise ValueError(f"dense must be 2-D, got shape {tuple(dense.shape)}")
        if dense.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dense must be a floating tensor (float16/bfloat16/float32/float64), got {dense.dtype}")
        _check_shape(tuple(dense.shape))  # (int32 indices: each dimension below 2**31)
        if dense.is_meta:
            raise ValueError("dense is on the meta device: it holds no values to keep")
        if mask is None:
            mask = dense != 0
        else:
            mask = check_mask(mask, dense.shape).to(device=dense.device)
        idx = mask.nonzero().t().contiguous()  # row-major order already
        vals = dense[mask].contiguous()
        return cls(idx.to(INDEX_DTYPE), vals, tuple(dense.shape), check=False)

    def to_dense(self) -> torch.Tensor:
        """The (rows, cols) dense matrix. For tests and export: allocates rows x cols."""
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        if self.nnz:
            idx = self.indices.to(torch.int64)
            out[idx[0], idx[1]] = self.values
        return out

    @classmethod
    def from_scipy(cls, mat, *, dtype: torch.dtype = torch.float32, device=None) -> "COO":
        """From any scipy.sparse matrix/array of real numbers, its values cast to `dtype` (float32
        by default: give dtype=torch.float64 to keep float64 data exact). Duplicated entries
        raise ValueError; complex data raises TypeError. The COO owns its tensors: nothing is
        shared with `mat`."""
        import scipy.sparse as sp
        if not sp.issparse(mat):
            raise TypeError(f"mat must be a scipy.sparse matrix or array, got {type(mat).__name__}")
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating dtype (float16/bfloat16/float32/float64), got {dtype!r}")
        if len(mat.shape) != 2:
            raise ValueError(f"mat must be 2-D, got shape {tuple(mat.shape)}")
        m = mat.tocoo()
        if not (np.issubdtype(m.dtype, np.floating) or np.issubdtype(m.dtype, np.integer) or m.dtype == np.bool_):
            raise TypeError(f"mat must hold real numbers, got {m.dtype} (a complex matrix would lose its "
                            "imaginary part)")
        data = m.data
        if np.issubdtype(data.dtype, np.floating) and data.dtype.itemsize > 8:  # long double: no torch dtype
            data = data.astype(np.float64)
        idx = torch.from_numpy(np.stack([m.row, m.col]).astype(np.int64))
        vals = torch.from_numpy(np.array(data, copy=True)).to(dtype)
        coo = cls(idx, vals, m.shape)
        return coo.to(device) if device is not None else coo

    def to_scipy(self, format: str = "coo"):
        """A scipy.sparse array ('coo' or 'csr'), in float64 for float16/bfloat16 values. It owns
        its arrays: editing it leaves this COO (and a layer's weights) as they are."""
        import scipy.sparse as sp
        idx = self.indices.cpu().numpy().copy()
        v = self.values.detach().cpu()
        if v.dtype in (torch.float16, torch.bfloat16):
            v = v.to(torch.float64)  # (a copy)
        else:
            v = v.clone()
        m = sp.coo_array((v.numpy(), (idx[0], idx[1])), shape=self.shape)
        if format == "coo":
            return m
        if format == "csr":
            return m.tocsr()
        raise ValueError(f"format must be 'coo' or 'csr', got {format!r}")

    @classmethod
    def from_torch_sparse(cls, t: torch.Tensor) -> "COO":
        """From a torch sparse COO or CSR tensor of floating values. An uncoalesced COO with
        duplicates raises. As the constructor, it keeps `t`'s values tensor (no copy) where its
        entries are already in row-major order."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"t must be 2-D, got shape {tuple(t.shape)}")
        if t.layout in (torch.sparse_coo, torch.sparse_csr):
            if not t.is_floating_point():
                raise TypeError(f"t must hold floating values (float16/bfloat16/float32/float64), got {t.dtype}")
            if t.dense_dim() != 0:
                raise ValueError(f"t must have 2 sparse dimensions and no dense ones, got a hybrid tensor with "
                                 f"{t.dense_dim()} dense dimension(s)")
        if t.layout == torch.sparse_coo:
            return cls(t._indices(), t._values(), tuple(t.shape))
        if t.layout == torch.sparse_csr:
            crow, col = t.crow_indices(), t.col_indices()
            counts = (crow[1:] - crow[:-1]).to(torch.int64)
            row = torch.repeat_interleave(torch.arange(t.shape[0], device=t.device), counts)
            return cls(torch.stack([row, col.to(torch.int64)]), t.values(), tuple(t.shape))
        raise ValueError(f"t must have layout sparse_coo or sparse_csr, got {t.layout}")

    def to_torch_sparse(self, layout=torch.sparse_coo) -> torch.Tensor:
        """A torch sparse tensor (sparse_coo, coalesced, or sparse_csr) with the same entries."""
        if layout == torch.sparse_coo:
            return torch.sparse_coo_tensor(self.indices.to(torch.int64), self.values, self.shape,
                                           is_coalesced=True, check_invariants=False)
        if layout == torch.sparse_csr:
            return torch.sparse_csr_tensor(self.topology.row_ptr.to(torch.int64),
                                           self.indices[1].to(torch.int64), self.values, self.shape,
                                           check_invariants=False)
        raise ValueError(f"layout must be torch.sparse_coo or torch.sparse_csr, got {layout}")

    # ---- random topologies ---------------------------------------------------------------
    @classmethod
    def random(cls, shape, *, density: Optional[float] = None, nnz: Optional[int] = None,
               seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
               device=None, dtype=torch.float32, init: str = "normal") -> "COO":
        """A uniformly random pattern with exactly `nnz` (or round(density * rows * cols))
        entries, built without a dense matrix; values ~ N(0, 1) ('normal') or ones ('ones')."""
        from .topology import uniform_indices
        rows, cols = _check_shape(shape)
        device = check_device(device)
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be a floating dtype (float16/bfloat16/float32/float64), got {dtype!r}")
        if init not in ("normal", "ones"):
            raise ValueError(f"init must be 'normal' or 'ones', got {init!r}")
        # seed and generator checked last: without either, a seed is drawn from torch's global
        # generator, which a bad argument checked after it would have advanced for nothing
        g = _generator_from(seed, generator)
        idx = uniform_indices((rows, cols), density=density, nnz=nnz, generator=g)
        if init == "normal":
            vals = torch.randn(idx.shape[1], generator=g, dtype=torch.float64).to(dtype)
        else:
            vals = torch.ones(idx.shape[1], dtype=dtype)
        coo = cls(idx, vals, (rows, cols), check=False)
        return coo.to(device) if device is not None else coo
