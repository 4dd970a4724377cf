"""Reference ops: the meaning of every kernel, in plain torch index ops (float64 capable).

With W the (out, in) COO matrix (indices (2, nnz): [0] row r, [1] column c; values v):
    spmm(x, W)        Y  = X W^T      Y[b, r]  += v_k X[b, c_k]      x (B, in)  -> (B, out)
    spmm_t(dy, W)     dX = dY W       dX[b, c] += v_k dY[b, r_k]     dy (B, out) -> (B, in)
    sddmm(dy, x, W)   dv_k = sum_b dY[b, r_k] X[b, c_k]              -> (nnz,)
They allocate (B, nnz) temporaries: clear, not fast. Tests compare every backend against these
(run in float64) and these against scipy.sparse.
"""
from __future__ import annotations

import torch

__all__ = ["spmm_reference", "spmm_t_reference", "sddmm_reference"]


def spmm_reference(x: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, out_features: int) -> torch.Tensor:
    """Y (B, out_features) = X W^T for x (B, in), W given by indices (2, nnz) and values (nnz,)."""
    r, c = indices[0].long(), indices[1].long()
    y = torch.zeros(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    return y.index_add_(1, r, x[:, c] * values.to(x.dtype))


def spmm_t_reference(dy: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, in_features: int) -> torch.Tensor:
    """dX (B, in_features) = dY W for dy (B, out)."""
    r, c = indices[0].long(), indices[1].long()
    dx = torch.zeros(dy.shape[0], in_features, dtype=dy.dtype, device=dy.device)
    return dx.index_add_(1, c, dy[:, r] * values.to(dy.dtype))


def sddmm_reference(dy: torch.Tensor, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """dv (nnz,) with dv_k = sum_b dY[b, r_k] X[b, c_k], for dy (B, out), x (B, in)."""
    r, c = indices[0].long(), indices[1].long()
    return (dy[:, r] * x[:, c]).sum(0)
