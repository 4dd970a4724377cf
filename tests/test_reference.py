"""Tests of the reference ops (core/reference.py) against scipy.sparse and dense float64 math.

The reference ops define what every backend computes, so they are checked here against an
independent oracle: scipy.sparse CSR products for the two SpMMs and the masked dense product
dY^T X for SDDMM, in float64, on odd shapes, B = 1, nnz = 0, empty rows and columns, 1 x 1,
and indices in any order (the reference does not need canonical order).
Trade-off: float64 only on small shapes; precision of other dtypes is a backend matter.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from snack.core import COO, sddmm_reference, spmm_reference, spmm_t_reference

# (out, in, B, density)
CASES = [
    (7, 96, 40, 0.2), (96, 7, 40, 0.3), (40, 333, 7, 0.05), (333, 40, 1, 0.1), (7, 333, 96, 0.01),
    (1, 1, 1, 1.0), (1, 1, 5, 1.0), (5, 1, 3, 0.6), (1, 9, 2, 0.5), (13, 17, 1, 0.0), (13, 17, 6, 0.0),
]
F64 = dict(rtol=1e-12, atol=1e-12)


def scipy_ops(coo: COO, x: np.ndarray, dy: np.ndarray):
    w = coo.to_scipy("csr")
    y = np.asarray((w @ x.T).T)
    dx = np.asarray((w.T @ dy.T).T)
    idx = coo.indices.long().numpy()
    dv = (dy.T @ x)[idx[0], idx[1]]
    return y, dx, dv


@pytest.mark.parametrize("out_f, in_f, B, density", CASES)
def test_reference_matches_scipy(gen, out_f, in_f, B, density):
    coo = COO.random((out_f, in_f), density=density, generator=gen, dtype=torch.float64)
    x = torch.randn(B, in_f, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, out_f, generator=gen, dtype=torch.float64)
    y, dx, dv = scipy_ops(coo, x.numpy(), dy.numpy())
    torch.testing.assert_close(spmm_reference(x, coo.indices, coo.values, out_f), torch.from_numpy(y), **F64)
    torch.testing.assert_close(spmm_t_reference(dy, coo.indices, coo.values, in_f), torch.from_numpy(dx), **F64)
    torch.testing.assert_close(sddmm_reference(dy, x, coo.indices), torch.from_numpy(dv), **F64)


def test_empty_rows_and_columns(gen):
    # rows 0, 2, 5 and columns 1, 3, 4 hold nothing
    idx = torch.tensor([[1, 1, 3, 4, 4], [0, 5, 2, 0, 6]], dtype=torch.int32)
    vals = torch.randn(5, generator=gen, dtype=torch.float64)
    coo = COO(idx, vals, (6, 7))
    x = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    dy = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    y = spmm_reference(x, coo.indices, coo.values, 6)
    dx = spmm_t_reference(dy, coo.indices, coo.values, 7)
    assert (y[:, [0, 2, 5]] == 0).all() and (dx[:, [1, 3, 4]] == 0).all()
    ys, dxs, dvs = scipy_ops(coo, x.numpy(), dy.numpy())
    torch.testing.assert_close(y, torch.from_numpy(ys), **F64)
    torch.testing.assert_close(dx, torch.from_numpy(dxs), **F64)
    torch.testing.assert_close(sddmm_reference(dy, x, coo.indices), torch.from_numpy(dvs), **F64)


def test_unsorted_indices_give_the_same_result(gen):
    coo = COO.random((40, 33), density=0.2, generator=gen, dtype=torch.float64)
    perm = torch.randperm(coo.nnz, generator=gen)
    idx, vals = coo.indices[:, perm], coo.values[perm]
    x = torch.randn(5, 33, generator=gen, dtype=torch.float64)
    dy = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(spmm_reference(x, idx, vals, 40), spmm_reference(x, coo.indices, coo.values, 40), **F64)
    torch.testing.assert_close(spmm_t_reference(dy, idx, vals, 33),
                               spmm_t_reference(dy, coo.indices, coo.values, 33), **F64)
    torch.testing.assert_close(sddmm_reference(dy, x, idx), sddmm_reference(dy, x, coo.indices)[perm], **F64)


def test_zero_batch_and_zero_nnz():
    coo = COO.random((4, 6), nnz=0, seed=0, dtype=torch.float64)
    x = torch.randn(0, 6, dtype=torch.float64)
    assert spmm_reference(x, coo.indices, coo.values, 4).shape == (0, 4)
    full = COO.random((4, 6), nnz=10, seed=0, dtype=torch.float64)
    dy = torch.randn(0, 4, dtype=torch.float64)
    assert spmm_t_reference(dy, full.indices, full.values, 6).shape == (0, 6)
    dv = sddmm_reference(dy, x, full.indices)
    assert dv.shape == (10,) and (dv == 0).all()
    y = spmm_reference(torch.randn(3, 6, dtype=torch.float64), coo.indices, coo.values, 4)
    assert y.shape == (3, 4) and (y == 0).all()


def test_gradients_agree_with_autograd_of_dense(gen):
    """spmm_t and sddmm are the gradients of spmm: check against autograd of the dense product."""
    coo = COO.random((9, 14), density=0.3, generator=gen, dtype=torch.float64)
    w = coo.to_dense().requires_grad_(True)
    x = torch.randn(4, 14, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    (x @ w.t()).backward(dy)
    r, c = coo.indices.long()
    torch.testing.assert_close(spmm_t_reference(dy, coo.indices, coo.values, 14), x.grad, **F64)
    torch.testing.assert_close(sddmm_reference(dy, x.detach(), coo.indices), w.grad[r, c], **F64)


def test_float32_inputs_stay_float32(gen):
    coo = COO.random((7, 96), density=0.2, generator=gen)
    x = torch.randn(3, 96, generator=gen)
    y = spmm_reference(x, coo.indices, coo.values, 7)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ coo.to_dense().double().t(), rtol=1e-5, atol=1e-5)
