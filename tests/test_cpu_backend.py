"""Tests of the CPU backend (core/cpu.py) against the float64 reference ops.

Every op is compared with `snack.core.reference` run in float64 on the same (already rounded)
inputs, on fresh random inputs of odd shapes, B = 1, batch widths that hit the 64-wide register
tile and its remainder, nnz = 0, empty rows/columns and 1 x 1, for float32/float64 and (with a
looser tolerance) float16/bfloat16; plus the `out=` argument, strided inputs, determinism across
thread counts, and every bad input. Tolerances come from conftest.py.
Trade-off: shapes stay small (the kernels are compiled once and cached on disk), so the file
runs in seconds; speed is measured by experiments/bench_cpu.py, not here.
"""
from __future__ import annotations

import numba
import pytest
import torch

from conftest import assert_close_dtype
from snack.core import COO, Topology, sddmm_reference, spmm_reference, spmm_t_reference
from snack.core import cpu

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

# (out, in, B, density)
CASES = [
    (7, 96, 40, 0.2), (96, 7, 40, 0.3), (40, 333, 7, 0.05), (333, 40, 1, 0.1), (1, 1, 1, 1.0),
    (1, 1, 3, 1.0), (5, 1, 2, 0.6), (13, 17, 6, 0.0), (64, 50, 64, 0.2), (50, 64, 65, 0.2),
    (33, 29, 130, 0.3), (17, 200, 2, 0.5),
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.fixture(params=["serial", "parallel"])
def mode(request, monkeypatch):
    """Runs a test with the kernels on the calling thread only, and with parallel tasks (the
    backend picks by the amount of work; these shapes are small, so force each way)."""
    monkeypatch.setattr(cpu, "_PARALLEL_MIN_WORK", 0 if request.param == "parallel" else 1 << 62)
    return request.param


def make(gen, out_f, in_f, B, density, dtype):
    coo = COO.random((out_f, in_f), density=density, generator=gen, dtype=dtype)
    x = torch.randn(B, in_f, generator=gen).to(dtype)
    dy = torch.randn(B, out_f, generator=gen).to(dtype)
    return coo, x, dy


def references(coo, x, dy):
    d = torch.float64
    idx, v = coo.indices, coo.values.to(d)
    return (spmm_reference(x.to(d), idx, v, coo.shape[0]), spmm_t_reference(dy.to(d), idx, v, coo.shape[1]),
            sddmm_reference(dy.to(d), x.to(d), idx))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_f, in_f, B, density", CASES)
def test_ops_match_reference(gen, mode, out_f, in_f, B, density, dtype):
    coo, x, dy = make(gen, out_f, in_f, B, density, dtype)
    y_ref, dx_ref, dv_ref = references(coo, x, dy)
    y = cpu.spmm(x, coo.topology, coo.values)
    dx = cpu.spmm_t(dy, coo.topology, coo.values)
    dv = cpu.sddmm(dy, x, coo.topology)
    for got, ref, shape in ((y, y_ref, (B, out_f)), (dx, dx_ref, (B, in_f)), (dv, dv_ref, (coo.nnz,))):
        assert got.dtype == dtype and got.shape == shape and got.device.type == "cpu"
        assert_close_dtype(got, ref)


def test_float32_against_scipy_odd_shape(gen):
    coo, x, dy = make(gen, 40, 333, 7, 0.1, torch.float32)
    w = coo.to_scipy("csr")
    y = cpu.spmm(x, coo.topology, coo.values)
    assert_close_dtype(y, torch.from_numpy((w @ x.double().numpy().T).T))
    dx = cpu.spmm_t(dy, coo.topology, coo.values)
    assert_close_dtype(dx, torch.from_numpy((w.T @ dy.double().numpy().T).T))


def test_empty_rows_and_columns(gen, mode):
    idx = torch.tensor([[1, 1, 3, 4, 4], [0, 5, 2, 0, 6]])
    coo = COO(idx, torch.randn(5, generator=gen), (6, 7))
    for B in (1, 3, 70):
        x, dy = torch.randn(B, 7, generator=gen), torch.randn(B, 6, generator=gen)
        y_ref, dx_ref, dv_ref = references(coo, x, dy)
        y = cpu.spmm(x, coo.topology, coo.values, out=torch.full((B, 6), float("nan")))
        dx = cpu.spmm_t(dy, coo.topology, coo.values, out=torch.full((B, 7), float("nan")))
        assert (y[:, [0, 2, 5]] == 0).all() and (dx[:, [1, 3, 4]] == 0).all()
        assert_close_dtype(y, y_ref)
        assert_close_dtype(dx, dx_ref)
        assert_close_dtype(cpu.sddmm(dy, x, coo.topology), dv_ref)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (4, 6)])
@pytest.mark.parametrize("B", [0, 3])
def test_zero_sizes(shape, B):
    coo = COO.random(shape, nnz=0, seed=0)
    x, dy = torch.randn(B, shape[1]), torch.randn(B, shape[0])
    y = cpu.spmm(x, coo.topology, coo.values, out=torch.full((B, shape[0]), 7.0))
    dx = cpu.spmm_t(dy, coo.topology, coo.values, out=torch.full((B, shape[1]), 7.0))
    dv = cpu.sddmm(dy, x, coo.topology)
    assert y.shape == (B, shape[0]) and (y == 0).all()
    assert dx.shape == (B, shape[1]) and (dx == 0).all()
    assert dv.shape == (0,)


def test_zero_batch_with_connections():
    coo = COO.random((5, 6), nnz=12, seed=1)
    assert cpu.spmm(torch.randn(0, 6), coo.topology, coo.values).shape == (0, 5)
    assert cpu.spmm_t(torch.randn(0, 5), coo.topology, coo.values).shape == (0, 6)
    dv = cpu.sddmm(torch.randn(0, 5), torch.randn(0, 6), coo.topology, out=torch.full((12,), 3.0))
    assert dv.shape == (12,) and (dv == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_argument(gen, mode, dtype):
    coo, x, dy = make(gen, 33, 29, 70, 0.3, dtype)
    y_ref, dx_ref, dv_ref = references(coo, x, dy)
    for fn, args, shape, ref in ((cpu.spmm, (x, coo.topology, coo.values), (70, 33), y_ref),
                                 (cpu.spmm_t, (dy, coo.topology, coo.values), (70, 29), dx_ref),
                                 (cpu.sddmm, (dy, x, coo.topology), (coo.nnz,), dv_ref)):
        out = torch.full(shape, float("nan"), dtype=dtype)
        res = fn(*args, out=out)
        assert res is out
        assert_close_dtype(out, ref)


def test_strided_and_grad_inputs(gen):
    coo, x, dy = make(gen, 21, 30, 9, 0.3, torch.float64)
    y_ref, dx_ref, dv_ref = references(coo, x, dy)
    xs = x.t().contiguous().t()                        # column-major (B, in)
    dys = torch.stack([dy, torch.zeros_like(dy)], dim=2)[..., 0]   # stride-2 view
    assert not xs.is_contiguous() and not dys.is_contiguous()
    assert_close_dtype(cpu.spmm(xs, coo.topology, coo.values), y_ref)
    assert_close_dtype(cpu.spmm_t(dys, coo.topology, coo.values), dx_ref)
    assert_close_dtype(cpu.sddmm(dys, xs, coo.topology), dv_ref)
    vals = coo.values.clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    y = cpu.spmm(xg, coo.topology, vals)
    assert not y.requires_grad
    assert_close_dtype(y, y_ref)
    if hasattr(torch, "_neg_view"):  # a lazily negated view (neg bit) is read as negated
        xn, vn = torch._neg_view(x), torch._neg_view(coo.values)
        assert xn.is_neg() and vn.is_neg()
        assert_close_dtype(cpu.spmm(xn, coo.topology, coo.values), -y_ref)
        assert_close_dtype(cpu.spmm(xn[:1], coo.topology, vn), y_ref[:1])


def test_int64_topology_and_canonical_from_unsorted(gen):
    coo = COO.random((19, 23), density=0.3, generator=gen, dtype=torch.float64)
    topo64 = Topology(coo.indices.long(), coo.shape)
    x = torch.randn(4, 23, generator=gen, dtype=torch.float64)
    assert_close_dtype(cpu.spmm(x, topo64, coo.values), cpu.spmm(x, coo.topology, coo.values))
    perm = torch.randperm(coo.nnz, generator=gen)
    again = COO(coo.indices[:, perm], coo.values[perm], coo.shape)
    assert torch.equal(cpu.spmm(x, again.topology, again.values), cpu.spmm(x, coo.topology, coo.values))


def test_deterministic_across_threads_and_modes(gen, monkeypatch):
    """Every output element is summed in a fixed order: bitwise equal results whatever the
    thread count and whether the call runs in parallel."""
    coo, x, dy = make(gen, 300, 257, 67, 0.1, torch.float32)
    prev = torch.get_num_threads()
    results = []
    try:
        for n, min_work in ((1, 1 << 62), (1, 0), (2, 0), (prev, 0), (prev, 1 << 62)):
            torch.set_num_threads(n)
            monkeypatch.setattr(cpu, "_PARALLEL_MIN_WORK", min_work)
            results.append((cpu.spmm(x, coo.topology, coo.values), cpu.spmm_t(dy, coo.topology, coo.values),
                            cpu.sddmm(dy, x, coo.topology)))
    finally:
        torch.set_num_threads(prev)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_input_gradient_scatter_and_transposed_spmm_give_the_same_bits(gen, mode, monkeypatch, dtype):
    """dX has two ways (a CSR-order scatter for small B, the SpMM on W^T with gathered values for
    large B) that add the same products in the same order: equal bits at every batch width."""
    coo, _, _ = make(gen, 45, 67, 1, 0.2, dtype)
    for B in (2, 9, 17, 40, 70, 130):
        dy = torch.randn(B, 45, generator=gen).to(dtype)
        got = []
        for min_width in (8, 1 << 30):  # every batch tile transposed / none
            monkeypatch.setattr(cpu, "_TRANSPOSED_MIN_WIDTH", min_width)
            got.append(cpu.spmm_t(dy, coo.topology, coo.values, out=torch.full((B, 67), float("nan"), dtype=dtype)))
        assert torch.equal(got[0], got[1]), B
        assert_close_dtype(got[0], spmm_t_reference(dy.double(), coo.indices, coo.values.double(), 67))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_batch_tiles_from_the_compiled_copy_serial_parallel_and_torch(gen, dtype):
    """The tile-major copy of X (or dY) is made by a compiled loop (on one thread or on all) when
    t's rows are contiguous and by torch copies otherwise (column-major t, another dtype): each
    is X^T tile by tile, zero-padded, 64-byte aligned, whatever the batch width and the input's
    strides."""
    other = torch.float64 if dtype == torch.float32 else torch.float32
    for B, m in ((1, 7), (2, 5), (9, 33), (17, 3), (40, 21), (70, 13), (130, 9), (65, 150), (64, 64), (33, 136)):
        t = torch.randn(B, m + 3, generator=gen, dtype=dtype)
        views = (t[:, :m], t[:, 3:].t().contiguous().t(), t[:, :m].contiguous(), t[:, :m].to(other),
                 t[::2, :m], t[:1, :m].expand(B, m))
        for view in views:
            want = view.to(dtype)
            plan, width = cpu._plan(view.shape[0])
            for parallel in (False, True):
                got = cpu._tiles(view, dtype, plan, width, parallel)
                assert got.shape == (m * width,), (B, m, view.stride())
                if width > 1:  # each w-wide row on whole cache lines
                    assert got.ctypes.data % 64 == 0, (B, m, view.stride())
                for w, b0, nb in plan.tolist():
                    blk = torch.from_numpy(got[b0 * m:(b0 + w) * m]).view(m, w)
                    assert torch.equal(blk[:, :nb], want[b0:b0 + nb].t()), (B, m, view.stride(), parallel)
                    assert not blk[:, nb:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sddmm_sums_in_a_fixed_tree_per_batch_tile(gen, mode, dtype):
    """Each dv_k is, per batch tile (width w zero-padded), the products summed as a tree of
    halves (lanes i and i + w/2, ..., then i and i + 1), and the tiles added in order, whether
    the row's non-zero is one of 8 reduced together or one of the row's last few: the same
    bits as this order written in torch."""
    ptr = [0]
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 24, 3):  # row lengths around the groups of 8
        ptr.append(ptr[-1] + n)
    rows = torch.repeat_interleave(torch.arange(len(ptr) - 1), torch.tensor(ptr).diff())
    cols = torch.cat([torch.randperm(30, generator=gen)[:n].sort().values for n in torch.tensor(ptr).diff().tolist()])
    idx = torch.stack([rows, cols])
    topo = Topology(idx, (len(ptr) - 1, 30))
    for B in (2, 8, 13, 32, 40, 64, 100, 130):
        x = torch.randn(B, 30, generator=gen, dtype=dtype)
        dy = torch.randn(B, len(ptr) - 1, generator=gen, dtype=dtype)
        plan, _ = cpu._plan(B)
        want = None
        for w, b0, nb in plan.tolist():
            p = torch.zeros(idx.shape[1], w, dtype=dtype)
            p[:, :nb] = dy[b0:b0 + nb, idx[0]].t() * x[b0:b0 + nb, idx[1]].t()
            while p.shape[1] > 1:
                p = p[:, :p.shape[1] // 2] + p[:, p.shape[1] // 2:]
            want = p[:, 0] if want is None else want + p[:, 0]
        got = cpu.sddmm(dy, x, topo, out=torch.full((idx.shape[1],), float("nan"), dtype=dtype))
        assert torch.equal(got, want), B


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_in_one_call_gives_the_bits_of_the_two_ops(gen, mode, dtype):
    """spmm_t_sddmm (dY tiled once for dX and dv) returns what spmm_t and sddmm return, bit for
    bit, at batch widths on both sides of the transposed dX, with and without the bias gradient,
    and for the empty cases; fuses_backward says where it is worth calling."""
    for out_f, in_f, density in ((45, 67, 0.2), (7, 300, 0.05), (30, 4, 1.0), (6, 5, 0.0)):
        coo, _, _ = make(gen, out_f, in_f, 1, density, dtype)
        t, v = coo.topology, coo.values
        for B in (0, 1, 2, 9, 17, 40, 70, 130):
            dy = torch.randn(B, out_f, generator=gen).to(dtype)
            x = torch.randn(B, in_f, generator=gen).to(dtype)
            dx, dv, db = cpu.spmm_t_sddmm(dy, x, t, v, bias_grad=True)
            assert torch.equal(dx, cpu.spmm_t(dy, t, v)) and torch.equal(dv, cpu.sddmm(dy, x, t)), (B, out_f)
            assert torch.equal(db, dy.sum(0))
            pair = cpu.spmm_t_sddmm(dy, x, t, v)
            assert len(pair) == 2 and torch.equal(pair[0], dx) and torch.equal(pair[1], dv)
            assert cpu.fuses_backward(B, t) == (B > 1 and t.nnz > 0)
    with pytest.raises(ValueError, match=r"same batch size"):
        cpu.spmm_t_sddmm(dy, x[:3], t, v)
    with pytest.raises(TypeError, match=r"x must have dy's dtype"):
        cpu.spmm_t_sddmm(dy, x.to(torch.float64 if dtype != torch.float64 else torch.float32), t, v)
    with pytest.raises(ValueError, match=r"values must"):
        cpu.spmm_t_sddmm(dy, x, t, v[:-1] if t.nnz else torch.ones(1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_single_sample_ops_with_gathers(gen, mode, dtype):
    """B = 1 takes 8 non-zeros of a row per step (gathers of x, and of dX's scratch with a
    scatter back): rows of 0-25 non-zeros, around the steps of 8. dX gets each column's products
    added one by one in row order, each rounded first, and the SDDMM one product per non-zero:
    the same bits as that order written in torch; the forward is within float rounding of
    float64."""
    lengths = (0, 1, 7, 8, 9, 15, 16, 17, 24, 25, 3, 8)
    n_in = 40
    cols = [torch.randperm(n_in, generator=gen)[:n].sort().values for n in lengths]
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    idx = torch.stack([rows, torch.cat(cols)])
    topo = Topology(idx, (len(lengths), n_in))
    v = torch.randn(idx.shape[1], generator=gen, dtype=dtype)
    x = torch.randn(1, n_in, generator=gen, dtype=dtype)
    dy = torch.randn(1, len(lengths), generator=gen, dtype=dtype)
    want_dx = torch.zeros(n_in, dtype=dtype)
    k = 0
    for r, n in enumerate(lengths):
        want_dx[idx[1, k:k + n]] = want_dx[idx[1, k:k + n]] + v[k:k + n] * dy[0, r]
        k += n
    assert torch.equal(cpu.spmm_t(dy, topo, v, out=torch.full((1, n_in), float("nan"), dtype=dtype))[0], want_dx)
    assert torch.equal(cpu.sddmm(dy, x, topo, out=torch.full((idx.shape[1],), float("nan"), dtype=dtype)),
                       dy[0, idx[0]] * x[0, idx[1]])
    y = cpu.spmm(x, topo, v, out=torch.full((1, len(lengths)), float("nan"), dtype=dtype))
    assert_close_dtype(y, spmm_reference(x.double(), idx, v.double(), len(lengths)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_forward_of_a_few_samples_is_each_samples_own(gen, mode, dtype):
    """Up to cpu._FEW_MAX samples the forward gathers from X as it is, sample by sample: each
    output row has the bits of that sample's B = 1 call, for X of any strides; and it is the
    product within float rounding."""
    coo, _, _ = make(gen, 23, 90, 1, 0.4, dtype)
    t, v = coo.topology, coo.values
    for B in range(1, cpu._FEW_MAX + 2):
        base = torch.randn(B, 95, generator=gen).to(dtype)
        for x in (base[:, :90], base[:, 5:].t().contiguous().t(), base[:, :90].contiguous()):
            y = cpu.spmm(x, t, v, out=torch.full((B, 23), float("nan"), dtype=dtype))
            if B <= cpu._FEW_MAX:
                for j in range(B):
                    assert torch.equal(y[j], cpu.spmm(x[j:j + 1].clone(), t, v)[0]), (B, j, x.stride())
            assert_close_dtype(y, spmm_reference(x.double(), coo.indices, v.double(), 23))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sddmm_of_a_few_samples_has_the_tiled_kernels_bits(gen, mode, monkeypatch, dtype):
    """Up to cpu._FEW_MAX samples the SDDMM gathers from dY and X as they are and adds the
    products in the order of the 8-wide tile's tree: the same bits as the tiled kernel, for
    inputs of any strides, in the one-call backward too."""
    coo, _, _ = make(gen, 31, 70, 1, 0.4, dtype)
    t, v = coo.topology, coo.values
    for B in range(1, cpu._FEW_MAX + 1):
        xb = torch.randn(B, 75, generator=gen).to(dtype)
        dy = torch.randn(B, 31, generator=gen).to(dtype)
        for x in (xb[:, :70], xb[:, 5:].t().contiguous().t()):
            got = cpu.sddmm(dy, x, t, out=torch.full((t.nnz,), float("nan"), dtype=dtype))
            assert torch.equal(cpu.spmm_t_sddmm(dy, x, t, v)[1], got)
            if B > 1:  # (B = 1 has no tiled path: it is checked in test_single_sample_ops_with_gathers)
                few = cpu._FEW_MAX
                monkeypatch.setattr(cpu, "_FEW_MAX", 1)
                assert torch.equal(cpu.sddmm(dy, x, t), got), (B, x.stride())
                monkeypatch.setattr(cpu, "_FEW_MAX", few)
            assert_close_dtype(got, sddmm_reference(dy.double(), x.double(), coo.indices))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_lopsided_batches_gather_and_match_the_reference(gen, mode, dtype):
    """A batch of 2-7 samples on a very wide layer with few non-zeros per input (`_lopsided`: the
    copy into a padded tile would move more than the gathers read) takes the gathering forward and
    SDDMM: each output row has the bits of that sample's B = 1 call, the one-call backward gives the
    SDDMM's bits, and all three ops match float64 within rounding, for inputs of any strides. A
    square layer at the same batch keeps its tiles."""
    n_out, n_in = 3, 700
    coo = COO.random((n_out, n_in), density=0.05, generator=gen, dtype=dtype)  # ~105 non-zeros
    t, v = coo.topology, coo.values
    for B in range(2, 8):
        assert cpu._lopsided(B, n_in, t.nnz) and cpu._lopsided(B, n_in + n_out, t.nnz), B
        base = torch.randn(B, n_in + 5, generator=gen).to(dtype)
        dy = torch.randn(B, n_out, generator=gen).to(dtype)
        y_ref, dx_ref, dv_ref = references(coo, base[:, :n_in], dy)
        for x in (base[:, :n_in], base[:, 5:].t().contiguous().t()):
            y = cpu.spmm(x, t, v, out=torch.full((B, n_out), float("nan"), dtype=dtype))
            for j in range(B):
                assert torch.equal(y[j], cpu.spmm(x[j:j + 1].clone(), t, v)[0]), (B, j, x.stride())
            dv = cpu.sddmm(dy, x, t, out=torch.full((t.nnz,), float("nan"), dtype=dtype))
            dx2, dv2, db = cpu.spmm_t_sddmm(dy, x, t, v, bias_grad=True)
            assert torch.equal(dv2, dv) and torch.equal(dx2, cpu.spmm_t(dy, t, v))
            assert_close_dtype(y, spmm_reference(x.double(), coo.indices, v.double(), n_out))
            assert_close_dtype(dv, sddmm_reference(dy.double(), x.double(), coo.indices))
            assert_close_dtype(dx2, dx_ref)
            assert torch.equal(db, dy.sum(0))
    assert not cpu._lopsided(4, 64, 64 * 64 // 10) and not cpu._lopsided(8, 200000, 10)
    assert not cpu._lopsided(1, 200000, 10)


def test_parallel_threshold():
    """A large call is split into parallel tasks, a small one runs on the calling thread."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: every call runs serially")
    expect = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    assert cpu._threads(cpu._PARALLEL_MIN_WORK) == expect
    assert cpu._threads(cpu._PARALLEL_MIN_WORK - 1) == 1


def test_supports():
    assert all(cpu.supports(d) for d in DTYPES)
    assert not cpu.supports(torch.int32) and not cpu.supports(torch.complex64)


# ---- bad input ----------------------------------------------------------------------------------
@pytest.fixture
def small():
    coo = COO.random((6, 8), nnz=10, seed=0)
    return coo, torch.randn(3, 8), torch.randn(3, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B", [1, 3, 32])
def test_bias_is_added_before_half_precision_results_are_rounded(gen, mode, dtype, B):
    """Y + bias in float16 / bfloat16 is rounded once, from the float32 sums, as F.linear's: the
    bias used to be added to the already rounded Y (a second rounding: about 30% of the outputs
    one unit off the once-rounded exact result). Exact sums here (small integers) make the
    once-rounded result the only right answer."""
    out_f, in_f = 64, 48
    coo = COO.random((out_f, in_f), density=0.3, generator=gen)
    vals = torch.randint(-4, 5, (coo.nnz,), generator=gen).to(dtype)
    x = torch.randint(-4, 5, (B, in_f), generator=gen).to(dtype)
    bias = (torch.randn(out_f, generator=gen) * 300).to(dtype)      # large: Y + bias needs rounding
    exact = spmm_reference(x.double(), coo.indices, vals.double(), out_f) + bias.double()
    y = cpu.spmm(x, coo.topology, vals, bias=bias)
    assert y.dtype == dtype and torch.equal(y, exact.to(dtype))
    out = torch.full((B, out_f), float("nan"), dtype=dtype)
    assert cpu.spmm(x, coo.topology, vals, out=out, bias=bias) is out and torch.equal(out, y)
    empty = COO(torch.zeros(2, 0, dtype=torch.int32), torch.zeros(0, dtype=dtype), (out_f, in_f))
    assert torch.equal(cpu.spmm(x, empty.topology, empty.values, bias=bias), bias.expand(B, out_f))


def test_bad_inputs_spmm(small):
    coo, x, _ = small
    t, v = coo.topology, coo.values
    cases = [
        (lambda: cpu.spmm(x.numpy(), t, v), TypeError, r"x must be a torch.Tensor.*ndarray"),
        (lambda: cpu.spmm(x.long(), t, v), TypeError, r"x must be float32.*int64"),
        (lambda: cpu.spmm(x[0], t, v), ValueError, r"x must be 2-D, got shape \(8,\)"),
        (lambda: cpu.spmm(x[:, :7], t, v), ValueError, r"x must have shape \(B, 8\).*\(3, 7\)"),
        (lambda: cpu.spmm(x.to("meta"), t, v), ValueError, r"x must be a CPU tensor.*meta"),
        (lambda: cpu.spmm(x, coo, v), TypeError, r"topo must be a snack.core.Topology.*COO"),
        (lambda: cpu.spmm(x, t, v[:9]), ValueError, r"values must have shape \(10,\).*\(9,\)"),
        (lambda: cpu.spmm(x, t, v.view(2, 5)), ValueError, r"values must be 1-D"),
        (lambda: cpu.spmm(x, t, v.double()), TypeError, r"values must have the dtype.*float32.*float64"),
        (lambda: cpu.spmm(x, t, v.int()), TypeError, r"values must be float32.*int32"),
        (lambda: cpu.spmm(x, t, v.to("meta")), ValueError, r"values must be a CPU tensor"),
        (lambda: cpu.spmm(x, t, v, out=torch.empty(3, 5)), ValueError, r"out must have shape \(3, 6\).*\(3, 5\)"),
        (lambda: cpu.spmm(x, t, v, out=torch.empty(3, 6, dtype=torch.float64)), TypeError, r"out must have dtype"),
        (lambda: cpu.spmm(x, t, v, out=torch.empty(6, 3).t()), ValueError, r"out must be contiguous"),
        (lambda: cpu.spmm(x, t, v, out=torch.zeros(3, 6, requires_grad=True)), ValueError, r"out must not require grad"),
        (lambda: cpu.sddmm(torch.randn(3, 6), x, t, out=torch.zeros(10, dtype=torch.float16, requires_grad=True)),
         TypeError, r"out must have dtype"),
        (lambda: cpu.spmm_t(torch.randn(3, 6), t, v, out=torch.zeros(3, 8, requires_grad=True)), ValueError,
         r"out must not require grad"),
        (lambda: cpu.spmm(x, t, v, out=torch.empty(3, 6).numpy()), TypeError, r"out must be a torch.Tensor"),
        (lambda: cpu.spmm(x, t, v, out=torch.empty(3, 6, device="meta")), ValueError, r"out must be a CPU"),
        (lambda: cpu.spmm(x, t.to("meta"), v), ValueError, r"topo must be on the CPU.*meta"),
        (lambda: cpu.spmm(x, t, v, bias=[0.0] * 6), TypeError, r"bias must be a torch.Tensor or None, got list"),
        (lambda: cpu.spmm(x, t, v, bias=torch.zeros(5)), ValueError, r"bias must have shape \(6,\).*\(5,\)"),
        (lambda: cpu.spmm(x, t, v, bias=torch.zeros(6, dtype=torch.float64)), TypeError,
         r"bias has dtype torch.float64 but values have torch.float32"),
        (lambda: cpu.spmm(x, t, v, bias=torch.zeros(6, device="meta")), ValueError, r"bias must be a CPU tensor"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


@pytest.mark.parametrize("bad, match", [
    ([[0, 2], [1, 9]], r"topo: indices\[1\].*\[0, 8\)"),       # column out of range
    ([[0, 6], [1, 1]], r"topo: indices\[0\].*\[0, 6\)"),       # row out of range
    ([[2, 0], [1, 1]], r"topo: indices.*canonical"),             # not sorted
    ([[1, 1], [3, 3]], r"topo: indices.*canonical"),             # duplicated
])
def test_bad_topology_rejected_before_any_kernel(bad, match):
    topo = Topology(torch.tensor(bad, dtype=torch.int32), (6, 8))
    with pytest.raises(ValueError, match=match):
        cpu.spmm(torch.randn(2, 8), topo, torch.ones(2))
    with pytest.raises(ValueError, match=match):
        cpu.spmm_t(torch.randn(2, 6), topo, torch.ones(2))
    with pytest.raises(ValueError, match=match):
        cpu.sddmm(torch.randn(2, 6), torch.randn(2, 8), topo)
    with pytest.raises(ValueError, match=match):
        cpu.spmm_t_sddmm(torch.randn(2, 6), torch.randn(2, 8), topo, torch.ones(2))


def test_bad_inputs_spmm_t_and_sddmm(small):
    coo, x, dy = small
    t, v = coo.topology, coo.values
    with pytest.raises(ValueError, match=r"dy must have shape \(B, 6\).*\(3, 8\)"):
        cpu.spmm_t(x, t, v)
    with pytest.raises(ValueError, match=r"out must have shape \(3, 8\)"):
        cpu.spmm_t(dy, t, v, out=torch.empty(3, 6))
    with pytest.raises(ValueError, match=r"x must have shape \(B, 8\)"):
        cpu.sddmm(dy, dy, t)
    with pytest.raises(ValueError, match=r"same batch size.*\(2, 8\).*\(3, 6\)"):
        cpu.sddmm(dy, x[:2], t)
    with pytest.raises(TypeError, match=r"x must have dy's dtype"):
        cpu.sddmm(dy, x.double(), t)
    with pytest.raises(ValueError, match=r"out must have shape \(10,\)"):
        cpu.sddmm(dy, x, t, out=torch.empty(9))
    with pytest.raises(TypeError, match=r"dy must be a torch.Tensor"):
        cpu.sddmm([1.0], x, t)


# ---- property tests -----------------------------------------------------------------------------
@st.composite
def problem(draw):
    out_f = draw(st.integers(1, 40))
    in_f = draw(st.integers(1, 40))
    B = draw(st.sampled_from([1, 2, 3, 5, 8, 31, 63, 64, 65, 100]))
    nnz = draw(st.integers(0, out_f * in_f))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return out_f, in_f, B, nnz, seed, dtype


@given(problem(), st.booleans())
def test_property_matches_reference(p, parallel):
    out_f, in_f, B, nnz, seed, dtype = p
    old = cpu._PARALLEL_MIN_WORK
    cpu._PARALLEL_MIN_WORK = 0 if parallel else 1 << 62
    try:
        _check_problem(out_f, in_f, B, nnz, seed, dtype)
    finally:
        cpu._PARALLEL_MIN_WORK = old


def _check_problem(out_f, in_f, B, nnz, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    coo = COO.random((out_f, in_f), nnz=nnz, generator=g, dtype=dtype)
    x = torch.randn(B, in_f, generator=g, dtype=dtype)
    dy = torch.randn(B, out_f, generator=g, dtype=dtype)
    y_ref, dx_ref, dv_ref = references(coo, x, dy)
    assert_close_dtype(cpu.spmm(x, coo.topology, coo.values), y_ref)
    assert_close_dtype(cpu.spmm_t(dy, coo.topology, coo.values), dx_ref)
    assert_close_dtype(cpu.sddmm(dy, x, coo.topology), dv_ref)


@given(problem())
def test_property_adjoint_identity(p):
    """<W x, dy> = <x, W^T dy> = <W, dy x^T>_pattern: the three ops are mutually consistent."""
    out_f, in_f, B, nnz, seed, _ = p
    g = torch.Generator().manual_seed(seed)
    coo = COO.random((out_f, in_f), nnz=nnz, generator=g, dtype=torch.float64)
    x = torch.randn(B, in_f, generator=g, dtype=torch.float64)
    dy = torch.randn(B, out_f, generator=g, dtype=torch.float64)
    a = (cpu.spmm(x, coo.topology, coo.values) * dy).sum()
    b = (x * cpu.spmm_t(dy, coo.topology, coo.values)).sum()
    c = (coo.values * cpu.sddmm(dy, x, coo.topology)).sum()
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def test_threads_calling_at_once_under_numba_workqueue():
    # Numba's workqueue threading layer (used without TBB / OpenMP) aborts the process when two
    # threads enter a parallel region at once: the backend runs its parallel kernels one at a time
    import subprocess
    import sys
    code = """
import threading, torch
from snack.core import COO, cpu
torch.set_num_threads(2)
c = COO.random((700, 900), density=0.1, seed=0)
x = torch.randn(40, 900)
ref = cpu.spmm(x, c.topology, c.values)
bad = []
def run():
    for _ in range(5):
        if not torch.equal(cpu.spmm(x, c.topology, c.values), ref):
            bad.append(1)
        cpu.sddmm(ref, x, c.topology); cpu.spmm_t(ref, c.topology, c.values)
ts = [threading.Thread(target=run) for _ in range(3)]
[t.start() for t in ts]; [t.join() for t in ts]
import numba
print(numba.threading_layer(), len(bad))
"""
    env = dict(__import__("os").environ, NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["workqueue", "0"]


@pytest.mark.parametrize("layer", ["omp", "default"])
def test_torch_thread_count_survives_numba_starting_its_pool(layer):
    # Numba's "omp" layer shares torch's OpenMP runtime; starting its pool used to reset the
    # thread count that torch.set_num_threads had chosen before the first sparse call
    import os
    import subprocess
    import sys
    code = """
import torch
torch.set_num_threads(1)
from snack.core import COO, cpu
c = COO.random((700, 900), density=0.1, seed=0)
x = torch.randn(40, 900)  # above the parallel threshold: the backend asks Numba for its threads
y = cpu.spmm(x, c.topology, c.values)
dv = cpu.sddmm(y, x, c.topology)
import numba
print(numba.threading_layer(), torch.get_num_threads(), numba.get_num_threads())
"""
    env = dict(os.environ, NUMBA_NUM_THREADS="3")
    if layer == "omp":
        env["NUMBA_THREADING_LAYER"] = "omp"
    else:
        env.pop("NUMBA_THREADING_LAYER", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    name, torch_threads, numba_threads = r.stdout.split()
    assert (torch_threads, numba_threads) == ("1", "1"), r.stdout
    if layer == "omp":
        assert name == "omp"
