"""The sparse linear op as torch.library custom ops, for torch.compile and torch.export.

    torch.ops.snack.sparse_linear(x, indices, values, bias, out_features) -> y
    torch.ops.snack.sparse_linear_backward(dy, x, indices, values, out_features,
                                           need_dx, need_dv, need_db) -> (dx, dv, db)

x (B, in) and dy (B, out) contiguous, indices (2, nnz) canonical row-major, values (nnz,), bias
(out,) or None. Outputs that are not needed come back as empty (0,) tensors (a custom op returns
tensors only). Both ops run the same backend code as `SparseLinearFunction` (the topology is
looked up from `indices` at run time, so an in-place change of the indices, as dynamic sparse
training makes, is seen by a compiled model) and have fake (meta) implementations, so that
TorchDynamo traces `SparseLinear` into one graph (`fullgraph=True` works) instead of breaking
the graph at each layer; the autograd formula is registered on the forward op.

`snack.functional.sparse_linear` calls these ops only while it is being compiled
(`torch.compiler.is_compiling()`): in eager mode the autograd Function is cheaper on the host
(a forward through the custom op took ~20 us more, 108 vs 87 us, on a 2-core CPU machine under
load: CPU backend, 2 x 16 x 16).
The default mode, aot_eager and `mode="reduce-overhead"` (CUDA-graph trees; with gradients
zeroed by `zero_grad()`'s default, set to None: see README, Known limits) train like eager mode
(tests/test_compile.py, on the GPU too).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import backend

__all__ = ["sparse_linear_op", "sparse_linear_backward_op"]


def _topology(indices: Tensor, out_features: int, in_features: int):
    return backend.get_topology(indices, (out_features, in_features))


@torch.library.custom_op("snack::sparse_linear", mutates_args=())
def sparse_linear_op(x: Tensor, indices: Tensor, values: Tensor, bias: Optional[Tensor],
                     out_features: int) -> Tensor:
    """Y (B, out) = X W^T + b with W = (indices, values) of shape (out_features, x.shape[1])."""
    topo = _topology(indices, out_features, x.shape[1])
    return backend.spmm(x, topo, values, bias=bias)


@sparse_linear_op.register_fake
def _(x, indices, values, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("snack::sparse_linear_backward", mutates_args=())
def sparse_linear_backward_op(dy: Tensor, x: Tensor, indices: Tensor, values: Tensor, out_features: int,
                              need_dx: bool, need_dv: bool, need_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(dX, dv, db) for dy (B, out); each one not needed is an empty (0,) tensor."""
    from .functional import gradients
    topo = _topology(indices, out_features, x.shape[1])
    dx, dv, db = gradients(dy, x, values, topo, need_dx, need_dv, need_db)
    empty = dy.new_empty(0)
    return (dx if dx is not None else empty, dv if dv is not None else empty.clone(),
            db if db is not None else empty.clone())


@sparse_linear_backward_op.register_fake
def _(dy, x, indices, values, out_features, need_dx, need_dv, need_db):
    return (x.new_empty(x.shape) if need_dx else dy.new_empty(0),
            values.new_empty(values.shape) if need_dv else dy.new_empty(0),
            dy.new_empty(out_features) if need_db else dy.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, indices, values, bias, out_features = inputs
    ctx.save_for_backward(x, indices, values)
    ctx.out_features = out_features
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, indices, values = ctx.saved_tensors
    need_dx, need_dv = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    need_db = ctx.has_bias and ctx.needs_input_grad[3]
    if not (need_dx or need_dv or need_db):
        return None, None, None, None, None
    dx, dv, db = torch.ops.snack.sparse_linear_backward(dy.contiguous(), x, indices, values, ctx.out_features,
                                                        need_dx, need_dv, need_db)
    return (dx if need_dx else None, None, dv if need_dv else None, db if need_db else None, None)


sparse_linear_op.register_autograd(_backward, setup_context=_setup_context)
