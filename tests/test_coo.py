"""Tests of the COO format: validation, canonical order, topology metadata, conversions.

scipy.sparse is the oracle for the metadata (CSR row pointers, CSC order) and the conversions;
hypothesis generates random coordinate sets (including empty ones and 1 x 1 matrices).
Trade-off: small shapes only, so the whole file runs in a few seconds.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from snack.core import COO, INDEX_DTYPE, Topology, canonicalize, validate_coo

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
              pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")]

SHAPES = [(7, 96), (40, 333), (1, 1), (5, 1), (1, 9), (96, 7)]


def random_coords(rng, shape, nnz):
    """nnz distinct coordinates in a random (unsorted) order, int64 (2, nnz)."""
    flat = rng.choice(shape[0] * shape[1], size=nnz, replace=False)
    return torch.from_numpy(np.stack([flat // shape[1], flat % shape[1]]).astype(np.int64))


def dense_from(idx, vals, shape):
    d = torch.zeros(shape, dtype=vals.dtype)
    d[idx[0].long(), idx[1].long()] = vals
    return d


# ---- validation -------------------------------------------------------------------------------
def test_valid_minimal():
    c = COO(torch.tensor([[0], [0]]), torch.tensor([2.0]), (1, 1))
    assert c.nnz == 1 and c.shape == (1, 1) and c.indices.dtype == INDEX_DTYPE
    assert c.to_dense().item() == 2.0


@pytest.mark.parametrize("shape, exc, match", [
    ((3,), ValueError, "shape"),
    ((3, 4, 5), ValueError, "shape"),
    ("ab", ValueError, "shape"),
    ((3.0, 4), TypeError, "shape"),
    ((3, True), TypeError, "shape"),
    ((-1, 4), ValueError, "shape"),
    ((3, 2**31), ValueError, "shape"),
])
def test_bad_shape(shape, exc, match):
    with pytest.raises(exc, match=match):
        COO(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0), shape)


def test_shape_accepts_torch_size_and_numpy_ints():
    c = COO(torch.tensor([[1], [2]]), torch.ones(1), torch.Size([2, 3]))
    assert c.shape == (2, 3)
    c = COO(torch.tensor([[1], [2]]), torch.ones(1), (np.int64(2), np.int32(3)))
    assert c.shape == (2, 3) and all(type(s) is int for s in c.shape)


@pytest.mark.parametrize("indices, exc", [
    ([[0], [0]], TypeError),                                       # not a tensor
    (np.zeros((2, 1), dtype=np.int64), TypeError),                 # numpy, not torch
    (torch.zeros(2, 1), TypeError),                                # float indices
    (torch.zeros(2, 1, dtype=torch.bool), TypeError),              # bool indices
    (torch.zeros(3, 1, dtype=torch.int64), ValueError),            # 3 rows
    (torch.zeros(2, dtype=torch.int64), ValueError),               # 1-D
    (torch.zeros(1, 2, 1, dtype=torch.int64), ValueError),         # 3-D
])
def test_bad_indices_type_and_shape(indices, exc):
    with pytest.raises(exc, match="indices"):
        COO(indices, torch.ones(1), (4, 4))


@pytest.mark.parametrize("bad, which", [
    ([[4], [0]], "rows"), ([[0], [5]], "columns"), ([[-1], [0]], "rows"), ([[0], [-3]], "columns"),
])
def test_indices_out_of_range(bad, which):
    with pytest.raises(ValueError, match=rf"indices.*{which}"):
        COO(torch.tensor(bad), torch.ones(1), (4, 5))


def test_out_of_range_in_any_position(rng):
    idx = random_coords(rng, (6, 7), 12)
    idx[1, 5] = 7
    with pytest.raises(ValueError, match=r"indices\[1\].*\[0, 7\).*\[\d+, 7\]"):
        COO(idx, torch.ones(12), (6, 7))


def test_duplicates_rejected(rng):
    idx = random_coords(rng, (9, 11), 20)
    idx = torch.cat([idx, idx[:, 3:4]], dim=1)  # one coordinate twice, not adjacent
    with pytest.raises(ValueError, match="indices.*duplicated"):
        COO(idx, torch.ones(21), (9, 11))
    with pytest.raises(ValueError, match="indices.*duplicated"):
        canonicalize(idx, (9, 11))


def test_duplicates_rejected_even_when_sorted():
    idx = torch.tensor([[0, 1, 1, 2], [3, 2, 2, 0]])
    with pytest.raises(ValueError, match=r"indices.*duplicated.*row 1, column 2"):
        COO(idx, torch.ones(4), (3, 4))


@pytest.mark.parametrize("values, exc, match", [
    ([1.0, 2.0], TypeError, "values must be a torch.Tensor"),
    (torch.ones(3), ValueError, r"values must have shape \(2,\).*\(3,\)"),
    (torch.ones(1), ValueError, r"values must have shape \(2,\)"),
    (torch.ones(2, 1), ValueError, r"values must have shape"),
    (torch.ones(2, dtype=torch.int64), TypeError, "values must be a floating.*int64"),
    (torch.ones(2, dtype=torch.bool), TypeError, "values must be a floating"),
    (torch.ones(2, dtype=torch.complex64), TypeError, "values must be a floating"),
])
def test_bad_values(values, exc, match):
    with pytest.raises(exc, match=match):
        COO(torch.tensor([[0, 1], [1, 0]]), values, (2, 2))


def test_values_on_other_device():
    with pytest.raises(ValueError, match="values is on meta.*indices is on cpu"):
        COO(torch.tensor([[0], [0]]), torch.ones(1, device="meta"), (2, 2))


def test_meta_tensors_are_refused_by_the_check_and_built_with_check_false():
    # a meta tensor has a shape but no data: the range check used to copy its min/max out
    # (torch's NotImplementedError "Cannot copy out of meta tensor"); now a ValueError naming
    # indices, empty or not, raised by every checked path (COO, a shared topology, check_topology)
    from snack.core.coo import check_topology
    mi = torch.zeros(2, 3, dtype=torch.long, device="meta")
    mv = torch.zeros(3, device="meta")
    for idx, vals in ((mi, mv), (mi[:, :0], mv[:0])):
        with pytest.raises(ValueError, match="indices is on the meta device.*check=False"):
            COO(idx, vals, (3, 3))
        with pytest.raises(ValueError, match="indices is on the meta device"):
            validate_coo(idx, None, (3, 3))
    topo = Topology(mi.to(INDEX_DTYPE), (3, 3))
    with pytest.raises(ValueError, match="topo: indices is on the meta device"):
        check_topology(topo)
    with pytest.raises(ValueError, match="indices is on the meta device"):
        COO(None, mv, None, topology=topo)
    c = COO(mi.to(INDEX_DTYPE), mv, (3, 3), check=False)  # shapes only, as SparseLinear.to_coo builds
    assert c.device.type == "meta" and c.nnz == 3 and c.shape == (3, 3)


def test_validate_coo_returns_shape():
    assert validate_coo(torch.tensor([[0], [1]]), None, (3, 2)) == (3, 2)
    assert validate_coo(torch.zeros(2, 0, dtype=torch.int32), torch.zeros(0), (0, 0)) == (0, 0)


# ---- canonical order ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_unsorted_input_is_sorted_row_major(rng, shape, idx_dtype):
    nnz = max(1, shape[0] * shape[1] // 3)
    idx = random_coords(rng, shape, nnz).to(idx_dtype)
    vals = torch.from_numpy(rng.standard_normal(nnz))
    c = COO(idx, vals, shape)
    assert c.indices.dtype == torch.int32 and c.indices.is_contiguous()
    r, col = c.indices[0].long(), c.indices[1].long()
    key = r * shape[1] + col
    assert bool((key[1:] > key[:-1]).all())
    # each (coordinate, value) pair survives the sort
    expect = sorted(zip(idx[0].tolist(), idx[1].tolist(), vals.tolist()))
    got = list(zip(r.tolist(), col.tolist(), c.values.tolist()))
    assert got == expect
    torch.testing.assert_close(c.to_dense(), dense_from(idx, vals, shape), rtol=0, atol=0)


def test_canonicalize_reports_sorted():
    idx = torch.tensor([[0, 0, 2], [1, 3, 0]])
    out, vals, already = canonicalize(idx, (3, 4), torch.arange(3.0))
    assert already and out.dtype == torch.int32 and torch.equal(vals, torch.arange(3.0))
    out, vals, already = canonicalize(idx[:, [2, 0, 1]], (3, 4), torch.tensor([2.0, 0.0, 1.0]))
    assert not already and torch.equal(out, idx.int()) and torch.equal(vals, torch.arange(3.0))
    for n in (0, 1):
        _, _, already = canonicalize(idx[:, :n], (3, 4))
        assert already


@pytest.mark.parametrize("indices, values, exc, match", [
    (torch.tensor([[0], [2**32 + 1]]), None, ValueError, r"indices\[1\] .* must lie in \[0, 4\)"),
    (torch.tensor([[0, 0], [-1, 2]]), None, ValueError, r"indices\[1\] .* must lie in"),
    (torch.tensor([[1, 0], [0, 4]]), None, ValueError, r"indices\[1\] .* must lie in"),  # not a false duplicate
    (torch.tensor([[0.5, 1.7], [1.2, 0.0]]), None, TypeError, "integer dtype"),
    (torch.tensor([0, 1]), None, ValueError, r"shape \(2, nnz\)"),
    (torch.tensor([[0, 1], [0, 1]]), torch.tensor([1.0]), ValueError, r"values must have shape \(2,\)"),
])
def test_canonicalize_checks_its_input(indices, values, exc, match):
    # a public entry point (the errors of sparse_linear and load_state_dict point to it): bad
    # input is refused, never wrapped, truncated or passed on as canonical
    with pytest.raises(exc, match=match):
        canonicalize(indices, (3, 4), values)


# ---- metadata vs scipy ------------------------------------------------------------------------
@pytest.mark.parametrize("shape, density", [((7, 96), 0.2), ((40, 333), 0.05), ((1, 1), 1.0),
                                            ((33, 17), 0.0), ((50, 3), 0.5), ((3, 50), 0.5)])
def test_metadata_matches_scipy(gen, shape, density):
    c = COO.random(shape, density=density, generator=gen, dtype=torch.float64)
    t = c.topology
    csr = c.to_scipy("csr")
    csc = c.to_scipy("coo").tocsc()
    csc.sort_indices()
    np.testing.assert_array_equal(t.row_ptr.numpy(), csr.indptr)
    np.testing.assert_array_equal(t.cols.numpy(), csr.indices)
    np.testing.assert_array_equal(t.col_ptr.numpy(), csc.indptr)
    np.testing.assert_array_equal(t.rows_by_col.numpy(), csc.indices)
    np.testing.assert_array_equal(c.values[t.col_perm].numpy(), csc.data)
    np.testing.assert_array_equal(t.cols_by_col.numpy(), np.repeat(np.arange(shape[1]), np.diff(csc.indptr)))
    assert t.row_ptr.dtype == torch.int32 and t.col_ptr.dtype == torch.int32
    assert t.rows_by_col.dtype == torch.int32 and t.col_perm.dtype == torch.int64
    assert t.row_ptr.shape == (shape[0] + 1,) and t.col_ptr.shape == (shape[1] + 1,)
    # col_perm is a permutation
    assert torch.equal(torch.sort(t.col_perm).values, torch.arange(c.nnz))


def test_metadata_is_cached_and_shared():
    c = COO.random((20, 30), density=0.3, seed=3)
    t = c.topology
    assert t.row_ptr is t.row_ptr and t.col_perm is t.col_perm
    c2 = c.with_values(torch.randn(c.nnz))
    assert c2.topology is t and c2.values is not c.values
    c3 = c.to(dtype=torch.float64)
    assert c3.topology is t and c3.dtype == torch.float64
    assert c.to("cpu").topology is t
    torch.testing.assert_close(c3.to_dense(), c.to_dense().double(), rtol=0, atol=0)


def test_empty_rows_and_columns():
    idx = torch.tensor([[1, 1, 4], [0, 5, 5]])
    c = COO(idx, torch.tensor([1.0, 2.0, 3.0]), (6, 7))
    assert c.topology.row_ptr.tolist() == [0, 0, 2, 2, 2, 3, 3]
    assert c.topology.col_ptr.tolist() == [0, 1, 1, 1, 1, 1, 3, 3]
    assert c.topology.rows_by_col.tolist() == [1, 1, 4]
    assert c.topology.col_perm.tolist() == [0, 1, 2]


def test_nnz_zero_and_zero_sized():
    for shape in [(0, 0), (0, 5), (5, 0), (4, 4)]:
        c = COO(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0), shape)
        assert c.nnz == 0 and c.to_dense().shape == shape and c.to_dense().abs().sum() == 0
        assert c.topology.row_ptr.tolist() == [0] * (shape[0] + 1)
        assert c.topology.col_ptr.tolist() == [0] * (shape[1] + 1)
        assert c.to_scipy().nnz == 0
    assert COO(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0), (0, 5)).density == 0.0


def test_properties_and_repr():
    c = COO.random((10, 20), nnz=50, seed=0)
    assert c.nnz == 50 and c.density == 0.25 and c.sparsity == 0.75
    assert c.device == torch.device("cpu") and c.dtype == torch.float32
    assert "nnz=50" in repr(c) and "(10, 20)" in repr(c)


def test_with_values_checks():
    c = COO.random((4, 5), nnz=6, seed=0)
    with pytest.raises(ValueError, match=r"values must have shape \(6,\)"):
        c.with_values(torch.ones(5))
    with pytest.raises(TypeError, match="values must be a torch.Tensor"):
        c.with_values([1.0] * 6)
    with pytest.raises(TypeError, match="values must be a floating"):
        c.with_values(torch.ones(6, dtype=torch.int32))


# ---- conversions -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dense_round_trip(gen, shape, dtype):
    c = COO.random(shape, density=0.3, generator=gen, dtype=dtype)
    d = c.to_dense()
    assert d.dtype == dtype and d.shape == shape
    back = COO.from_dense(d)
    # random values are never exactly 0, so the pattern is recovered
    assert torch.equal(back.indices, c.indices) and torch.equal(back.values, c.values)


def test_from_dense_with_mask_keeps_explicit_zeros(gen):
    d = torch.randn(6, 8, generator=gen)
    mask = torch.rand(6, 8, generator=gen) < 0.4
    d[0, :] = 0.0
    mask[0, :3] = True
    c = COO.from_dense(d, mask=mask)
    assert c.nnz == int(mask.sum())
    assert torch.equal(c.to_dense(), d * mask)
    with pytest.raises(ValueError, match="mask must have the shape"):
        COO.from_dense(d, mask=mask[:, :4])
    with pytest.raises(TypeError, match="mask"):
        COO.from_dense(d, mask=mask.numpy())
    # a 0/1 mask of any dtype keeps its ones; other values are refused, as SparseLinear.from_dense does
    c01 = COO.from_dense(d, mask=mask.to(torch.float32))
    assert torch.equal(c01.indices, c.indices) and torch.equal(c01.values, c.values)
    for bad, shown in ((torch.full((6, 8), 0.5), "0.5"), (mask.to(torch.int64) * 2, "2")):
        with pytest.raises(ValueError, match=f"mask must be bool or hold only 0 and 1, got the value {shown}"):
            COO.from_dense(d, mask=bad)
    with pytest.raises(ValueError, match="mask is on the meta device"):
        COO.from_dense(d, mask=mask.to("meta"))
    with pytest.raises(ValueError, match="dense is on the meta device"):
        COO.from_dense(d.to("meta"))
    with pytest.raises(ValueError, match="dense must be 2-D"):
        COO.from_dense(torch.ones(3))
    with pytest.raises(TypeError, match="dense must be a torch.Tensor"):
        COO.from_dense(np.ones((3, 3)))
    with pytest.raises(TypeError, match="dense must be a floating"):
        COO.from_dense(torch.ones(3, 3, dtype=torch.int64))


@pytest.mark.parametrize("shape", SHAPES)
def test_scipy_round_trip(rng, shape):
    m = sp.random(*shape, density=0.3, format="coo", random_state=rng, dtype=np.float64)
    # scipy's random is sorted column-major; shuffle to be sure we sort
    perm = rng.permutation(m.nnz)
    m = sp.coo_matrix((m.data[perm], (m.row[perm], m.col[perm])), shape=shape)
    c = COO.from_scipy(m, dtype=torch.float64)
    np.testing.assert_array_equal(c.to_dense().numpy(), m.toarray())
    for fmt in ("coo", "csr"):
        back = c.to_scipy(fmt)
        assert back.format == fmt
        np.testing.assert_array_equal(back.toarray(), m.toarray())
    csr = c.to_scipy("csr")
    np.testing.assert_array_equal(csr.indptr, c.topology.row_ptr.numpy())
    assert torch.equal(COO.from_scipy(m.tocsr(), dtype=torch.float64).indices, c.indices)
    assert torch.equal(COO.from_scipy(m.tocsc(), dtype=torch.float64).values, c.values)


def test_scipy_errors_and_half_precision():
    with pytest.raises(TypeError, match="mat must be a scipy.sparse"):
        COO.from_scipy(np.eye(3))
    dup = sp.coo_matrix((np.ones(2), ([0, 0], [1, 1])), shape=(2, 2))
    with pytest.raises(ValueError, match="indices.*duplicated"):
        COO.from_scipy(dup)
    c = COO.random((5, 6), density=0.5, seed=0, dtype=torch.bfloat16)
    m = c.to_scipy()
    assert m.dtype == np.float64
    np.testing.assert_array_equal(m.toarray(), c.to_dense().double().numpy())
    with pytest.raises(ValueError, match="format"):
        c.to_scipy("csc")
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        COO.from_scipy(sp.eye(3, format="csr"), dtype=torch.int64)


def test_topologies_are_checked_once():
    # the library's own topologies are made from validated indices; a hand-built one is checked
    # by the backends before first use, once (a refresh takes the new pattern's state)
    from snack.core.coo import check_topology
    made = COO.random((5, 7), nnz=6, seed=0)
    coo = COO(made.indices, made.values, made.shape)  # validated here
    assert coo.topology.checked and coo.topology.to("cpu").checked
    assert not COO(coo.indices, coo.values, coo.shape, check=False).topology.checked
    hand = Topology(coo.indices.clone(), (5, 7))
    assert not hand.checked
    check_topology(hand)
    assert hand.checked
    bad = Topology(torch.tensor([[1, 0], [0, 0]], dtype=torch.int32), (5, 7))
    with pytest.raises(ValueError, match="canonical"):
        check_topology(bad)
    assert not bad.checked
    other = COO.random((5, 7), nnz=6, seed=1).indices.clone()
    hand.checked = False
    assert hand.refresh_from(Topology(other, (5, 7))) and hand.checked  # checked on the way in
    assert torch.equal(hand.indices, other)
    with pytest.raises(ValueError, match="new: .*canonical"):  # nothing copied
        hand.refresh_from(Topology(coo.indices.flip(1).contiguous(), (5, 7)))
    assert torch.equal(hand.indices, other)


def test_scipy_conversions_share_nothing_with_their_source():
    mat = sp.random(6, 7, density=0.5, format="csr", dtype=np.float32, random_state=1)
    c = COO.from_scipy(mat)  # already row-major, float32: the case that could alias
    before = (c.indices.clone(), c.values.clone())
    mat.data[:] = 0
    assert torch.equal(c.values, before[1])
    exported = c.to_scipy()
    exported.data[:] = 5
    exported.row[:] = 0
    assert torch.equal(c.indices, before[0]) and torch.equal(c.values, before[1])


def test_conversions_name_a_bad_source():
    with pytest.raises(ValueError, match="mat must be 2-D"):
        COO.from_scipy(sp.coo_array(np.array([1.0, 0.0, 2.0])))
    long = sp.coo_array(np.array([[1.5, 0], [0, 2]], dtype=np.longdouble))
    assert torch.equal(COO.from_scipy(long, dtype=torch.float64).to_dense(),
                       torch.tensor([[1.5, 0], [0, 2]], dtype=torch.float64))
    with pytest.raises(ValueError, match="t must have 2 sparse dimensions"):
        COO.from_torch_sparse(torch.randn(3, 4).to_sparse(1))
    for layout in ("coo", "csr"):
        ints = torch.ones(3, 4, dtype=torch.int64)
        ints = ints.to_sparse() if layout == "coo" else ints.to_sparse_csr()
        with pytest.raises(TypeError, match="t must hold floating values"):
            COO.from_torch_sparse(ints)


def test_topology_arguments():
    idx = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"shape\[rows\] must be in"):
        Topology(idx, (-1, 4))
    with pytest.raises(ValueError, match="shape must be a pair"):
        Topology(idx, (4,))
    with pytest.raises(ValueError, match=r"indices must have shape \(2, nnz\)"):
        Topology(idx[0], (4, 4))
    with pytest.raises(TypeError, match="indices must be a torch.Tensor"):
        Topology([[0], [1]], (4, 4))
    strided = torch.tensor([[0, 1], [2, 0], [3, 3]], dtype=torch.int32).t()
    t = Topology(strided, (4, 4))
    assert t.indices.is_contiguous() and torch.equal(t.indices, strided) and t.nnz == 3


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="values must be a floating tensor"):
        COO(torch.tensor([[0], [1]]), None, (3, 4))
    with pytest.raises(TypeError, match="seed must be an int"):
        COO.random((3, 4), nnz=3, seed=1.5)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        COO.random((3, 4), nnz=3, generator=5)
    wide = torch.zeros(1, 1).expand(1, 2**31 + 5)  # (a view: no memory of that size)
    with pytest.raises(ValueError, match=r"shape\[cols\] must be in \[0, 2\*\*31 - 1\]"):
        COO.from_dense(wide)


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 10**30])
def test_random_names_a_seed_outside_64_bits(seed):
    # torch.Generator.manual_seed takes [-2**63, 2**64) and says only "Overflow when unpacking
    # long long" outside it
    with pytest.raises(ValueError, match=r"seed must fit in 64 bits.*got " + str(seed)):
        COO.random((3, 4), nnz=3, seed=seed)


def test_random_takes_every_seed_torch_takes():
    # the ends of torch's range, and numpy integers (torch.Generator.manual_seed refuses those:
    # "an integer is required")
    for seed in (2**64 - 1, -2**63, 0):
        g = torch.Generator().manual_seed(seed)
        expect = COO.random((6, 7), nnz=5, generator=g)
        got = COO.random((6, 7), nnz=5, seed=seed)
        assert torch.equal(got.indices, expect.indices) and torch.equal(got.values, expect.values)
    a, b = COO.random((6, 7), nnz=5, seed=np.int64(9)), COO.random((6, 7), nnz=5, seed=9)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert torch.equal(COO.random((6, 7), nnz=5, seed=np.uint64(2**64 - 1)).indices,
                       COO.random((6, 7), nnz=5, seed=2**64 - 1).indices)


def test_random_checks_everything_before_drawing_from_the_global_generator():
    # without seed or generator a seed is drawn from torch's global generator: a call refused
    # for its dtype or init (checked before the seed; init used to be checked after the draw)
    # leaves that generator where it was
    torch.manual_seed(5)
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        COO.random((3, 4), nnz=3, dtype=torch.int64)
    with pytest.raises(ValueError, match="init must be 'normal' or 'ones', got 'zeros'"):
        COO.random((3, 4), nnz=3, init="zeros")
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr])
def test_torch_sparse_round_trip(gen, shape, layout):
    c = COO.random(shape, density=0.3, generator=gen, dtype=torch.float64)
    t = c.to_torch_sparse(layout)
    assert t.layout == layout
    torch.testing.assert_close(t.to_dense(), c.to_dense(), rtol=0, atol=0)
    back = COO.from_torch_sparse(t)
    assert torch.equal(back.indices, c.indices) and torch.equal(back.values, c.values)


def test_torch_sparse_uncoalesced_and_errors():
    i = torch.tensor([[2, 0, 1], [0, 1, 1]])
    t = torch.sparse_coo_tensor(i, torch.tensor([3.0, 1.0, 2.0]), (3, 2))
    c = COO.from_torch_sparse(t)  # unsorted, uncoalesced but no duplicates
    assert c.indices.tolist() == [[0, 1, 2], [1, 1, 0]] and c.values.tolist() == [1.0, 2.0, 3.0]
    dup = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.ones(2), (2, 2))
    with pytest.raises(ValueError, match="indices.*duplicated"):
        COO.from_torch_sparse(dup)
    with pytest.raises(ValueError, match="layout"):
        COO.from_torch_sparse(torch.ones(2, 2))
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        COO.from_torch_sparse(np.ones((2, 2)))
    with pytest.raises(ValueError, match="layout"):
        COO.random((2, 2), nnz=1, seed=0).to_torch_sparse(torch.strided)


def test_random_init_and_determinism():
    a = COO.random((30, 40), density=0.1, seed=5)
    b = COO.random((30, 40), density=0.1, seed=5)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert a.nnz == 120
    ones = COO.random((30, 40), nnz=7, seed=5, init="ones", dtype=torch.float64)
    assert ones.dtype == torch.float64 and bool((ones.values == 1).all())
    with pytest.raises(ValueError, match="init"):
        COO.random((3, 3), nnz=1, seed=0, init="zeros")
    torch.manual_seed(11)
    c = COO.random((30, 40), density=0.1)
    after = torch.rand(1)
    torch.manual_seed(11)
    d = COO.random((30, 40), density=0.1)
    assert torch.equal(c.indices, d.indices) and torch.equal(torch.rand(1), after)


# ---- property tests ----------------------------------------------------------------------------
@st.composite
def coo_case(draw):
    rows = draw(st.integers(1, 12))
    cols = draw(st.integers(1, 12))
    flat = draw(st.lists(st.integers(0, rows * cols - 1), unique=True, max_size=rows * cols))
    vals = draw(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=len(flat),
                         max_size=len(flat)))
    return rows, cols, flat, vals


@given(coo_case())
def test_property_canonical_and_consistent(case):
    rows, cols, flat, vals = case
    idx = torch.tensor([[f // cols for f in flat], [f % cols for f in flat]], dtype=torch.int64).reshape(2, -1)
    v = torch.tensor(vals, dtype=torch.float64)
    c = COO(idx, v, (rows, cols))
    key = c.indices[0].long() * cols + c.indices[1].long()
    assert key.tolist() == sorted(flat)
    ref = np.zeros((rows, cols))
    for f, x in zip(flat, vals):
        ref[f // cols, f % cols] = x
    np.testing.assert_array_equal(c.to_dense().numpy(), ref)
    m = sp.csr_array(ref)
    m.eliminate_zeros()
    t = c.topology
    counts = np.diff(t.row_ptr.numpy())
    assert counts.sum() == len(flat) and (counts == np.bincount([f // cols for f in flat], minlength=rows)).all()
    ccounts = np.diff(t.col_ptr.numpy())
    assert (ccounts == np.bincount([f % cols for f in flat], minlength=cols)).all()
    # column order: sorted by (column, row)
    ckey = t.cols_by_col.long() * rows + t.rows_by_col.long()
    assert bool((ckey[1:] > ckey[:-1]).all()) if c.nnz > 1 else True
    assert torch.equal(c.indices[0][t.col_perm], t.rows_by_col)
    np.testing.assert_array_equal(c.to_scipy().toarray(), ref)
    back = COO.from_torch_sparse(c.to_torch_sparse(torch.sparse_csr))
    assert torch.equal(back.indices, c.indices) and torch.equal(back.values, c.values)


@given(coo_case(), st.integers(0, 2**31 - 1))
def test_property_duplicate_always_rejected(case, which):
    rows, cols, flat, vals = case
    if not flat:
        return
    flat = flat + [flat[which % len(flat)]]
    idx = torch.tensor([[f // cols for f in flat], [f % cols for f in flat]], dtype=torch.int64)
    with pytest.raises(ValueError, match="indices"):
        COO(idx, torch.ones(len(flat)), (rows, cols))


def test_coo_owns_its_indices_and_checks_dtypes():
    # canonical int32 input is copied: a later change of the caller's tensor cannot reach the
    # validated pattern (the kernels read it without bounds checks)
    idx = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    vals = torch.ones(2)
    c = COO(idx, vals, (2, 2))
    idx[1, 1] = 50_000_000
    assert c.indices.tolist() == [[0, 1], [0, 1]]
    assert c.values is vals  # canonical input: values kept as given (documented)
    c64 = c.to(torch.float64)  # a dtype given first, as torch's .to
    assert c64.dtype == torch.float64 and c64.device == c.device
    for bad in (lambda: c.to(dtype=torch.int64), lambda: c.to(torch.int32),
                lambda: COO.random((3, 3), density=0.5, dtype=torch.int32)):
        with pytest.raises(TypeError, match="floating dtype"):
            bad()
    with pytest.raises(ValueError, match="device must be a torch.device or a name .* got 'float64'"):
        c.to("float64")                          # a dtype's name is not a device
    with pytest.raises(ValueError, match="but torch sees"):
        c.to(f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    # a shape given as an array, a 1-D tensor or 0-d tensors; floats refused; complex scipy data refused
    for shape in (np.array([3, 4]), torch.tensor([3, 4]), (torch.tensor(3), np.int64(4)), (np.array(3), 4)):
        assert COO(c.indices, c.values, shape).shape == (3, 4)
    for shape in ((3.0, 4), (torch.tensor(3.0), 4)):
        with pytest.raises(TypeError, match=r"shape\[rows\] must be an int, got float"):
            COO(c.indices, c.values, shape)
    with pytest.raises(TypeError, match="mat must hold real numbers, got complex128"):
        COO.from_scipy(sp.coo_matrix(np.array([[1 + 2j, 0], [0, 3]])))
    with pytest.raises(ValueError, match="seed or generator, not both"):
        COO.random((3, 3), density=0.5, seed=1, generator=torch.Generator())
    assert COO.random((5, 6), density=np.float32(0.5), seed=1).nnz == 15
    assert COO.random((5, 6), nnz=np.int64(4), seed=1).nnz == 4
