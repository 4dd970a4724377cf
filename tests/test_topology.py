"""Tests of random topologies and layer densities: uniform_indices, Erdos-Renyi, ERK.

The uniformity test is statistical (a chi-square test over many draws of a small matrix, with a
fixed seed so that it is repeatable); a sampler biased towards any cell, row or column fails it.
Trade-off: small matrices and a few thousand draws keep the file under a few seconds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from snack.core import density_to_nnz, erdos_renyi_density, erk_densities, uniform_indices


def check_canonical(idx, shape, nnz):
    assert idx.dtype == torch.int32 and idx.shape == (2, nnz) and idx.is_contiguous()
    if nnz:
        assert int(idx[0].min()) >= 0 and int(idx[0].max()) < shape[0]
        assert int(idx[1].min()) >= 0 and int(idx[1].max()) < shape[1]
    key = idx[0].long() * shape[1] + idx[1].long()
    assert bool((key[1:] > key[:-1]).all())  # sorted row-major and distinct


@pytest.mark.parametrize("shape, density", [((7, 96), 0.1), ((40, 333), 0.01), ((1, 1), 1.0),
                                            ((1, 1), 0.0), ((300, 200), 0.9), ((13, 17), 0.5),
                                            ((13, 17), 0.51), ((96, 7), 0.999)])
def test_exact_nnz_distinct_in_range(seed, shape, density):
    idx = uniform_indices(shape, density=density, seed=seed)
    nnz = int(round(density * shape[0] * shape[1]))
    check_canonical(idx, shape, nnz)


@pytest.mark.parametrize("nnz", [0, 1, 2, 50, 51, 99, 100])
def test_nnz_argument(gen, nnz):
    idx = uniform_indices((10, 10), nnz=nnz, generator=gen)
    check_canonical(idx, (10, 10), nnz)


def test_full_density_is_every_coordinate():
    idx = uniform_indices((5, 6), density=1.0, seed=0)
    assert idx[0].tolist() == [r for r in range(5) for _ in range(6)]
    assert idx[1].tolist() == list(range(6)) * 5


def test_seeded_determinism():
    a = uniform_indices((50, 60), density=0.2, seed=7)
    b = uniform_indices((50, 60), density=0.2, generator=torch.Generator().manual_seed(7))
    c = uniform_indices((50, 60), density=0.2, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    hi1 = uniform_indices((50, 60), density=0.8, seed=7)
    hi2 = uniform_indices((50, 60), density=0.8, seed=7)
    assert torch.equal(hi1, hi2)
    torch.manual_seed(3)
    d = uniform_indices((50, 60), density=0.2)
    torch.manual_seed(3)
    assert torch.equal(d, uniform_indices((50, 60), density=0.2))


@pytest.mark.parametrize("nnz", [9, 35])  # the rejection path and the complement path (> 0.5)
def test_roughly_uniform(nnz):
    shape, draws = (6, 7), 3000
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(shape[0] * shape[1], dtype=torch.int64)
    for _ in range(draws):
        idx = uniform_indices(shape, nnz=nnz, generator=g)
        counts += torch.bincount(idx[0].long() * shape[1] + idx[1].long(), minlength=counts.numel())
    expected = draws * nnz / counts.numel()
    # each cell is in the sample with probability nnz / n: variance draws * p * (1 - p)
    p = nnz / counts.numel()
    stat = float(((counts.double() - expected) ** 2).sum() / (draws * p * (1 - p)))
    pval = scipy.stats.chi2.sf(stat, df=counts.numel() - 1)
    assert pval > 1e-4, (pval, counts.view(shape))
    # and no cell is far off (5 standard deviations)
    sd = math.sqrt(draws * p * (1 - p))
    assert float((counts.double() - expected).abs().max()) < 5 * sd


def test_rows_and_columns_uniform_on_a_large_matrix():
    shape = (200, 300)
    idx = uniform_indices(shape, density=0.1, seed=99)
    for dim, n in ((0, shape[0]), (1, shape[1])):
        counts = torch.bincount(idx[dim].long(), minlength=n).numpy()
        other = shape[1 - dim]
        # a count per row is hypergeometric-like, close to binomial(other, 0.1)
        stat = ((counts - other * 0.1) ** 2).sum() / (other * 0.1 * 0.9)
        assert scipy.stats.chi2.sf(stat, df=n - 1) > 1e-4


@pytest.mark.parametrize("kw, exc, match", [
    (dict(), ValueError, "exactly one"),
    (dict(density=0.1, nnz=3), ValueError, "exactly one"),
    (dict(density=1.5), ValueError, "density"),
    (dict(density=-0.1), ValueError, "density"),
    (dict(density=float("nan")), ValueError, "density"),
    (dict(density="0.1"), ValueError, "density"),
    (dict(nnz=101), ValueError, "nnz"),
    (dict(nnz=-1), ValueError, "nnz"),
    (dict(nnz=3.0), TypeError, "nnz"),
    (dict(nnz=True), TypeError, "nnz"),
])
def test_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        uniform_indices((10, 10), seed=0, **kw)


def test_bad_shape():
    with pytest.raises(ValueError, match="shape"):
        uniform_indices((-1, 10), nnz=0, seed=0)
    with pytest.raises(TypeError, match="shape"):
        uniform_indices((2.5, 10), nnz=0, seed=0)


def test_zero_sized():
    assert uniform_indices((0, 10), nnz=0, seed=0).shape == (2, 0)
    assert uniform_indices((10, 0), density=0.5, seed=0).shape == (2, 0)


def test_density_to_nnz():
    assert density_to_nnz((10, 10), density=0.25) == 25
    assert density_to_nnz((7, 96), density=0.1) == 67  # round(67.2)
    assert density_to_nnz((4096, 4096), density=0.1) == 1677722
    assert density_to_nnz((3, 3), nnz=9) == 9


# ---- Erdos-Renyi and ERK -----------------------------------------------------------------------
def test_erdos_renyi_density():
    assert erdos_renyi_density((100, 300), epsilon=20) == pytest.approx(20 * 400 / 30000)
    assert erdos_renyi_density((10, 10), epsilon=20) == 1.0  # capped
    assert erdos_renyi_density((784, 300), 1.0) == pytest.approx(1084 / (784 * 300))
    with pytest.raises(ValueError, match="epsilon"):
        erdos_renyi_density((10, 10), epsilon=0)
    with pytest.raises(ValueError, match="shape"):
        erdos_renyi_density((0, 10))


LENET = [(300, 784), (100, 300), (10, 100)]
GPT_ISH = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (50, 768), (4, 4)]


@pytest.mark.parametrize("shapes", [LENET, GPT_ISH, [(64, 64)], [(5, 5), (1000, 1000)]])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
def test_erk_budget_cap_and_proportionality(shapes, sparsity):
    d = erk_densities(shapes, sparsity)
    sizes = np.array([r * c for r, c in shapes], dtype=np.float64)
    d = np.array(d)
    assert d.shape == (len(shapes),)
    assert (d > 0).all() and (d <= 1.0 + 1e-12).all()
    # the total number of connections is the target
    assert (d * sizes).sum() == pytest.approx((1 - sparsity) * sizes.sum(), rel=1e-9)
    raw = np.array([(r + c) / (r * c) for r, c in shapes])
    sparse = d < 1.0 - 1e-12
    if sparse.any():
        # density proportional to (rows + cols) / (rows * cols) among the layers not kept dense
        scale = d[sparse] / raw[sparse]
        assert np.allclose(scale, scale[0], rtol=1e-9)
        # a layer is kept dense only if its ERK density would exceed 1
        assert (scale[0] * raw[~sparse] >= 1.0 - 1e-9).all()


def test_erk_small_layers_denser():
    d = erk_densities(LENET, 0.9)
    assert d[0] < d[1] < d[2]
    assert d[2] == 1.0  # (10, 100) would exceed 1
    # a floating 0-d tensor (as sparsify takes it) gives the same densities; other tensors do not pass
    assert erk_densities(LENET, torch.tensor(0.9, dtype=torch.float64)) == d
    with pytest.raises(ValueError, match="sparsity"):
        erk_densities(LENET, torch.tensor([0.9]))


def test_erk_errors():
    with pytest.raises(ValueError, match="sparsity"):
        erk_densities(LENET, 1.0)
    with pytest.raises(ValueError, match="sparsity"):
        erk_densities(LENET, -0.1)
    with pytest.raises(ValueError, match="shapes"):
        erk_densities([(0, 10)], 0.5)
    assert erk_densities([], 0.5) == []


def test_numbers_of_any_kind_and_nan_rejected():
    assert density_to_nnz((4, 5), density=np.float32(0.5)) == 10 and density_to_nnz((4, 5), nnz=np.int32(3)) == 3
    with pytest.raises(ValueError, match="density"):
        density_to_nnz((4, 5), density=True)
    with pytest.raises(ValueError, match="epsilon"):
        erdos_renyi_density((30, 40), float("nan"))
    assert erk_densities([(4, 5), (6, 7)], np.float32(0.5)) == erk_densities([(4, 5), (6, 7)], 0.5)
    with pytest.raises(ValueError, match="sparsity"):
        erk_densities([(4, 5)], float("nan"))


def test_seed_and_generator_are_not_both_taken():
    with pytest.raises(ValueError, match="give seed or generator, not both"):
        uniform_indices((5, 6), nnz=4, seed=1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(uniform_indices((5, 6), nnz=4, seed=1),
                       uniform_indices((5, 6), nnz=4, generator=torch.Generator().manual_seed(1)))


class _OnCuda(torch.Generator):
    """A CPU generator that says it is on CUDA (no GPU is needed to reach the device check)."""
    @property
    def device(self):
        return torch.device("cuda", 0)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(seed=1.5), TypeError, "seed must be an int or None, got float"),
    (dict(seed=True), TypeError, "seed must be an int or None, got bool"),  # (torch would take it as 1)
    (dict(seed="7"), TypeError, "seed must be an int or None, got str"),
    (dict(seed=2**64), ValueError, r"seed must fit in 64 bits.*got 18446744073709551616"),
    (dict(seed=-2**63 - 1), ValueError, "seed must fit in 64 bits"),
    (dict(generator=5), TypeError, "generator must be a torch.Generator or None, got int"),
    (dict(generator=_OnCuda()), ValueError, "generator must be a CPU torch.Generator.*cuda:0"),
])
def test_seed_and_generator_are_checked_as_by_coo_random(kw, exc, match):
    # torch's own errors named neither (manual_seed's "expected a long", "Overflow when unpacking
    # long long", randint's list of signatures); the same helper checks COO.random's
    from snack.core import COO
    with pytest.raises(exc, match=match):
        uniform_indices((5, 6), nnz=4, **kw)
    with pytest.raises(exc, match=match):
        COO.random((5, 6), nnz=4, **kw)


def test_any_seed_torch_takes_numpy_integers_too():
    for seed in (2**64 - 1, -2**63, np.int64(3), np.uint8(3)):
        assert torch.equal(uniform_indices((5, 6), nnz=4, seed=seed),
                           uniform_indices((5, 6), nnz=4, generator=torch.Generator().manual_seed(int(seed))))
