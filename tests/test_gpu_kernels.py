"""SNACK kernels on a real GPU (marked `gpu`): every op and variant against the float64 reference
on fresh random inputs (odd shapes, nnz = 0, empty rows, 4096 x 4096 points of the benchmark
grid), outputs poisoned with NaN first; CUDA-graph capture and replay; bad input."""
import pytest
import torch

from conftest import ladder

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _run_all(coo, B, dtype, gen, **kw):
    """The three ops on coo's GPU (which need not be the current device) against float64."""
    import snack.gpu as G
    from snack.core.reference import sddmm_reference, spmm_reference, spmm_t_reference
    o, i = coo.shape
    dev = coo.values.device
    x = torch.randn(B, i, generator=gen).to(dtype).to(dev)
    dy = torch.randn(B, o, generator=gen).to(dtype).to(dev)
    v = coo.values.to(dtype)
    t = coo.topology
    outs = [torch.full((B, o), float("nan"), dtype=dtype, device=dev),
            torch.full((B, i), float("nan"), dtype=dtype, device=dev),
            torch.full((coo.nnz,), float("nan"), dtype=dtype, device=dev)]
    G.spmm(x, t, v, out=outs[0], **kw)
    G.spmm_t(dy, t, v, out=outs[1], **kw)
    sd = {k: a for k, a in kw.items() if k != "split"}
    G.sddmm(dy, x, t, out=outs[2], **sd)
    outs.append(torch.full((coo.nnz,), float("nan"), dtype=dtype, device=dev))
    outs += [G.sddmm(dy, x, t, out=outs[3], bias_grad=True, **sd)[1]]  # dv again, and db
    torch.cuda.synchronize(dev)
    xd, dyd, vd = x.double(), dy.double(), v.double()
    refs = (spmm_reference(xd, t.indices, vd, o), spmm_t_reference(dyd, t.indices, vd, i),
            sddmm_reference(dyd, xd, t.indices))
    refs += (refs[2], dyd.sum(0))
    names = ["spmm", "spmm_t", "sddmm", "sddmm with db", "db"]
    if B <= 32:  # the fused backward with the same chunks and split
        fkw = {k: a for k, a in kw.items() if k in ("chunks", "split", "threads")}
        for bias_grad in (True, False):
            res = G.spmm_t_sddmm(dy, x, t, v, bias_grad=bias_grad, fused=True, **fkw)
            outs += list(res)
            names += [f"fused {n}, bias_grad={bias_grad}" for n in ("dX", "dv", "db")[:len(res)]]
            refs += (refs[1], refs[2], refs[4])[:len(res)]
        torch.cuda.synchronize(dev)
    for name, got, ref in zip(names, outs, refs):
        assert got.device == dev, name
        assert torch.isfinite(got).all(), f"{name}: an output element was not written"
        err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if ref.norm() > 0:
            assert err < TOL[dtype], (name, err)
        else:
            assert torch.equal(got.double(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,B,density", [
    ((7, 96), 1, 0.3), ((96, 7), 40, 0.3), ((333, 40), 3, 0.2), ((40, 333), 8, 0.1),
    ((1, 1), 1, 1.0), ((513, 1025), 17, 0.05), ((300, 7000), 33, 0.02), ((64, 70000), 2, 0.001),
    ((1000, 200), 130, 0.5), ((70000, 64), 100, 0.01),  # > 65536 rows: int32 transposed index
])
def test_ops_match_reference(shape, B, density, dtype, gen):
    from snack.core import COO
    coo = COO.random(shape, density=density, generator=gen, device="cuda")
    _run_all(coo, B, dtype, gen)


@pytest.mark.parametrize("B,chunks", [(16, None), (40, 2), (77, 3), (5, 2)])
def test_wide_variants(B, chunks, gen):
    from snack.core import COO
    coo = COO.random((301, 4100), density=0.05, generator=gen, device="cuda")
    _run_all(coo, B, torch.float32, gen, wide=True, chunks=chunks)


@pytest.mark.parametrize("mode", ["warp", "rows4", "own"])
@pytest.mark.parametrize("B,chunks,dtype", [(40, 2, torch.float32), (128, None, torch.bfloat16), (33, 3, torch.float16)])
def test_wide_modes_on_short_and_long_segments(mode, B, chunks, dtype, gen):
    # a warp per row, a row per group of 8 lanes (the default for short segments) or lane-owned
    # non-zeros (the SpMMs; the SDDMM then a warp per row), forced on a matrix whose segments are
    # mostly short (1 %) with a few whole rows; the SDDMM's batch tiles add up with atomics from B = 33
    from snack.gpu import ops
    from snack.core import COO
    mask = torch.rand(777, 4100, generator=gen) < 0.01
    mask[::97] = True
    idx = mask.nonzero().T.to(torch.int32)
    coo = COO(idx, torch.randn(idx.shape[1], generator=gen), (777, 4100)).to("cuda")
    with ops.wide_mode(mode, sddmm=True):
        _run_all(coo, B, dtype, gen, wide=True, chunks=chunks)


@pytest.mark.parametrize("order", [True, False])
@pytest.mark.parametrize("mode,density,B", [("own", 0.1, 33), ("own", 0.05, 64), ("rows4", 0.02, 128), ("own", 0.1, 32)])
def test_wide_rows_in_length_order_or_index_order(monkeypatch, order, mode, density, B, gen):
    # from B = 33 the forward's groups of 8 lanes take a row block's rows longest segment first
    # (ops.WIDE_ORDER, the default) or in index order, 4096 x 4096, with the row lengths of a
    # random pattern; the transposed SpMM, and the forward at B = 32, in index order either way
    from snack.gpu import ops
    from snack.core import COO
    monkeypatch.setattr(ops, "WIDE_ORDER", order)
    coo = COO.random((4096, 4096), density=density, generator=gen, device="cuda")
    with ops.wide_mode(mode, sddmm=True):
        _run_all(coo, B, torch.float32, gen, wide=True)
    names = {key[1]: plan[0].dispatcher.py_func.__name__ for key, plan in coo.topology.cache.items()
             if isinstance(key, tuple) and key[0] == "spmm_plan" and plan is not None}
    assert ("_ord" in names[False]) == (order and B > 32) and "_ord" not in names[True], names


@pytest.mark.parametrize("B,chunks,split,dtype", [
    (32, 4, 1, torch.float32), (64, 4, 2, torch.float32), (100, 3, None, torch.float32),
    (17, 2, 1, torch.float32), (40, 3, 3, torch.float16), (33, 2, 2, torch.bfloat16),
])
def test_wide_split_variants(B, chunks, split, dtype, gen):
    # a block consumes several chunks in turn (split < chunks: plain stores when split = 1)
    from snack.core import COO
    coo = COO.random((301, 4100), density=0.05, generator=gen, device="cuda")
    _run_all(coo, B, dtype, gen, wide=True, chunks=chunks, split=split)


@pytest.mark.parametrize("B,kw,dtype", [
    (1, {}, torch.float32), (8, {}, torch.float16), (32, {}, torch.float32), (130, {}, torch.bfloat16),
    (40, {"wide": True, "chunks": 3, "split": 1}, torch.float32),
])
def test_forward_with_fused_bias(B, kw, dtype, gen):
    import snack.gpu as G
    from snack.core import COO
    from snack.core.reference import spmm_reference
    coo = COO.random((517, 4100), density=0.05, generator=gen, device="cuda")
    x = torch.randn(B, 4100, generator=gen).to(dtype).cuda()
    bias = torch.randn(517, generator=gen).to(dtype).cuda()
    v = coo.values.to(dtype)
    y = torch.full((B, 517), float("nan"), dtype=dtype, device="cuda")
    G.spmm(x, coo.topology, v, out=y, bias=bias, **kw)
    ref = spmm_reference(x.double(), coo.topology.indices, v.double(), 517) + bias.double()
    assert torch.isfinite(y).all()
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


@pytest.mark.parametrize("B,chunks,split,dtype,mode", [
    (32, None, None, torch.float32, None),       # the default 4 chunks at B = 32: clusters of 4 blocks
    (64, 4, 2, torch.float32, "warp"),           # 2 groups of 2 chunks each
    (40, 3, None, torch.float16, "own"),
    (128, None, None, torch.bfloat16, "rows4"),  # 3 chunks x 4 batch tiles
    (17, 8, None, torch.float32, "warp"),        # the largest portable cluster
    (33, 9, None, torch.float32, None),          # 9 groups: atomics
])
def test_chunk_groups_summed_through_cluster_shared_memory(monkeypatch, B, chunks, split, dtype, mode, gen):
    # where 2-8 blocks share a row block, they form a thread-block cluster and add their partial
    # rows through distributed shared memory: every op matches float64 (rows shared unevenly by
    # the cluster's blocks: 517 rows), the same call gives the same bits (no atomics), and the
    # atomics (CLUSTER_SUMS = False) agree within rounding; with float32 values too (mixed)
    import snack.gpu as G
    from snack.gpu import ops
    from snack.core import COO
    from snack.core.reference import spmm_reference
    monkeypatch.setattr(ops, "CLUSTER_SUMS", True)
    coo = COO.random((517, 4100), density=0.05, generator=gen, device="cuda")
    t = coo.topology
    kw = dict(wide=True, chunks=chunks, split=split)
    with ops.wide_mode(mode) if mode else torch.no_grad():
        _run_all(coo, B, dtype, gen, **kw)
        x = torch.randn(B, 4100, generator=gen).to(dtype).cuda()
        bias = torch.randn(517, generator=gen).cuda()
        for v, b in ((coo.values.to(dtype), bias.to(dtype)), (coo.values, bias)):  # one dtype; mixed
            y = G.spmm(x, t, v, bias=b, **kw)
            # the plan key: ("spmm_plan", transposed, batch, kind, ..., has_bias (9), mode, CLUSTER_SUMS (11), ...)
            kind = ops._plan_kind(x.dtype, v.dtype)
            plan = [p for k, p in t.cache.items() if isinstance(k, tuple) and k[0] == "spmm_plan"
                    and k[1] is False and k[2] == B and k[3] == kind and k[9] and k[11]]
            assert len(plan) == 1
            plan = plan[0]
            nsplit = plan[0].grid[0]
            assert plan[1] == ("cluster" if 2 <= nsplit <= 8 else "atomic")
            assert plan[0].cluster == (nsplit if plan[1] == "cluster" else 1)
            ref = spmm_reference(x.double(), t.indices, v.double(), 517) + b.double()
            assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
            if plan[1] == "cluster":
                for _ in range(3):
                    assert torch.equal(G.spmm(x, t, v, bias=b, **kw), y)
            try:
                ops.CLUSTER_SUMS = False
                ya = G.spmm(x, t, v, bias=b, **kw)
            finally:
                ops.CLUSTER_SUMS = True
            assert ((ya.double() - y.double()).norm() / ref.norm()).item() < TOL[dtype]


@pytest.mark.parametrize("chunks", [1, 2])
def test_wide_flush_with_more_rows_than_threads(monkeypatch, chunks, gen):
    # one row block of 1500 rows for 1024 threads: the flush loops over rows one column at a time
    from snack.gpu import ops
    from snack.core import COO
    monkeypatch.setattr(ops, "_grid_rows", lambda *args: 1)
    coo = COO.random((1500, 64), density=0.2, generator=gen, device="cuda")
    _run_all(coo, 40, torch.float32, gen, wide=True, chunks=chunks)


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
@pytest.mark.parametrize("mode", ["warp", "own"])
def test_wide_atomic_flush_into_an_output_at_any_offset(mode, offset, gen):
    # the atomic flush adds quads of 4 rows with 16-byte reductions only where y's base is
    # 16-byte aligned: an fp32 out= that starts 1, 2 or 4 floats into its buffer (4: aligned
    # again) takes the sums itself; the elements before it stay as they were
    import snack.gpu as G
    from snack.core import COO
    from snack.core.reference import spmm_reference, spmm_t_reference
    from snack.gpu import ops
    coo = COO.random((1024, 768), density=0.1, generator=gen, device="cuda")
    t, v = coo.topology, coo.values
    B = 40
    x = torch.randn(B, 768, generator=gen).cuda()
    dy = torch.randn(B, 1024, generator=gen).cuda()
    bias = torch.randn(1024, generator=gen).cuda()
    with ops.wide_mode(mode):
        for shape, args, ref in (
                ((B, 1024), (x, t, v), spmm_reference(x.double(), t.indices, v.double(), 1024) + bias.double()),
                ((B, 768), (dy, t, v), spmm_t_reference(dy.double(), t.indices, v.double(), 768))):
            buf = torch.full((shape[0] * shape[1] + offset,), float("nan"), device="cuda")
            out = buf[offset:].view(shape)
            if shape[1] == 1024:
                G.spmm(*args, out=out, bias=bias, wide=True, chunks=2)
            else:
                G.spmm_t(*args, out=out, wide=True, chunks=2)
            assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]
            assert torch.isnan(buf[:offset]).all()


@pytest.mark.parametrize("mode", ["warp", "rows4", "own"])
@pytest.mark.parametrize("threads,B,chunks", [(640, 32, 5), (640, 128, 4), (768, 128, 4), (96, 40, 2)])
def test_wide_block_sizes_not_a_power_of_two(monkeypatch, mode, threads, B, chunks, gen):
    # 4096 x 4096 at 90 %: blocks of 640 or 768 threads (the lane-owned SpMMs compiled for as
    # many) flush row blocks of 129-512 rows, padded to a power of two that does not divide the
    # block size; the chunk groups add up with atomics, so a column flushed twice counts twice
    from snack.gpu import ops
    from snack.core import COO
    monkeypatch.setattr(ops, "WIDE_OWN_THREADS", max(threads, 512))
    coo = COO.random((4096, 4096), density=0.1, generator=gen, device="cuda")
    with ops.wide_mode(mode):
        _run_all(coo, B, torch.float32, gen, wide=True, chunks=chunks, threads=threads)


@pytest.mark.parametrize("sparsity", [0.9, 0.99])
@pytest.mark.parametrize("B", [1, 8, 32, 128])
def test_benchmark_points(sparsity, B, gen):
    from snack.core import COO
    coo = COO.random((4096, 4096), density=1 - sparsity, generator=gen, device="cuda")
    _run_all(coo, B, torch.float32, gen)


@pytest.mark.parametrize("clusters", ["deterministic", False])
@pytest.mark.parametrize("B", [32, 128])
def test_deterministic_mode_is_bit_identical_from_run_to_run(monkeypatch, clusters, B, gen):
    # torch.use_deterministic_algorithms(True): the wide ops run without atomics, so repeated
    # calls give the same bits (with atomics across 4 column chunks they differ in the last
    # bits); the layer's forward and backward too. The SpMMs' chunk groups add up through
    # thread-block clusters (the default) or as parts summed in order (CLUSTER_SUMS = False)
    import snack
    import snack.gpu as G
    from snack.core import COO
    from snack.gpu import ops
    monkeypatch.setattr(ops, "CLUSTER_SUMS", clusters)
    coo = COO.random((4096, 4096), density=0.1, generator=gen, device="cuda")
    t, v = coo.topology, coo.values
    x = torch.randn(B, 4096, generator=gen).cuda()
    dy = torch.randn(B, 4096, generator=gen).cuda()
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _run_all(coo, B, torch.float32, gen)
        calls = [lambda: G.spmm(x, t, v), lambda: G.spmm_t(dy, t, v),
                 lambda: G.sddmm(dy, x, t, bias_grad=True)[0]]
        if B <= 32:
            calls.append(lambda: torch.cat([a.reshape(-1) for a in G.spmm_t_sddmm(dy, x, t, v, bias_grad=True)]))
        for call in calls:
            first = call().clone()
            for _ in range(4):
                assert torch.equal(call(), first)
        layer = snack.SparseLinear(4096, 4096, sparsity=0.9).cuda()
        grads = []
        for _ in range(3):
            layer.zero_grad()
            layer(x).square().sum().backward()
            grads.append(torch.cat([layer.values.grad, layer.bias.grad]))
        assert all(torch.equal(g, grads[0]) for g in grads[1:])
    finally:
        torch.use_deterministic_algorithms(old)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,B,density", [
    ((4096, 4096), 1, 0.1), ((4096, 4096), 8, 0.1), ((4096, 4096), 32, 0.1), ((4096, 4096), 128, 0.05),
    ((4096, 4096), 12, 0.5), ((777, 1313), 5, 0.2), ((1313, 777), 40, 0.02)])
def test_half_precision_within_twice_torchs_own_error(shape, B, density, dtype, gen):
    # each op's relative error against float64 is at most twice that of torch's dense product
    # at the same dtype on the same (rounded) inputs: x @ W^T, dY @ W and (dY^T X) at W's cells
    import snack.gpu as G
    from snack.core import COO
    coo = COO.random(shape, density=density, generator=gen, device="cuda")
    t, v = coo.topology, coo.values.to(dtype)
    x = torch.randn(B, shape[1], generator=gen).to(dtype).cuda()
    dy = torch.randn(B, shape[0], generator=gen).to(dtype).cuda()
    r, c = t.indices[0].long(), t.indices[1].long()
    w = torch.zeros(shape, dtype=dtype, device="cuda")
    w[r, c] = v
    wd, xd, dyd = w.double(), x.double(), dy.double()
    cases = [("spmm", G.spmm(x, t, v), x @ w.T, xd @ wd.T),
             ("spmm_t", G.spmm_t(dy, t, v), dy @ w, dyd @ wd),
             ("sddmm", G.sddmm(dy, x, t), (dy.T @ x)[r, c], (dyd.T @ xd)[r, c])]

    def rel(a, ref):
        return ((a.double() - ref).norm() / ref.norm()).item()
    for name, got, torch_res, ref in cases:
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        ours, theirs = rel(got, ref), rel(torch_res, ref)
        assert theirs > 0, name
        assert ours <= 2 * theirs, (name, ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,kw,density", [(1, {}, 0.08), (8, {}, 0.08), (20, {}, 0.08), (32, {}, 0.08), (64, {}, 0.08),
                                          (32, {"wide": True, "chunks": 3}, 0.08), (48, {}, 0.02)])
def test_nan_in_an_input_reaches_exactly_the_outputs_it_feeds(dtype, B, kw, density, gen):
    """A NaN in X[b, c] (or dY[b, r]) makes NaN every output that reads it and no output of
    another batch row; other outputs of row b may turn NaN too, as in a dense product, where
    0 * NaN is NaN (a lane-owned wide kernel pads a partial round with value 0). The value
    gradient is exact: NaN where the entry's row or column meets the NaN, nowhere else. On the
    GPU an fp32 NaN is 0x7FFFFFFF, which the half-precision stores must keep a NaN (not -0).
    At 2 % density from B = 32 the SpMMs gather (their batch tiles of X written transposed)."""
    import snack.gpu as G
    from snack.core import COO
    from snack.gpu import ops
    coo = COO.random((1024, 2048), density=density, generator=gen, device="cuda")
    t, v = coo.topology, coo.values.to(dtype)
    r, c = t.indices[0].long(), t.indices[1].long()
    col, row = int(c[0]), int(r[-1])
    x = torch.randn(B, 2048, generator=gen).to(dtype).cuda()
    dy = torch.randn(B, 1024, generator=gen).to(dtype).cuda()
    x[B - 1, col] = float("nan")
    dy[0, row] = float("nan")
    assert ops._gathers(B, kw.get("wide"), "spmm", ops._plan_kind(dtype, dtype), t) == (density < 0.025)
    y = G.spmm(x, t, v, **kw)
    _nan_where_fed(y, B - 1, r[c == col])
    dx = G.spmm_t(dy, t, v, **kw)
    _nan_where_fed(dx, 0, c[r == row])
    dv = G.sddmm(dy, x, t, **{k: a for k, a in kw.items() if k != "split"})
    assert torch.equal(torch.isnan(dv), (r == row) | (c == col))
    if B <= 32:
        fdx, fdv = G.spmm_t_sddmm(dy, x, t, v)
        _nan_where_fed(fdx, 0, c[r == row])
        assert torch.equal(torch.isnan(fdv), torch.isnan(dv))


def _nan_where_fed(out, b, fed):
    """out[b, fed] all NaN, every other batch row of out finite."""
    assert torch.isnan(out[b, fed]).all()
    others = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    others[b] = False
    assert torch.isfinite(out[others]).all()


def test_empty_rows_and_no_nonzeros(gen):
    from snack.core import COO
    idx = torch.tensor([[0, 0, 5, 9], [3, 7, 1, 7]])
    coo = COO(idx, torch.randn(4, generator=gen), (12, 8)).to("cuda")
    _run_all(coo, 5, torch.float32, gen)
    empty = COO(torch.empty(2, 0, dtype=torch.int32), torch.empty(0), (6, 5)).to("cuda")
    _run_all(empty, 3, torch.float32, gen)


@pytest.mark.parametrize("B,kw", [(1, {}), (8, {}), (32, {}), (32, {"wide": True, "chunks": 3})])
def test_cuda_graph_capture_and_replay(B, kw, gen):
    # the last case adds column chunks with atomics: the output is zeroed (a driver memset) in
    # the graph before the kernel adds to it
    import snack.gpu as G
    from snack.core import COO
    from snack.core.reference import spmm_reference, spmm_t_reference
    coo = COO.random((512, 768), density=0.1, generator=gen, device="cuda")
    t, v = coo.topology, coo.values
    x = torch.randn(B, 768, device="cuda")
    y = torch.empty(B, 512, device="cuda")
    dx = torch.empty(B, 768, device="cuda")
    G.spmm(x, t, v, out=y, **kw)  # warm-up: compile, build metadata outside the capture
    G.spmm_t(y, t, v, out=dx, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        G.spmm(x, t, v, out=y, **kw)
        G.spmm_t(y, t, v, out=dx, **kw)
    for _ in range(2):
        x.copy_(torch.randn(B, 768, generator=gen).cuda())
        y.fill_(float("nan"))
        dx.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = spmm_reference(x.double(), t.indices, v.double(), 512)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
        dref = spmm_t_reference(y.double(), t.indices, v.double(), 768)
        assert torch.isfinite(dx).all()
        err = ((dx.double() - dref).norm() / dref.norm()).item()
        assert err < 1e-5, err


def test_bad_input_on_gpu():
    import snack.gpu as G
    from snack.core import COO
    coo = COO.random((4, 6), density=0.5, seed=0, device="cuda")
    t, v = coo.topology, coo.values
    with pytest.raises(ValueError, match="x is on cpu"):
        G.spmm(torch.randn(2, 6), t, v)
    with pytest.raises(ValueError, match="x must have 6 columns"):
        G.spmm(torch.randn(2, 7, device="cuda"), t, v)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        G.spmm(torch.randn(2, 6, device="cuda", dtype=torch.float64), t, v)


def test_driver_memset_zeroes_on_the_current_stream():
    from snack.gpu.launch import zero
    t = torch.full((1000, 3), float("nan"), device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert zero(t) is t
    s.synchronize()
    assert bool((t == 0).all())
    h = torch.full((7,), 1.0, device="cuda", dtype=torch.float16)   # 2-byte elements: torch's zero_
    zero(h)
    assert bool((h == 0).all())
    zero(torch.empty(0, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,density", [(1, 0.1), (4, 0.1), (8, 0.1), (24, 0.1), (32, 0.1), (32, 0.01), (128, 0.05)])
def test_float32_values_with_half_activations(B, density, dtype, gen):
    # mixed precision (fp32 values and bias, half x and dy) in every SpMM variant: within the
    # dtype's tolerance of float64 and no worse than the same op with the values rounded first;
    # exact on a matrix whose values need fp32 (conftest's `ladder`)
    import snack.gpu as G
    from snack.core import COO
    from snack.core.reference import spmm_reference, spmm_t_reference
    n = 4096
    coo = COO.random((n, n), density=density, generator=gen, device="cuda")
    t, v = coo.topology, coo.values
    bias = torch.randn(n, generator=gen).cuda()
    x = torch.randn(B, n, generator=gen).to(dtype).cuda()
    dy = torch.randn(B, n, generator=gen).to(dtype).cuda()
    vd = v.double()
    y_ref = spmm_reference(x.double(), t.indices, vd, n) + bias.double()
    dx_ref = spmm_t_reference(dy.double(), t.indices, vd, n)

    def rel(a, ref):
        assert a.dtype == dtype and torch.isfinite(a).all()
        return ((a.double() - ref).norm() / ref.norm()).item()
    pairs = [(G.spmm(x, t, v, bias=bias), G.spmm(x, t, v.to(dtype), bias=bias.to(dtype)), y_ref),
             (G.spmm_t(dy, t, v), G.spmm_t(dy, t, v.to(dtype)), dx_ref)]
    if B <= 32:
        pairs.append((G.spmm_t_sddmm(dy, x, t, v, fused=True)[0], G.spmm_t_sddmm(dy, x, t, v.to(dtype), fused=True)[0],
                      dx_ref))
    for i, (mixed, half, ref) in enumerate(pairs):
        assert rel(mixed, ref) < TOL[dtype], i
        assert rel(mixed, ref) <= rel(half, ref), i
    # exact where rounding the values first would not be (conftest's `ladder`)
    idx, vals, e = ladder(n, dtype)
    lad = COO(idx, vals, (n, n)).to("cuda")
    scale = torch.arange(1, B + 1, dtype=torch.float32, device="cuda")[:, None]
    ones = (scale * torch.ones(B, n, device="cuda")).to(dtype)
    want = (scale * e.cuda()).to(dtype)  # exact in fp32, rounded once
    assert torch.equal(G.spmm(ones, lad.topology, lad.values), want)
    assert torch.equal(G.spmm_t(ones, lad.topology, lad.values), want)
    if B <= 32:
        dxf = G.spmm_t_sddmm(ones, ones, lad.topology, lad.values, fused=True)[0]
        assert torch.equal(dxf, want)


@pytest.mark.parametrize("shape,density,B,chunks,dtype,vdtype", [
    ((4096, 4096), 0.1, 32, None, torch.float32, torch.float32),
    ((4096, 4096), 0.05, 128, None, torch.float32, torch.float32),
    ((4096, 4096), 0.01, 33, None, torch.float32, torch.float32),
    ((777, 4100), 0.05, 40, 3, torch.float32, torch.float32), ((301, 1000), 0.3, 64, 1, torch.float32, torch.float32),
    ((3072, 768), 0.1, 96, None, torch.float32, torch.float32),
    ((4096, 4096), 0.01, 128, None, torch.bfloat16, torch.bfloat16),
    ((777, 4100), 0.05, 40, 3, torch.float16, torch.float16),
    ((3072, 768), 0.02, 96, None, torch.bfloat16, torch.float32),
    ((301, 1000), 0.3, 33, None, torch.float16, torch.float32),
])
def test_gather_spmms_eager_and_captured(shape, density, B, chunks, dtype, vdtype, gen):
    # the gathering SpMMs (wide_mode "gather"; they read x as transposed batch tiles of its
    # dtype), in float32, half precision, and float32 values with half activations: forward with
    # and without a bias and dX against float64 (half: within twice torch's own error at that
    # dtype), outputs poisoned; then the same calls captured in a CUDA graph and replayed on new
    # inputs
    import snack.gpu as G
    from snack.core import COO
    from snack.core.reference import spmm_reference, spmm_t_reference
    from snack.gpu import ops
    o, i = shape
    coo = COO.random(shape, density=density, generator=gen, device="cuda")
    t, v = coo.topology, coo.values.to(vdtype)
    bias = torch.randn(o, generator=gen).cuda().to(vdtype)
    x = torch.randn(B, i, generator=gen).cuda().to(dtype)
    dy = torch.randn(B, o, generator=gen).cuda().to(dtype)
    y, yb = torch.empty(B, o, device="cuda", dtype=dtype), torch.empty(B, o, device="cuda", dtype=dtype)
    dx = torch.empty(B, i, device="cuda", dtype=dtype)
    w_dense = coo.to_dense().to(vdtype).to(dtype) if dtype != torch.float32 else None

    def calls():
        G.spmm(x, t, v, out=y, wide=True, chunks=chunks)
        G.spmm(x, t, v, out=yb, bias=bias, wide=True, chunks=chunks)
        G.spmm_t(dy, t, v, out=dx, wide=True, chunks=chunks)

    def err(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    def check():
        torch.cuda.synchronize()
        ref = spmm_reference(x.double(), t.indices, v.double(), o)
        dxref = spmm_t_reference(dy.double(), t.indices, v.double(), i)
        # half precision: torch's own error at that dtype (its dense products) sets the bound
        own = {} if w_dense is None else {
            "spmm": err(torch.nn.functional.linear(x, w_dense), ref),
            "spmm + bias": err(torch.nn.functional.linear(x, w_dense, bias.to(dtype)), ref + bias.double()),
            "spmm_t": err(dy @ w_dense, dxref)}
        for name, got, want in (("spmm", y, ref), ("spmm + bias", yb, ref + bias.double()), ("spmm_t", dx, dxref)):
            assert got.dtype == dtype and torch.isfinite(got).all(), f"{name}: an output element was not written"
            assert err(got, want) < (1e-5 if w_dense is None else 2 * own[name]), (name, err(got, want), own.get(name))

    with ops.wide_mode("gather"):
        for out in (y, yb, dx):
            out.fill_(float("nan"))
        calls()
        assert sum(1 for key, plan in t.cache.items() if isinstance(key, tuple) and key[0] == "spmm_plan"
                   and plan is not None and plan[0].tiles_transposed) == 3
        check()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls()
        for _ in range(2):
            x.copy_(torch.randn(B, i, generator=gen).cuda().to(dtype))
            dy.copy_(torch.randn(B, o, generator=gen).cuda().to(dtype))
            for out in (y, yb, dx):
                out.fill_(float("nan"))
            g.replay()
            check()
