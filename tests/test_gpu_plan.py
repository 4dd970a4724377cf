"""Launch planning of the GPU ops (no GPU needed): column chunks of the wide kernels and the
number of row blocks, for an H200's multiprocessor count and shared memory."""
import pytest

from snack.gpu import ops

H200 = (132, 227 * 1024, 228 * 1024)


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(ops, "device_properties", lambda device: H200)
    ops._grid_rows.cache_clear()
    yield "cuda:0"
    ops._grid_rows.cache_clear()


def test_wide_chunks_narrow_at_small_batch_when_several_are_needed(h200):
    assert ops.wide_chunks(4096, h200, batch=32) == (4, 1024, 1024 * 32 * 4)
    assert ops.wide_chunks(4096, h200, batch=64)[0] == 4
    assert ops.wide_chunks(4096, h200, batch=128)[:2] == (3, 1368)   # widest chunks that fit
    assert ops.wide_chunks(4096, h200)[:2] == (3, 1368)
    assert ops.wide_chunks(1500, h200, batch=32)[:2] == (1, 1504)    # one chunk: no atomics
    assert ops.wide_chunks(3072, h200, batch=16)[:2] == (3, 1024)
    assert ops.wide_chunks(4096, h200, chunks=6, batch=32)[:2] == (6, 688)  # explicit


def test_wide_grid_counts_registers(h200):
    # a 1024-thread wide block holds 64 registers per thread: one block per SM even when two
    # chunks of 88 KB would fit in shared memory
    assert ops._grid_rows(4096, 6, 688 * 128, h200, 1024, ops._WIDE_REGS) == 22
    assert ops._grid_rows(4096, 6, 688 * 128, h200, 512, ops._WIDE_REGS) == 44
    assert ops._grid_rows(4096, 6, 688 * 128, h200, 1024) == 44  # shared memory alone
    nch, cw, cps, nsplit, gy, rpb, smem = ops._wide_plan(4096, 4096, 32, h200, 1024)
    assert (nch, cw, nsplit, gy) == (4, 1024, 4, 33) and rpb * gy >= 4096
    assert smem == 1024 * 128 + rpb * 33 * 4 <= H200[1]


def test_wide_kernels_chosen_by_batch_density_and_size():
    from snack.core import COO

    def topo(shape, density):
        return COO.random(shape, density=density, seed=0).topology

    big, sparse, small = topo((640, 640), 0.4), topo((640, 640), 0.02), topo((300, 300), 0.4)
    assert big.nnz >= ops.WIDE_MIN_NNZ > small.nnz
    assert ops._use_wide(32, None, "spmm", big) and ops._use_wide(32, None, "spmm_t", big)
    assert not ops._use_wide(16, None, "spmm", big)
    assert not ops._use_wide(32, None, "spmm", sparse)      # density < WIDE_DENSITY
    assert ops._use_wide(96, None, "spmm", sparse)
    assert not ops._use_wide(32, None, "spmm", small)       # few non-zeros below B = 64
    assert ops._use_wide(64, None, "spmm", small)
    assert ops._use_wide(16, None, "sddmm", small)          # the wide SDDMM wins from B = 16
    assert ops._use_wide(8, True, "spmm", small) and not ops._use_wide(128, False, "spmm", big)


def test_fused_backward_chosen_from_b9_to_b32_on_any_sparse_matrix():
    from snack.core import COO
    big = COO.random((640, 640), density=0.2, seed=0).topology
    sparse_big = COO.random((4096, 4096), density=0.01, seed=0).topology  # 99 %: fused too
    small = COO.random((300, 300), density=0.02, seed=0).topology         # 1.8 K non-zeros too
    empty = COO.random((30, 30), density=0.0, seed=0).topology
    for b in (9, 12, 15, 16, 24, 32):
        assert ops.fuses_backward(b, big) and ops.fuses_backward(b, sparse_big) and ops.fuses_backward(b, small)
        assert not ops.fuses_backward(b, empty) and not ops.fuses_backward(b, big, fused=False)
    for b in (0, 1, 8, 33, 128):                                  # tiled kernels win up to 8
        assert not ops.fuses_backward(b, big) and not ops.fuses_backward(b, small)
    assert ops.fuses_backward(1, big, fused=True) and not ops.fuses_backward(33, big, fused=True)
    dense = COO.random((640, 640), density=0.4, seed=0).topology   # dense-ish: the separate ops win
    assert not ops.fuses_backward(32, dense) and ops.fuses_backward(32, dense, fused=True)


@pytest.mark.parametrize("transposed,batch,own", [
    (False, 1, False), (False, 2, False), (False, 4, True), (False, 8, True), (False, 20, True),
    (True, 1, False), (True, 2, True), (True, 3, True), (True, 8, True)])
def test_tiled_kernel_variant_by_batch_tile(h200, transposed, batch, own):
    # lanes own their non-zeros for BT = 4 and 8, and for BT = 2 in the transposed SpMM only
    from snack.core import COO
    from snack.gpu import kernels
    topo = COO.random((50, 70), density=0.1, seed=1).topology
    bound = ops._build_spmm_plan(topo, transposed, batch, 0, "cuda:0", None, 1024, False, None, None, False,
                                  "atomic")[0]
    kern = bound.dispatcher
    name = kern.py_func.__name__
    assert ("_own_" in name) == own, name
    assert name.startswith("snack_spmm_")
    bt = min(8, 1 << (batch - 1).bit_length())
    maker = kernels.make_spmm_own_kernel if own else kernels.make_spmm_kernel
    assert kern is maker(bt, 0, transposed, False, transposed)  # transposed: uint16 row index (50 rows)


@pytest.mark.parametrize("transposed,batch,density,cols", [
    (False, 4, 0.1, True), (False, 4, 0.25, True), (False, 4, 0.5, False), (False, 8, 0.1, True),
    (False, 8, 0.5, True), (True, 2, 0.1, True), (True, 2, 0.5, False), (True, 3, 0.5, False),
    (True, 8, 0.5, True)])
def test_lane_owned_staging_layout_by_tile_and_density(h200, transposed, batch, density, cols):
    # column-staged tiles (vector reads) at BT = 8, and at BT = 2 and 4 up to OWN_COLS_MAX_DENSITY;
    # batch row by batch row above it
    from snack.core import COO
    from snack.gpu import kernels
    topo = COO.random((50, 70), density=density, seed=1).topology
    kern = ops._build_spmm_plan(topo, transposed, batch, 0, "cuda:0", None, 1024, False, None, None, False,
                                "atomic")[0].dispatcher
    assert ("_rowstaged" not in kern.py_func.__name__) == cols, kern.py_func.__name__
    idx16 = transposed and density <= ops.IDX16_MAX_DENSITY
    bt = min(8, 1 << (batch - 1).bit_length())
    assert kern is kernels.make_spmm_own_kernel(bt, 0, transposed, False, idx16, cols=cols)


def test_transposed_spmm_goes_wide_from_17_rows(h200):
    from snack.core import COO
    topo = COO.random((4096, 4096), density=0.1, seed=0).topology
    assert [ops._use_wide(b, None, "spmm_t", topo) for b in (16, 17, 31)] == [False, True, True]
    assert [ops._use_wide(b, None, "spmm", topo) for b in (17, 31, 32)] == [False, False, True]
    assert not ops._use_wide(24, None, "spmm_t", COO.random((4096, 4096), density=0.01, seed=0).topology)


def test_wide_sddmm_row_per_lane_group_for_short_segments_or_many_rows(h200, monkeypatch):
    from types import SimpleNamespace

    def t(o, i, sparsity):
        return SimpleNamespace(shape=(o, i), nnz=round(o * i * (1 - sparsity)))
    # 99 %, B = 128: 14 non-zeros per (row, chunk) segment
    assert ops._sddmm_rows4(t(4096, 4096, 0.99), 3, 4, 1024, h200)
    # 768 x 3072 at 99 %: 15 per segment though only 6 blocks of rows per (chunk, tile)
    assert ops._sddmm_rows4(t(768, 3072, 0.99), 2, 4, 1024, h200)
    # long segments (102 per chunk at 90 %) but 32 x 4 blocks of 4 rows per warp: >= half the SMs
    assert ops._sddmm_rows4(t(4096, 4096, 0.9), 4, 1, 1024, h200)
    # 768 x 768 at 90 %: 77 per segment and 24 blocks: a warp per row
    assert not ops._sddmm_rows4(t(768, 768, 0.9), 1, 4, 1024, h200)
    # the short-segment bound is WIDE_ROWS4_BELOW's
    monkeypatch.setattr(ops, "WIDE_ROWS4_BELOW", 8)
    assert not ops._sddmm_rows4(t(768, 3072, 0.99), 2, 4, 1024, h200)


def test_partial_sums_follow_torch_deterministic_mode(monkeypatch):
    import torch
    old = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert ops._sum_mode() == ops.PARTIAL_SUMS == "atomic"
        monkeypatch.setattr(ops, "PARTIAL_SUMS", "parts")
        assert ops._sum_mode() == "parts"
        monkeypatch.setattr(ops, "PARTIAL_SUMS", "atomics")
        with pytest.raises(ValueError, match="PARTIAL_SUMS must be 'atomic' or 'parts'"):
            ops._sum_mode()
        torch.use_deterministic_algorithms(True)
        assert ops._sum_mode() == "parts"  # whatever PARTIAL_SUMS says
    finally:
        torch.use_deterministic_algorithms(old)


def test_partial_target_and_finish_sum_the_parts_in_order():
    import torch
    y = torch.full((3, 5), float("nan"), dtype=torch.float16)
    parts = ops._partial_target(y, "parts", 4, torch.device("cpu"))
    assert parts.shape == (4, 3, 5) and parts.dtype == torch.float32
    parts.copy_(torch.randn(4, 3, 5, dtype=torch.float64).float())
    ops._finish_partial(y, parts, "parts")
    ref = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert torch.allclose(y.float(), ref, rtol=1e-3, atol=1e-3)
    y32 = torch.empty(3, 5)
    ops._finish_partial(y32, parts, "parts")
    assert torch.allclose(y32, ref, rtol=1e-6, atol=1e-6)
    assert ops._partial_target(y32, None, 4, torch.device("cpu")) is y32


@pytest.mark.parametrize("batch,density,cols", [
    (2, 0.1, True), (4, 0.25, True), (8, 0.1, True), (12, 0.05, True), (1, 0.1, False),
    (4, 0.5, False), (8, 0.5, False), (12, 0.5, False)])
def test_tiled_sddmm_staging_layout_by_density(h200, batch, density, cols):
    # the tiled SDDMM stages X column by column up to OWN_COLS_MAX_DENSITY at every tile > 1,
    # batch row by batch row above it (also at BT = 8, unlike the SpMMs)
    from snack.core import COO
    from snack.gpu import kernels
    topo = COO.random((50, 70), density=density, seed=1).topology
    kern = ops._build_sddmm_plan(topo, batch, 0, "cuda:0", None, 1024, False, None, True, "atomic")[0].dispatcher
    assert kern.py_func.__name__.endswith("_cols") == cols, kern.py_func.__name__
    bt = min(8, 1 << (batch - 1).bit_length())
    assert kern is kernels.make_sddmm_kernel(bt, 0, True, cols)


@pytest.mark.parametrize("mode,fwd,dx", [
    ("auto", "own", "warp"), ("warp", "warp", "warp"), ("rows4", "rows4", "rows4"), ("own", "own", "own")])
def test_wide_spmm_row_mode_by_default_and_by_wide_mode(h200, monkeypatch, mode, fwd, dx):
    # by default the wide forward runs lane-owned on long segments (512-thread blocks) and dX a
    # warp per row; ops.wide_mode forces one mode on both SpMMs and restores the knobs after
    import torch
    from snack.core import COO
    monkeypatch.setattr(ops, "_kind_dummy", lambda device, kind: torch.zeros(1))  # no GPU here
    topo = COO.random((64, 90), density=0.6, seed=3).topology  # one chunk, ~54 per segment

    def kernel(transposed):
        bound = ops._build_spmm_plan(topo, transposed, 40, 0, "cuda:0", None, 1024, True, None, None, False,
                                     "atomic")[0]
        name = bound.dispatcher.py_func.__name__
        got = "own" if "_own" in name else "rows4" if "_rows4" in name else "warp"
        assert name.startswith("snack_spmm_wide_") and bound.block == (512 if got == "own" else 1024), name
        return got

    saved = ops.WIDE_OWN, ops.WIDE_ROWS4_BELOW, ops.SDDMM_ROWS4
    rule = ops._sddmm_rows4(topo, 1, 2, 1024, "cuda:0")
    with ops.wide_mode(mode):
        assert (kernel(False), kernel(True)) == (fwd, dx)
        assert ops.SDDMM_ROWS4 is None  # the SDDMM keeps its rule (which reads WIDE_ROWS4_BELOW)
    # with sddmm=True the wide SDDMM follows: rows4 in "rows4", a warp per row in "warp" and "own"
    with ops.wide_mode(mode, sddmm=True):
        assert (kernel(False), kernel(True)) == (fwd, dx)
        assert ops._sddmm_rows4(topo, 1, 2, 1024, "cuda:0") == (rule if mode == "auto" else mode == "rows4")
    assert (ops.WIDE_OWN, ops.WIDE_ROWS4_BELOW, ops.SDDMM_ROWS4) == saved
    short = COO.random((64, 90), density=0.1, seed=3).topology  # ~9 per segment: rows4 by default
    n_rows = short.shape[0]
    assert ops._short_segments(short, n_rows, 1) and not ops._short_segments(topo, n_rows, 1)
    with pytest.raises(ValueError, match="mode must be one of"):
        with ops.wide_mode("rows8"):
            pass
    assert (ops.WIDE_OWN, ops.WIDE_ROWS4_BELOW, ops.SDDMM_ROWS4) == saved


def test_kernel_factories_give_one_dispatcher_however_the_values_kind_is_passed():
    # the factories are cached on normalized arguments: vkind absent, None or x's own kind is one
    # kernel (compiled once), float32 values with bfloat16 x another
    from snack.gpu import kernels as K
    a = K.make_spmm_kernel(4, 2, False)
    assert a is K.make_spmm_kernel(4, 2, False, False, False, None) is K.make_spmm_kernel(4, 2, False, vkind=2)
    assert K.make_spmm_kernel(4, 2, False, vkind=0) is not a
    w = K.make_spmm_wide_kernel(2, True, "atomic")
    assert w is K.make_spmm_wide_kernel(2, True, "atomic", False, vkind=2) is K.make_spmm_wide_kernel(2, 1, "atomic")
    assert K.make_spmm_wide_kernel(2, True, "atomic", vkind=0).py_func.__name__.endswith("_vfloat32")
    o = K.make_spmm_own_kernel(8, 1, False)
    assert o is K.make_spmm_own_kernel(8, 1, False, vkind=1) and K.make_spmm_own_kernel(8, 1, False, vkind=0) is not o


def test_chunk_groups_sum_through_clusters_where_supported(monkeypatch):
    import torch
    dev = torch.device("cuda:0")
    monkeypatch.setattr(ops, "clusters_supported", lambda device: True)
    assert ops.CLUSTER_SUMS == "deterministic"  # the default: clusters in place of the parts
    assert ops._chunk_sums("parts", 1, dev) is None  # one chunk group: written once
    assert [ops._chunk_sums("parts", n, dev) for n in (2, 4, 8)] == ["cluster"] * 3
    assert ops._chunk_sums("atomic", 4, dev) == "atomic"
    assert ops._chunk_sums("parts", 9, dev) == "parts"  # beyond the portable cluster size
    monkeypatch.setattr(ops, "CLUSTER_SUMS", True)
    assert ops._chunk_sums("atomic", 4, dev) == "cluster"
    monkeypatch.setattr(ops, "CLUSTER_SUMS", False)
    assert ops._chunk_sums("parts", 4, dev) == "parts"
    monkeypatch.setattr(ops, "CLUSTER_SUMS", "always")
    with pytest.raises(ValueError, match="CLUSTER_SUMS must be True, False or 'deterministic', got 'always'"):
        ops._chunk_sums("atomic", 4, dev)
    monkeypatch.setattr(ops, "CLUSTER_SUMS", True)
    monkeypatch.setattr(ops, "clusters_supported", lambda device: False)
    assert ops._chunk_sums("atomic", 4, dev) == "atomic"


def test_cluster_launch_is_gpu_only_here():
    # the simulator runs blocks one after another, and a machine without a GPU has none: no
    # clusters, whatever the device
    import torch
    from snack.gpu.launch import clusters_supported
    assert not clusters_supported(torch.device("cuda:0"))


@pytest.mark.parametrize("active,expect", [
    (40, (33, 125)),   # every cluster fits at once: the plan is kept
    (32, (32, 128)),   # fewer clusters run at once than row blocks: fewer, taller row blocks
    (0, None),         # such a cluster cannot run: no cluster plan
])
def test_cluster_fit_keeps_every_cluster_resident(h200, monkeypatch, active, expect):
    import torch
    seen = []

    def fake(kern, arrays, scalars, device, cluster, block, smem):
        seen.append((cluster, block, smem, tuple(a.dtype for a in arrays)))
        return active
    monkeypatch.setattr(ops, "max_active_clusters", fake)
    monkeypatch.setattr(ops, "dummy_array", lambda device, dtype=torch.float32: torch.zeros(1, dtype=dtype))
    wp = ops._wide_plan(4096, 4096, 32, h200, 1024)
    nch, cw, cps, nsplit, gy, rpb, smem = wp
    assert (nch, nsplit, gy, rpb) == (4, 4, 33, 125)
    fit = ops._cluster_fit(None, wp, 1, 4096, 1024, h200,
                           ops._wide_dtypes(2, 0, torch.uint16, fused=False))
    assert seen[0][:3] == (4, 1024, smem)
    # the kernel is queried for the dtypes the call passes (bfloat16 x, float32 values)
    assert seen[0][3] == (torch.bfloat16, torch.int32, torch.uint16, torch.float32, torch.int32,
                          torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    if expect is None:
        assert fit is None
    else:
        g, r, sm = fit
        assert (g, r) == expect and g * r >= 4096 and sm == cw * 32 * 4 + r * 33 * 4


def test_bound_launch_cluster_checks(monkeypatch):
    import torch
    from snack.gpu import launch
    from snack.gpu.launch import BoundLaunch
    monkeypatch.setattr(launch, "_mode", "numba")  # Numba's dispatcher cannot launch clusters
    with pytest.raises(ValueError, match="grid\\[0\\] = 3 is not a multiple of cluster = 2"):
        BoundLaunch(None, (3, 1, 1), 32, 0, [None], [], cluster=2)
    b = BoundLaunch(None, (4, 1, 1), 32, 0, [None], [], cluster=2)
    with pytest.raises(RuntimeError, match="thread-block cluster launches need the driver launch path"):
        b([torch.zeros(1)], torch.device("cpu"))


def test_gathering_spmm_chosen_for_very_sparse_w_from_b32(h200):
    # float32: W at most GATHER_MAX_DENSITY dense, B >= GATHER_FROM_B, no `wide` named;
    # wide_mode("gather") gathers wherever the 32-wide kernels would run, the staged modes never
    from snack.core import COO
    from snack.gpu import kernels
    sparse = COO.random((300, 400), density=0.02, seed=0).topology
    denser = COO.random((300, 400), density=0.05, seed=0).topology
    assert ops._density(sparse) <= ops.GATHER_MAX_DENSITY < ops._density(denser)
    assert ops._gathers(32, None, "spmm", 0, sparse) and ops._gathers(128, None, "spmm_t", 0, sparse)
    assert not ops._gathers(31, None, "spmm", 0, sparse)
    assert not ops._gathers(128, None, "spmm", 0, denser)
    # half-precision x (with values of its dtype or float32) up to GATHER_MAX_DENSITY_HALF
    half = COO.random((300, 400), density=0.03, seed=0).topology
    assert ops.GATHER_MAX_DENSITY < ops._density(half) <= ops.GATHER_MAX_DENSITY_HALF
    assert all(ops._gathers(128, None, "spmm", k, half) for k in (1, 2, 4, 5))
    assert not ops._gathers(128, None, "spmm", 0, half) and not ops._gathers(31, None, "spmm", 2, sparse)
    assert not ops._gathers(128, None, "spmm", 1, COO.random((300, 400), density=0.04, seed=0).topology)
    assert not ops._gathers(128, True, "spmm", 0, sparse) and not ops._gathers(128, False, "spmm", 0, sparse)
    with ops.wide_mode("gather"):
        assert ops._gathers(128, True, "spmm", 0, denser) and ops._gathers(128, None, "spmm", 0, denser)
        assert not ops._gathers(128, False, "spmm", 0, sparse) and not ops._gathers(8, None, "spmm", 0, denser)
        assert all(ops._gathers(128, None, "spmm", k, sparse) for k in (1, 2, 3, 4, 5))  # forced: every dtype
    for mode in ("own", "warp", "rows4"):
        with ops.wide_mode(mode):
            assert not ops._gathers(128, None, "spmm", 0, sparse)
    assert ops.WIDE_GATHER is None
    # the plans: the forward prefetches its entries, dX does not; x goes in transposed
    for transposed, n_rows in ((False, 300), (True, 400)):
        bound = ops._build_spmm_plan(sparse, transposed, 40, 0, "cuda:0", None, 1024, None, None, None, False,
                                     "atomic")[0]
        assert bound.dispatcher is kernels.make_spmm_gather_kernel(transposed, False, not transposed,
                                                                   ops.GATHER_MIN_BLOCKS, 0, None)
        assert bound.grid == (-(-n_rows // kernels.GATHER_ROWS), 2, 1) and bound.block == 256
        assert bound.tiles_transposed.grid == (-(-(700 - n_rows) // kernels.WIDE), 2, 1)


@pytest.mark.parametrize("n_sets,nwarps", [(32, 16), (31, 16), (5, 2), (7, 3), (1, 4)])
def test_snake_slots_deal_every_set_once(n_sets, nwarps):
    slots = ops._snake_slots(n_sets, nwarps)
    assert sorted(slots) == list(range(n_sets))
    # the first nwarps sets (the longest) go one to each warp, the next ones back in reverse
    assert [s % nwarps for s in slots[:nwarps]] == list(range(min(nwarps, n_sets)))
    if n_sets >= 2 * nwarps:
        assert [s % nwarps for s in slots[nwarps:2 * nwarps]] == list(reversed(range(nwarps)))


@pytest.mark.parametrize("shape,nch,gy,rpb,nwarps", [((50, 70), 2, 3, 17, 2), ((13, 9), 1, 2, 7, 1),
                                                     ((40, 64), 4, 1, 40, 4)])
def test_seg_order_sorts_each_row_block_by_segment_length(shape, nch, gy, rpb, nwarps):
    # the table after the segment starts: per (chunk, row block) each of the block's rows once
    # (-1 elsewhere), sets of 4 positions (a warp's four groups), dealt longest first as a snake
    import torch
    from snack.core import COO
    coo = COO.random(shape, density=0.3, seed=sum(shape))
    cw = -(-shape[1] // nch)
    seg = ops._seg(coo.topology, False, nch, cw)
    table = ops._seg_order(coo.topology, False, nch, cw, gy, rpb, nwarps)
    n = shape[0] * nch + 1
    assert table.dtype == torch.int32 and torch.equal(table[:n], seg)
    pw = -(-rpb // 4) * 4
    t = table[n:].view(nch, gy, pw)
    lens = seg.diff().view(shape[0], nch)
    slots = ops._snake_slots(pw // 4, nwarps)
    for ch in range(nch):
        for z in range(gy):
            rows = t[ch, z]
            own = list(range(z * rpb, min((z + 1) * rpb, shape[0])))
            assert sorted(r for r in rows.tolist() if r >= 0) == own
            assert (rows < 0).sum().item() == pw - len(own)
            by_slot = rows.view(-1, 4)[slots].reshape(-1)  # the sets in the order they were dealt
            got = [lens[r, ch].item() if r >= 0 else -1 for r in by_slot.tolist()]
            assert got == sorted(got, reverse=True)
    assert ops._seg_order(coo.topology, False, nch, cw, gy, rpb, nwarps) is table  # cached


def test_seg_order_follows_a_refreshed_pattern_in_place():
    # a topology whose pattern changes in place (DST under a captured graph): the row order's
    # table is rebuilt for the new pattern into the same tensor
    import torch
    from snack.core import COO
    a = COO.random((30, 40), density=0.3, seed=1).topology
    b = COO.random((30, 40), density=0.3, seed=2).topology
    assert a.nnz == b.nnz
    table = ops._seg_order(a, False, 2, 20, 2, 15, 2)
    ptr = table.data_ptr()
    assert a.refresh_from(b)
    assert a.cache[("seg_order", False, 2, 20, 2, 15, 2)].data_ptr() == ptr
    assert torch.equal(table, ops._seg_order(b, False, 2, 20, 2, 15, 2))
