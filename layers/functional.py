"""sparse_linear: Y = X W^T + b with W a COO matrix, differentiable in x, values and bias.

The autograd Function builds every gradient from the same three backend ops:
    forward   Y  = spmm(X, W) + b  (the GPU kernels add b as they write Y)
    backward  dX = spmm_t(dY, W)      dv = sddmm(dY, X, W)      db = sum_b dY
(on the GPU db comes from the SDDMM's launch, which reads dY anyway; a GEMV when only db is wanted;
where the GPU backend fuses the backward (9 <= B <= 32 on matrices up to 25% dense:
`snack.gpu.fuses_backward`) dX, dv and db come from one launch; the CPU backend's one call from
B = 2 copies dY into its tiles once for both)
so nothing of the dense weight's size (out x in) is allocated, in forward or in backward.
Higher orders: when the backward is itself differentiated (create_graph=True: gradient penalties,
Hessian-vector products) or a torch.func transform runs, dX and dv come from the Functions
`_SpmmT` and `_Sddmm`, whose backward and jvp are made of the same three ops again (see the
comment above `_Spmm`), so torch.func.grad / vjp / jvp / jacrev / jacfwd / hessian and vmap work
(per-sample gradients: one SDDMM per sample). Not supported: `torch.autograd.grad(...,
is_grads_batched=True)` and legacy batched forward tangents (gradcheck's
check_batched_forward_grad): NotImplementedError; and double backward through torch.compile.
When no gradient is wanted (torch.no_grad, or nothing requires grad) the forward runs without
the autograd Function, saving its host overhead on every inference call. While torch.compile
traces it, the op is `torch.ops.snack.sparse_linear` instead (layers/library.py: the same backend
code as custom ops with fake implementations and the same autograd formula), so a model compiles
into one graph.
Inputs of any leading shape are flattened to (B, in) (a copy only if they are not contiguous).
Under torch.autocast the inputs are cast like nn.Linear's: to the autocast dtype (fp16/bf16) on
CUDA; on CPU the math runs in float32 and the result is returned in the autocast dtype. On the GPU
backend only x is cast: its kernels read float32 values and bias next to half activations, which
saves two casts per call and multiplies by the unrounded weights (the output and dX are in the
autocast dtype, the value and bias gradients float32, as with cast weights).
Trade-off: the topology's validation happens when it is (re)built (see backend.get_topology),
so a call with unchanged indices does no device work beyond the kernels and is CUDA-graph
capturable; indices must therefore already be canonical row-major.
"""
from __future__ import annotations

import gc
import math
import types
from numbers import Integral
from typing import Optional

import torch
from torch.autograd import forward_ad
from torch._C._functorch import maybe_current_level as _current_level

from . import backend, library
from .backend import _version_of
from snack.core import Topology
from snack.core.coo import _MAX_DIM, REBUILD

_is_tracing = torch._C._is_tracing  # torch.jit.trace is recording (torch.jit.is_tracing without its wrapper)

__all__ = ["sparse_linear", "SparseLinearFunction", "settle_autograd"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _keep_topology(ctx, topo: Topology) -> None:
    """Keeps the forward's topology for the backward, with the version of its index tensor: the
    pattern is not a saved tensor (autograd would not see it change), so `_check_topology` does
    what autograd does for saved tensors modified in place."""
    ctx.topo = topo
    ctx.topo_version = _version_of(topo.indices)


def _check_topology(ctx) -> None:
    """RuntimeError where the forward's pattern changed in place before its backward (indices
    written, a layer's load_state_dict, dst.step(), or a later call that refreshed the cached
    topology from indices written in place): the gradients would be those of the new pattern."""
    if _version_of(ctx.topo.indices) != ctx.topo_version:
        raise RuntimeError(
            "sparse_linear's backward: the connection pattern (indices) of its forward was modified in place "
            "since (indices written, load_state_dict, or a DST step between forward and backward); its "
            "gradients would be those of the new pattern. Run the backward before changing the pattern, "
            "or run the forward again")


class SparseLinearFunction(torch.autograd.Function):
    """Y (B, out) = X W^T + b for x (B, in) contiguous, W = (topo, values), bias (out,) or None.

    Call through `sparse_linear` (which validates and reshapes); apply(x, values, bias, topo).
    Backward respects ctx.needs_input_grad: dX needs only values, dv only x. When the backward
    itself is differentiated (`create_graph=True`: gradient penalties, Hessian-vector products)
    it builds dX and dv from `_SpmmT` and `_Sddmm`, which are differentiable in turn (see
    `_differentiable_gradients`); otherwise from the backend's fused or separate launches.
    Forward and `setup_context` are separate, and `vmap` is given, so that `torch.func`'s
    transforms (grad, vjp, jacrev, vmap: per-sample gradients) accept it (see `_vmap_rule`).
    """

    @staticmethod
    def forward(x: torch.Tensor, values: torch.Tensor, bias: Optional[torch.Tensor], topo: Topology):
        return backend.spmm(x, topo, values, bias=bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, values, bias, topo = inputs
        _keep_topology(ctx, topo)
        ctx.has_bias = bias is not None
        need_x, need_v = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x if need_v else None, values if need_x else None)
        if _forward_mode():
            ctx.save_for_forward(x, values)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, values = ctx.saved_tensors
        _check_topology(ctx)
        need_dx, need_dv = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        if torch._C._functorch.is_legacy_batchedtensor(dy):
            raise NotImplementedError(
                "sparse_linear's backward does not take torch.autograd.grad(..., is_grads_batched=True) "
                "(its legacy batched gradients); use torch.func.vmap over the vector-Jacobian product, "
                "or torch.func.jacrev, which SparseLinearFunction supports")
        dy = dy.contiguous()
        if (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dy, x, values))) \
                or _in_functorch():
            return _differentiable_gradients(dy, x, values, ctx.topo, need_dx, need_dv, need_db) + (None,)
        return gradients(dy, x, values, ctx.topo, need_dx, need_dv, need_db) + (None,)

    @staticmethod
    def jvp(ctx, dx, dv, db, _):
        if any(t is not None and torch._C._functorch.is_legacy_batchedtensor(t) for t in (dx, dv, db)):
            raise NotImplementedError(
                "sparse_linear's forward-mode derivative does not take torch's legacy batched tangents "
                "(gradcheck's check_batched_forward_grad); use torch.func.vmap over torch.func.jvp, "
                "or torch.func.jacfwd, which SparseLinearFunction supports")
        x, values = ctx.saved_tensors
        return _tangent(_Spmm, x, values, dx, dv, ctx.topo, db)

    @staticmethod
    def vmap(info, in_dims, x, values, bias, topo):
        return _vmap_rule(SparseLinearFunction.apply, info, in_dims, (x, values, bias), topo, fold=True)


# Higher-order gradients. The three ops are closed under differentiation: with
#     Y = spmm(X, v)       Y[b, r]  = sum_k v_k X[b, c_k] [r_k = r]
#     G = spmm_t(D, v)     G[b, c]  = sum_k v_k D[b, r_k] [c_k = c]
#     h = sddmm(D, X)      h_k      = sum_b D[b, r_k] X[b, c_k]
# the vector-Jacobian products are
#     spmm:   dX = spmm_t(dY, v),   dv = sddmm(dY, X)
#     spmm_t: dD = spmm(dG, v),     dv = sddmm(D, dG)
#     sddmm:  dD = spmm(X, dh),     dX = spmm_t(D, dh)
# so each Function's backward is made of the other two and can be differentiated again, to any
# order, with nothing of the dense weight's size.
def _bilinear_function(name: str, doc: str, op, vjp, fold: bool):
    """A torch.autograd.Function `name` for op(a, b, topo), bilinear in the tensors a and b: its
    backward is vjp(a, b, g, topo, need_a, need_b) -> (grad a, grad b), made of the three
    Functions (so differentiable in turn); its jvp is op(da, b) + op(a, db); its vmap rule is
    `_vmap_rule` (fold: rows of a independent, see there)."""
    def forward(a, b, topo):
        return op(a, b, topo)

    def setup_context(ctx, inputs, output):
        a, b, topo = inputs
        _keep_topology(ctx, topo)
        ctx.save_for_backward(a, b)
        if _forward_mode():
            ctx.save_for_forward(a, b)

    def backward(ctx, g):
        a, b = ctx.saved_tensors
        _check_topology(ctx)
        return vjp(a, b, g.contiguous(), ctx.topo, ctx.needs_input_grad[0], ctx.needs_input_grad[1]) + (None,)

    def jvp(ctx, da, db, _):
        a, b = ctx.saved_tensors
        return _tangent(cls, a, b, da, db, ctx.topo)

    def vmap(info, in_dims, a, b, topo):
        return _vmap_rule(cls.apply, info, in_dims, (a, b), topo, fold=fold)

    body = {"__doc__": doc, "__module__": __name__, "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context), "backward": staticmethod(backward),
            "jvp": staticmethod(jvp), "vmap": staticmethod(vmap)}
    cls = types.new_class(name, (torch.autograd.Function,), {}, lambda ns: ns.update(body))
    return cls


def _spmm_vjp(x, values, g, topo, need_x, need_v):
    return (_SpmmT.apply(g, values, topo) if need_x else None,
            _Sddmm.apply(g, x, topo) if need_v else None)


def _spmm_t_vjp(dy, values, g, topo, need_dy, need_v):
    return (_Spmm.apply(g, values, topo) if need_dy else None,
            _Sddmm.apply(dy, g, topo) if need_v else None)


def _sddmm_vjp(dy, x, h, topo, need_dy, need_x):
    return (_Spmm.apply(x, h, topo) if need_dy else None,
            _SpmmT.apply(dy, h, topo) if need_x else None)


_Spmm = _bilinear_function("_Spmm", "spmm(x, values) without bias, differentiable to any order.",
                           lambda x, values, topo: backend.spmm(x, topo, values), _spmm_vjp, fold=True)
_SpmmT = _bilinear_function("_SpmmT", "spmm_t(dy, values) = dY W, differentiable to any order.",
                            lambda dy, values, topo: backend.spmm_t(dy, topo, values), _spmm_t_vjp, fold=True)
_Sddmm = _bilinear_function("_Sddmm", "sddmm(dy, x): h_k = sum_b dY[b, r_k] X[b, c_k], differentiable to any order.",
                            lambda dy, x, topo: backend.sddmm(dy, x, topo), _sddmm_vjp, fold=False)


def _tangent(f, a, b, da, db, topo, dbias=None):
    """Forward-mode derivative of the op f, bilinear in (a, b): f(da, b) + f(a, db) (+ dbias,
    the bias's tangent broadcast over the rows); None when every tangent is None."""
    out = None
    if da is not None:
        out = f.apply(da.contiguous(), b, topo)
    if db is not None:
        t = f.apply(a, db.contiguous(), topo)
        out = t if out is None else out + t
    if dbias is not None:
        out = dbias.expand(a.shape[0], dbias.shape[0]) if out is None else out + dbias
    return out


def _forward_mode() -> bool:
    """Whether forward-mode AD may ask for a jvp (inside `torch.autograd.forward_ad.dual_level`,
    which torch.func.jvp / jacfwd / hessian enter): only then are inputs saved for it, since
    `save_for_forward` costs host time on every call."""
    return forward_ad._current_level >= 0


def _in_functorch() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) is running: its tensors are wrappers
    the backend's kernels cannot read, so the op goes through the Functions, whose `vmap` and
    `jvp` rules unwrap them. One call (~0.1 us), made on every forward."""
    return _current_level() is not None


def _vmap_rule(apply, info, in_dims, tensors, topo, fold: bool):
    """torch.func.vmap of an op `apply(*tensors, topo)` whose first tensor is a (B, n) operand.
    With `fold` (spmm, spmm_t: rows independent) and only the first tensor batched, the vmapped
    dimension joins the rows: one call on (V * B, n). Otherwise (a batched weight or bias, or the
    SDDMM, whose sum runs over each sample's own rows) one call per sample, stacked."""
    if fold and all(d is None for d in in_dims[1:]):
        a, d = tensors[0], in_dims[0]
        if d is None:
            return apply(*tensors, topo), None
        a = a.movedim(d, 0)
        v, b = a.shape[0], a.shape[1]
        y = apply(a.reshape(v * b, a.shape[2]).contiguous(), *tensors[1:], topo)
        return y.reshape(v, b, y.shape[-1]), 0
    if info.batch_size == 0:  # the shape of one sample's result, from zeros
        args = [t if (t is None or d is None) else t.new_zeros(t.shape[:d] + t.shape[d + 1:])
                for t, d in zip(tensors, in_dims)]
        y = apply(*args, topo)
        return y.new_empty((0,) + tuple(y.shape)), 0
    outs = []
    for i in range(info.batch_size):
        args = [t if (t is None or d is None) else t.select(d, i).contiguous() for t, d in zip(tensors, in_dims)]
        outs.append(apply(*args, topo))
    return torch.stack(outs), 0


def _differentiable_gradients(dy, x, values, topo, need_dx: bool, need_dv: bool, need_db: bool):
    """(dX, dv, db) as `gradients` returns them, recorded by autograd (create_graph=True)."""
    dx = _SpmmT.apply(dy, values, topo) if need_dx else None
    dv = _Sddmm.apply(dy, x, topo) if need_dv else None
    db = dy.sum(0) if need_db else None
    return dx, dv, db


# Where the GPU backend fuses the backward (9 <= B <= 32), a CUDA-graph capture can still take dX
# and the SDDMM as two branches of the graph (below) when CAPTURED_TWO_BRANCHES is on; eager calls
# keep the fused launch (one launch: less host time in a host-bound step). The separate ops' launch
# plans cannot be built under capture, so with it on, the first fused eager backward of a topology,
# batch and dtypes also runs the two separate ops once (their results unused) to build them, and a
# capture takes the two branches only where that happened. Measured on an H100 (`e54deb9`: the
# captured training step of a 4096 x 4096 layer at 90% with snack.optim.Adam, graph us, two rounds
# each): B = 32 fused 81.4 / 84.5, two branches 74.6 / 74.4; B = 16 77.4 / 81.0 against 74.4 /
# 74.9 (gpu/PERFORMANCE.md, "The fused backward"); at `288030e`, with the plans built by the eager
# steps: B = 32 81.7 -> 74.3, B = 16 78.4 -> 74.5. False: the fused launch under capture too.
CAPTURED_TWO_BRANCHES = True
REBUILD.setdefault("backward_branches", None)  # a flag per (batch, dtypes): independent of the pattern


def _capture_state(dy) -> Optional[bool]:
    """None for a tensor off the GPU, else whether the current CUDA stream is capturing."""
    if not dy.is_cuda:
        return None
    return torch.cuda.is_current_stream_capturing()


def _branches_key(dy, x, values, need_db) -> tuple:
    return ("backward_branches", dy.shape[0], dy.dtype, x.dtype, values.dtype, bool(need_db))


def gradients(dy, x, values, topo, need_dx: bool, need_dv: bool, need_db: bool):
    """(dX, dv, db) of Y = X W^T + b for dy (B, out) contiguous, None where not needed: one
    fused launch where the backend has one (under CUDA-graph capture, with CAPTURED_TWO_BRANCHES,
    the two branches instead where their plans were built), else spmm_t and the SDDMM (two
    branches of the graph under CUDA-graph capture). x may be None when dv is not needed, values
    when dX is not."""
    dx = dv = db = None
    if need_dx and need_dv:
        capturing = _capture_state(dy)
        if CAPTURED_TWO_BRANCHES and capturing and _branches_key(dy, x, values, need_db) in topo.cache:
            return _backward_two_branches(dy, x, values, topo, need_db)
        fused = backend.backward(dy, x, topo, values, need_db)
        if fused is not None:
            if CAPTURED_TWO_BRANCHES and capturing is False:
                _build_branches(dy, x, values, topo, need_db)
            return fused
        if capturing:
            return _backward_two_branches(dy, x, values, topo, need_db)
    if need_dx:
        dx = backend.spmm_t(dy, topo, values)
    if need_dv:
        dv, db = _values_grad(dy, x, topo, need_db)
    elif need_db:
        db = _bias_grad(dy)
    return dx, dv, db


def _build_branches(dy, x, values, topo, need_db) -> None:
    """Once per topology, batch and dtypes: the two separate ops of the backward run eagerly (their
    results dropped), so that their launch plans exist when a CUDA graph is captured."""
    key = _branches_key(dy, x, values, need_db)
    if key not in topo.cache:
        backend.spmm_t(dy, topo, values)
        _values_grad(dy, x, topo, need_db)
        topo.cache[key] = True


def _values_grad(dy, x, topo, need_db):
    """(dv, db): the SDDMM, with the bias gradient from the same launch when it is wanted
    (else db is None)."""
    if need_db:
        return backend.sddmm(dy, x, topo, bias_grad=True)
    return backend.sddmm(dy, x, topo), None


# Under CUDA-graph capture the backward's two independent ops become two branches of the graph:
# the SDDMM (dv, db) on a side stream while dX runs on the capturing stream, so the kernels' tails
# overlap (H200, 4096 x 4096, 90%, B = 32, captured training step with snack.optim.Adam: 89.4 ->
# 86.0 us per replay, the same values after 8 steps). Eager calls keep one stream: there the
# stream switches would add host time to a host-bound step. One side stream per capturing stream:
# a side stream joined into one capture stays in it until that capture ends, so two captures open
# at once (two threads, each on its own stream) must not share one, and no side stream may be
# another capture's own stream: the side streams come from `gpu.launch.private_stream`, torch's
# high-priority pool, distinct from every default-priority stream (where capture streams come
# from), and from each other for up to 32 capturing streams. (Drawn from the default-priority
# pool, which torch.cuda.Stream() hands out in turn, a side stream cached for one capture stream
# could be the very stream a second thread captures on; the likely cause of that thread's
# capture failing on the H200 at 4019434, see the README's test table.)
_SIDE = {}


def _backward_two_branches(dy, x, values, topo, need_db):
    cur = torch.cuda.current_stream(dy.device)
    key = (dy.device, cur.cuda_stream)
    side = _SIDE.get(key)
    if side is None:
        from snack.gpu.launch import private_stream
        side = _SIDE[key] = private_stream(dy.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):  # (x and dy are only read there, before the join below)
        dv, db = _values_grad(dy, x, topo, need_db)
    dx = backend.spmm_t(dy, topo, values)
    cur.wait_stream(side)
    dv.record_stream(cur)
    if db is not None:
        db.record_stream(cur)
    return dx, dv, db


# A float32 vector of ones per CUDA device for the bias gradient, grown by doubling and never
# freed: a captured CUDA graph may read any of them.
_ONES = {}
_ONES_KEPT = []


def _bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """sum_b dY (B, out) -> (out,). For float32 CUDA tensors one GEMV with a cached vector of
    ones (H200, B = 32, out = 4096, graph replay: 1.8 us against 3.4 us for dy.sum(0)); else
    dy.sum(0), which accumulates fp16/bf16 in float32."""
    if not (dy.is_cuda and dy.dtype == torch.float32):
        return dy.sum(0)
    n = dy.shape[0]
    ones = _ONES.get(dy.device)
    if ones is None or ones.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            # made now, the vector would come from the graph's pool and be filled only when the
            # graph replays: an eager call before that would read garbage from the cache
            return dy.sum(0)
        size = max(n, 64 if ones is None else 2 * ones.numel())
        ones = _ONES[dy.device] = backend._build_persistent(dy, torch.ones, size, dtype=torch.float32,
                                                            device=dy.device)
        _ONES_KEPT.append(ones)
    return torch.mv(dy.t(), ones[:n])


def _check_tensor(name: str, t, dims: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {t.dtype}")
    if t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}; convert it with .to_dense()")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")


def _autocast_inputs(x, values, bias, dev: str, compiling: bool):
    """Casts like autocast does for nn.Linear (autocast is on for device type `dev`); returns
    (x, values, bias, dtype to cast the result to or None). On the GPU backend float32 values and
    bias stay as they are (its kernels read them next to half activations: no cast per call, and
    the products use the unrounded weights); the result and the gradients of x, values and bias
    are as with cast weights (half-precision outputs, float32 gradients for float32 parameters)."""
    target = torch.get_autocast_dtype(dev)
    compute = target if dev == "cuda" else torch.float32

    def cast(t):
        if t is None or t.dtype == compute:
            return t
        return t.to(compute)
    if x.dtype == torch.float64 or values.dtype == torch.float64:
        return x, values, bias, None  # autocast leaves float64 alone
    x = cast(x)
    if (dev == "cuda" and values.dtype == torch.float32 and x.dtype != torch.float32
            and (bias is None or bias.dtype == torch.float32) and not compiling
            and getattr(backend._backend(x), "mixed_values", False)
            and not _forward_mode() and not _in_functorch()):
        return x, values, bias, None
    return x, cast(values), cast(bias), (target if dev == "cpu" else None)


# Function.apply binds the arguments to forward's signature (inspect.signature, ~5-20 us of host
# time per call) when setup_context is separate, then calls the C++ apply unless a torch.func
# transform is active. The training forward calls the C++ apply itself outside torch.func (all
# arguments are given positionally, so there is nothing to bind).
_apply_function = super(torch.autograd.Function, SparseLinearFunction).apply


def _apply(x2, values, bias, topo):
    """The Function when a gradient is wanted (reverse or forward mode) or a torch.func transform
    runs; otherwise its forward without autograd's cost."""
    if torch.is_grad_enabled() and (x2.requires_grad or values.requires_grad
                                    or (bias is not None and bias.requires_grad)) \
            or forward_ad._current_level >= 0 or _current_level() is not None:  # _forward_mode, _in_functorch
        if _current_level() is None:
            return _apply_function(x2, values, bias, topo)
        return SparseLinearFunction.apply(x2, values, bias, topo)
    return backend.spmm(x2, topo, values, bias=bias)


def settle_autograd(device=None) -> None:
    """Collects Python's reference cycles, then returns once autograd's worker thread for each
    CUDA device given has freed the graphs of earlier backward passes that nothing else
    references. Call it between eager steps and a
    `torch.cuda.graph` capture of a training step (before the side-stream warm-up and again
    before the capture).

    device: a CUDA device (torch.device, "cuda:1", an index), an nn.Module or an iterable of
    tensors (the CUDA devices of its parameters / of the tensors), or None for the current CUDA
    device. Autograd has one worker thread per device: give the model's devices.

    Why: a finished graph stays alive as long as something references it, and for a moment or
    for long after `backward()` returns something can. (1) Reference cycles: compiling a Numba
    CUDA kernel leaves garbage cycles that contain frames of its compiler (hundreds of frames for
    a few kernels), and through `f_back` they keep alive the frames of the forward or backward
    that triggered the compile, with every local that call assigned, the output and its graph
    included, until Python's cyclic collector runs, which depends on allocation counts. On an
    H100 the capture of a step failed every time in one order of the GPU tests (the eager step
    before it compiled a kernel variant) and passed with a `gc.collect()` first. (2) Autograd
    frees a finished graph on its device thread, and the node of a Python autograd Function
    (SparseLinearFunction's) needs the GIL to be freed. For a moment after
    `backward()` returns, the AccumulateGrad nodes of that pass's leaves (weights, inputs) can
    still be alive, and the next forward then reuses them together with the stream they were
    created on. A capture that reuses one created on the default stream fails: with
    cudaErrorStreamCaptureImplicit ("operation would make the legacy stream depend on a
    capturing blocking stream") in torch 2.11; torch 2.13 raises a RuntimeError naming the
    stale reference to the default stream, and can redirect such nodes to the capturing stream
    itself (`torch.autograd.graph.set_override_stale_capture_stream(True)`). Whether it happens
    depends on thread timing (H200: the second of a few eager step + warm-up + capture rounds
    failed without this call; none of 40 failed with it). This runs a
    one-element backward on each device: its worker reaches it only after that release, while
    this thread waits without the GIL.

    It cannot free what something else still references: a kept loss or output of an eager
    step, `retain_graph=True`, or a wrapper holding the AccumulateGrad nodes (DDP's reducer).
    There, run the eager steps (and build the wrapper) under the side stream that warms the
    capture up (`with torch.cuda.stream(s)`), so that no node is made on the default stream."""
    if not torch.cuda.is_available():
        _cuda_devices(device, resolve=False)  # (the argument checked all the same)
        gc.collect()
        return
    devices = _cuda_devices(device)
    for dev in devices:
        with torch.cuda.device(dev):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("settle_autograd must be called before the capture, not during it")
    gc.collect()
    for dev in devices:
        with torch.cuda.device(dev):
            with torch.inference_mode(False), torch.enable_grad():
                t = torch.zeros(1, device=dev, requires_grad=True)
                (t * 1).sum().backward()


def _cuda_devices(spec, resolve: bool = True) -> list:
    """The CUDA devices named by settle_autograd's `device` argument, in order, once each (with
    `resolve`, "cuda" without an index is the current device)."""
    if spec is None:
        return [torch.device("cuda", torch.cuda.current_device())] if resolve else []
    if isinstance(spec, torch.nn.Module):
        spec = list(spec.parameters()) + list(spec.buffers())
    if isinstance(spec, torch.Tensor) or not hasattr(spec, "__iter__") or isinstance(spec, str):
        spec = [spec]
    devices = []
    for item in spec:
        if isinstance(item, torch.Tensor):
            d = item.device
            if d.type != "cuda":
                continue  # a module's CPU tensors have no CUDA worker to wait for
        elif isinstance(item, bool) or not isinstance(item, (int, str, torch.device)):
            raise TypeError("device must be a CUDA device, an index, an nn.Module or tensors, "
                            f"got {type(item).__name__}")
        else:
            d = torch.device("cuda", item) if isinstance(item, int) else torch.device(item)
            if d.type != "cuda":
                raise ValueError(f"device must name CUDA devices, got {d}")
        if d.index is None and resolve:
            d = torch.device("cuda", torch.cuda.current_device())
        if d not in devices:
            devices.append(d)
    return devices


def _check_plain_indices(indices: torch.Tensor) -> None:
    """NotImplementedError for indices that a torch.func transform has wrapped (their data
    cannot be read); called when the topology could not be built."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(indices):
        return
    if torch._C._functorch.is_batchedtensor(indices):
        raise NotImplementedError(
            "indices is batched by torch.func.vmap (e.g. the stacked buffers of several SparseLinear "
            "from torch.func.stack_module_state): models with different sparsity patterns cannot be "
            "vmapped together. Models sharing one pattern can: pass the indices unbatched (in_dims "
            "None for the buffers, values batched); else call each model in turn")
    raise NotImplementedError("indices is wrapped by a torch.func transform; pass it from outside "
                              "the transform (it is an integer buffer, not differentiable)")


def sparse_linear(x: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor] = None, *, in_features: Optional[int] = None) -> torch.Tensor:
    """y = x @ W.T + bias for a sparse W of shape (out_features, in_features) given as COO.

    Args:
        x: (..., in_features) floating tensor; in_features is taken from x.shape[-1] (or checked
            against the keyword `in_features` when given).
        indices: (2, nnz) int32 (or int64) on x's device; [0] output (row) index in
            [0, out_features), [1] input (column) index in [0, in_features); canonical row-major
            (sorted by row, then column), each coordinate once. Unsorted indices raise ValueError:
            sort once with `indices, values, _ = snack.core.canonicalize(indices, shape, values)`.
            Checked only when its topology is (re)built, i.e. when `indices` changes.
        values: (nnz,) of x's dtype and device, entry k the weight at (indices[0, k], indices[1, k]).
        out_features: number of outputs.
        bias: (out_features,) of x's dtype and device, or None.
    Returns (..., out_features) of x's dtype. Differentiable in x, values and bias, to any order
    in eager mode (gradient penalties, Hessian-vector products); compiled models: first order.
    Where the pattern holds every connection (nnz = out_features * in_features) the product runs
    as `F.linear` on `values` viewed as the (out, in) matrix it then is (eager mode).
    """
    compiling = torch.compiler.is_compiling()
    if not compiling and _is_tracing():
        raise RuntimeError("torch.jit.trace cannot record sparse_linear (SparseLinear): its kernels run outside "
                           "the tracer, which would record a graph without them; use torch.compile or "
                           "torch.export, or snack.densify(model) for a dense copy of the model")
    _check_tensor("x", x)
    _check_tensor("values", values, dims=1)
    if type(out_features) is not int:  # (the exact-type test first: an ABC isinstance costs ~0.5 us)
        if isinstance(out_features, bool) or not isinstance(out_features, Integral):
            raise TypeError(f"out_features must be an int, got {type(out_features).__name__}")
        out_features = int(out_features)  # numpy integers
    if not 0 <= out_features <= _MAX_DIM:
        raise ValueError(f"out_features must be in [0, 2**31 - 1] (int32 indices), got {out_features}")
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (..., in_features), got a scalar")
    in_f = x.shape[-1]
    if in_features is not None and type(in_features) is not int and (
            isinstance(in_features, bool) or not isinstance(in_features, Integral)):
        raise TypeError(f"in_features must be an int or None, got {type(in_features).__name__}")
    if in_features is not None and in_f != in_features:
        raise ValueError(f"x must have shape (..., {in_features}) (last dim = in_features), "
                         f"got {tuple(x.shape)}")
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.layout is not torch.strided:
        raise TypeError(f"indices must be a dense (strided) tensor, got layout {indices.layout}")
    if indices.dim() != 2 or indices.shape[0] != 2:
        raise ValueError(f"indices must have shape (2, nnz), got {tuple(indices.shape)}")
    if values.shape[0] != indices.shape[1]:
        raise ValueError(f"values must have shape ({indices.shape[1]},) to match indices "
                         f"(2, {indices.shape[1]}), got {tuple(values.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, dims=1)
        if bias.shape[0] != out_features:
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
    dev = x.device
    for name, t in (("values", values), ("indices", indices), ("bias", bias)):
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but x is on {dev}; move them to one device")

    dev_type = dev.type
    autocast = dev_type in ("cuda", "cpu") and torch.is_autocast_enabled(dev_type)
    result_dtype = None
    if autocast:
        x, values, bias, result_dtype = _autocast_inputs(x, values, bias, dev_type, compiling)
    if values.dtype != x.dtype and not autocast:  # (under autocast: float32 values on the GPU backend)
        raise TypeError(f"x and values must have the same dtype, got x {x.dtype} and values {values.dtype}")
    if bias is not None and bias.dtype != values.dtype:
        raise TypeError(f"bias must have the dtype of x and values, {values.dtype}, got {bias.dtype}")

    if dev_type == "meta":  # shapes only (a model built on the meta device): the op's fake
        compiling = True      # implementation, as in a traced model
    try:
        topo = None if compiling else backend.get_topology(indices, (out_features, in_f))
    except RuntimeError:
        _check_plain_indices(indices)
        raise
    if topo is not None and topo.nnz == out_features * in_f and topo.nnz:
        # Every connection present (a small layer that ERK makes dense, a mask of all ones): the
        # validated topology is then every coordinate once in row-major order, so `values` is W
        # itself, laid out as a dense (out, in) matrix. A BLAS product on that view gives the same
        # numbers (within rounding) several times faster than the sparse kernels, and allocates
        # nothing more: its weight gradient has nnz entries, as the value gradient would.
        if result_dtype is not None:  # CPU autocast: float32 math rounded once, as the kernels do
            with torch.autocast(dev_type, enabled=False):
                return torch.nn.functional.linear(x, values.reshape(out_features, in_f), bias).to(result_dtype)
        return torch.nn.functional.linear(x, values.reshape(out_features, in_f), bias)
    flat = x.dim() != 2
    x2 = x.reshape(math.prod(x.shape[:-1]), in_f) if flat else x
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if compiling:  # traced: the custom op (the topology is looked up when the op runs)
        def apply(x2, values, bias, _):
            return library.sparse_linear_op(x2, indices, values, bias, out_features)
    else:
        apply = _apply
    if autocast and compiling:
        with torch.autocast(dev_type, enabled=False):
            y = apply(x2, values, bias, topo)
    elif autocast:  # the same switch as a torch.autocast(enabled=False) region, without its ~4-10 us
        torch.set_autocast_enabled(dev_type, False)
        try:
            y = apply(x2, values, bias, topo)
        finally:
            torch.set_autocast_enabled(dev_type, True)
    else:
        y = apply(x2, values, bias, topo)
    if flat:
        y = y.reshape(*x.shape[:-1], out_features)
    return y.to(result_dtype) if result_dtype is not None else y
