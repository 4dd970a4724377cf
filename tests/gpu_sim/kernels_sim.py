"""The real SNACK kernels (every variant family), run by Numba's CUDA simulator on tiny shapes,
against the float64 reference: odd shapes, nnz = 0, empty rows, partial batch tiles, column
chunks with atomics, float16/bfloat16, outputs poisoned before each run, bad input.

Not collected by a plain `pytest` run (the file name has no test_ prefix): the simulator must be
switched on before numba.cuda is imported, so tests/test_gpu_simulator.py runs this file in a
subprocess with NUMBA_ENABLE_CUDASIM=1."""
import copy
import warnings

import pytest
import torch
from numba import cuda

import snack.gpu as G
from snack.core import COO
from snack.core.reference import sddmm_reference, spmm_reference, spmm_t_reference
from snack.gpu.kernels import _cv_bf16

from conftest import ladder

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rel(a, ref):
    assert torch.isfinite(a).all(), "an output element was not written (NaN poison survived)"
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(coo, B, dtype, seed, fused=True, **kw):
    g = torch.Generator().manual_seed(seed)
    o, i = coo.shape
    x = torch.randn(B, i, generator=g).to(dtype)
    dy = torch.randn(B, o, generator=g).to(dtype)
    v = coo.values.to(dtype)
    t = coo.topology
    y = torch.full((B, o), float("nan"), dtype=dtype)
    dx = torch.full((B, i), float("nan"), dtype=dtype)
    dv = torch.full((coo.nnz,), float("nan"), dtype=dtype)
    G.spmm(x, t, v, out=y, **kw)
    G.spmm_t(dy, t, v, out=dx, **kw)
    # the SDDMM with the bias gradient from the same launch (its variant without db is the same
    # code less that part: test_sddmm_without_bias_grad)
    _, db = G.sddmm(dy, x, t, out=dv, bias_grad=True, **{k: a for k, a in kw.items() if k != "split"})
    xd, dyd, vd = x.double(), dy.double(), v.double()
    tol = TOL[dtype]
    refs = (spmm_reference(xd, t.indices, vd, o), spmm_t_reference(dyd, t.indices, vd, i),
            sddmm_reference(dyd, xd, t.indices), dyd.sum(0))
    assert db.dtype == dtype and db.shape == (o,)
    got = [y, dx, dv, db]
    names = ["spmm", "spmm_t", "sddmm", "db"]
    if fused and B <= 32:  # the fused backward (dX, dv, db in one launch) with the same chunks and split
        # (its variant without db: test_fused_backward_and_its_fallback_agree)
        fkw = {k: a for k, a in kw.items() if k in ("chunks", "split", "threads")}
        got += list(G.spmm_t_sddmm(dy, x, t, v, bias_grad=True, fused=True, **fkw))
        names += ["fused dX", "fused dv", "fused db"]
        refs += refs[1:]
    for name, g_, ref in zip(names, got, refs):
        assert g_.dtype == dtype, name
        if ref.numel() and ref.norm() > 0:
            assert _rel(g_, ref) < tol, name
        else:
            assert torch.equal(g_.double(), ref), name


@pytest.mark.parametrize("B,kw", [(3, {}), (11, {}), (5, {"wide": True, "chunks": 2}),
                                  (40, {"wide": True, "chunks": 3})])
def test_sddmm_without_bias_grad(B, kw):
    # the SDDMM variants without the bias gradient (tiled one and two tiles, wide one and two
    # tiles): same dv as the variant with it, against float64
    coo = COO.random((10, 70), density=0.3, seed=B)
    g = torch.Generator().manual_seed(B)
    x, dy = torch.randn(B, 70, generator=g), torch.randn(B, 10, generator=g)
    dv = torch.full((coo.nnz,), float("nan"))
    assert G.sddmm(dy, x, coo.topology, out=dv, **kw) is dv
    dv2, db = G.sddmm(dy, x, coo.topology, bias_grad=True, **kw)
    assert torch.equal(dv, dv2)
    assert _rel(dv, sddmm_reference(dy.double(), x.double(), coo.topology.indices)) < TOL[torch.float32]
    assert _rel(db, dy.double().sum(0)) < TOL[torch.float32]


@pytest.mark.parametrize("shape,B,density", [
    ((7, 40), 1, 0.3),     # BT = 1 (lanes over non-zeros)
    ((9, 13), 2, 0.5),     # BT = 2
    ((5, 33), 3, 0.4),     # BT = 4, partial batch tile
    ((6, 29), 8, 0.3),     # BT = 8, full tile (fast staging path)
    ((3, 21), 11, 0.5),    # two tiles of 8, the second partial
    ((1, 1), 1, 1.0),      # 1 x 1
])
def test_tiled_kernels_float32(shape, B, density):
    coo = COO.random(shape, density=density, seed=B)
    _check(coo, B, torch.float32, seed=7)


@pytest.mark.parametrize("B", [1, 2, 3, 4, 8, 11])
def test_tiled_rows_of_several_steps_and_several_rows_per_warp(monkeypatch, B):
    # one block of 2 warps walks all rows (each warp takes every other row, requesting the next
    # row's non-zeros during the current one); rows of 150, 0, 64, 65, 1, 0 and 130 non-zeros:
    # several 64-entry steps, the last one partial or exactly full, empty rows in between.
    # Every tiled variant: BT = 1 / 2 / 4 / 8 / two tiles, shuffle and lane-owned kernels.
    from snack.gpu import ops
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    monkeypatch.setattr(ops, "_THREADS", 64)
    g = torch.Generator().manual_seed(B)
    rows, cols = [], []
    for r, n in enumerate((150, 0, 64, 65, 1, 0, 130)):
        c = torch.randperm(300, generator=g)[:n]
        rows.append(torch.full((n,), r))
        cols.append(c)
    idx = torch.stack([torch.cat(rows), torch.cat(cols)])
    coo = COO(idx, torch.randn(idx.shape[1], generator=g), (7, 300))
    x = torch.randn(B, 300, generator=g)
    dy = torch.randn(B, 7, generator=g)
    t, v = coo.topology, coo.values
    kw = dict(threads=64, wide=False)
    y = G.spmm(x, t, v, out=torch.full((B, 7), float("nan")), **kw)
    dx = G.spmm_t(dy, t, v, out=torch.full((B, 300), float("nan")), **kw)
    assert _rel(y, spmm_reference(x.double(), t.indices, v.double(), 7)) < TOL[torch.float32]
    assert _rel(dx, spmm_t_reference(dy.double(), t.indices, v.double(), 300)) < TOL[torch.float32]
    # the transposed SpMM staging 300 columns (its fast staging path at every tile width)
    tt = COO(idx.flip(0), v, (300, 7)).topology
    dy2 = torch.randn(B, 300, generator=g)
    dx2 = G.spmm_t(dy2, tt, v, out=torch.full((B, 7), float("nan")), **kw)
    assert _rel(dx2, spmm_t_reference(dy2.double(), tt.indices, v.double(), 7)) < TOL[torch.float32]


@pytest.mark.parametrize("B", [2, 4, 8])
@pytest.mark.parametrize("max_density", [0.0, 1.0])
def test_lane_owned_kernels_in_both_staging_layouts(monkeypatch, B, max_density):
    # the lane-owned SpMMs stage their tile column by column (vector reads, BT = 8 always) or
    # batch row by batch row (BT = 2, 4 above OWN_COLS_MAX_DENSITY): both layouts, forward and
    # transposed, with the fast staging path (300 staged columns) and its tail
    from snack.gpu import ops
    monkeypatch.setattr(ops, "OWN_COLS_MAX_DENSITY", max_density)
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    monkeypatch.setattr(ops, "_THREADS", 64)
    kw = dict(threads=64, wide=False)
    for shape, seed in (((9, 300), 1), ((300, 9), 2)):
        coo = COO.random(shape, density=0.3, seed=seed + B)
        t, v = coo.topology, coo.values
        g = torch.Generator().manual_seed(B)
        x, dy = torch.randn(B, shape[1], generator=g), torch.randn(B, shape[0], generator=g)
        y = G.spmm(x, t, v, out=torch.full((B, shape[0]), float("nan")), **kw)
        dx = G.spmm_t(dy, t, v, out=torch.full((B, shape[1]), float("nan")), **kw)
        assert _rel(y, spmm_reference(x.double(), t.indices, v.double(), shape[0])) < TOL[torch.float32]
        assert _rel(dx, spmm_t_reference(dy.double(), t.indices, v.double(), shape[1])) < TOL[torch.float32]


@pytest.mark.parametrize("B", [2, 3, 8, 11])
@pytest.mark.parametrize("cols", [False, True])
def test_tiled_sddmm_in_both_staging_layouts(monkeypatch, B, cols):
    # the tiled SDDMM with X staged batch row by batch row or column by column (vector reads),
    # one batch tile or two (partial sums kept between tiles), with and without the bias gradient
    from snack.gpu import ops
    monkeypatch.setattr(ops, "SDDMM_COLUMN_STAGING", cols)
    monkeypatch.setattr(ops, "OWN_COLS_MAX_DENSITY", 1.0)
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    for shape, seed in (((9, 300), 1), ((40, 9), 2)):
        coo = COO.random(shape, density=0.3, seed=seed + B)
        t = coo.topology
        g = torch.Generator().manual_seed(B)
        x, dy = torch.randn(B, shape[1], generator=g), torch.randn(B, shape[0], generator=g)
        dv = torch.full((coo.nnz,), float("nan"))
        G.sddmm(dy, x, t, out=dv, threads=64, wide=False)
        dv2, db = G.sddmm(dy, x, t, bias_grad=True, threads=64, wide=False)
        kern = ops._sddmm_plan(t, B, 0, x.device, None, 64, False, None, True)[0].dispatcher
        assert kern.py_func.__name__.endswith("_cols") == cols, kern.py_func.__name__
        ref = sddmm_reference(dy.double(), x.double(), t.indices)
        assert _rel(dv, ref) < TOL[torch.float32] and torch.equal(dv, dv2)
        assert _rel(db, dy.double().sum(0)) < TOL[torch.float32]


def test_empty_rows_and_columns_and_unsorted_input():
    # rows 1 and 3 and columns 0, 5 empty; given in shuffled order
    idx = torch.tensor([[4, 0, 2, 0, 4, 2], [1, 2, 3, 4, 6, 2]])
    coo = COO(idx, torch.randn(6, dtype=torch.float64).float(), (5, 7))
    _check(coo, 3, torch.float32, seed=3)


def test_deep_copy_of_a_matrix_whose_plans_are_cached():
    """copy.deepcopy of a COO after the ops ran (its topology caches launch plans bound to its
    index arrays): the copy computes the same, and keeps working once the original is gone."""
    coo = COO.random((40, 24), density=0.25, seed=8)
    x, dy = torch.randn(3, 24), torch.randn(3, 40)
    want = (G.spmm(x, coo.topology, coo.values), G.spmm_t(dy, coo.topology, coo.values),
            G.sddmm(dy, x, coo.topology))
    twin = copy.deepcopy(coo)
    del coo
    got = (G.spmm(x, twin.topology, twin.values), G.spmm_t(dy, twin.topology, twin.values),
           G.sddmm(dy, x, twin.topology))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _entries(topo, name):
    """The fast path's entries of op `name` in a topology's cache."""
    return {k: v for k, v in topo.cache.items() if isinstance(k, tuple) and k[0] == name}


@pytest.mark.parametrize("dtype,vdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float16, torch.float32)])
def test_repeated_calls_take_the_fast_path(dtype, vdtype, monkeypatch):
    """A call like an earlier one (same dtypes, shapes, devices, default options, no out=) goes
    straight to that call's plan, without the checks and the plan lookup: fresh inputs give
    fresh, right outputs (spmm with and without a bias, spmm_t), each call its own output tensor;
    a new batch size is planned anew."""
    from snack.gpu import ops
    coo = COO.random((13, 37), density=0.3, seed=4)
    t, v = coo.topology, coo.values.to(vdtype)
    bias = torch.randn(13).to(vdtype)
    g = torch.Generator().manual_seed(0)
    outs = []
    for call in range(3):
        x, dy = torch.randn(5, 37, generator=g).to(dtype), torch.randn(5, 13, generator=g).to(dtype)
        y, yb, dx = G.spmm(x, t, v), G.spmm(x, t, v, bias=bias), G.spmm_t(dy, t, v)
        xd, dyd, vd = x.double(), dy.double(), v.double()
        for got, ref in ((y, spmm_reference(xd, t.indices, vd, 13)),
                         (yb, spmm_reference(xd, t.indices, vd, 13) + bias.double()),
                         (dx, spmm_t_reference(dyd, t.indices, vd, 37))):
            assert got.dtype == dtype and _rel(got, ref) < TOL[dtype]
        outs.append(y)
        assert len(_entries(t, "spmm_fast")) == 3  # forward, forward with a bias, transposed
        if call == 0:  # from the second call on the checked path would fail (the module's dict
            # is patched directly: setting an attribute of ops would start a new generation)
            def checked_path(*a, **k):
                raise AssertionError("the checked path ran")
            for name in ("_check_common", "_check_values", "_spmm_plan"):
                monkeypatch.setitem(ops.__dict__, name, checked_path)
    assert len({o.data_ptr() for o in outs}) == 3
    with pytest.raises(AssertionError, match="the checked path ran"):
        G.spmm(torch.randn(2, 37).to(dtype), t, v)
    monkeypatch.undo()
    G.spmm(torch.randn(2, 37).to(dtype), t, v)
    assert len(_entries(t, "spmm_fast")) == 4


def test_fast_path_keeps_the_checks_and_follows_the_knobs(monkeypatch):
    """After a call has taken the fast path's entry, bad input still gets its error (a changed
    shape, dtype, device or type never matches the entry); a non-contiguous x is right (the
    checked path copies it); a knob set on snack.gpu.ops, or deterministic algorithms, plan anew."""
    from snack.gpu import ops
    coo = COO.random((12, 30), density=0.3, seed=6)
    t, v = coo.topology, coo.values
    x = torch.randn(4, 30)
    want = G.spmm(x, t, v)
    assert torch.equal(G.spmm(x, t, v), want)
    with pytest.raises(ValueError, match="x must have 30 columns"):
        G.spmm(torch.randn(4, 31), t, v)
    with pytest.raises(ValueError, match=r"values must have shape"):
        G.spmm(x, t, v[:-1].contiguous())
    with pytest.raises(TypeError, match="values has dtype"):
        G.spmm(x, t, v.double())
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        G.spmm(x.numpy(), t, v)
    with pytest.raises(ValueError, match="bias must have shape"):
        G.spmm(x, t, v, bias=torch.randn(11))
    wide = torch.randn(4, 60)[:, ::2]  # not contiguous
    assert _rel(G.spmm(wide, t, v), spmm_reference(wide.double(), t.indices, v.double(), 12)) < 1e-5
    n, gen = len(_entries(t, "spmm_fast")), ops._generation
    monkeypatch.setattr(ops, "PARTIAL_SUMS", "parts")
    assert ops._generation != gen
    assert torch.allclose(G.spmm(x, t, v), want, rtol=1e-5, atol=1e-6)
    assert len(_entries(t, "spmm_fast")) == n + 1
    with ops.wide_mode("rows4"):
        assert torch.allclose(G.spmm(x, t, v), want, rtol=1e-5, atol=1e-6)
    assert len(_entries(t, "spmm_fast")) == n + 2
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.allclose(G.spmm(x, t, v), want, rtol=1e-5, atol=1e-6)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(_entries(t, "spmm_fast")) == n + 3


@pytest.mark.parametrize("B", [3, 12])
def test_backward_ops_take_the_fast_path(B, monkeypatch):
    """sddmm and spmm_t_sddmm called like an earlier call go straight to its plan, as spmm does:
    fresh inputs give fresh, right results (dv, db and, fused at B = 12, dX); the checked path is
    not run again (patched to fail); bad input still gets its error; a new batch size is planned
    anew."""
    from snack.gpu import ops
    coo = COO.random((13, 37), density=0.2, seed=5)
    t, v = coo.topology, coo.values
    g = torch.Generator().manual_seed(2)
    fused = G.fuses_backward(B, t)
    assert fused == (B == 12)
    for call in range(3):
        x, dy = torch.randn(B, 37, generator=g), torch.randn(B, 13, generator=g)
        xd, dyd = x.double(), dy.double()
        dv_ref = sddmm_reference(dyd, xd, t.indices)
        dv, db = G.sddmm(dy, x, t, bias_grad=True)
        dv2 = G.sddmm(dy, x, t)
        dx3, dv3, db3 = G.spmm_t_sddmm(dy, x, t, v, bias_grad=True)
        assert _rel(dv, dv_ref) < 1e-5 and _rel(dv2, dv_ref) < 1e-5 and _rel(dv3, dv_ref) < 1e-5
        assert _rel(db, dyd.sum(0)) < 1e-5 and _rel(db3, dyd.sum(0)) < 1e-5
        assert _rel(dx3, spmm_t_reference(dyd, t.indices, v.double(), 37)) < 1e-5
        assert len(_entries(t, "sddmm_fast")) == 2  # with and without db
        entry = list(_entries(t, "fused_fast").values())  # the plan, or False: the two ops
        assert len(entry) == 1 and (entry[0] is not False) == fused
        if call == 0:
            def checked_path(*a, **k):
                raise AssertionError("the checked path ran")
            for name in ("_check_pair", "_sddmm_plan", "_cached_plan"):
                monkeypatch.setitem(ops.__dict__, name, checked_path)
            monkeypatch.setitem(ops.__dict__, "_check_common", checked_path)  # (spmm_t's)
    monkeypatch.undo()
    x, dy = torch.randn(B, 37), torch.randn(B, 13)
    with pytest.raises(ValueError, match="dy must have 13 columns"):
        G.sddmm(torch.randn(B, 12), x, t)
    with pytest.raises(ValueError, match="same batch size"):
        G.spmm_t_sddmm(dy, torch.randn(B + 1, 37), t, v)
    with pytest.raises(TypeError, match="x has dtype"):
        G.sddmm(dy, x.half(), t)
    with pytest.raises(TypeError, match="bias_grad"):
        G.sddmm(dy, x, t, bias_grad=1)
    with pytest.raises(ValueError, match="values must have shape"):
        G.spmm_t_sddmm(dy, x, t, v[:-1].contiguous())
    G.sddmm(dy[:2].contiguous(), x[:2].contiguous(), t)
    assert len(_entries(t, "sddmm_fast")) == 3


@pytest.mark.parametrize("B,kw", [(8, {}), (20, dict(wide=True, chunks=2))])
def test_cached_plans_follow_a_topology_refreshed_in_place(B, kw):
    """After every op ran (plans and arrays cached), a new pattern with the same nnz is written
    into the topology's own arrays (Topology.refresh_from, as snack.dst does through
    get_topology): the same plan objects, bound to the same arrays, compute with the new
    pattern; tiled, fused and wide (two column chunks) kernels."""
    from snack.core import Topology
    shape = (11, 29)
    coo = COO.random(shape, density=0.2, seed=11)
    _check(coo, B, torch.float32, seed=1, **kw)
    t = coo.topology
    plans = {k: v for k, v in t.cache.items() if isinstance(k, tuple) and k[0].endswith("_plan")}
    arrays = {k: v for k, v in t.cache.items() if isinstance(v, torch.Tensor)}
    assert plans and ("rows_by_col_u16" in arrays)
    new = COO.random(shape, nnz=coo.nnz, seed=12)
    t.indices.copy_(new.topology.indices)
    assert t.refresh_from(Topology(new.topology.indices.clone(), shape))
    assert all(t.cache[k] is v for k, v in plans.items()) and all(t.cache[k] is v for k, v in arrays.items())
    _check(COO(t.indices, new.values, shape, topology=t, check=False), B, torch.float32, seed=2, **kw)


def test_no_nonzeros():
    coo = COO(torch.empty(2, 0, dtype=torch.int32), torch.empty(0), (4, 6))
    _check(coo, 2, torch.float32, seed=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,B,density", [
    ((5, 17), 3, 0.4),     # tiles staged batch row by batch row (BT = 4 above 25% density)
    ((9, 40), 8, 0.2),     # staged column by column (vector reads): SpMMs and SDDMM at BT = 8
    ((6, 31), 2, 0.2),     # BT = 2 column-staged (transposed SpMM and SDDMM)
])
def test_half_precision(dtype, shape, B, density):
    coo = COO.random(shape, density=density, seed=5)
    _check(coo, B, dtype, seed=11)


@pytest.fixture(params=["warp", "rows4", "own"])
def wide_mode(request):
    """The wide SpMMs and SDDMM with a warp per row, with a row per group of 8 lanes (rows4,
    chosen for short segments) whatever the segments' lengths, or (the SpMMs) with lane-owned
    non-zeros (own; the SDDMM a warp per row)."""
    from snack.gpu import ops
    with ops.wide_mode(request.param, sddmm=True):
        yield request.param


def _check_wide(mode, coo, B, seed, **kw):
    """_check at float32: every op in the warp mode; in the other modes all but the fused
    backward (one mode, checked in the warp mode)."""
    _check(coo, B, torch.float32, seed, fused=mode == "warp", **kw)


@pytest.mark.parametrize("B,chunks", [(16, None), (20, 2)])
def test_wide_kernels(B, chunks, wide_mode):
    # 32-wide batch tiles (partial); chunks=2 splits the columns and adds partial rows with atomics
    coo = COO.random((3, 19), density=0.4, seed=B)
    _check_wide(wide_mode, coo, B, seed=2, wide=True, chunks=chunks)


@pytest.mark.parametrize("B,chunks,split", [(32, 3, 1), (33, 3, 2)])
def test_wide_kernels_split(B, chunks, split, wide_mode):
    # a block consumes several chunks in turn (split < chunks); split > 1 adds with atomics
    coo = COO.random((5, 37), density=0.3, seed=B)
    _check_spmm(coo, B, seed=6, wide=True, chunks=chunks, split=split)


def _plan_sums(topo):
    """How the cached launch plans of topo add partial results: {None, "atomic", "parts", "acc"}."""
    return {plan[1] for key, plan in topo.cache.items()
            if isinstance(key, tuple) and key[0] in ("spmm_plan", "fused_plan", "sddmm_plan") and plan is not None}


@pytest.mark.parametrize("B", [20, 40])
def test_deterministic_mode_writes_parts_instead_of_atomics(B):
    # chunks = 3 adds the chunks' partial rows with atomics by default, and B = 40 the wide
    # SDDMM's two batch tiles; under torch.use_deterministic_algorithms(True) every part goes to
    # a buffer of its own, summed in order: the results must be right and repeat bit for bit
    coo = COO.random((6, 41), density=0.3, seed=B)
    _check(coo, B, torch.float32, seed=B, wide=True, chunks=3)
    assert "atomic" in _plan_sums(coo.topology)
    det = COO.random((6, 41), density=0.3, seed=B)
    torch.use_deterministic_algorithms(True)
    try:
        _check(det, B, torch.float32, seed=B, wide=True, chunks=3)
        if B > 32:
            _check(det, B, torch.float16, seed=B + 1, wide=True, chunks=3)
        x = torch.randn(B, 41)
        t, v = det.topology, det.values
        a = G.spmm(x, t, v, wide=True, chunks=3)
        assert torch.equal(a, G.spmm(x, t, v, wide=True, chunks=3))
    finally:
        torch.use_deterministic_algorithms(False)
    assert "parts" in _plan_sums(det.topology) and "atomic" not in _plan_sums(det.topology)


@pytest.mark.parametrize("B,kw", [(33, {"chunks": 3, "split": 2}), (20, {"chunks": 3})])
def test_partial_sums_as_parts(B, kw, wide_mode, monkeypatch):
    # PARTIAL_SUMS = "parts" without the deterministic flag: every wide op and mode, fp32, and
    # bf16 at B = 33 (the parts are fp32 whatever the dtype)
    from snack.gpu import ops
    monkeypatch.setattr(ops, "PARTIAL_SUMS", "parts")
    coo = COO.random((7, 53), density=0.3, seed=B)
    _check_wide(wide_mode, coo, B, seed=B, wide=True, **kw)
    if B > 32:
        _check(COO.random((7, 53), density=0.3, seed=B + 1), B, torch.bfloat16, seed=B, fused=False, wide=True, **kw)
    assert "parts" in _plan_sums(coo.topology) and "atomic" not in _plan_sums(coo.topology)


def test_wide_flush_with_a_block_size_not_a_power_of_two(monkeypatch, wide_mode):
    # one row block of 40 rows (padded to 64 in the output flush) and 3 warps: the threads
    # past the last whole group of 64 must not flush a column again (with 2 chunk groups the
    # partial rows add up with atomics, so a column flushed twice would count twice)
    from snack.gpu import ops
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    monkeypatch.setattr(ops, "WIDE_OWN_THREADS", 1024)  # the lane-owned SpMMs take all the threads too
    coo = COO.random((40, 48), density=0.3, seed=3)
    _check_spmm(coo, 20, seed=3, wide=True, chunks=2, threads=96)


@pytest.mark.parametrize("shape,row_blocks,quads", [
    ((24, 40), 3, 6),   # row blocks of 8 rows: two 4-row quads each, one 16-byte atomic per quad
    ((22, 40), 3, 0),   # 22 rows: the scalar flush (y's columns would not start 16-byte aligned)
    ((24, 40), 4, 4),   # row blocks of 6 rows: one whole quad each, the other 2 rows one by one
    ((28, 40), 5, 5),   # blocks of 6 rows, the last of 4 (rows 24-27: a quad)
])
def test_wide_atomic_flush_by_quads_of_rows(monkeypatch, shape, row_blocks, quads):
    # column chunks added with atomics; B = 35: a whole batch tile and one of 3 columns (the
    # quads past the tile's columns stay out); the forward with a bias added once per element;
    # the 16-byte adds are counted (the simulator runs the kernels' Python, so the module's
    # _red4 is the one called): `quads` per column and chunk group over the row blocks
    from snack.gpu import kernels, ops
    calls = []
    red4 = kernels._red4

    def counted(*args):
        calls.append(args[1])
        red4(*args)
    monkeypatch.setattr(kernels, "_red4", counted)
    monkeypatch.setattr(ops, "_grid_rows", lambda *args, **kw: row_blocks)
    coo = COO.random(shape, density=0.3, seed=5)
    g = torch.Generator().manual_seed(5)
    B = 35
    x, dy = torch.randn(B, shape[1], generator=g), torch.randn(B, shape[0], generator=g)
    bias = torch.randn(shape[0], generator=g)
    t, v = coo.topology, coo.values
    y = torch.full((B, shape[0]), float("nan"))
    G.spmm(x, t, v, out=y, bias=bias, wide=True, chunks=2, threads=64)
    ref = spmm_reference(x.double(), t.indices, v.double(), shape[0]) + bias.double()
    assert _rel(y, ref) < TOL[torch.float32]
    assert "atomic" in _plan_sums(t)
    assert len(calls) == 2 * B * quads and all(int(i) % 4 == 0 for i in calls)  # 2 chunk groups
    dx = torch.full((B, shape[1]), float("nan"))
    G.spmm_t(dy, t, v, out=dx, wide=True, chunks=2, threads=64)
    assert _rel(dx, spmm_t_reference(dy.double(), t.indices, v.double(), shape[1])) < TOL[torch.float32]


def test_wide_staging_fast_path():
    # 256 threads (8 warps): several warps share the staging (full tile, then a partial one)
    coo = COO.random((4, 45), density=0.3, seed=1)
    _check_spmm(coo, 40, seed=9, wide=True, chunks=2, split=1, threads=256)


@pytest.mark.parametrize("shape,chunks,B", [
    ((2, 200), 2, 32),   # chunks of 104 columns: 3 whole 32-column groups over 2 warps, 8 checked
    ((2, 300), 1, 33),   # 9 groups over 2 warps (up to 5 rounds each), 12 checked; a 1-row tile
])
def test_wide_staging_of_whole_column_groups(shape, chunks, B, wide_mode):
    # the staging's fast path (a line of 32 columns per load, 16-byte stores at swizzled or, lane
    # owned, plain quads) and the checked loop for the columns left: the forward in each mode
    coo = COO.random(shape, density=0.3, seed=B)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, shape[1], generator=g)
    y = torch.full((B, shape[0]), float("nan"))
    G.spmm(x, coo.topology, coo.values, out=y, wide=True, chunks=chunks, split=1, threads=64)
    assert _rel(y, spmm_reference(x.double(), coo.topology.indices, coo.values.double(), shape[0])) < TOL[torch.float32]


def test_wide_staging_of_whole_column_groups_in_every_op():
    # the same staging in the SDDMM (X's 200 columns), and in dX and the fused backward (dY's)
    g = torch.Generator().manual_seed(4)
    kw = dict(wide=True, chunks=2, threads=64)
    coo = COO.random((2, 200), density=0.3, seed=7)
    x, dy = torch.randn(32, 200, generator=g), torch.randn(32, 2, generator=g)
    dv, db = G.sddmm(dy, x, coo.topology, bias_grad=True, **kw)
    assert _rel(dv, sddmm_reference(dy.double(), x.double(), coo.topology.indices)) < TOL[torch.float32]
    assert _rel(db, dy.double().sum(0)) < TOL[torch.float32]
    coo = COO.random((200, 2), density=0.3, seed=8)
    x, dy = torch.randn(32, 2, generator=g), torch.randn(32, 200, generator=g)
    t, v = coo.topology, coo.values
    dx_ref = spmm_t_reference(dy.double(), t.indices, v.double(), 2)
    dv_ref = sddmm_reference(dy.double(), x.double(), t.indices)
    assert _rel(G.spmm_t(dy, t, v, split=1, **kw), dx_ref) < TOL[torch.float32]
    fdx, fdv, fdb = G.spmm_t_sddmm(dy, x, t, v, bias_grad=True, fused=True, chunks=2, split=1, threads=64)
    assert _rel(fdx, dx_ref) < TOL[torch.float32] and _rel(fdv, dv_ref) < TOL[torch.float32]
    assert _rel(fdb, dy.double().sum(0)) < TOL[torch.float32]


def test_wide_probe_leaves_phases_out_and_is_part_of_the_plan(monkeypatch):
    # ops.WIDE_PROBE (timing decomposition): without the rows the output is the zeroed tile,
    # without the flush nothing is written; back to 0, the cached plan is not reused
    from snack.gpu import ops
    coo = COO.random((6, 40), density=0.4, seed=5)
    x = torch.randn(32, 40)
    ref = spmm_reference(x.double(), coo.topology.indices, coo.values.double(), 6)
    for probe, check in ((2, lambda y: torch.equal(y, torch.zeros_like(y))),
                         (4, lambda y: bool(torch.isnan(y).all())),
                         (0, lambda y: _rel(y, ref) < TOL[torch.float32])):
        monkeypatch.setattr(ops, "WIDE_PROBE", probe)
        y = torch.full((32, 6), float("nan"))
        G.spmm(x, coo.topology, coo.values, out=y, wide=True, chunks=1)
        assert check(y), probe
    # 16 (lane-owned products without their shared-memory reads): every element written, not the product
    monkeypatch.setattr(ops, "WIDE_PROBE", 16)
    with ops.wide_mode("own"):
        y = torch.full((32, 6), float("nan"))
        G.spmm(x, coo.topology, coo.values, out=y, wide=True, chunks=1)
    assert torch.isfinite(y).all() and _rel(y, ref) > 0.1


def _check_spmm(coo, B, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    o, i = coo.shape
    x = torch.randn(B, i, generator=g)
    dy = torch.randn(B, o, generator=g)
    t, v = coo.topology, coo.values
    y = torch.full((B, o), float("nan"))
    dx = torch.full((B, i), float("nan"))
    G.spmm(x, t, v, out=y, **kw)
    G.spmm_t(dy, t, v, out=dx, **kw)
    vd = v.double()
    assert _rel(y, spmm_reference(x.double(), t.indices, vd, o)) < TOL[torch.float32]
    assert _rel(dx, spmm_t_reference(dy.double(), t.indices, vd, i)) < TOL[torch.float32]


@pytest.mark.parametrize("B,kw,dtype", [
    (3, {}, torch.float32),                                  # tiled, BT = 4
    (9, {}, torch.float16),                                  # tiled, two tiles, fp16
    (33, {"wide": True, "chunks": 1}, torch.float32),       # wide, one chunk: written once
    (20, {"wide": True, "chunks": 3}, torch.float32),       # wide, atomics across chunks
    (12, {"wide": True, "chunks": 2}, torch.bfloat16),      # wide, atomics into an fp32 buffer
])
def test_forward_adds_the_bias_in_the_kernel(B, kw, dtype):
    coo = COO.random((6, 27), density=0.4, seed=B)
    g = torch.Generator().manual_seed(B)
    x = torch.randn(B, 27, generator=g).to(dtype)
    bias = torch.randn(6, generator=g).to(dtype)
    v = coo.values.to(dtype)
    y = torch.full((B, 6), float("nan"), dtype=dtype)
    G.spmm(x, coo.topology, v, out=y, bias=bias, **kw)
    ref = spmm_reference(x.double(), coo.topology.indices, v.double(), 6) + bias.double()
    assert _rel(y, ref) < TOL[dtype]
    # no non-zeros: the output is the bias
    empty = COO(torch.empty(2, 0, dtype=torch.int32), torch.empty(0), (6, 27))
    y0 = G.spmm(x, empty.topology, torch.empty(0, dtype=dtype), bias=bias, **kw)
    assert torch.equal(y0, bias.expand(B, 6))
    with pytest.raises(ValueError, match="bias must have shape"):
        G.spmm(x, coo.topology, v, bias=bias[:5])
    with pytest.raises(TypeError, match="bias has dtype"):
        G.spmm(x, coo.topology, v, bias=bias.double())


@pytest.mark.parametrize("chunks", [1, 2])
def test_wide_flush_with_more_rows_than_threads(monkeypatch, chunks):
    # one row block of 70 rows for 32 threads: the flush loops over rows one column at a time
    from snack.gpu import ops
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    coo = COO.random((70, 13), density=0.3, seed=chunks)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 13, generator=g)
    bias = torch.randn(70, generator=g)
    y = torch.full((40, 70), float("nan"))
    G.spmm(x, coo.topology, coo.values, out=y, bias=bias, wide=True, chunks=chunks)
    ref = spmm_reference(x.double(), coo.topology.indices, coo.values.double(), 70) + bias.double()
    assert _rel(y, ref) < TOL[torch.float32]


@pytest.mark.parametrize("chunks,B", [(1, 33), (2, 32)])  # B = 32: the fused backward too
def test_wide_rows_pipelined_across_long_empty_and_partial_segments(monkeypatch, chunks, B, wide_mode):
    # 2 warps over one row block of 12 rows (6 rows each): segments of several 32-entry steps
    # (the last one partial), empty rows, and a row with non-zeros in the second chunk only,
    # so that each warp's stream of steps runs across rows of every kind
    from snack.gpu import ops
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    g = torch.Generator().manual_seed(chunks)
    mask = torch.rand(12, 150, generator=g) < 0.3
    mask[0] = mask[4] = mask[11] = True     # 150 non-zeros (75 per chunk of two)
    mask[2] = mask[7] = False               # empty
    mask[9] = False
    mask[9, 100:] = True                    # second chunk only
    idx = mask.nonzero().T.to(torch.int32)
    coo = COO(idx, torch.randn(idx.shape[1], generator=g), (12, 150))
    _check_wide(wide_mode, coo, B, seed=8, wide=True, chunks=chunks, threads=64)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("dtype,B,chunks", [(torch.float32, 35, None), (torch.float16, 40, 2)])
def test_wide_rows4_groups_with_segments_of_every_length(monkeypatch, dtype, B, chunks, own):
    # a row per group of 8 lanes (rows4, or lane-owned with own), one warp over 17 rows: the
    # four groups of a warp walk segments of 0, 1, 7, 8, 9, 32, 33 and 90 non-zeros side by side
    # (rounds of 8 entries, or 8 x WIDE_OWN_PER_LANE, the last one trimmed to the longest
    # segment), and the last round of rows has one row and three groups past the block's rows
    from snack.gpu import ops
    monkeypatch.setattr(ops, "WIDE_OWN", own)
    monkeypatch.setattr(ops, "WIDE_ROWS4_BELOW", 10 ** 9)
    monkeypatch.setattr(ops, "SDDMM_ROWS4", True)
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    g = torch.Generator().manual_seed(3)
    lengths = [90, 0, 1, 7, 8, 9, 16, 17, 0, 0, 3, 90, 32, 33, 31, 40, 5]
    mask = torch.zeros(len(lengths), 90, dtype=torch.bool)
    for r, n in enumerate(lengths):
        mask[r, torch.randperm(90, generator=g)[:n]] = True
    idx = mask.nonzero().T.to(torch.int32)
    coo = COO(idx, torch.randn(idx.shape[1], generator=g), tuple(mask.shape))
    _check(coo, B, dtype, seed=4, wide=True, chunks=chunks, threads=32)


@pytest.mark.parametrize("order", [True, False])
@pytest.mark.parametrize("mode", ["rows4", "own"])
def test_wide_rows_taken_longest_first(monkeypatch, mode, order):
    # the forward's groups of 8 lanes take a row block's rows longest segment first
    # (ops._seg_order: a different order in each column chunk; the transposed SpMM keeps index
    # order) or in index order: two row blocks of 7 rows (the
    # second one 6, so a position of its table is empty), 2 warps, 2 chunks, rows of 0-40
    # non-zeros per chunk, B = 35 (two batch tiles, the second partial; at B <= 32, one tile,
    # index order whatever WIDE_ORDER says)
    from snack.gpu import ops
    monkeypatch.setattr(ops, "WIDE_ORDER", order)
    monkeypatch.setattr(ops, "_grid_rows", lambda *args, **kw: 2)
    g = torch.Generator().manual_seed(11)
    lengths = [(40, 0), (0, 3), (5, 40), (17, 17), (1, 0), (33, 9), (0, 0),
               (8, 31), (26, 2), (0, 40), (12, 12), (39, 1), (2, 25)]
    mask = torch.zeros(len(lengths), 80, dtype=torch.bool)
    for r, (a, b) in enumerate(lengths):
        mask[r, torch.randperm(40, generator=g)[:a]] = True
        mask[r, 40 + torch.randperm(40, generator=g)[:b]] = True
    idx = mask.nonzero().T.to(torch.int32)
    coo = COO(idx, torch.randn(idx.shape[1], generator=g), tuple(mask.shape))
    with ops.wide_mode(mode):
        _check_spmm(coo, 35, seed=12, wide=True, chunks=2, threads=64)
        y = G.spmm(torch.randn(35, 80, generator=g), coo.topology, coo.values, wide=True, chunks=2, threads=64,
                   bias=torch.randn(13, generator=g))
        assert torch.isfinite(y).all()
    names = {key[1]: plan[0].dispatcher.py_func.__name__ for key, plan in coo.topology.cache.items()
             if isinstance(key, tuple) and key[0] == "spmm_plan" and plan is not None}
    assert ("_ord" in names[False]) == order and "_ord" not in names[True], names  # the forward only
    with ops.wide_mode(mode):
        one_tile = G.spmm(torch.randn(32, 80, generator=g), coo.topology, coo.values, wide=True, chunks=2, threads=64)
    assert torch.isfinite(one_tile).all()
    assert not any("_ord" in plan[0].dispatcher.py_func.__name__ for key, plan in coo.topology.cache.items()
                   if isinstance(key, tuple) and key[0] == "spmm_plan" and key[2] == 32)
    assert any(isinstance(k, tuple) and k[0] == "seg_order" for k in coo.topology.cache) == order


@pytest.mark.parametrize("B", [9, 33])  # B = 33: the SDDMM's tiles add up in fp32 atomics
def test_wide_kernels_bfloat16_with_chunks(B):
    coo = COO.random((3, 17), density=0.4, seed=9)
    _check(coo, B, torch.bfloat16, seed=4, wide=True, chunks=2)


def test_bad_input_is_rejected_before_launch():
    coo = COO.random((4, 6), density=0.5, seed=0)
    t, v = coo.topology, coo.values
    with pytest.raises(ValueError, match="x must have 6 columns"):
        G.spmm(torch.randn(2, 5), t, v)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        G.spmm(torch.randn(2, 6, dtype=torch.float64), t, v.double())
    with pytest.raises(TypeError, match="values has dtype"):
        G.spmm(torch.randn(2, 6), t, v.half())
    with pytest.raises(ValueError, match="values must have shape"):
        G.spmm(torch.randn(2, 6), t, v[:-1])
    with pytest.raises(ValueError, match="dy must have 4 columns"):
        G.spmm_t(torch.randn(2, 6), t, v)
    with pytest.raises(ValueError, match="same batch size"):
        G.sddmm(torch.randn(3, 4), torch.randn(2, 6), t)
    out = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="out must be"):
        G.spmm(torch.randn(2, 6), t, v, out=out)
    assert torch.equal(out, torch.zeros(2, 5))  # nothing half-written
    with pytest.raises(ValueError, match="out must not require grad"):
        G.spmm(torch.randn(2, 6), t, v, out=torch.zeros(2, 4, requires_grad=True))
    dy, x = torch.randn(2, 4), torch.randn(2, 6)  # the fused backward checks like the three ops
    for args, err, msg in (((torch.randn(2, 5), x, t, v), ValueError, "dy must have 4 columns"),
                           ((dy, torch.randn(2, 7), t, v), ValueError, "x must have 6 columns"),
                           ((torch.randn(3, 4), x, t, v), ValueError, "same batch size"),
                           ((dy, x.half(), t, v), TypeError, "x has dtype"),
                           ((dy, x, t, v.half()), TypeError, "values has dtype"),
                           ((dy, x, t, v[:-1]), ValueError, "values must have shape"),
                           ((dy.double(), x.double(), t, v.double()), TypeError, "float32, float16 or bfloat16")):
        with pytest.raises(err, match=msg):
            G.spmm_t_sddmm(*args, fused=True)


def test_bad_options_outputs_sharing_inputs_and_a_coo_for_a_topology_are_rejected():
    coo = COO.random((4, 6), density=0.5, seed=0)
    t, v = coo.topology, coo.values
    x, dy = torch.randn(3, 6), torch.randn(3, 4)
    for kw, err, msg in ((dict(threads=48), ValueError, "threads must be a multiple of 32"),
                         (dict(threads=0), ValueError, "threads must be a multiple of 32"),
                         (dict(threads=2048), ValueError, "threads must be a multiple of 32"),
                         (dict(bt=3), ValueError, r"bt must be None or one of \(1, 2, 4, 8, 16, 32\)"),
                         (dict(bt=2.5), ValueError, "bt must be"),
                         (dict(wide="no"), TypeError, "wide must be None, True or False"),
                         (dict(chunks=0), ValueError, "chunks must be None or an int >= 1"),
                         (dict(chunks=2.5), ValueError, "chunks must be"),
                         (dict(split=-3), ValueError, "split must be None or an int >= 1")):
        for op in (lambda: G.spmm(x, t, v, **kw), lambda: G.spmm_t(dy, t, v, **kw)):
            with pytest.raises(err, match=msg):
                op()
        if "split" not in kw:
            with pytest.raises(err, match=msg):
                G.sddmm(dy, x, t, **kw)
        if not {"bt", "wide"} & set(kw):
            with pytest.raises(err, match=msg):
                G.spmm_t_sddmm(dy, x, t, v, **kw)
    with pytest.raises(TypeError, match="pass coo.topology"):
        G.spmm(x, coo, v)
    with pytest.raises(TypeError, match="topo must be a snack.core.Topology"):
        G.sddmm(dy, x, None)
    # an output sharing memory with an input: other blocks would read what one block writes
    buf = torch.full((3, 4), 7.0)
    for call, name in ((lambda: G.spmm(x, t, v, out=buf, bias=buf[0]), "bias"),
                       (lambda: G.spmm(x, t, buf.view(-1)[:coo.nnz], out=buf), "values"),
                       (lambda: G.spmm_t(buf, t, v, out=torch.empty(3, 6)), None),
                       (lambda: G.sddmm(buf, x, t, out=buf.view(-1)[:coo.nnz]), "dy")):
        if name is None:
            call()  # distinct buffers: fine
            continue
        with pytest.raises(ValueError, match=f"out shares memory with {name}"):
            call()
        assert torch.equal(buf, torch.full((3, 4), 7.0))  # nothing written
    sq = COO.random((6, 6), density=0.5, seed=1)
    xs = torch.randn(6, 6)
    with pytest.raises(ValueError, match="out shares memory with x"):
        G.spmm(xs, sq.topology, sq.values, out=xs)
    # one buffer: x and out side by side share no element (fine, and right); a transposed x
    # whose strided extent reaches into out does share memory
    whole = torch.randn(72)
    x_left, out_right = whole[:36].view(6, 6), whole[36:].view(6, 6)
    G.spmm(x_left, sq.topology, sq.values, out=out_right)
    assert torch.allclose(out_right, x_left @ sq.to_dense().T, atol=1e-5)
    with pytest.raises(ValueError, match="out shares memory with x"):
        G.spmm(whole[30:66].view(6, 6).t(), sq.topology, sq.values, out=out_right)
    with pytest.raises(TypeError, match="bias_grad must be True or False"):
        G.sddmm(dy, x, t, bias_grad="no")
    with pytest.raises(TypeError, match="bias_grad must be True or False"):
        G.spmm_t_sddmm(dy, x, t, v, bias_grad=1)


def test_a_hand_built_topology_is_checked_before_any_kernel():
    # the kernels do not bounds-check: a Topology made by hand with indices out of range, unsorted
    # or repeated is refused before the first plan is built from it, and out= stays as it was
    from snack.core import Topology
    v = torch.ones(2)
    for bad, msg in (([[0, 9], [0, 1]], r"topo: indices\[0\]"), ([[0, 1], [0, 70]], r"topo: indices\[1\]"),
                     ([[1, 0], [0, 1]], "canonical"), ([[1, 1], [2, 2]], "canonical")):
        t = Topology(torch.tensor(bad, dtype=torch.int32), (5, 7))
        y = torch.full((3, 5), float("nan"))
        dx = torch.full((3, 7), float("nan"))
        for call in (lambda: G.spmm(torch.randn(3, 7), t, v, out=y), lambda: G.spmm_t(torch.randn(3, 5), t, v, out=dx),
                     lambda: G.sddmm(torch.randn(3, 5), torch.randn(3, 7), t),
                     lambda: G.spmm_t_sddmm(torch.randn(3, 5), torch.randn(3, 7), t, v, fused=True)):
            with pytest.raises(ValueError, match=msg):
                call()
        assert y.isnan().all() and dx.isnan().all()


def test_hand_built_topologies_strided_or_refreshed_after_a_cached_plan():
    # indices made as a transposed (nnz, 2) table (strided): the kernels read the two rows as
    # flat arrays, so the topology keeps a contiguous copy and every op matches the reference
    from snack.core import Topology
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(6, 9, generator=g) < 0.4
    idx = torch.stack(torch.where(mask), 1).to(torch.int32).t()
    assert not idx.is_contiguous()
    t = Topology(idx, (6, 9))
    assert t.indices.is_contiguous() and torch.equal(t.indices, idx)
    v = torch.randn(t.nnz, generator=g)
    w = torch.zeros(6, 9)
    w[mask] = v
    x, dy = torch.randn(3, 9, generator=g), torch.randn(3, 6, generator=g)
    torch.testing.assert_close(G.spmm(x, t, v), x @ w.T)
    torch.testing.assert_close(G.spmm_t(dy, t, v), dy @ w)
    torch.testing.assert_close(G.sddmm(dy, x, t), (dy.T @ x)[mask])
    # a pattern refreshed in place after the op cached its plan (whose fast path skips the
    # checks): an invalid new pattern is refused by name and changes nothing
    before = t.indices.clone()
    for bad, msg in (([[0, 1], [1, 9]], r"new: indices\[1\]"), ([[1, 0], [0, 1]], "new: .*canonical")):
        new = torch.tensor(bad, dtype=torch.int32)
        new = torch.cat([new, t.indices[:, 2:]], 1) if t.nnz > 2 else new
        with pytest.raises(ValueError, match=msg):
            t.refresh_from(Topology(new, (6, 9)))
        assert torch.equal(t.indices, before)
    torch.testing.assert_close(G.spmm(x, t, v), x @ w.T)


def test_inputs_that_require_grad():
    # the ops take tensors that require grad (they are not autograd functions: no graph is made)
    coo = COO.random((5, 7), nnz=12, seed=3)
    x = torch.randn(2, 7, requires_grad=True)
    v = coo.values.clone().requires_grad_()
    y = G.spmm(x, coo.topology, v)
    assert not y.requires_grad
    assert _rel(y, spmm_reference(x.detach().double(), coo.indices, coo.values.double(), 5)) < TOL[torch.float32]


def test_fused_backward_fallback_keeps_chunks_and_split(monkeypatch):
    # where the fused kernel does not apply (here: fused=False), dX still gets the chunks and
    # split asked for, which mean the same column chunks of dY there
    import snack.gpu.ops as ops
    coo = COO.random((5, 40), density=0.5, seed=3)
    seen = []
    real = ops.spmm_t
    monkeypatch.setattr(ops, "spmm_t", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    g = torch.Generator().manual_seed(4)
    dy, x = torch.randn(3, 5, generator=g), torch.randn(3, 40, generator=g)
    dx, dv = G.spmm_t_sddmm(dy, x, coo.topology, coo.values, fused=False, chunks=3, split=2)
    assert seen and seen[0]["chunks"] == 3 and seen[0]["split"] == 2
    ref = spmm_t_reference(dy.double(), coo.indices, coo.values.double(), 40)
    assert _rel(dx, ref) < TOL[torch.float32]


@pytest.mark.parametrize("B", [2, 20])
def test_fused_backward_and_its_fallback_agree(B):
    # fused=False takes spmm_t and sddmm: the same results as the fused launch (dX's sums in
    # another order: close, not equal); no non-zeros never fuses and gives zeros
    coo = COO.random((9, 21), density=0.4, seed=B)
    g = torch.Generator().manual_seed(B)
    dy, x = torch.randn(B, 9, generator=g), torch.randn(B, 21, generator=g)
    t, v = coo.topology, coo.values
    for bias_grad in (False, True):
        a = G.spmm_t_sddmm(dy, x, t, v, bias_grad=bias_grad, fused=True, threads=64)
        b = G.spmm_t_sddmm(dy, x, t, v, bias_grad=bias_grad, fused=False, threads=64)
        assert len(a) == len(b) == 2 + bias_grad
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    empty = COO(torch.zeros(2, 0, dtype=torch.int32), torch.zeros(0), (9, 21))
    assert not G.fuses_backward(B, empty.topology, fused=True)
    dx, dv, db = G.spmm_t_sddmm(dy, x, empty.topology, empty.values, bias_grad=True, fused=True)
    assert torch.equal(dx, torch.zeros(B, 21)) and dv.shape == (0,)
    torch.testing.assert_close(db, dy.sum(0))


@pytest.mark.parametrize("wide", [False, True])
def test_transposed_spmm_keeps_only_int32_metadata(wide):
    # the GPU path caches the column permutation as int32 only (4 bytes per connection)
    coo = COO.random((6, 9), density=0.5, seed=3)
    t = coo.topology
    G.spmm_t(torch.randn(2, 6), t, coo.values, wide=wide)
    assert "col_perm" not in t.cache and "cols_by_col" not in t.cache
    assert t.cache["col_perm_i32"].dtype == torch.int32
    assert torch.equal(t.cache["col_perm_i32"].long(), t.col_perm)  # rebuilt on demand, same order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_within_twice_torchs_own(dtype):
    # the rule: our error <= 2 x the error of torch's own dense matmul at that dtype (+ a small atol),
    # both against the float64 product of the same rounded inputs
    g = torch.Generator().manual_seed(21)
    coo = COO.random((9, 40), density=0.5, seed=8)
    x = torch.randn(6, 40, generator=g).to(dtype)
    v = coo.values.to(dtype)
    ref = spmm_reference(x.double(), coo.indices, v.double(), 9)
    w = coo.with_values(v).to_dense()
    torch_err = ((x @ w.t()).double() - ref).abs().max().item()
    ours = G.spmm(x, coo.topology, v)
    our_err = (ours.double() - ref).abs().max().item()
    assert our_err <= 2 * torch_err + 1e-3 * ref.abs().max().item(), (our_err, torch_err)


def test_transposed_index_is_uint16_up_to_65536_rows(monkeypatch):
    # the transposed SpMM reads the rows of W's entries in column order as uint16 (the int32
    # copy leaves the topology's cache); above IDX16_MAX_ROWS rows, or above
    # IDX16_MAX_DENSITY, they stay int32
    import snack.gpu.ops as ops
    assert ops._rows_by_col(COO.random((9, 13), density=0.4, seed=31).topology).dtype == torch.int32
    coo = COO.random((9, 13), density=0.2, seed=31)
    t = coo.topology
    r = ops._rows_by_col(t)
    assert r.dtype == torch.uint16 and "rows_by_col" not in t.cache and "col_perm" not in t.cache
    assert torch.equal(r.to(torch.int64), coo.indices[0][torch.argsort(coo.indices[1] * 9 + coo.indices[0])].long())
    _check(coo, 3, torch.float32, seed=32)
    monkeypatch.setattr(ops, "IDX16_MAX_ROWS", 8)
    coo2 = COO.random((9, 13), density=0.2, seed=31)
    assert ops._rows_by_col(coo2.topology).dtype == torch.int32
    _check(coo2, 3, torch.float32, seed=32)
    _check(coo2, 33, torch.float32, seed=33, wide=True, chunks=2)


def test_large_batches_go_in_slices(monkeypatch):
    # operands past the kernels' 32-bit offsets are cut into batch slices (limit lowered here)
    import snack.gpu.ops as ops
    monkeypatch.setattr(ops, "MAX_ELEMENTS", 2 * 13)
    coo = COO.random((9, 13), density=0.4, seed=12)
    _check(coo, 3, torch.float32, seed=13)  # slices of 2 and 1 rows (width 13)


def test_cached_launch_plans_follow_batch_and_dtype():
    # one topology, calls with different batch sizes (different tiles) and dtypes in turn: each
    # call must use its own cached launch plan
    coo = COO.random((5, 19), density=0.4, seed=21)
    for B, dtype in ((2, torch.float32), (9, torch.float32), (2, torch.float16), (2, torch.float32)):
        _check(coo, B, dtype, seed=B)


# ---- the fused Adam step ---------------------------------------------------------------------
@pytest.mark.parametrize("cls,wd", [(torch.optim.Adam, 0.0), (torch.optim.Adam, 0.1), (torch.optim.AdamW, 0.05)])
def test_adam_step_matches_torch_adam(cls, wd):
    # one kernel step per call against torch's own Adam / AdamW over several steps (odd size,
    # several grid-stride rounds: 2 simulated SMs x 64 blocks x 32 threads < 4500)
    g = torch.Generator().manual_seed(5)
    n = 4500
    p = torch.randn(n, generator=g)
    ref = p.clone().requires_grad_()
    opt = cls([ref], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd)
    m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
    for _ in range(4):
        grad = torch.randn(n, generator=g)
        ref.grad = grad.clone()
        opt.step()
        step += 1
        G.adam_step(p, grad, m, v, step, lr=0.01, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=wd,
                    decoupled=cls is torch.optim.AdamW)
    st = opt.state[ref]
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, st["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sizes", [(4500,), (4500, 7), (0, 33), (3, 0, 2000), (1, 2, 3, 4)])
def test_adam_steps_advance_step_counts_and_match_torch(sizes):
    # tensors two per launch (odd counts, empty ones, a second tensor larger than the grid's
    # first round); the kernel advances every step count itself and leaves the counter at zero
    g = torch.Generator().manual_seed(7)
    ps = [torch.randn(n, generator=g) for n in sizes]
    refs = [p.clone().requires_grad_() for p in ps]
    opt = torch.optim.AdamW(refs, lr=0.02, betas=(0.85, 0.9), eps=1e-7, weight_decay=0.03)
    ms, vs = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    steps = [torch.full((), float(i)) for i in range(len(sizes))]  # different counts per tensor
    counter = torch.zeros(3, dtype=torch.int32)
    for i, r in enumerate(refs):  # the reference starts from the same counts
        opt.state[r]["step"] = torch.tensor(float(i))
        opt.state[r]["exp_avg"], opt.state[r]["exp_avg_sq"] = torch.zeros(sizes[i]), torch.zeros(sizes[i])
    for _ in range(3):
        grads = [torch.randn(n, generator=g) for n in sizes]
        for r, gr in zip(refs, grads):
            r.grad = gr.clone()
        opt.step()
        G.adam_steps(ps, grads, ms, vs, steps, counter=counter, lr=0.02, beta1=0.85, beta2=0.9, eps=1e-7,
                     weight_decay=0.03, decoupled=True)
    assert [float(s) for s in steps] == [i + 3.0 for i in range(len(sizes))]
    assert torch.equal(counter, torch.zeros(3, dtype=torch.int32))
    for p, r, m, v in zip(ps, refs, ms, vs):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, opt.state[r]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, opt.state[r]["exp_avg_sq"], rtol=1e-6, atol=1e-7)


def test_adam_steps_bad_input_changes_nothing():
    ps = [torch.zeros(5), torch.zeros(3)]
    args = lambda: ([torch.ones(5), torch.ones(3)], [torch.zeros(5), torch.zeros(3)],
                    [torch.zeros(5), torch.zeros(3)], [torch.ones(()), torch.ones(())])
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    grads, ms, vs, steps = args()
    with pytest.raises(ValueError, match=r"exp_avg\[1\] must have 3 elements"):
        G.adam_steps(ps, grads, [ms[0], torch.zeros(4)], vs, steps, counter=torch.zeros(1, dtype=torch.int32), **hyper)
    with pytest.raises(ValueError, match="counter must have at least 1"):
        G.adam_steps(ps, grads, ms, vs, steps, counter=torch.zeros(0, dtype=torch.int32), **hyper)
    with pytest.raises(TypeError, match="counter must be a contiguous int32"):
        G.adam_steps(ps, grads, ms, vs, steps, counter=torch.zeros(1), **hyper)
    with pytest.raises(ValueError, match="same length"):
        G.adam_steps(ps, grads[:1], ms, vs, steps, counter=torch.zeros(1, dtype=torch.int32), **hyper)
    # two sets sharing memory: one launch would update both and lose one update
    big = torch.zeros(8)
    for bad, msg in ((dict(params=[ps[0], ps[0]]), r"params\[0\] and params\[1\] share memory"),
                     (dict(exp_avgs=[big[:5], big[4:7]]), r"exp_avgs\[0\] and exp_avgs\[1\] share memory"),
                     (dict(grads=[grads[0], ps[0][:3]]), r"params\[0\] and grads\[1\] share memory"),
                     (dict(steps=[steps[0], steps[0]]), r"steps\[0\] and steps\[1\] share memory")):
        call = dict(params=ps, grads=grads, exp_avgs=ms, exp_avg_sqs=vs, steps=steps, **hyper)
        call.update({k: v for k, v in bad.items()})
        if "params" in bad:
            call.update(grads=[grads[0], torch.ones(5)], exp_avgs=[ms[0], torch.zeros(5)],
                        exp_avg_sqs=[vs[0], torch.zeros(5)])
        with pytest.raises(ValueError, match=msg):
            G.adam_steps(counter=torch.zeros(1, dtype=torch.int32), **call)
    with pytest.raises(TypeError, match="decoupled must be True or False"):
        G.adam_steps(ps, grads, ms, vs, steps, counter=torch.zeros(1, dtype=torch.int32), decoupled="yes", **hyper)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in ps) and [float(s) for s in steps] == [1.0, 1.0]
    assert torch.equal(big, torch.zeros(8))


def test_adam_step_bad_input():
    p, grad, m, v, s = torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.ones(1)
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    with pytest.raises(TypeError, match="grad must be float32"):
        G.adam_step(p, grad.double(), m, v, s, **hyper)
    with pytest.raises(ValueError, match="exp_avg_sq must have 5 elements"):
        G.adam_step(p, grad, m, torch.zeros(4), s, **hyper)
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        G.adam_step(p, grad, torch.zeros(10)[::2], v, s, **hyper)
    with pytest.raises(ValueError, match="step must have 1 elements"):
        G.adam_step(p, grad, m, v, torch.ones(2), **hyper)
    with pytest.raises(ValueError, match="beta1 and beta2"):
        G.adam_step(p, grad, m, v, s, **dict(hyper, beta2=1.0))
    with pytest.raises(TypeError, match="lr must be a Python number"):
        G.adam_step(p, grad, m, v, s, **dict(hyper, lr=torch.tensor(0.1)))
    for key, bad in (("lr", float("nan")), ("lr", -1.0), ("lr", float("inf")), ("eps", -1e-8),
                     ("eps", float("nan")), ("weight_decay", -0.1), ("weight_decay", float("nan"))):
        with pytest.raises(ValueError, match=f"{key} must be a finite number"):
            G.adam_step(p, grad, m, v, s, **dict(hyper, **{key: bad}))
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        G.adam_step(p, grad, m, m, s, **hyper)
    with pytest.raises(ValueError, match="param and grad share memory"):
        G.adam_step(p, p, m, v, s, **hyper)
    assert torch.equal(p, torch.zeros(5)) and torch.equal(m, torch.zeros(5))  # nothing written


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_snack_optimizer_kernel_path_matches_torch(name):
    # snack.optim on a model with a SparseLinear: under the simulator its CPU parameters take the
    # kernel path; same trajectory and state as torch's optimizer, state_dict loads into torch's
    import snack
    torch.manual_seed(3)
    model = torch.nn.Sequential(snack.SparseLinear(13, 9, sparsity=0.6), torch.nn.ReLU(), torch.nn.Linear(9, 4))
    twin = copy.deepcopy(model)
    groups = lambda m: [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": 0.003}]
    ours = getattr(snack.optim, name)(groups(model), lr=0.01, weight_decay=0.02)
    theirs = getattr(torch.optim, name)(groups(twin), lr=0.01, weight_decay=0.02)
    x = torch.randn(6, 13)
    for _ in range(3):
        for m, o in ((model, ours), (twin, theirs)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sv = ours.state[model[0].values]
    assert sv["step"].device == model[0].values.device and float(sv["step"]) == 3
    torch.testing.assert_close(sv["exp_avg_sq"], theirs.state[twin[0].values]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    fresh = getattr(torch.optim, name)(groups(twin), lr=0.01)
    fresh.load_state_dict(ours.state_dict())  # same layout: loads into torch's optimizer
    assert torch.equal(fresh.state[twin[0].values]["exp_avg"], sv["exp_avg"])


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("alias", ["twice", "one storage"])
def test_snack_optimizer_parameters_sharing_memory_take_torchs_step(name, alias):
    # one launch updates two parameters at once: a parameter given twice, or two on one storage,
    # would race there; they take torch's step, which updates them one after the other
    import snack
    runs = []
    for mod in (snack.optim, torch.optim):
        p = torch.nn.Parameter(torch.randn(40, generator=torch.Generator().manual_seed(4)))
        params = [p, p] if alias == "twice" else [p, torch.nn.Parameter(p.data)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch warns of a duplicate parameter)
            opt = getattr(mod, name)(params, lr=0.1, weight_decay=0.01)
        for _ in range(4):
            opt.zero_grad()
            sum(q.sin().sum() for q in params).backward()
            opt.step()
        runs.append((p.detach().clone(), float(opt.state[p]["step"])))
    (ours, steps), (theirs, their_steps) = runs
    assert steps == their_steps
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_snack_optimizer_with_grad_scaler_and_fused_skips_overflowing_steps(name):
    # torch.amp.GradScaler hands a fused=True optimizer its scale and inf flag instead of
    # unscaling: the step must be torch's (skipped on inf, gradients unscaled), not the kernel's
    import snack
    torch.manual_seed(5)
    model = torch.nn.Sequential(snack.SparseLinear(12, 7, sparsity=0.5), torch.nn.Linear(7, 3))
    twin = copy.deepcopy(model)
    ours = getattr(snack.optim, name)(model.parameters(), lr=0.01, fused=True, weight_decay=0.01)
    theirs = getattr(torch.optim, name)(twin.parameters(), lr=0.01, fused=True, weight_decay=0.01)
    x = torch.randn(5, 12)
    for scale in (1.0, float("inf"), 1.0):  # the second step overflows
        for m, o in ((model, ours), (twin, theirs)):
            scaler = getattr(o, "_test_scaler", None) or torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
            o._test_scaler = scaler
            o.zero_grad()
            scaler.scale(m(x).square().sum() * scale).backward()
            scaler.step(o)
            scaler.update()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ours._work() is not None  # without a scaler the kernel path is taken again


def test_snack_optimizer_resumes_torch_state_and_skips_params_without_grad():
    # a checkpoint of torch's Adam (CPU step counts) continues under snack.optim.Adam exactly as
    # under torch's; a parameter without a gradient is left alone; a non-contiguous gradient
    # makes the step torch's own
    import snack
    torch.manual_seed(4)
    model = torch.nn.Sequential(snack.SparseLinear(10, 6, sparsity=0.5), torch.nn.Linear(6, 3))
    frozen = torch.nn.Parameter(torch.randn(5))
    twin, twin_frozen = copy.deepcopy(model), frozen.detach().clone().requires_grad_()
    x = torch.randn(4, 10)
    ref = torch.optim.Adam(list(twin.parameters()) + [twin_frozen], lr=0.02)
    for _ in range(2):
        ref.zero_grad()
        twin(x).square().sum().backward()
        ref.step()
    model.load_state_dict(twin.state_dict())
    ours = snack.optim.Adam(list(model.parameters()) + [frozen], lr=0.02)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))   # a checkpoint: no shared tensors
    for m, o in ((model, ours), (twin, ref)):
        o.zero_grad()
        m(x).square().sum().backward()
        if o is ours:
            assert o._work() is not None and frozen.grad is None
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(frozen, twin_frozen) and float(ours.state[model[0].values]["step"]) == 3
    w = model[1].weight
    w.grad = torch.randn(3, 6).t().contiguous().t()          # right shape, not contiguous
    assert ours._work() is None


@cuda.jit
def _to_bf16_bits(x, out):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x.size:
        out[i] = _cv_bf16(x[i])


def test_bfloat16_rounding_matches_torch_and_keeps_nan():
    # the kernels' fp32 -> bfloat16 store: round to nearest even as torch does, +-Inf kept,
    # overflow to Inf, and every NaN (the GPU's own 0x7FFFFFFF among them) a NaN of its sign
    special = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
               0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000,
               0x3F807FFF, 0x00000001, 0x80000001, 0x00000000, 0x80000000, 0x007FFFFF]
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in special], dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(200, generator=torch.Generator().manual_seed(5)) * 1e3])
    out = torch.zeros(x.numel(), dtype=torch.int16)
    xs, outs = x.numpy(), out.numpy()
    _to_bf16_bits[(x.numel() + 63) // 64, 64](xs, outs)
    got = torch.from_numpy(outs).view(torch.bfloat16).float()
    want = x.to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(torch.signbit(got[nan]), torch.signbit(x[nan]))
    assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,kw", [(3, {}), (20, dict(wide=True, chunks=2))])
def test_nan_in_an_input_reaches_exactly_the_outputs_it_feeds(dtype, B, kw):
    coo = COO.random((9, 40), density=0.2, seed=B)
    t, v = coo.topology, coo.values.to(dtype)
    r, c = t.indices[0].long(), t.indices[1].long()
    col, row = int(c[0]), int(r[-1])
    g = torch.Generator().manual_seed(B)
    x, dy = torch.randn(B, 40, generator=g).to(dtype), torch.randn(B, 9, generator=g).to(dtype)
    x[B - 1, col] = float("nan")
    dy[0, row] = float("nan")
    # every output fed by the NaN is NaN, no other batch row is (the batch row itself may turn
    # NaN further, as in a dense product: 0 * NaN); the value gradient exactly where fed
    for out, b, fed in ((G.spmm(x, t, v, **kw), B - 1, r[c == col]), (G.spmm_t(dy, t, v, **kw), 0, c[r == row])):
        assert torch.isnan(out[b, fed]).all()
        assert torch.isfinite(torch.cat([out[:b], out[b + 1:]])).all()
    assert torch.equal(torch.isnan(G.sddmm(dy, x, t, **kw)), (r == row) | (c == col))


@pytest.mark.parametrize("dtype,B,kw", [(torch.bfloat16, 1, {}), (torch.bfloat16, 2, {}), (torch.float16, 3, {}),
                                        (torch.bfloat16, 9, {}), (torch.bfloat16, 12, dict(wide=True, chunks=2)),
                                        (torch.float16, 12, dict(wide=True, chunks=2)),
                                        (torch.bfloat16, 33, dict(wide=True, chunks=1))])
def test_float32_values_with_half_activations_are_read_unrounded(dtype, B, kw):
    # mixed precision: float32 values (and bias) with float16 / bfloat16 x and dy, products and
    # sums in fp32, outputs rounded once to x's dtype
    n = 40
    idx, vals, e = ladder(n, dtype)  # (conftest)
    coo = COO(idx, vals, (n, n))
    t, v = coo.topology, coo.values
    assert v.dtype == torch.float32
    scale = torch.arange(1, B + 1, dtype=torch.float32)[:, None]
    x = (scale * torch.ones(B, n)).to(dtype)
    bias = 3 * e
    y = torch.full((B, n), float("nan"), dtype=dtype)
    G.spmm(x, t, v, out=y, bias=bias, **kw)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), (scale + 3) * e, rtol=0, atol=0)
    # dX = dY W: column c holds 1 + e_c (row c) and -1 (row c - 1)
    dx = G.spmm_t(x, t, v, **kw)
    assert dx.dtype == dtype
    torch.testing.assert_close(dx.float(), scale * e, rtol=0, atol=0)
    if B <= 32:  # the fused backward: dX from the float32 values, dv and db in dy's dtype
        dy, xf = x, torch.ones(B, n, dtype=dtype)
        fkw = {k: a for k, a in kw.items() if k == "chunks"}
        dx2, dv, db = G.spmm_t_sddmm(dy, xf, t, v, bias_grad=True, fused=True, **fkw)
        torch.testing.assert_close(dx2.float(), scale * e, rtol=0, atol=0)
        assert dv.dtype == db.dtype == dtype
        want = scale.sum().to(dtype)  # sum_b dY[b, r] X[b, c] = sum_b (b + 1), rounded once
        assert torch.equal(dv, want.expand(coo.nnz)) and torch.equal(db, want.expand(n))
    # a float32 bias goes with float32 values only; half values with float32 x are refused
    with pytest.raises(TypeError, match="bias has dtype"):
        G.spmm(x, t, v, bias=bias.to(dtype))
    with pytest.raises(TypeError, match="values has dtype"):
        G.spmm(x.float(), t, v.to(dtype))


@pytest.mark.parametrize("dtype,native", [(torch.float32, False), (torch.float16, False), (torch.float16, True),
                                          (torch.bfloat16, True)])
def test_tiles_transposed_kernel(dtype, native):
    # the gathering SpMMs' input: xt[t, c, j] = x[32 t + j, c] in float32 (or, native, in x's own
    # dtype, bfloat16 as int16 bits), zeros past the batch, from one launch over partial 32 x 32
    # squares
    import numpy as np
    from snack.gpu import kernels
    from snack.gpu.launch import as_kernel_array
    g = torch.Generator().manual_seed(0)
    B, n = 37, 45
    x = torch.randn(B, n, generator=g).to(dtype)
    xt = torch.full((2 * n * 32,), float("nan"), dtype=dtype if native else torch.float32)
    kind = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
    kernels.make_tiles_t_kernel(kind, native)[(2, 2), 256, 0, kernels.TILES_T_SMEM](
        as_kernel_array(x.reshape(-1)).numpy(), as_kernel_array(xt).numpy(), B, n)
    want = torch.cat([x, torch.zeros(64 - B, n, dtype=dtype)]).view(2, 32, n).transpose(1, 2).reshape(-1)
    assert xt.dtype == (dtype if native else torch.float32) and not np.isnan(xt.float().numpy()).any()
    assert torch.equal(xt, want.to(xt.dtype))


@pytest.mark.parametrize("shape,B,density,dtype,vdtype", [
    ((37, 45), 20, 0.3, torch.float32, torch.float32), ((70, 9), 33, 0.4, torch.float32, torch.float32),
    ((40, 150), 64, 0.1, torch.float32, torch.float32), ((37, 45), 20, 0.3, torch.float16, torch.float16),
    ((70, 9), 33, 0.4, torch.bfloat16, torch.bfloat16), ((40, 150), 40, 0.1, torch.bfloat16, torch.float32),
    ((23, 50), 35, 0.2, torch.float16, torch.float32)])
def test_gather_spmms(shape, B, density, dtype, vdtype):
    # the gathering SpMMs (wide_mode "gather"): no staging, each entry reads its column's line of
    # the transposed batch tiles (in x's dtype); partial tiles, rows past the last block's end,
    # empty rows, and dX on the transposed order with its uint16 row index; half precision, and
    # float32 values with half activations; forward with and without a bias and dX against
    # float64 (half: within TOL, the outputs in x's dtype), outputs poisoned, and every plan
    # taking that path
    from snack.gpu import ops
    coo = COO.random(shape, density=density, seed=B)
    t, v = coo.topology, coo.values.to(vdtype)
    g = torch.Generator().manual_seed(B)
    x, dy = torch.randn(B, shape[1], generator=g).to(dtype), torch.randn(B, shape[0], generator=g).to(dtype)
    bias = torch.randn(shape[0], generator=g).to(vdtype)
    y, yb = torch.full((B, shape[0]), float("nan"), dtype=dtype), torch.full((B, shape[0]), float("nan"), dtype=dtype)
    dx = torch.full((B, shape[1]), float("nan"), dtype=dtype)
    with ops.wide_mode("gather"):
        G.spmm(x, t, v, out=y, wide=True)
        G.spmm(x, t, v, out=yb, bias=bias, wide=True)
        G.spmm_t(dy, t, v, out=dx, wide=True)
    gathering = [plan[0] for key, plan in t.cache.items()
                 if isinstance(key, tuple) and key[0] == "spmm_plan" and plan is not None and plan[0].tiles_transposed]
    assert len(gathering) == 3
    xd, vd = x.double(), v.double()
    ref = spmm_reference(xd, t.indices, vd, shape[0])
    assert _rel(y, ref) < TOL[dtype]
    assert _rel(yb, ref + bias.double()) < TOL[dtype]
    assert _rel(dx, spmm_t_reference(dy.double(), t.indices, vd, shape[1])) < TOL[dtype]