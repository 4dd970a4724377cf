"""Tests of SparseLinear's dtype checks (construction and from_dense) and of its nnz's docstring.

The layer supports the dtypes its op has kernels for, float32, float64, float16 and bfloat16
(`snack.layers.functional._FLOAT_DTYPES`); any other is refused at construction with a TypeError
naming the argument, rather than later in torch (float8 is floating, yet has no uniform_ for the
initialisation, and the op refuses it at forward and to_coo).
Trade-off: tiny layers only; the numerics of each dtype are tested in test_layers.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from snack import SparseLinear
from snack.layers.functional import _FLOAT_DTYPES

# floating dtypes torch has but the layer does not support (those of this torch build)
UNSUPPORTED = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                           "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, n)]


def _convertible(dtype) -> bool:
    try:
        torch.ones(1).to(dtype)
        return True
    except (RuntimeError, TypeError):  # (a packed type such as float4 has no conversion)
        return False


def test_the_supported_dtypes_are_the_ops():
    assert set(_FLOAT_DTYPES) == {torch.float32, torch.float64, torch.float16, torch.bfloat16}
    for dtype in _FLOAT_DTYPES:
        layer = SparseLinear(4, 3, sparsity=0.5, dtype=dtype)
        assert layer.values.dtype == dtype and layer.bias.dtype == dtype
        assert layer(torch.randn(2, 4, dtype=dtype)).dtype == dtype
        back = SparseLinear.from_dense(layer.to_dense().detach())
        assert back.values.dtype == dtype


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_construction_refuses_an_unsupported_floating_dtype(dtype):
    assert dtype.is_floating_point  # (what the check used to accept)
    with pytest.raises(TypeError, match=rf"dtype must be a floating torch.dtype the layer supports \(float32, "
                                        rf"float64, float16, bfloat16\) or None, got {dtype}"):
        SparseLinear(4, 4, dtype=dtype)


@pytest.mark.parametrize("dtype", [d for d in UNSUPPORTED if _convertible(d)], ids=str)
def test_from_dense_refuses_an_unsupported_floating_weight(dtype):
    w = torch.ones(4, 4).to(dtype)
    match = rf"weight must be a floating tensor of a dtype the layer supports .*got {dtype}"
    for kw in (dict(mask=torch.eye(4)), dict(), dict(sparsity=0.5)):
        with pytest.raises(TypeError, match=match):
            SparseLinear.from_dense(w, **kw)
    lin = nn.Linear(4, 4).to(dtype)
    with pytest.raises(TypeError, match=match):
        SparseLinear.from_dense(lin)


def test_other_dtypes_are_still_refused():
    for bad in (torch.int32, torch.bool, torch.complex64, "float32", float):
        with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
            SparseLinear(3, 3, dtype=bad)
    with pytest.raises(TypeError, match="weight must be a floating tensor.*int64"):
        SparseLinear.from_dense(torch.ones(3, 3, dtype=torch.int64))


def test_nnz_follows_a_checkpoint_of_another_nnz():
    # (as the nnz property's docstring says: fixed at construction until such a load)
    layer = SparseLinear(20, 10, sparsity=0.5)
    assert layer.nnz == 100
    layer.load_state_dict(SparseLinear(20, 10, sparsity=0.8).state_dict())
    assert layer.nnz == 40
