"""Tests of snack.functional.sparse_linear and the backend dispatch / topology cache.

Oracle: F.linear with the dense (out, in) matrix of the COO weight, in float64, and its dense
weight gradient gathered at the pattern. Shapes include odd sizes, nnz = 0, empty rows and
columns, 1 x 1, leading dims and non-contiguous inputs.
"""
import pytest
import torch
import torch.nn.functional as F

import snack
import snack.functional
from snack.core import Topology, canonicalize, uniform_indices
from snack.layers import backend
from snack.layers.functional import sparse_linear

from conftest import MaxNumel, assert_close_dtype, tolerance

F64_ATOL = tolerance(torch.float64)[1]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _coo(out_f, in_f, *, density=None, nnz=None, seed=0, dtype=torch.float64, empty_rows=False,
         empty_cols=False):
    """Canonical int32 indices (2, nnz) and values (nnz,), optionally leaving rows/cols empty."""
    g = _gen(seed)
    idx = uniform_indices((out_f, in_f), density=density, nnz=nnz, generator=g).long()
    keep = torch.ones(idx.shape[1], dtype=torch.bool)
    if empty_rows:
        keep &= idx[0] % 2 == 0
    if empty_cols:
        keep &= idx[1] % 3 != 1
    idx = idx[:, keep].to(torch.int32).contiguous()
    vals = torch.randn(idx.shape[1], generator=g, dtype=torch.float64).to(dtype)
    return idx, vals


def _dense(idx, vals, out_f, in_f):
    w = torch.zeros(out_f, in_f, dtype=vals.dtype)
    w[idx[0].long(), idx[1].long()] = vals
    return w


# (lead shape, in, out, density, empty_rows, empty_cols)
CASES = [
    ((7,), 96, 40, 0.3, False, False),
    ((7,), 333, 40, 0.05, False, False),
    ((3,), 40, 96, 0.2, True, True),
    ((1,), 1, 1, 1.0, False, False),
    ((1,), 1, 1, 0.0, False, False),          # nnz = 0
    ((5,), 17, 9, 0.0, False, False),         # nnz = 0
    ((2, 3), 13, 11, 0.4, False, False),      # leading dims
    ((), 13, 11, 0.4, False, False),          # 1-D input
    ((0,), 13, 11, 0.4, False, False),        # empty batch
    ((4,), 8, 6, 1.0, False, False),          # fully dense pattern
]


def _check_matches_dense(idx, vals, lead, in_f, out_f, with_bias, seed, before=None):
    """sparse_linear's output and gradients (x, values, bias) on fresh float64 inputs against F.linear
    with the dense matrix of (idx, vals); `before()` runs just before the sparse call."""
    g = _gen(seed)
    x = torch.randn(*lead, in_f, generator=g, dtype=torch.float64)
    b = torch.randn(out_f, generator=g, dtype=torch.float64) if with_bias else None
    dy = torch.randn(*lead, out_f, generator=g, dtype=torch.float64)

    xs, vs = x.clone().requires_grad_(), vals.clone().requires_grad_()
    bs = b.clone().requires_grad_() if with_bias else None
    if before is not None:
        before()
    y = sparse_linear(xs, idx, vs, out_f, bs)
    y.backward(dy)

    w = _dense(idx, vals, out_f, in_f).requires_grad_()
    xd = x.clone().requires_grad_()
    bd = b.clone().requires_grad_() if with_bias else None
    yd = F.linear(xd, w, bd)
    yd.backward(dy)

    assert y.shape == yd.shape == (*lead, out_f)
    torch.testing.assert_close(y, yd, atol=F64_ATOL, rtol=0)
    torch.testing.assert_close(xs.grad, xd.grad, atol=F64_ATOL, rtol=0)
    # value gradient == dense weight gradient masked to the pattern
    torch.testing.assert_close(vs.grad, w.grad[idx[0].long(), idx[1].long()], atol=F64_ATOL, rtol=0)
    if with_bias:
        torch.testing.assert_close(bs.grad, bd.grad, atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("lead,in_f,out_f,density,er,ec", CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_backward_match_dense(lead, in_f, out_f, density, er, ec, with_bias):
    idx, vals = _coo(out_f, in_f, density=density, seed=in_f * 31 + out_f, empty_rows=er, empty_cols=ec)
    _check_matches_dense(idx, vals, lead, in_f, out_f, with_bias, seed=7)


def test_matches_scipy():
    sp = pytest.importorskip("scipy.sparse")
    idx, vals = _coo(40, 96, density=0.1, seed=3)
    x = torch.randn(7, 96, generator=_gen(1), dtype=torch.float64)
    m = sp.coo_array((vals.numpy(), (idx[0].numpy(), idx[1].numpy())), shape=(40, 96)).tocsr()
    ref = (m @ x.numpy().T).T
    y = sparse_linear(x, idx, vals, 40)
    torch.testing.assert_close(y, torch.from_numpy(ref), atol=F64_ATOL, rtol=0)


@pytest.mark.parametrize("lead,in_f,out_f,density", [((3,), 11, 7, 0.4), ((2, 3), 5, 4, 0.5),
                                                      ((2,), 6, 5, 0.0), ((3,), 9, 6, 0.6)])
def test_gradcheck(lead, in_f, out_f, density):
    empty = density == 0.6
    idx, vals = _coo(out_f, in_f, density=density, seed=5, empty_rows=empty)
    g = _gen(11)
    x = torch.randn(*lead, in_f, generator=g, dtype=torch.float64, requires_grad=True)
    v = vals.clone().requires_grad_()
    b = torch.randn(out_f, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v, b: sparse_linear(x, idx, v, out_f, b), (x, v, b))


def test_float32_close_to_float64():
    idx, vals = _coo(40, 333, density=0.1, seed=9)
    x = torch.randn(7, 333, generator=_gen(2), dtype=torch.float64)
    y64 = sparse_linear(x, idx, vals, 40)
    y32 = sparse_linear(x.float(), idx, vals.float(), 40)
    assert y32.dtype == torch.float32
    # error at most a small multiple of torch's own float32 error on the dense product
    dense_err = (F.linear(x.float(), _dense(idx, vals, 40, 333).float()).double() - y64).abs().max()
    assert (y32.double() - y64).abs().max() <= 2 * dense_err + 1e-5


def test_non_contiguous_input_and_int64_indices():
    idx, vals = _coo(12, 10, density=0.3, seed=4)
    xt = torch.randn(10, 6, generator=_gen(3), dtype=torch.float64).t()   # (6, 10), not contiguous
    assert not xt.is_contiguous()
    y = sparse_linear(xt, idx.long(), vals, 12)
    torch.testing.assert_close(y, xt @ _dense(idx, vals, 12, 10).t(), atol=F64_ATOL, rtol=0)


def test_needs_input_grad_skips_unneeded_ops(monkeypatch):
    idx, vals = _coo(9, 8, density=0.5, seed=1)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    called = []
    real_sddmm, real_spmm_t = backend.sddmm, backend.spmm_t
    monkeypatch.setattr(backend, "sddmm", lambda *a, **k: called.append("sddmm") or real_sddmm(*a, **k))
    monkeypatch.setattr(backend, "spmm_t", lambda *a, **k: called.append("spmm_t") or real_spmm_t(*a, **k))
    sparse_linear(x, idx, vals, 9).sum().backward()          # values frozen: no sddmm
    assert called == ["spmm_t"]
    called.clear()
    v = vals.clone().requires_grad_()
    sparse_linear(x.detach(), idx, v, 9).sum().backward()   # x frozen: no spmm_t
    assert called == ["sddmm"]
    assert x.grad is not None and v.grad is not None


@pytest.mark.parametrize("with_bias", [False, True])
def test_backward_takes_a_backends_fused_backward(monkeypatch, with_bias):
    # a backend that fuses the backward (the GPU kernels from B = 9 to 32) gets one
    # spmm_t_sddmm call instead of spmm_t and sddmm, and its results are the gradients
    idx, vals = _coo(9, 8, density=0.5, seed=3)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    v = vals.clone().requires_grad_()
    b = torch.randn(9, dtype=torch.float64, requires_grad=True) if with_bias else None
    cpu = backend._load("cpu")
    calls = []

    def fused(dy, x_, topo, values, bias_grad=False):
        calls.append((tuple(dy.shape), bias_grad))
        res = (cpu.spmm_t(dy, topo, values), cpu.sddmm(dy, x_, topo))
        return res + (dy.sum(0),) if bias_grad else res

    monkeypatch.setitem(backend._loaded, "cpu", backend.SimpleNamespace(
        **{**vars(cpu), "fuses_backward": lambda batch, topo: batch == 4, "spmm_t_sddmm": fused}))
    monkeypatch.setattr(backend, "sddmm", lambda *a, **k: pytest.fail("sddmm called"))
    monkeypatch.setattr(backend, "spmm_t", lambda *a, **k: pytest.fail("spmm_t called"))
    dy = torch.randn(4, 9, dtype=torch.float64)
    sparse_linear(x, idx, v, 9, b).backward(dy)
    assert calls == [((4, 9), with_bias)]
    w = _dense(idx, vals, 9, 8)
    torch.testing.assert_close(x.grad, dy @ w)
    torch.testing.assert_close(v.grad, (dy.T @ x.detach())[idx[0].long(), idx[1].long()])
    if with_bias:
        torch.testing.assert_close(b.grad, dy.sum(0))


def test_captured_backward_takes_two_branches_once_their_plans_are_built(monkeypatch):
    # CAPTURED_TWO_BRANCHES: the first fused eager backward of a topology and batch also runs
    # spmm_t and the SDDMM once (building their launch plans: they cannot be built under capture);
    # a capture then takes the two branches where that happened, else the fused launch. The
    # capture is simulated (functional._capture_state) and so is the backend's fusion
    from snack.layers import functional as Fn
    idx, vals = _coo(9, 8, density=0.5, seed=4)
    cpu = backend._load("cpu")
    calls = []

    def fused(dy, x_, topo, values, bias_grad=False):
        calls.append("fused")
        res = (cpu.spmm_t(dy, topo, values), cpu.sddmm(dy, x_, topo))
        return res + (dy.sum(0),) if bias_grad else res

    def counted(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapped

    def branches(dy, x_, values, topo, need_db):
        calls.append("branches")
        return (cpu.spmm_t(dy, topo, values), cpu.sddmm(dy, x_, topo), dy.sum(0) if need_db else None)

    monkeypatch.setitem(backend._loaded, "cpu", backend.SimpleNamespace(
        **{**vars(cpu), "fuses_backward": lambda batch, topo: batch == 4, "spmm_t_sddmm": fused}))
    monkeypatch.setattr(backend, "spmm_t", counted("spmm_t", backend.spmm_t))
    monkeypatch.setattr(backend, "sddmm", counted("sddmm", backend.sddmm))
    monkeypatch.setattr(Fn, "_backward_two_branches", branches)
    monkeypatch.setattr(Fn, "CAPTURED_TWO_BRANCHES", True)
    state = {"capturing": False}
    monkeypatch.setattr(Fn, "_capture_state", lambda dy: state["capturing"])
    w = _dense(idx, vals, 9, 8)
    dy = torch.randn(4, 9, dtype=torch.float64)

    def step(indices, values):
        x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        v = values.clone().requires_grad_()
        b = torch.zeros(9, dtype=torch.float64, requires_grad=True)
        calls.clear()
        sparse_linear(x, indices, v, 9, b).backward(dy)
        torch.testing.assert_close(x.grad, dy @ w)
        torch.testing.assert_close(v.grad, (dy.T @ x.detach())[idx[0].long(), idx[1].long()])
        torch.testing.assert_close(b.grad, dy.sum(0))
        return list(calls)

    assert step(idx, vals) == ["fused", "spmm_t", "sddmm"]  # eager: the plans built once
    topo = backend.get_topology(idx, (9, 8))
    assert [k for k in topo.cache if isinstance(k, tuple) and k[0] == "backward_branches"]
    assert step(idx, vals) == ["fused"]
    state["capturing"] = True
    assert step(idx, vals) == ["branches"]
    assert step(idx.clone(), vals) == ["fused"]  # another topology, no eager step before: fused
    # the flag is independent of the pattern: a topology refreshed in place keeps it
    from snack.core.coo import REBUILD
    assert REBUILD["backward_branches"] is None
    monkeypatch.setattr(Fn, "CAPTURED_TWO_BRANCHES", False)
    assert step(idx, vals) == ["fused"]
    state["capturing"] = False
    other = idx.clone()
    assert step(other, vals) == ["fused"]  # off: no plans built either


# ---- validation ---------------------------------------------------------------------------------
def test_unsorted_indices_raise_with_hint():
    idx, vals = _coo(6, 5, density=0.5, seed=2)
    perm = torch.randperm(idx.shape[1], generator=_gen(0))
    bad = idx[:, perm.flip(0)].contiguous()
    with pytest.raises(ValueError, match="canonicalize"):
        sparse_linear(torch.randn(2, 5, dtype=torch.float64), bad, vals, 6)
    # the hinted fix works
    fixed, fvals, _ = canonicalize(bad, (6, 5), vals[perm.flip(0)])
    y = sparse_linear(torch.ones(2, 5, dtype=torch.float64), fixed, fvals, 6)
    torch.testing.assert_close(y, torch.ones(2, 5, dtype=torch.float64) @ _dense(idx, vals, 6, 5).t())


def test_bad_inputs_raise():
    idx, vals = _coo(6, 5, density=0.5, seed=2)
    x = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="indices\\[1\\]"):           # x too narrow for the columns
        sparse_linear(torch.randn(3, 2, dtype=torch.float64), idx, vals, 6)
    with pytest.raises(ValueError, match="indices\\[0\\]"):           # out_features too small
        sparse_linear(x, idx, vals, 2)
    with pytest.raises(ValueError, match="in_features"):
        sparse_linear(x, idx, vals, 6, in_features=4)
    with pytest.raises(TypeError, match="in_features must be an int or None, got str"):
        sparse_linear(x, idx, vals, 6, in_features="a")
    with pytest.raises(TypeError, match="same dtype"):
        sparse_linear(x.float(), idx, vals, 6)
    with pytest.raises(ValueError, match="values must have shape"):
        sparse_linear(x, idx, vals[:-1], 6)
    with pytest.raises(ValueError, match="bias must have shape"):
        sparse_linear(x, idx, vals, 6, torch.zeros(5, dtype=torch.float64))
    with pytest.raises(TypeError, match="bias must have"):
        sparse_linear(x, idx, vals, 6, torch.zeros(6, dtype=torch.float32))
    with pytest.raises(ValueError, match="indices must have shape"):
        sparse_linear(x, idx[0], vals, 6)
    with pytest.raises(TypeError, match="floating"):
        sparse_linear(x.long(), idx, vals, 6)
    with pytest.raises(TypeError, match="integer dtype"):
        sparse_linear(x, idx.double(), vals, 6)
    with pytest.raises(ValueError, match="meta"):
        sparse_linear(x.to("meta"), idx, vals.to("meta"), 6)
    dup = torch.tensor([[0, 0, 1], [1, 1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="duplicated"):
        sparse_linear(x, dup, torch.ones(3, dtype=torch.float64), 6)
    neg = torch.tensor([[0, 1], [-1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="indices\\[1\\]"):
        sparse_linear(x, neg, torch.ones(2, dtype=torch.float64), 6)


# ---- topology cache ---------------------------------------------------------------------------------
def test_topology_cached_and_rebuilt_on_change(monkeypatch):
    idx, vals = _coo(10, 12, density=0.3, seed=8)
    builds = []
    real = backend._build_topology
    monkeypatch.setattr(backend, "_build_topology", lambda *a: builds.append(1) or real(*a))
    x = torch.randn(3, 12, dtype=torch.float64)
    t1 = backend.get_topology(idx, (10, 12))
    y1 = sparse_linear(x, idx, vals, 10)
    sparse_linear(x, idx, vals, 10)
    assert backend.get_topology(idx, (10, 12)) is t1 and len(builds) == 1
    # a different shape is a different topology
    backend.get_topology(idx, (10, 13))
    assert len(builds) == 2
    # an in-place change of the indices (as DST does) is seen, validated and used
    new_idx, new_vals = _coo(10, 12, nnz=idx.shape[1], seed=99)
    idx.copy_(new_idx)
    y2 = sparse_linear(x, idx, new_vals, 10)
    assert len(builds) == 3
    torch.testing.assert_close(y2, x @ _dense(new_idx, new_vals, 10, 12).t(), atol=F64_ATOL, rtol=0)
    assert not torch.allclose(y1, y2)
    # an in-place change that breaks the order is caught at the rebuild
    idx.copy_(idx.flip(1))
    with pytest.raises(ValueError, match="row-major"):
        sparse_linear(x, idx, new_vals, 10)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_topology_refreshed_in_place_when_indices_change(index_dtype):
    """An in-place change of the indices (same nnz) rebuilds the pattern into the old topology's
    own arrays (what a captured CUDA graph holds by address), the GPU ops' arrays included;
    launch plans are kept."""
    from snack.gpu import ops
    shape = (14, 23)
    idx, _ = _coo(*shape, density=0.2, seed=3)
    idx = idx.to(index_dtype)
    topo = backend.get_topology(idx, shape)

    def fill(t):  # every array the backends cache, a launch plan too
        _ = t.row_ptr, t.col_ptr, t.rows_by_col, t.cols_by_col, t.col_perm
        ops._seg(t, False, 3, 8), ops._seg(t, True, 2, 7)
        ops._perm32(t), ops._rows_by_col(t)
    fill(topo)
    plan = topo.cache[("spmm_plan", False, 4)] = object()
    arrays = {k: v for k, v in topo.cache.items() if isinstance(v, torch.Tensor)}
    assert arrays["rows_by_col_u16"].dtype == torch.uint16 and ("seg", True, 2, 7) in arrays
    ptrs = {k: v.data_ptr() for k, v in arrays.items()}
    before = {k: v.clone() for k, v in arrays.items()}
    idx_ptr = topo.indices.data_ptr()

    new_idx, _ = _coo(*shape, nnz=idx.shape[1], seed=4)
    idx.copy_(new_idx)
    assert backend.get_topology(idx, shape) is topo
    fresh = Topology(new_idx.to(torch.int32), shape)
    fill(fresh)
    assert topo.indices.data_ptr() == idx_ptr and torch.equal(topo.indices, new_idx.to(torch.int32))
    assert topo.cache[("spmm_plan", False, 4)] is plan
    changed = 0
    for k, v in arrays.items():
        assert topo.cache[k] is v and v.data_ptr() == ptrs[k], k
        assert torch.equal(v.to(torch.int64), fresh.cache[k].to(torch.int64)), k
        changed += not torch.equal(v.to(torch.int64), before[k].to(torch.int64))
    assert changed >= len(arrays) - 1
    # results follow the new pattern
    x = torch.randn(3, shape[1], dtype=torch.float64)
    vals = torch.randn(idx.shape[1], dtype=torch.float64)
    torch.testing.assert_close(sparse_linear(x, idx, vals, shape[0]),
                               x @ _dense(new_idx, vals, *shape).t(), atol=F64_ATOL, rtol=0)


def test_topology_not_refreshable_is_replaced():
    """A cache entry without a registered rebuild (here the CPU backend's numpy arrays): the old
    topology is left as it was and a new one takes the new pattern."""
    shape = (9, 11)
    idx, _ = _coo(*shape, density=0.3, seed=5)
    topo = backend.get_topology(idx, shape)
    _ = topo.row_ptr
    topo.cache["unknown_entry"] = [1, 2]
    old_ptr = topo.row_ptr.clone()
    new_idx, _ = _coo(*shape, nnz=idx.shape[1], seed=6)
    idx.copy_(new_idx)
    t2 = backend.get_topology(idx, shape)
    assert t2 is not topo and torch.equal(topo.row_ptr, old_ptr)
    assert torch.equal(t2.row_ptr, Topology(new_idx.to(torch.int32), shape).row_ptr)


def test_topology_cache_does_not_keep_indices_alive():
    import gc
    import weakref
    idx, _ = _coo(10, 12, density=0.3, seed=8)
    backend.get_topology(idx, (10, 12))
    ref = weakref.ref(idx)
    del idx
    gc.collect()
    assert ref() is None


def test_force_reference_backend_and_backend_name():
    idx, vals = _coo(20, 30, density=0.2, seed=6)
    x = torch.randn(5, 30, dtype=torch.float32, generator=_gen(0))
    y = sparse_linear(x, idx, vals.float(), 20)
    with backend.force_backend("reference"):
        assert backend.backend_name("cpu") == "reference"
        y_ref = sparse_linear(x, idx, vals.float(), 20)
    assert_close_dtype(y, y_ref)
    assert backend.backend_name("cpu") in ("cpu", "reference")
    with pytest.raises(ValueError):
        with backend.force_backend("fastest"):
            pass


# ---- autocast ---------------------------------------------------------------------------------------
def test_autocast_cpu_bf16():
    idx, vals = _coo(24, 40, density=0.25, seed=12, dtype=torch.float32)
    x = torch.randn(6, 40, generator=_gen(5))
    v = vals.clone().requires_grad_()
    b = torch.randn(24, generator=_gen(6), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sparse_linear(x, idx, v, 24, b)
        yd = F.linear(x, _dense(idx, vals, 24, 40), b)
    assert y.dtype == yd.dtype == torch.bfloat16
    ref = F.linear(x.double(), _dense(idx, vals, 24, 40).double(), b.double())
    assert_close_dtype(y, ref, torch.bfloat16)
    y.float().sum().backward()
    assert v.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    torch.testing.assert_close(v.grad, (torch.ones(6, 24).t() @ x)[idx[0].long(), idx[1].long()],
                               atol=1e-4, rtol=1e-4)


# ---- every connection present: F.linear on the values ------------------------------------------


def _no_sparse_ops(monkeypatch):
    """Makes the backend's ops and the sparse autograd Function fail if called."""
    from snack.layers import functional as fn

    def boom(*a, **k):
        raise AssertionError("a sparse op ran for a full pattern")
    for name in ("spmm", "spmm_t", "sddmm", "backward"):
        monkeypatch.setattr(backend, name, boom)
    monkeypatch.setattr(fn, "_apply", boom)


@pytest.mark.parametrize("lead,with_bias", [((5,), True), ((2, 3), False), ((), True)])
def test_full_pattern_runs_as_a_dense_product_of_the_values(monkeypatch, lead, with_bias):
    out_f, in_f = 7, 9
    idx, vals = _coo(out_f, in_f, density=1.0, seed=21)
    assert idx.shape[1] == out_f * in_f
    backend.get_topology(idx, (out_f, in_f))  # built before the ops are taken away
    _check_matches_dense(idx, vals, lead, in_f, out_f, with_bias, seed=22,
                         before=lambda: _no_sparse_ops(monkeypatch))


def test_full_pattern_gradcheck_and_layer_at_sparsity_zero(monkeypatch):
    idx, vals = _coo(4, 5, density=1.0, seed=23)
    x = torch.randn(3, 5, generator=_gen(24), dtype=torch.float64, requires_grad=True)
    v = vals.clone().requires_grad_()
    backend.get_topology(idx, (4, 5))
    _no_sparse_ops(monkeypatch)
    assert torch.autograd.gradcheck(lambda x, v: sparse_linear(x, idx, v, 4), (x, v))
    assert torch.autograd.gradgradcheck(lambda x, v: sparse_linear(x, idx, v, 4), (x, v))
    layer = snack.SparseLinear(5, 4, sparsity=0.0, dtype=torch.float64)
    backend.get_topology(layer.indices, (4, 5))
    torch.testing.assert_close(layer(x), F.linear(x, layer.to_dense(), layer.bias), atol=F64_ATOL, rtol=0)


def test_pattern_one_short_of_full_keeps_the_sparse_ops(monkeypatch):
    idx, vals = _coo(4, 5, density=1.0, seed=25)
    idx, vals = idx[:, 1:].contiguous(), vals[1:]
    backend.get_topology(idx, (4, 5))
    _no_sparse_ops(monkeypatch)
    with pytest.raises(AssertionError, match="a sparse op ran"):
        sparse_linear(torch.randn(2, 5, dtype=torch.float64), idx, vals, 4)


def test_full_count_with_a_repeated_coordinate_is_refused():
    idx, vals = _coo(3, 4, density=1.0, seed=26)
    bad = idx.clone()
    bad[1, 1] = bad[1, 0]   # (0, 0) twice, (0, 1) missing: still 12 entries
    with pytest.raises(ValueError):
        sparse_linear(torch.randn(2, 4, dtype=torch.float64), bad, vals, 3)


def test_full_pattern_under_cpu_autocast_is_bf16_like_the_sparse_path():
    """A pattern with every connection runs as F.linear on the values; under CPU autocast that
    product is float32 math rounded once to bfloat16, as the sparse kernels give (it used to run
    in bfloat16 under the autocast that was still on: about half the outputs differed)."""
    idx, vals = _coo(6, 8, density=1.0, seed=27, dtype=torch.float32)
    x = torch.randn(5, 8, generator=_gen(28))
    v = vals.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sparse_linear(x, idx, v, 6)
        b = torch.randn(6, generator=_gen(29))
        yb = sparse_linear(x, idx, vals, 6, bias=b)
    assert y.dtype == torch.bfloat16
    assert_close_dtype(y, F.linear(x.double(), _dense(idx, vals, 6, 8).double()), torch.bfloat16)
    assert torch.equal(y, F.linear(x, _dense(idx, vals, 6, 8)).to(torch.bfloat16))
    assert torch.equal(yb, F.linear(x, _dense(idx, vals, 6, 8), b).to(torch.bfloat16))
    y.float().sum().backward()
    assert v.grad.dtype == torch.float32


def test_autocast_on_a_backend_with_mixed_values_casts_only_x(monkeypatch):
    # on CUDA, a backend whose kernels read float32 values next to half activations (the GPU
    # backend: `mixed_values`) gets x cast and the values and bias as they are; any other backend,
    # half values, or a compiled trace get everything cast (the selection, without a GPU)
    from types import SimpleNamespace
    from snack.layers.functional import _autocast_inputs
    x, v, b = torch.randn(3, 5), torch.randn(7), torch.randn(4)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda dev: torch.bfloat16)
    monkeypatch.setattr(backend, "_backend", lambda t: SimpleNamespace(mixed_values=True))
    xc, vc, bc, res = _autocast_inputs(x, v, b, "cuda", False)
    assert xc.dtype == torch.bfloat16 and vc is v and bc is b and res is None
    for args in ((x, v.half(), b, "cuda", False), (x, v, b, "cuda", True), (x, v, b.half(), "cuda", False)):
        xc, vc, bc, _ = _autocast_inputs(*args)
        assert xc.dtype == vc.dtype == bc.dtype == torch.bfloat16, args[1:]
    monkeypatch.setattr(backend, "_backend", lambda t: SimpleNamespace(mixed_values=False))
    xc, vc, bc, _ = _autocast_inputs(x, v, None, "cuda", False)
    assert xc.dtype == vc.dtype == torch.bfloat16 and bc is None
    # on the CPU the math runs in float32 and the result is cast back
    xc, vc, bc, res = _autocast_inputs(x.bfloat16(), v, b, "cpu", False)
    assert xc.dtype == vc.dtype == bc.dtype == torch.float32 and res == torch.bfloat16


# ---- nothing of the dense weight's size ------------------------------------------------------------


@pytest.mark.parametrize("which", ["auto", "reference"])
def test_no_dense_sized_allocation_in_forward_or_backward(which):
    # torch ops are seen by the dispatch mode; the reference backend is all torch ops, the
    # compiled CPU backend allocates its outputs through torch too
    out_f, in_f, B = 1024, 1024, 4
    layer = snack.SparseLinear(in_f, out_f, sparsity=0.99)
    x = torch.randn(B, in_f, requires_grad=True)
    with backend.force_backend(which), MaxNumel() as mode:   # incl. the topology build
        y = layer(x)
        (y * y).sum().backward()
    assert layer.values.grad is not None and x.grad is not None
    assert mode.max_numel < out_f * in_f // 10, (mode.max_numel, mode.worst)


def test_functional_alias():
    import importlib
    assert snack.functional.sparse_linear is sparse_linear
    assert importlib.import_module("snack.functional") is snack.layers.functional


# ---- higher-order gradients and torch.func ---------------------------------------------------
def _sparse_and_dense(seed, out_f=9, in_f=13, density=0.35):
    """(f(x, v, b) through sparse_linear, the same through a dense weight built from v) and
    fresh float64 inputs (x (5, in), v, b)."""
    idx, vals = _coo(out_f, in_f, density=density, seed=seed)
    g = _gen(seed + 1)
    x = torch.randn(5, in_f, generator=g, dtype=torch.float64)
    b = torch.randn(out_f, generator=g, dtype=torch.float64)
    rows, cols = idx.long()

    def sparse(x, v, b):
        return sparse_linear(x, idx, v, out_f, b)

    def dense(x, v, b):
        w = torch.zeros(out_f, in_f, dtype=v.dtype).index_put((rows, cols), v)
        return x @ w.T + b
    return sparse, dense, (x, vals, b)


@pytest.mark.parametrize("seed", [0, 1])
def test_double_backward_matches_dense(seed):
    # a gradient penalty differentiates the backward: before the backward was differentiable,
    # the penalty's gradient silently came out wrong (the first-order gradients did not require grad)
    sparse, dense, (x, v, b) = _sparse_and_dense(seed)
    grads = []
    for f in (sparse, dense):
        xs, vs, bs = (t.clone().requires_grad_() for t in (x, v, b))
        y = torch.tanh(f(xs, vs, bs)).pow(2).sum()
        gx, = torch.autograd.grad(y, xs, create_graph=True)
        assert gx.requires_grad
        (y + gx.pow(2).sum()).backward()
        grads.append((xs.grad, vs.grad, bs.grad))
    for got, ref in zip(*grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    # Hessian-vector products in every argument
    def loss(f):
        return lambda *a: torch.tanh(f(*a)).pow(2).sum()
    vecs = tuple(torch.randn(t.shape, generator=_gen(seed + 7), dtype=torch.float64) for t in (x, v, b))
    _, h = torch.autograd.functional.hvp(loss(sparse), (x, v, b), vecs)
    _, hd = torch.autograd.functional.hvp(loss(dense), (x, v, b), vecs)
    for got, ref in zip(h, hd):
        assert ref.abs().max() > 1e-3  # a product that is not zero
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_gradgradcheck_and_forward_ad():
    sparse, _, (x, v, b) = _sparse_and_dense(3)
    args = tuple(t.clone().requires_grad_() for t in (x, v, b))

    def f(*a):
        return torch.tanh(sparse(*a))
    assert torch.autograd.gradcheck(f, args, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, args, check_fwd_over_rev=True)
    # x alone (a gradcheck over all three would pass even if dX did not depend on x's graph)
    assert torch.autograd.gradgradcheck(lambda x: f(x, args[1].detach(), args[2].detach()), (args[0],))
    # third order
    xs = args[0]
    g1, = torch.autograd.grad(f(*args).sum(), xs, create_graph=True)
    g2, = torch.autograd.grad(g1.pow(3).sum(), xs, create_graph=True)
    assert g2.requires_grad
    # forward mode with tangents only (nothing requires grad)
    import torch.autograd.forward_ad as fwad
    tx, tv = torch.randn_like(x), torch.randn_like(v)
    _, dense, _ = _sparse_and_dense(3)
    with fwad.dual_level():
        y = sparse(fwad.make_dual(x, tx), fwad.make_dual(v, tv), b)
        tangent = fwad.unpack_dual(y).tangent
    _, ref = torch.func.jvp(lambda x, v: dense(x, v, b), (x, v), (tx, tv))
    torch.testing.assert_close(tangent, ref, rtol=1e-10, atol=1e-10)


def test_torch_func_transforms_match_dense():
    sparse, dense, (x, v, b) = _sparse_and_dense(4)
    close = dict(rtol=1e-10, atol=1e-10)

    def loss(f):
        return lambda v, xi: torch.tanh(f(xi, v, b)).sum()
    # per-sample gradients (vmap over grad): the SDDMM runs per sample
    per = torch.func.vmap(torch.func.grad(loss(sparse)), in_dims=(None, 0))(v, x)
    assert per.shape == (x.shape[0], v.numel())
    torch.testing.assert_close(per, torch.func.vmap(torch.func.grad(loss(dense)), in_dims=(None, 0))(v, x), **close)
    for argnum in (0, 1, 2):  # jacobians in every argument, reverse and forward mode
        for jac in (torch.func.jacrev, torch.func.jacfwd):
            torch.testing.assert_close(jac(sparse, argnums=argnum)(x, v, b), jac(dense, argnums=argnum)(x, v, b),
                                       **close)
    torch.testing.assert_close(torch.func.hessian(lambda v: loss(sparse)(v, x))(v),
                               torch.func.hessian(lambda v: loss(dense)(v, x))(v), **close)
    # vmap over batched inputs (folded into the rows) and over batched values (an ensemble)
    xs = torch.randn(3, *x.shape, generator=_gen(9), dtype=torch.float64)
    vs = torch.randn(3, v.numel(), generator=_gen(10), dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(sparse, in_dims=(0, None, None))(xs, v, b),
                               torch.stack([dense(xi, v, b) for xi in xs]), **close)
    torch.testing.assert_close(torch.func.vmap(sparse, in_dims=(None, 0, None))(x, vs, b),
                               torch.stack([dense(x, vi, b) for vi in vs]), **close)
    torch.testing.assert_close(torch.func.vmap(sparse)(xs, vs, torch.stack([b] * 3)),
                               torch.stack([dense(xi, vi, b) for xi, vi in zip(xs, vs)]), **close)
    # the layer through torch.func.functional_call
    layer = snack.SparseLinear(13, 9, sparsity=0.6, dtype=torch.float64)
    params = {k: p.detach() for k, p in layer.named_parameters()}
    per = torch.func.vmap(torch.func.grad(
        lambda p, xi: torch.func.functional_call(layer, p, (xi,)).pow(2).sum()), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        layer.zero_grad()
        layer(x[i]).pow(2).sum().backward()
        torch.testing.assert_close(per["values"][i], layer.values.grad, **close)
        torch.testing.assert_close(per["bias"][i], layer.bias.grad, **close)


def test_legacy_batched_gradients_raise_clearly():
    sparse, _, (x, v, b) = _sparse_and_dense(5)
    x = x.requires_grad_()
    y = sparse(x, v, b)
    with pytest.raises(NotImplementedError, match="is_grads_batched"):
        torch.autograd.grad(y, x, torch.randn(2, *y.shape, dtype=y.dtype), is_grads_batched=True)
    # (gradcheck re-raises it as a GradcheckError carrying the message)
    with pytest.raises(RuntimeError, match="legacy batched tangents.*check_batched_forward_grad"):
        torch.autograd.gradcheck(sparse, (x.detach().requires_grad_(), v.detach().requires_grad_(), b),
                                 check_forward_ad=True, check_batched_forward_grad=True, check_backward_ad=False,
                                 check_undefined_grad=False)


def test_training_forward_skips_argument_binding(monkeypatch):
    # torch's Function.apply binds arguments with inspect.signature (5-20 us of host time) for a
    # Function with a separate setup_context; outside torch.func the op calls the C++ apply
    import inspect
    calls = []
    real = inspect.signature

    def signature(obj, *a, **k):
        if getattr(obj, "__qualname__", "").startswith("SparseLinearFunction."):
            calls.append(obj)
        return real(obj, *a, **k)
    monkeypatch.setattr(inspect, "signature", signature)
    sparse, _, (x, v, b) = _sparse_and_dense(6)
    xs, vs = x.clone().requires_grad_(), v.clone().requires_grad_()
    sparse(xs, vs, b).sum().backward()
    assert calls == [] and xs.grad is not None and vs.grad is not None
    torch.func.grad(lambda v: sparse(x, v, b).sum())(v)  # under torch.func: torch's own apply
    assert calls


def test_vmap_over_an_empty_batch():
    sparse, dense, (x, v, b) = _sparse_and_dense(7)
    for in_dims, args in (((None, 0, None), (x, v.new_empty(0, v.numel()), b)),
                          ((0, None, None), (x.new_empty(0, *x.shape), v, b)),
                          ((None, None, 0), (x, v, b.new_empty(0, b.numel())))):
        got = torch.func.vmap(sparse, in_dims=in_dims)(*args)
        assert got.shape == (0, x.shape[0], b.numel())


def test_ensembles_of_layers_via_stack_module_state():
    """torch.func.stack_module_state + functional_call over SparseLinear models: with one shared
    pattern (indices unbatched) the vmapped outputs equal each model's; with different patterns
    (batched indices) a NotImplementedError says so instead of a data-pointer RuntimeError."""
    import copy
    from torch.func import functional_call, stack_module_state
    torch.manual_seed(3)
    models = [snack.SparseLinear(20, 10, sparsity=0.8, dtype=torch.float64) for _ in range(3)]
    for m in models[1:]:  # one shared pattern, different values and biases
        m.indices = models[0].indices
    x = torch.randn(4, 20, dtype=torch.float64)
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def shared(p, x):
        return functional_call(base, (p, {"indices": models[0].indices}), (x,))
    y = torch.func.vmap(shared, in_dims=(0, None))(params, x)
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], m(x))

    fresh = [snack.SparseLinear(20, 10, sparsity=0.8, dtype=torch.float64) for _ in range(3)]
    params, buffers = stack_module_state(fresh)
    with pytest.raises(NotImplementedError, match="different sparsity patterns"):
        torch.func.vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)


def test_force_backend_blocks_of_two_threads_closing_out_of_order():
    """A thread's force_backend('reference') block opens, then the main thread's, then the
    thread's closes first: the setting stays 'reference' while the main block is open and is the
    default after both (a saved-and-restored global was left on 'reference' for good)."""
    import threading
    entered, release = threading.Event(), threading.Event()

    def other():
        with backend.force_backend("reference"):
            entered.set()
            release.wait(10)
    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(10)
    with backend.force_backend("reference"):
        release.set()
        t.join(10)  # the thread's block closed first
        assert backend.backend_name("cpu") == "reference"
    assert backend.backend_name("cpu") == "cpu"
    with backend.force_backend("reference"):
        with backend.force_backend("auto"):
            assert backend.backend_name("cpu") == "cpu"
        assert backend.backend_name("cpu") == "reference"
    assert backend.backend_name("cpu") == "cpu"


@pytest.mark.parametrize("how", ["written", "refreshed", "dst-step", "load"])
def test_a_pattern_changed_in_place_between_forward_and_backward_is_refused(how):
    """The pattern is not a saved tensor, so autograd cannot see it change: the backward checks
    it, as autograd does for saved tensors modified in place, instead of returning the new
    pattern's gradients. Not changed, or changed only after the backward, nothing is refused."""
    torch.manual_seed(3)
    layer = snack.SparseLinear(8, 6, sparsity=0.5)
    x = torch.randn(3, 8)                        # no gradient for x: only x is saved, not values
    other = snack.SparseLinear(8, 6, sparsity=0.5)
    y = layer(x)
    if how == "written":
        layer.indices.copy_(other.indices)
    elif how == "refreshed":                     # written, then a forward that refreshes the topology
        layer.indices.copy_(other.indices)
        layer(x)
    elif how == "dst-step":
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        snack.dst.SET(layer, opt, update_every=1, drop_fraction=0.5, decay="constant").step()
    else:
        layer.load_state_dict(other.state_dict())
    with pytest.raises(RuntimeError, match="connection pattern .indices. of its forward was modified in place"):
        y.sum().backward()
    # a new forward on the pattern as it is now: its backward gives that pattern's gradient
    layer.values.grad = None
    layer(x).sum().backward()
    dense = layer.to_dense().detach().requires_grad_()
    (x @ dense.t()).sum().backward()
    idx = layer.indices.long()
    torch.testing.assert_close(layer.values.grad, dense.grad[idx[0], idx[1]])


def test_sparse_layout_tensors_are_refused_by_name():
    """x, values, bias or indices in a sparse layout get a TypeError naming the argument (they
    used to fail deep inside with torch's own messages)."""
    idx, vals = _coo(6, 8, density=0.5, seed=30, dtype=torch.float32)
    x = torch.randn(3, 8, generator=_gen(31))
    b = torch.randn(6, generator=_gen(32))
    for args, kwargs, name in (((x.to_sparse(), idx, vals, 6), {}, "x"),
                               ((x.to_sparse_csr(), idx, vals, 6), {}, "x"),
                               ((x, idx, vals.to_sparse(), 6), {}, "values"),
                               ((x, idx, vals, 6), {"bias": b.to_sparse()}, "bias"),
                               ((x, idx.to_sparse(), vals, 6), {}, "indices")):
        with pytest.raises(TypeError, match=rf"^{name} must be a dense \(strided\) tensor, got layout torch.sparse"):
            sparse_linear(*args, **kwargs)
