"""Random sparse topologies and per-layer densities, built without a dense matrix.

- `uniform_indices`: exactly `nnz` distinct coordinates drawn uniformly, by rejection sampling
  of flat keys (memory O(nnz), not O(rows * cols)), sorted row-major, int32.
- `erdos_renyi_density`: SET's Erdos-Renyi density eps * (rows + cols) / (rows * cols).
- `erk_densities`: per-layer densities for a global sparsity, RigL's ERK rule: each layer's
  density proportional to (rows + cols) / (rows * cols), layers that would exceed 1 kept dense
  and the scale solved again for the rest, so that the total number of connections matches.
Trade-off: rejection sampling needs a few passes when density is high; above 0.5 it samples the
complement instead and touches O(rows * cols) int64 keys, the same order as the nnz it returns.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import List, Optional, Sequence, Tuple

import torch

from .coo import _check_shape, _generator_from

__all__ = ["uniform_indices", "sample_distinct", "erdos_renyi_density", "erk_densities", "density_to_nnz"]


def density_to_nnz(shape: Tuple[int, int], density: Optional[float] = None,
                   nnz: Optional[int] = None) -> int:
    """The exact number of connections for `density` (or a given `nnz`) of a (rows, cols) matrix."""
    rows, cols = shape
    n = rows * cols
    if (density is None) == (nnz is None):
        raise ValueError("give exactly one of density or nnz")
    if nnz is None:
        if isinstance(density, bool) or not isinstance(density, Real) or math.isnan(density) \
                or not 0.0 <= density <= 1.0:
            raise ValueError(f"density must be a number in [0, 1], got {density!r}")
        nnz = int(round(float(density) * n))
    if isinstance(nnz, bool) or not isinstance(nnz, Integral):  # (numpy integers too)
        raise TypeError(f"nnz must be an int, got {type(nnz).__name__}")
    nnz = int(nnz)
    if not 0 <= nnz <= n:
        raise ValueError(f"nnz must be in [0, rows * cols = {n}], got {nnz}")
    return nnz


def sample_distinct(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """k distinct int64 values uniform in [0, n), sorted, drawn with generator g (CPU).

    For k <= n / 2 by rejection of repeats (a few rounds of torch.unique on ~1.1 k draws, memory
    O(k)); above, by drawing the n - k values left out (then n < 2 k, so the complement is O(k))."""
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n] = [0, {n}] (distinct values), got {k}")
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if k > n // 2:
        left_out = sample_distinct(n, n - k, g)
        keep = torch.ones(n, dtype=torch.bool)
        keep[left_out] = False
        return keep.nonzero().flatten()
    keys = torch.empty(0, dtype=torch.int64)
    while keys.numel() < k:
        need = k - keys.numel()
        draw = torch.randint(0, n, (int(need * 1.1) + 16,), generator=g, dtype=torch.int64)
        keys = torch.unique(torch.cat([keys, draw]))
    if keys.numel() > k:  # drop a uniformly random surplus
        keep = torch.randperm(keys.numel(), generator=g)[:k]
        keys = torch.sort(keys[keep]).values
    return keys


def uniform_indices(shape: Tuple[int, int], *, density: Optional[float] = None,
                    nnz: Optional[int] = None, generator: Optional[torch.Generator] = None,
                    seed: Optional[int] = None) -> torch.Tensor:
    """int32 (2, nnz) indices, row-major sorted, distinct, uniform over all coordinates (CPU).

    shape: (rows, cols); density (fraction of the coordinates, rounded to a count) or nnz (the
    count): exactly one of them; generator (a CPU torch.Generator) or seed (an int in
    [-2**63, 2**64)): at most one, by default a seed drawn from torch's global generator
    (torch.manual_seed repeats it). Checked as `COO.random` checks them (one helper)."""
    rows, cols = _check_shape(shape)
    k = density_to_nnz((rows, cols), density, nnz)
    g = _generator_from(seed, generator)
    n = rows * cols
    if k == 0:
        return torch.empty(2, 0, dtype=torch.int32)
    keys = sample_distinct(n, k, g)
    return torch.stack([keys // cols, keys % cols]).to(torch.int32).contiguous()


def erdos_renyi_density(shape: Tuple[int, int], epsilon: float = 20.0) -> float:
    """SET's Erdos-Renyi density eps * (rows + cols) / (rows * cols), capped at 1."""
    rows, cols = _check_shape(shape)
    if rows == 0 or cols == 0:
        raise ValueError(f"shape must have rows > 0 and cols > 0, got {(rows, cols)}")
    if isinstance(epsilon, bool) or not isinstance(epsilon, Real) or not epsilon > 0:  # (NaN too)
        raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
    return min(1.0, epsilon * (rows + cols) / (rows * cols))


def erk_densities(shapes: Sequence[Tuple[int, int]], sparsity: float) -> List[float]:
    """Per-layer densities so that sum(density_i * n_i) = (1 - sparsity) * sum(n_i), with density_i
    proportional to (rows_i + cols_i) / (rows_i * cols_i) and at most 1 (RigL's ERK rule).
    `sparsity` a number or a floating 0-d tensor (as `sparsify` takes)."""
    if isinstance(sparsity, torch.Tensor) and sparsity.dim() == 0 and sparsity.is_floating_point():
        sparsity = float(sparsity)
    if isinstance(sparsity, bool) or not isinstance(sparsity, Real) or math.isnan(sparsity) \
            or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
    sparsity = float(sparsity)
    shapes = [_check_shape(s) for s in shapes]
    for r, c in shapes:
        if r == 0 or c == 0:
            raise ValueError(f"shapes must have rows > 0 and cols > 0, got {(r, c)}")
    sizes = [r * c for r, c in shapes]
    raw = [(r + c) / (r * c) for r, c in shapes]
    dense = set()
    total_keep = (1.0 - sparsity) * sum(sizes)
    while True:
        budget = total_keep - sum(sizes[i] for i in dense)
        denom = sum(raw[i] * sizes[i] for i in range(len(shapes)) if i not in dense)
        eps = budget / denom if denom > 0 else 0.0
        over = [i for i in range(len(shapes)) if i not in dense and eps * raw[i] > 1.0]
        if not over:
            break
        dense.add(max(over, key=lambda i: raw[i]))
    return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
