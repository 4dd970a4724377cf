"""Tests of snack.SparseLinear: construction, forward/backward against the dense layer of its
to_dense() weight (float64), from_dense, state_dict / torch.save round trips, optimizers, dtype
and device moves, and input validation. GPU-marked tests compare the same on CUDA, under CUDA
graph capture and under autocast.
"""
import copy
import math
import sys
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snack
from snack import SparseLinear

from conftest import assert_close_dtype, collector_off, ladder, tolerance
from snack.layers.functional import settle_autograd

F64_ATOL = tolerance(torch.float64)[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _canonical_unique(idx, shape):
    key = idx[0].long() * shape[1] + idx[1].long()
    return bool((key[1:] > key[:-1]).all()) if key.numel() > 1 else True


@pytest.mark.parametrize("in_f,out_f,sparsity", [(96, 40, 0.9), (333, 7, 0.5), (1, 1, 0.0), (7, 5, 0.95),
                                                 (40, 96, 0.0)])
def test_construction(in_f, out_f, sparsity):
    layer = SparseLinear(in_f, out_f, sparsity=sparsity)
    nnz = round((1 - sparsity) * in_f * out_f)
    assert layer.nnz == nnz and layer.values.shape == (nnz,)
    assert layer.indices.dtype == torch.int32 and layer.indices.shape == (2, nnz)
    assert layer.in_features == in_f and layer.out_features == out_f
    assert math.isclose(layer.sparsity, 1 - nnz / (in_f * out_f))
    assert isinstance(layer.values, nn.Parameter) and isinstance(layer.bias, nn.Parameter)
    assert layer.bias.shape == (out_f,)
    assert "indices" in dict(layer.named_buffers())
    idx = layer.indices
    if nnz:
        assert int(idx[0].min()) >= 0 and int(idx[0].max()) < out_f
        assert int(idx[1].min()) >= 0 and int(idx[1].max()) < in_f
    assert _canonical_unique(idx, (out_f, in_f))
    bound = 1 / math.sqrt(in_f)
    assert float(layer.values.detach().abs().max()) <= bound and float(layer.bias.detach().abs().max()) <= bound
    assert f"nnz={nnz}" in repr(layer)


def test_no_bias_and_dtype_device_args():
    layer = SparseLinear(10, 6, bias=False, sparsity=0.5, dtype=torch.float64, device="cpu")
    assert layer.bias is None and layer.values.dtype == torch.float64
    assert layer.indices.dtype == torch.int32
    x = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.to_dense().t(), atol=F64_ATOL, rtol=0)


def test_seeded_construction_is_reproducible():
    torch.manual_seed(0)
    a = SparseLinear(50, 30, sparsity=0.8)
    torch.manual_seed(0)
    b = SparseLinear(50, 30, sparsity=0.8)
    c = SparseLinear(50, 30, sparsity=0.8)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert not torch.equal(b.indices, c.indices)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "0.5", True])
def test_bad_sparsity(bad):
    with pytest.raises(ValueError, match="sparsity"):
        SparseLinear(8, 8, sparsity=bad)


@pytest.mark.parametrize("in_f,out_f", [(0, 4), (4, 0), (-3, 4)])
def test_bad_features(in_f, out_f):
    with pytest.raises(ValueError, match="features"):
        SparseLinear(in_f, out_f)
    with pytest.raises(TypeError, match="in_features"):
        SparseLinear(4.0, 4)


@pytest.mark.parametrize("lead", [(7,), (2, 3), (), (1,)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_dense_and_masked_gradient(lead, bias):
    torch.manual_seed(1)
    layer = SparseLinear(33, 17, bias=bias, sparsity=0.7, dtype=torch.float64)
    x = torch.randn(*lead, 33, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    w = layer.to_dense().detach().requires_grad_()
    xd = x.detach().clone().requires_grad_()
    bd = layer.bias.detach().clone().requires_grad_() if bias else None
    yd = F.linear(xd, w, bd)
    torch.testing.assert_close(y, yd, atol=F64_ATOL, rtol=0)
    dy = torch.randn_like(yd)
    y.backward(dy)
    yd.backward(dy)
    torch.testing.assert_close(x.grad, xd.grad, atol=F64_ATOL, rtol=0)
    r, c = layer.indices.long()
    torch.testing.assert_close(layer.values.grad, w.grad[r, c], atol=F64_ATOL, rtol=0)
    if bias:
        torch.testing.assert_close(layer.bias.grad, bd.grad, atol=F64_ATOL, rtol=0)


def test_to_dense_is_differentiable_and_sparse():
    layer = SparseLinear(20, 10, sparsity=0.8, dtype=torch.float64)
    w = layer.to_dense()
    assert w.shape == (10, 20) and int((w != 0).sum()) <= layer.nnz
    w.sum().backward()
    assert torch.equal(layer.values.grad, torch.ones_like(layer.values))


def test_wrong_input_width():
    layer = SparseLinear(12, 5)
    with pytest.raises(ValueError, match="12"):
        layer(torch.randn(3, 11))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, 12, dtype=torch.float64))


# ---- from_dense ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,sparsity", [((40, 96), 0.9), ((7, 333), 0.5), ((1, 1), 0.0), ((5, 3), 0.99)])
@pytest.mark.filterwarnings("ignore:SparseLinear .* holds no connection")
def test_from_dense_keeps_largest(shape, sparsity):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    layer = SparseLinear.from_dense(w, sparsity=sparsity)
    k = round((1 - sparsity) * w.numel())
    assert layer.nnz == k and layer.indices.dtype == torch.int32
    assert _canonical_unique(layer.indices, shape)
    r, c = layer.indices.long()
    torch.testing.assert_close(layer.values.detach(), w[r, c], atol=0, rtol=0)
    if 0 < k < w.numel():
        kept = w[r, c].abs().min()
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[r, c] = True
        assert float(w.abs()[~mask].max()) <= float(kept)
    x = torch.randn(4, shape[1], dtype=torch.float64)
    assert layer.bias is None
    torch.testing.assert_close(layer(x), x @ (w * (layer.to_dense() != 0)).t(), atol=F64_ATOL, rtol=0)
    assert layer.values.requires_grad


def test_from_dense_ties_are_deterministic():
    w = torch.ones(4, 5)
    layer = SparseLinear.from_dense(w, sparsity=0.5)
    assert layer.nnz == 10
    # the first ten entries in row-major order win
    assert layer.indices.tolist() == [[0] * 5 + [1] * 5, list(range(5)) * 2]
    w2 = torch.tensor([[1.0, -3.0, 3.0], [0.5, -3.0, 2.0]])
    l2 = SparseLinear.from_dense(w2, sparsity=0.5)
    assert l2.indices.tolist() == [[0, 0, 1], [1, 2, 1]]


def test_from_dense_linear_mask_and_nonzeros():
    torch.manual_seed(4)
    lin = nn.Linear(30, 20).double()
    sl = SparseLinear.from_dense(lin, sparsity=0.75)
    assert torch.equal(sl.bias.detach(), lin.bias.detach()) and sl.bias is not lin.bias
    assert sl.values.dtype == torch.float64
    mask = torch.rand(20, 30) < 0.3
    ml = SparseLinear.from_dense(lin, mask=mask)
    torch.testing.assert_close(ml.to_dense(), lin.weight.detach() * mask, atol=0, rtol=0)
    assert ml.nnz == int(mask.sum())
    x = torch.randn(6, 30, dtype=torch.float64)
    torch.testing.assert_close(ml(x), F.linear(x, lin.weight * mask, lin.bias), atol=F64_ATOL, rtol=0)
    pruned = lin.weight.detach() * mask
    nz = SparseLinear.from_dense(pruned)
    assert nz.nnz == int((pruned != 0).sum()) and nz.bias is None
    with pytest.raises(ValueError, match="mask must have"):
        SparseLinear.from_dense(lin, mask=mask.t())
    with pytest.raises(ValueError, match="not both"):
        SparseLinear.from_dense(lin, mask=mask, sparsity=0.5)
    with pytest.raises(ValueError, match="sparsity"):
        SparseLinear.from_dense(lin, sparsity=1.0)
    with pytest.raises(ValueError, match="2-D"):
        SparseLinear.from_dense(torch.randn(3, 4, 5))
    with pytest.raises(TypeError):
        SparseLinear.from_dense([[1.0]])
    lin.weight.requires_grad_(False)
    assert not SparseLinear.from_dense(lin, sparsity=0.5).values.requires_grad


def test_from_dense_mask_must_be_bool_or_zero_one():
    w = torch.randn(3, 4)
    for ok in (torch.ones(3, 4), torch.ones(3, 4, dtype=torch.int64), torch.eye(3, 4, dtype=torch.uint8)):
        assert SparseLinear.from_dense(w, mask=ok).nnz == int((ok != 0).sum())
    for bad, shown in ((torch.full((3, 4), 0.3), "0.3"), (torch.tensor([[1, 0, 2, 0]] * 3), "2"),
                       (torch.full((3, 4), float("nan")), "nan"), (-torch.ones(3, 4), "-1")):
        with pytest.raises(ValueError, match=f"mask must be bool or hold only 0 and 1, got the value {shown}"):
            SparseLinear.from_dense(w, mask=bad)


def test_a_device_torch_cannot_reach_is_refused_by_name():
    from snack.core import COO
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    unreachable = [f"cuda:{n}", torch.device("cuda", n)] + ([] if n else ["cuda", 0])
    for dev in unreachable:
        for make in (lambda: SparseLinear(4, 3, device=dev), lambda: COO.random((3, 4), density=0.5, device=dev)):
            with pytest.raises(ValueError, match=r"device=.*but torch sees (no CUDA GPU|\d+ CUDA device)"):
                make()
    for bad, err in (("gpu", ValueError), (3.5, TypeError)):
        with pytest.raises(err, match="device must be a torch.device or a name such as 'cpu' or 'cuda:0', got"):
            SparseLinear(4, 3, device=bad)
    assert SparseLinear(4, 3, device="cpu").values.device.type == "cpu"
    if n:
        assert SparseLinear(4, 3, device=n - 1).indices.device == torch.device("cuda", n - 1)


def test_from_dense_and_sparsify_on_the_meta_device():
    """A meta weight has no values: with a sparsity it gives a meta layer of as many connections
    as a real weight would (for a checkpoint to fill after to_empty), with a mask the mask's
    pattern; without either, or with a meta mask, there is nothing to select and it says so."""
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 10))
    want = snack.sparsify(copy.deepcopy(real), sparsity=0.8, distribution="erk")
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 10))
    got = snack.sparsify(meta, sparsity=0.8, distribution="erk")
    for a, b in ((got[0], want[0]), (got[2], want[2])):
        assert isinstance(a, SparseLinear) and a.values.is_meta and a.indices.is_meta and a.bias.is_meta
        assert a.nnz == b.nnz and a.indices.dtype == torch.int32
    got = got.to_empty(device="cpu")
    got.load_state_dict(want.state_dict())
    x = torch.randn(5, 30)
    assert torch.equal(got(x), want(x))
    w = torch.randn(6, 7, device="meta")
    assert SparseLinear.from_dense(w, sparsity=0.5).nnz == SparseLinear.from_dense(torch.randn(6, 7), sparsity=0.5).nnz
    mask = torch.rand(6, 7) < 0.3
    m = SparseLinear.from_dense(w, mask=mask)
    assert m.indices.is_meta and m.nnz == int(mask.sum())
    with pytest.raises(ValueError, match="weight is on the meta device: it holds no values"):
        SparseLinear.from_dense(w)
    with pytest.raises(ValueError, match="mask is on the meta device"):
        SparseLinear.from_dense(torch.randn(6, 7), mask=mask.to("meta"))


def test_forward_on_the_meta_device_gives_the_output_shape():
    with torch.device("meta"):
        layer = SparseLinear(20, 10, sparsity=0.7)
        model = nn.Sequential(layer, nn.ReLU(), nn.Linear(10, 3))
    y = layer(torch.randn(4, 5, 20, device="meta"))
    assert y.is_meta and y.shape == (4, 5, 10) and y.dtype == torch.float32
    assert model(torch.randn(6, 20, device="meta")).shape == (6, 3)


def test_torchscript_is_refused_by_name():
    layer = SparseLinear(20, 10, sparsity=0.7)
    with pytest.raises(RuntimeError, match="torch.jit.trace cannot record sparse_linear"):
        torch.jit.trace(layer, torch.randn(4, 20))
    for m in (layer, nn.Sequential(nn.Linear(5, 20), layer)):
        with pytest.raises(RuntimeError, match="SparseLinear cannot be compiled by TorchScript"):
            torch.jit.script(m)
    assert layer(torch.randn(4, 20)).shape == (4, 10)  # still usable


@pytest.fixture
def swap_mode():
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(False)


def test_load_and_conversion_under_torch_swap_mode(swap_mode):
    # torch.__future__.set_swap_module_params_on_conversion(True): the layer loads and converts
    # as in the classic mode (swap_tensors refuses its weakly referenced tensors)
    torch.manual_seed(0)
    src, dst = SparseLinear(20, 10, sparsity=0.8), SparseLinear(20, 10, sparsity=0.8)
    x = torch.randn(4, 20)
    dst(x)                                   # its topology is cached (a weak reference to indices)
    values = dst.values
    dst.load_state_dict(src.state_dict())
    assert dst.values is values and torch.equal(dst(x), src(x))
    other = SparseLinear(20, 10, sparsity=0.5)
    other.load_state_dict(src.state_dict())  # another nnz: resized
    assert other.nnz == src.nnz and torch.equal(other(x), src(x))
    other.double()
    assert other.values.dtype == torch.float64 and other.indices.dtype == torch.int32
    torch.testing.assert_close(other(x.double()), src(x).double())
    assert torch.__future__.get_swap_module_params_on_conversion()  # the mode is left as it was


def test_from_dense_by_magnitude_rejects_nan_but_a_mask_keeps_it():
    """NaN has no magnitude: keeping the largest |w| of a weight holding one raises (naming where),
    while a mask or the non-zeros of the weight choose the pattern without ranking it."""
    w = torch.randn(4, 5)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"weight holds 1 NaN value\(s\) \(e.g. at \(2, 3\)\)"):
        SparseLinear.from_dense(w, sparsity=0.5)
    m = torch.zeros(4, 5, dtype=torch.bool)
    m[2, 3] = m[0, 0] = True
    layer = SparseLinear.from_dense(w, mask=m)
    assert layer.nnz == 2 and torch.isnan(layer.to_dense()[2, 3])
    assert SparseLinear.from_dense(w).nnz == 20
    lin = nn.Linear(6, 3)
    with torch.no_grad():
        lin.weight[1, 4] = float("nan")
    model = nn.Sequential(nn.Linear(6, 6), lin)
    before = [type(mod) for mod in model]
    with pytest.raises(ValueError, match=r"sparsify: module '1': weight holds 1 NaN"):
        snack.sparsify(model, 0.5)
    assert [type(mod) for mod in model] == before  # nothing replaced


def test_construction_checks_dtype_warns_when_empty_and_takes_numpy_ints():
    import numpy as np
    with pytest.raises(TypeError, match="dtype must be a floating"):
        SparseLinear(3, 3, dtype=torch.int32)
    with pytest.warns(UserWarning, match="holds no connection"):
        assert SparseLinear(2, 2, sparsity=0.9).nnz == 0
    with pytest.warns(UserWarning, match="holds no connection"):
        assert SparseLinear.from_dense(torch.randn(2, 3), sparsity=0.95).nnz == 0
    with pytest.warns(UserWarning, match="holds no connection .the mask keeps no entry"):
        assert SparseLinear.from_dense(torch.randn(2, 3), mask=torch.zeros(2, 3, dtype=torch.bool)).nnz == 0
    with pytest.warns(UserWarning, match="holds no connection .the weight has no non-zero entry"):
        assert SparseLinear.from_dense(torch.zeros(2, 3)).nnz == 0
    layer = SparseLinear(np.int64(5), np.int32(3), sparsity=0.0)
    assert type(layer.in_features) is int and layer.nnz == 15
    assert SparseLinear(5, 4, sparsity=torch.tensor(0.5)).nnz == 10  # a 0-d tensor
    assert SparseLinear(5, 4, sparsity=np.float32(0.5)).nnz == 10


def test_construction_under_a_default_device_context():
    torch.manual_seed(3)
    ref = SparseLinear(20, 10)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = SparseLinear(20, 10)
    assert meta.values.is_meta and meta.indices.is_meta and meta.bias.is_meta
    layer = meta.to_empty(device="cpu")
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(4, 20)
    assert torch.equal(layer(x), ref(x))


# ---- state, serialisation, moves ----------------------------------------------------------------
def test_state_dict_round_trip_bit_for_bit():
    torch.manual_seed(5)
    a = SparseLinear(64, 48, sparsity=0.9)
    torch.manual_seed(6)
    b = SparseLinear(64, 48, sparsity=0.9)
    assert not torch.equal(a.indices, b.indices)
    x = torch.randn(5, 64)
    b(x)                              # b's topology is cached before the load
    sd = a.state_dict()
    assert set(sd) == {"values", "indices", "bias"} and sd["indices"].dtype == torch.int32
    b.load_state_dict(sd)
    for k in sd:
        assert torch.equal(getattr(b, k), sd[k]) and getattr(b, k).dtype == sd[k].dtype
    assert torch.equal(a(x), b(x))    # the cached topology was rebuilt from the loaded indices


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.Adam(p, lr=1e-2), lambda p: snack.optim.Adam(p, lr=1e-2),
                                      lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)],
                         ids=["torch-adam", "snack-adam", "sgd-momentum"])
def test_an_optimizer_with_state_of_the_old_nnz_is_refused_before_it_steps(make_opt):
    """After a checkpoint of another nnz is loaded, an optimizer holding state of the old size
    stops with a RuntimeError that says why, before it changes anything; one built after the load,
    or whose state was loaded to match, steps."""
    import snack.layers.linear as linear_module
    torch.manual_seed(4)
    x = torch.randn(3, 8)
    layer = SparseLinear(8, 4, sparsity=0.5)
    opt = make_opt(layer.parameters())
    layer(x).sum().backward()
    opt.step()
    ckpt_layer = SparseLinear(8, 4, sparsity=0.25)
    ckpt_opt = make_opt(ckpt_layer.parameters())
    ckpt_layer(x).sum().backward()
    ckpt_opt.step()
    layer.load_state_dict(ckpt_layer.state_dict())
    layer(x).sum().backward()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"holds state \(.*\) for 16 connections of a SparseLinear that "
                                           r"load_state_dict gave 24: build the optimizer after loading"):
        opt.step()
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k])
    opt.load_state_dict(ckpt_opt.state_dict())         # the optimizer's checkpoint too: it steps
    opt.step()
    assert not torch.equal(layer.values, before["values"])
    assert not linear_module._RESIZED
    layer.load_state_dict(SparseLinear(8, 4, sparsity=0.5).state_dict())
    fresh = make_opt(layer.parameters())                # built after the load: it steps
    layer(x).sum().backward()
    fresh.step()
    assert not linear_module._RESIZED


def test_state_dict_of_another_nnz_loads():
    # a checkpoint with another number of connections (from_dense, another sparsity) loads into a
    # freshly built layer: values and indices take its size, indices stay int32
    torch.manual_seed(8)
    src = SparseLinear.from_dense(nn.Linear(20, 12), mask=torch.rand(12, 20) < 0.3)
    x = torch.randn(3, 20)
    for assign in (False, True):
        dst = SparseLinear(20, 12, sparsity=0.9)
        values = dst.values
        dst(x)                                             # a cached topology of the old pattern
        sd = {k: v.clone() for k, v in src.state_dict().items()}
        sd["indices"] = sd["indices"].long()               # e.g. written by another tool
        dst.load_state_dict(sd, assign=assign)
        assert dst.nnz == src.nnz != 24 and dst.indices.dtype == torch.int32
        assert (dst.values is values) != assign            # the same Parameter unless assign=True
        assert torch.equal(dst(x), src(x))
        opt = torch.optim.Adam(dst.parameters())
        dst(x).sum().backward()
        opt.step()
    # a checkpoint of another shape, copied into a plain dict (without the metadata that names
    # its shape), is refused before anything changes: indices out of range, or in range but with
    # a bias of another size (a 7 x 10 checkpoint into an 8 x 10 layer)
    for layer, ckpt, msg in ((SparseLinear(5, 4, sparsity=0.5), dict(SparseLinear(9, 4, sparsity=0.3).state_dict()),
                              "outside this layer's 4 x 5 weight"),
                             (SparseLinear(10, 8, sparsity=0.8), dict(SparseLinear(10, 7, sparsity=0.3).state_dict()),
                              "size mismatch for bias"),
                             (SparseLinear(20, 12, bias=False), src.state_dict(), "Unexpected key")):
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(RuntimeError, match=msg):
            layer.load_state_dict(ckpt)
        assert layer.state_dict().keys() == before.keys()
        for k, v in layer.state_dict().items():
            assert torch.equal(v, before[k])
    # strict=False: a bias missing from the checkpoint, or one the layer lacks, is only reported,
    # and values and indices take the checkpoint's size (torch passes strict=True to every
    # module's _load_from_state_dict: the layer reads load_state_dict's own argument)
    nobias = SparseLinear.from_dense(nn.Linear(20, 12, bias=False), mask=torch.rand(12, 20) < 0.3)
    for layer, ckpt, missing, unexpected in ((SparseLinear(20, 12, sparsity=0.9), nobias.state_dict(), ["bias"], []),
                                             (SparseLinear(20, 12, bias=False, sparsity=0.9), src.state_dict(),
                                              [], ["bias"]),
                                             (nn.Sequential(SparseLinear(20, 12, sparsity=0.9)),
                                              {"0." + k: v for k, v in nobias.state_dict().items()}, ["0.bias"], [])):
        res = layer.load_state_dict(ckpt, strict=False)
        assert (res.missing_keys, res.unexpected_keys) == (missing, unexpected)
        lin = layer[0] if isinstance(layer, nn.Sequential) else layer
        ref = nobias if missing else src
        assert lin.nnz == ref.nnz and torch.equal(lin.indices, ref.indices) and torch.equal(lin.values, ref.values)
    # loaded under inference_mode, after a backward: still trainable, the old gradient dropped
    dst = SparseLinear(20, 12, sparsity=0.9)
    dst(x).sum().backward()
    with torch.inference_mode():
        dst.load_state_dict(src.state_dict())
    assert dst.values.grad is None and not dst.indices.is_inference() and not dst.values.is_inference()
    dst(x).sum().backward()
    assert dst.values.grad.shape == (src.nnz,)
    bad = dict(src.state_dict(), values=src.values.detach()[:-1])
    with pytest.raises(RuntimeError, match=r"expected shapes \(2, nnz\) and \(nnz,\)"):
        SparseLinear(20, 12).load_state_dict(bad)


def test_state_dict_of_another_shape_or_order_is_refused(tmp_path):
    # the weight's shape travels in the checkpoint's metadata (also through torch.save / load):
    # a narrower or shorter layer's checkpoint, whose indices all fit, is refused like
    # nn.Linear's; indices that are unsorted or hold a coordinate twice are refused at load,
    # not at the next forward; in every case the layer is left as it was
    torch.manual_seed(9)
    src = SparseLinear(5, 7, sparsity=0.3)
    sd = src.state_dict()
    assert sd._metadata[""]["weight_shape"] == (7, 5)
    torch.save(sd, tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt")
    nested = nn.Sequential(nn.Linear(3, 5), SparseLinear(5, 7, sparsity=0.3)).state_dict()
    assert nested._metadata["1"]["weight_shape"] == (7, 5)
    flipped = dict(sd, indices=sd["indices"].flip(1).contiguous(), values=sd["values"].flip(0))
    twice = {k: v.clone() for k, v in sd.items()}
    twice["indices"][:, 1] = twice["indices"][:, 0]
    cases = ((SparseLinear(10, 7), sd, "checkpoint's weight is 7 x 5 .* this layer's 7 x 10"),
             (SparseLinear(10, 7), loaded, "checkpoint's weight is 7 x 5"),
             (SparseLinear(5, 9, bias=False), SparseLinear(5, 7, bias=False).state_dict(), "7 x 5"),
             (SparseLinear(5, 7), flipped, "not in canonical row-major order"),
             (SparseLinear(5, 7), twice, "duplicated coordinate"))
    x = torch.randn(2, 5)
    for layer, ckpt, msg in cases:
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(RuntimeError, match=msg):
            layer.load_state_dict(ckpt)
        for k, v in layer.state_dict().items():
            assert torch.equal(v, before[k]), k
    # the same shape loads, from the file too, and a plain dict without metadata still loads
    for ckpt in (sd, loaded, dict(sd)):
        dst = SparseLinear(5, 7, sparsity=0.6)
        dst.load_state_dict(ckpt)
        assert torch.equal(dst(x), src(x))
    nn.Sequential(nn.Linear(3, 5), SparseLinear(5, 7, sparsity=0.8)).load_state_dict(nested)


def test_indices_made_under_inference_mode_are_never_stale():
    # inference tensors have no version counter: their topology is rebuilt every call, so an
    # in-place change is seen (and validated) instead of reading a stale pattern
    from snack.functional import sparse_linear
    with torch.inference_mode():
        idx = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
        v = torch.tensor([1.0, 2.0])
        x = torch.tensor([[10.0, 100.0]])
        with pytest.warns(RuntimeWarning, match="inference tensor"):
            assert sparse_linear(x, idx, v, 2).tolist() == [[10.0, 200.0]]
        idx[1, 1] = 0
        assert sparse_linear(x, idx, v, 2).tolist() == [[10.0, 20.0]]
        idx[0, 1] = 7
        with pytest.raises(ValueError, match="rows"):
            sparse_linear(x, idx, v, 2)


def test_torch_save_load(tmp_path):
    torch.manual_seed(7)
    a = SparseLinear(20, 11, sparsity=0.6)
    x = torch.randn(3, 20)
    ya = a(x)
    torch.save(a.state_dict(), tmp_path / "sd.pt")
    torch.save(a, tmp_path / "module.pt")
    b = SparseLinear(20, 11, sparsity=0.6)
    b.load_state_dict(torch.load(tmp_path / "sd.pt"))
    c = torch.load(tmp_path / "module.pt", weights_only=False)
    assert torch.equal(b(x), ya) and torch.equal(c(x), ya)
    assert c.indices.dtype == torch.int32
    d = copy.deepcopy(a)
    assert torch.equal(d(x), ya)


def test_dtype_moves_keep_int32_indices():
    layer = SparseLinear(10, 8, sparsity=0.5)
    idx = layer.indices.clone()
    for move in (lambda m: m.to(dtype=torch.float64), lambda m: m.double(), lambda m: m.half(),
                 lambda m: m.to(torch.float64), lambda m: m.type(torch.float64), lambda m: m.float()):
        move(layer)
        assert layer.indices.dtype == torch.int32 and torch.equal(layer.indices, idx)
    layer.double()
    assert layer.values.dtype == torch.float64 and layer.bias.dtype == torch.float64
    y = layer(torch.randn(2, 10, dtype=torch.float64))
    assert y.dtype == torch.float64
    seq = nn.Sequential(layer).to(torch.float32)
    assert seq[0].indices.dtype == torch.int32 and seq[0].values.dtype == torch.float32


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                        (torch.optim.Adam, {"lr": 1e-2}), (torch.optim.AdamW, {"lr": 1e-2}),
                                        (torch.optim.RMSprop, {"lr": 1e-2}), (torch.optim.Adagrad, {"lr": 0.1})])
def test_optimizers_reduce_loss(opt_cls, kw):
    torch.manual_seed(8)
    teacher = SparseLinear(32, 16, sparsity=0.8)
    student = SparseLinear(32, 16, sparsity=0.8)
    student.indices.copy_(teacher.indices)        # same pattern: the loss can reach 0
    opt = opt_cls(student.parameters(), **kw)
    x = torch.randn(64, 32)
    with torch.no_grad():
        target = teacher(x)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.mse_loss(student(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    assert student.nnz == teacher.nnz and student.indices.dtype == torch.int32


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("B", [3, 32])  # the tiled kernels, and the 32-wide ones with the fused backward
def test_cuda_higher_order_gradients_and_per_sample_gradients(B):
    # a gradient penalty and per-sample gradients on the GPU kernels against float64 on the CPU
    torch.manual_seed(12)
    layer = SparseLinear(300, 200, sparsity=0.9, device="cuda")
    x = torch.randn(B, 300, device="cuda")
    ref = copy.deepcopy(layer).cpu().double()

    def penalised(m, x):
        x = x.clone().requires_grad_()
        y = torch.tanh(m(x)).pow(2).sum()
        gx, = torch.autograd.grad(y, x, create_graph=True)
        (y + gx.pow(2).sum()).backward()
        return m.values.grad, m.bias.grad
    for got, want in zip(penalised(layer, x), penalised(ref, x.cpu().double())):
        assert ((got.double().cpu() - want).norm() / want.norm()).item() < 1e-5
    params = {k: p.detach() for k, p in layer.named_parameters()}
    per = torch.func.vmap(torch.func.grad(
        lambda p, xi: torch.func.functional_call(layer, p, (xi,)).pow(2).sum()), in_dims=(None, 0))(params, x)
    ref.zero_grad()
    for i in (0, B - 1):
        ref.zero_grad()
        ref(x[i].cpu().double()).pow(2).sum().backward()
        err = ((per["values"][i].double().cpu() - ref.values.grad).norm() / ref.values.grad.norm()).item()
        assert err < 1e-5


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("lead,in_f,out_f,sparsity", [((7,), 96, 40, 0.9), ((2, 3), 333, 40, 0.95),
                                                      ((1,), 1, 1, 0.0), ((128,), 512, 256, 0.99)])
def test_cuda_matches_dense(lead, in_f, out_f, sparsity):
    torch.manual_seed(9)
    layer = SparseLinear(in_f, out_f, sparsity=sparsity, device="cuda")
    assert layer.indices.is_cuda and layer.indices.dtype == torch.int32
    x = torch.randn(*lead, in_f, device="cuda", requires_grad=True)
    y = layer(x)
    w = layer.to_dense().detach().double().requires_grad_()
    xd = x.detach().double().requires_grad_()
    bd = layer.bias.detach().double().requires_grad_()
    yd = F.linear(xd, w, bd)
    assert_close_dtype(y, yd)
    dy = torch.randn_like(y)
    y.backward(dy)
    yd.backward(dy.double())
    assert_close_dtype(x.grad, xd.grad)
    r, c = layer.indices.long()
    assert_close_dtype(layer.values.grad, w.grad[r, c])
    assert_close_dtype(layer.bias.grad, bd.grad)  # one GEMV on CUDA


@pytest.mark.gpu
@cuda
def test_cuda_move_and_back():
    layer = SparseLinear(30, 20, sparsity=0.7)
    x = torch.randn(4, 30)
    y = layer(x)
    layer.cuda()
    assert layer.indices.is_cuda and layer.indices.dtype == torch.int32
    assert_close_dtype(layer(x.cuda()).cpu(), y)
    with pytest.raises(ValueError, match="cuda"):
        layer(x)


@pytest.mark.gpu
@cuda
def test_cuda_graph_training_step():
    torch.manual_seed(10)
    layer = SparseLinear(256, 128, sparsity=0.9, device="cuda")
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3, capturable=True)
    x = torch.randn(16, 256, device="cuda")
    target = torch.randn(16, 128, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        opt.step()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    settle_autograd()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step()
    # inference graph with a poisoned output: replay must overwrite it
    with torch.no_grad():
        gi = torch.cuda.CUDAGraph()
        layer(x)
        with torch.cuda.graph(gi):
            static_y = layer(x)
    static_y.fill_(float("nan"))
    gi.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert_close_dtype(static_y, F.linear(x.double(), layer.to_dense().double(), layer.bias.double()))
    values_before = layer.values.detach().clone()
    static_loss.detach().fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(static_loss).all()
    assert not torch.equal(values_before, layer.values.detach())


def _replayed_grads(layer, x, dy):
    """(gradients [x, values(, bias)] of layer(x).backward(dy) replayed from a CUDA graph of the
    step (warmed up on a side stream; poisoned with NaN before the replay), the graph: kept by
    the caller while it reads them)."""
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)

    settle_autograd()  # (the eager steps' AccumulateGrad nodes, on the default stream, gone)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    settle_autograd()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    got = [x.grad, layer.values.grad] + ([layer.bias.grad] if layer.bias is not None else [])
    for t in got:
        t.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return got, g


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("B,bias", [(8, True), (64, False)])
def test_cuda_graph_backward_on_two_branches_matches_eager(B, bias):
    """Captured, an unfused backward (B outside 9..32) runs the SDDMM on a side stream next to
    dX: the replayed gradients (poisoned before the replay) equal the eager ones."""
    import snack.gpu as G
    from snack.layers import functional as Fn
    from snack.layers.backend import get_topology
    torch.manual_seed(12)
    layer = SparseLinear(640, 384, sparsity=0.9, bias=bias, device="cuda")
    assert not G.fuses_backward(B, get_topology(layer.indices, (384, 640)))
    x = torch.randn(B, 640, device="cuda", requires_grad=True)
    dy = torch.randn(B, 384, device="cuda")
    layer(x).backward(dy)
    want = [x.grad.clone(), layer.values.grad.clone()] + ([layer.bias.grad.clone()] if bias else [])

    got, _graph = _replayed_grads(layer, x, dy)
    assert any(key[0] == torch.device("cuda", torch.cuda.current_device()) for key in Fn._SIDE)
    # no side stream is one of the default-priority pool's streams (torch.cuda.Stream() hands
    # them out in turn: one of them may be another thread's capture stream)
    pool = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    assert not pool & {side.cuda_stream for side in Fn._SIDE.values()}
    for name, a, b in zip(("dx", "dv", "db"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@cuda
def test_two_captures_open_at_once_each_get_their_own_backward_side_stream():
    """Two threads capture a training step each at the same time (thread-local capture mode, a
    capture stream each; the second capture runs while the first is still open): each unfused
    backward takes a side stream of its own, both captures succeed and both replays give the
    eager gradients."""
    import threading

    import snack.gpu as G
    from snack.layers import functional as Fn
    from snack.layers.backend import get_topology
    torch.manual_seed(15)
    B = 8
    runs = []
    for _ in range(2):
        layer = SparseLinear(640, 384, sparsity=0.9, device="cuda")
        assert not G.fuses_backward(B, get_topology(layer.indices, (384, 640)))
        x = torch.randn(B, 640, device="cuda", requires_grad=True)
        dy = torch.randn(B, 384, device="cuda")
        layer(x).backward(dy)
        want = [x.grad.clone(), layer.values.grad.clone(), layer.bias.grad.clone()]
        runs.append((layer, x, dy, want))

    def step(layer, x, dy):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)

    settle_autograd()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for layer, x, dy, _ in runs:
            step(layer, x, dy)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    settle_autograd()

    graphs, errors = [None, None], []
    first_open, second_done = threading.Event(), threading.Event()

    def capture(i):
        layer, x, dy, _ = runs[i]
        try:
            if i == 1:
                assert first_open.wait(60)
            # (capture_begin / capture_end rather than torch.cuda.graph, whose entry synchronizes
            # the device and empties the allocator's cache while the other capture is open)
            g, cs = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.stream(cs):
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    step(layer, x, dy)
                    if i == 0:  # keep this capture open while the other thread captures its step
                        first_open.set()
                        assert second_done.wait(60)
                finally:
                    g.capture_end()
            graphs[i] = g
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append((i, e))
            first_open.set()
        finally:
            if i == 1:
                second_done.set()

    threads = [threading.Thread(target=capture, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    keys = [k for k in Fn._SIDE if k[0] == torch.device("cuda", torch.cuda.current_device())]
    assert len(set(id(Fn._SIDE[k]) for k in keys)) >= 2
    for (layer, x, _, want), g in zip(runs, graphs):
        got = [x.grad, layer.values.grad, layer.bias.grad]
        for t in got:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("dx", "dv", "db"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("two_branches", [False, True])
@pytest.mark.parametrize("B,bias", [(12, True), (16, True), (32, False), (32, True)])
def test_fused_backward_matches_float64_eager_and_captured(monkeypatch, B, bias, two_branches):
    """From B = 9 to 32 the eager GPU backward is one fused launch (dX, dv, db): its gradients
    equal a float64 dense computation, and replayed from a CUDA graph (gradients poisoned before
    the replay) they equal the eager ones, captured as the fused launch or, with
    CAPTURED_TWO_BRANCHES (whose plans the eager fused steps build), as two branches."""
    import snack.gpu as G
    from snack.layers import functional as Fn
    from snack.layers.backend import get_topology
    monkeypatch.setattr(Fn, "CAPTURED_TWO_BRANCHES", two_branches)
    monkeypatch.setattr(Fn, "_SIDE", {})  # the side streams the captured backward takes
    torch.manual_seed(13)
    layer = SparseLinear(1000, 1700, sparsity=0.9, bias=bias, device="cuda")
    assert G.fuses_backward(B, get_topology(layer.indices, (1700, 1000)))
    x = torch.randn(B, 1000, device="cuda", requires_grad=True)
    dy = torch.randn(B, 1700, device="cuda")
    layer(x).backward(dy)
    w = layer.to_dense().detach().double()  # (detached: no autograd graph may outlive the step,
    xd = x.detach().double()                # whose AccumulateGrad would then stay on this stream)
    want = [dy.double() @ w, (dy.double().T @ xd)[tuple(layer.indices.long())]]
    if bias:
        want.append(dy.double().sum(0))
    got = [x.grad, layer.values.grad] + ([layer.bias.grad] if bias else [])
    for name, a, b in zip(("dx", "dv", "db"), got, want):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-5, name
    eager = [t.clone() for t in got]

    got, _graph = _replayed_grads(layer, x, dy)
    for name, a, b in zip(("dx", "dv", "db"), got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert bool(Fn._SIDE) == two_branches


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("B", [1, 8, 12, 32, 128])
def test_cuda_graph_replays_pattern_changed_in_place(B):
    """Forward and backward captured in a CUDA graph, then the indices rewritten in place (same
    nnz, as dynamic sparse training does) and the topology rebuilt with one get_topology call:
    the replay computes with the new pattern (output and gradients against float64), through
    every kernel family (tiled B = 1 / 8, fused backward B = 12 / 32, wide kernels B = 32 / 128)."""
    from experiments.bench_layer import capture
    from snack.core import uniform_indices
    from snack.layers.backend import get_topology
    torch.manual_seed(17)
    layer = SparseLinear(1000, 1700, sparsity=0.9, device="cuda")
    x = torch.randn(B, 1000, device="cuda", requires_grad=True)
    dy = torch.randn(B, 1700, device="cuda")

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x)
        y.backward(dy)
        return y
    g, y = capture(step)
    got = [y, x.grad, layer.values.grad, layer.bias.grad]
    topo = get_topology(layer.indices, (1700, 1000))
    for seed in (1, 2):
        new_idx = uniform_indices((1700, 1000), nnz=layer.nnz, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            layer.indices.copy_(new_idx.to(layer.indices))
            layer.values.normal_()
        assert get_topology(layer.indices, (1700, 1000)) is topo
        for t in got:
            t.detach().fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        w = layer.to_dense().detach().double()
        xd = x.detach().double()
        want = [xd @ w.T + layer.bias.detach().double(), dy.double() @ w,
                (dy.double().T @ xd)[tuple(layer.indices.long())], dy.double().sum(0)]
        for name, a, b in zip(("y", "dx", "dv", "db"), got, want):
            assert ((a.double() - b).norm() / b.norm()).item() < 1e-5, (name, seed)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast(dtype):
    torch.manual_seed(11)
    layer = SparseLinear(128, 64, sparsity=0.9, device="cuda")
    x = torch.randn(8, 128, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        y = layer(x)
        yd = F.linear(x, layer.to_dense(), layer.bias)
    assert y.dtype == yd.dtype == dtype
    # inputs rounded to `dtype` first, then compared at that dtype's tolerance
    ref = F.linear(x.to(dtype).double(), layer.to_dense().to(dtype).double(), layer.bias.to(dtype).double())
    assert_close_dtype(y, ref, dtype)
    y.float().sum().backward()
    assert layer.values.grad.dtype == torch.float32 and torch.isfinite(layer.values.grad).all()
    assert layer.bias.grad.dtype == torch.float32


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B", [1, 8, 32])
def test_cuda_autocast_reads_float32_values_unrounded(dtype, B):
    # on the GPU backend only x is cast: W[r, r] = 1 + e_r, W[r, r + 1] = -1 with e_r exact in
    # `dtype` but 1 + e_r not, and equal inputs, give outputs e_r * scale exactly (0 or a multiple
    # of 2^-7 / 2^-10 with the values cast first); gradients as with cast weights
    n = 512
    idx, vals, e = ladder(n, dtype)
    idx, e = idx.cuda(), e.cuda()
    vals = vals.cuda().requires_grad_()
    bias = torch.zeros(n, device="cuda", requires_grad=True)
    scale = torch.arange(1, B + 1, dtype=torch.float32, device="cuda")[:, None]
    x = (scale * torch.ones(B, n, device="cuda")).requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        y = snack.functional.sparse_linear(x, idx, vals, n, bias)
        with torch.no_grad():
            y0 = snack.functional.sparse_linear(x, idx, vals, n, bias)
    assert y.dtype == y0.dtype == dtype
    assert torch.equal(y.float(), scale * e) and torch.equal(y0, y)
    y.backward(torch.ones_like(y))
    assert vals.grad.dtype == bias.grad.dtype == x.grad.dtype == torch.float32
    rows, cols = idx.long()
    torch.testing.assert_close(vals.grad, x.detach().sum(0)[cols])  # sum_b dY[b, r] X[b, c], dY = 1
    torch.testing.assert_close(bias.grad, torch.full((n,), float(B), device="cuda"))
    torch.testing.assert_close(x.grad, (e + 0 * scale).expand(B, n))  # dX = dY W: column c sums to e_c


# ---- the CUDA kernels through the layer, under Numba's simulator (no GPU needed) -----------------
SIM_SCRIPT = r"""
import torch, torch.nn.functional as F
import snack.gpu as gpu
from snack.layers import backend
backend._loaded["cpu"] = backend._wrap(gpu, "gpu")   # CPU tensors -> the simulated CUDA kernels
assert backend.backend_name("cpu") == "gpu"
import snack
torch.manual_seed(0)
layer = snack.SparseLinear(19, 13, sparsity=0.7)
x = torch.randn(2, 3, 19, requires_grad=True)
y = layer(x)
dy = torch.randn_like(y)
y.backward(dy)
w = layer.to_dense().detach().requires_grad_()
xd = x.detach().clone().requires_grad_()
yd = F.linear(xd, w, layer.bias)
yd.backward(dy)
r, c = layer.indices.long()
torch.testing.assert_close(y, yd, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(x.grad, xd.grad, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(layer.values.grad, w.grad[r, c], atol=1e-5, rtol=1e-5)
print("SIM-OK")
"""


@pytest.mark.slow
def test_layer_through_cuda_kernels_under_simulator():
    import os
    import subprocess
    import sys
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    res = subprocess.run([sys.executable, "-c", SIM_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert "SIM-OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
@cuda
def test_settle_autograd_lets_captures_follow_eager_steps():
    """Eager step, side-stream warm-up and capture, ten times over, with settle_autograd before
    the warm-up and the capture: every capture succeeds (one that reused an eager pass's
    AccumulateGrad node would fail) and replays the eager gradients."""
    for i in range(10):
        torch.manual_seed(40 + i)
        B = (12, 64)[i % 2]
        layer = SparseLinear(300, 200, sparsity=0.9, device="cuda")
        x = torch.randn(B, 300, device="cuda", requires_grad=True)
        dy = torch.randn(B, 200, device="cuda")
        layer(x).backward(dy)
        want = [x.grad.clone(), layer.values.grad.clone(), layer.bias.grad.clone()]
        got, _graph = _replayed_grads(layer, x, dy)
        for name, a, b in zip(("dx", "dv", "db"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} round {i}: {m}")


def _step_held_by_a_cycle(layer, x, dy):
    """layer(x).backward(dy) in a frame that references itself, as the frames a Numba kernel
    compile leaves in garbage cycles do: the output and its graph outlive the call until the
    cyclic collector runs. Returns a weak reference to the output."""
    cycle = [sys._getframe()]  # a cycle: this frame holds the list, the list this frame
    cycle.append(cycle)
    y = layer(x)
    y.backward(dy)
    return weakref.ref(y)


def test_settle_autograd_frees_a_graph_that_a_reference_cycle_holds():
    """settle_autograd collects reference cycles (with the cyclic collector off, so that nothing
    else does): the output of an eager step held only by one is gone after the call."""
    with collector_off():
        layer = SparseLinear(30, 20, sparsity=0.5)
        ref = _step_held_by_a_cycle(layer, torch.randn(4, 30, requires_grad=True), torch.randn(4, 20))
        assert ref() is not None and ref().grad_fn is not None
        settle_autograd()
        assert ref() is None


@pytest.mark.gpu
@cuda
def test_capture_follows_an_eager_step_that_a_reference_cycle_holds():
    """An eager step on the default stream whose graph a reference cycle keeps alive (what a
    kernel compiled during the step leaves), then settle_autograd, warm-up and capture: the
    capture succeeds (it would reuse the eager pass's AccumulateGrad nodes, made on the default
    stream, and fail, if the cycle were still there) and replays the eager gradients."""
    with collector_off():
        torch.manual_seed(5)
        for B in (16, 64):
            layer = SparseLinear(300, 200, sparsity=0.9, device="cuda")
            x = torch.randn(B, 300, device="cuda", requires_grad=True)
            dy = torch.randn(B, 200, device="cuda")
            ref = _step_held_by_a_cycle(layer, x, dy)
            assert ref() is not None
            want = [x.grad.clone(), layer.values.grad.clone(), layer.bias.grad.clone()]
            got, _graph = _replayed_grads(layer, x, dy)
            assert ref() is None
            for name, a, b in zip(("dx", "dv", "db"), got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} B = {B}: {m}")


def test_settle_autograd_arguments():
    """Devices, indices, modules and tensors name the CUDA workers to wait for (once each; a
    module's CPU tensors none); other devices and types are refused, with or without CUDA; on a
    GPU it also runs under inference_mode."""
    from snack.layers.functional import _cuda_devices, settle_autograd
    cuda = lambda i: torch.device("cuda", i)  # noqa: E731
    assert _cuda_devices(["cuda:1", 0, torch.device("cuda:2"), 1], resolve=False) == [cuda(1), cuda(0), cuda(2)]
    assert _cuda_devices(nn.Linear(3, 2), resolve=False) == []
    assert _cuda_devices(None, resolve=False) == []
    for bad, err in (("cpu", ValueError), (torch.device("meta"), ValueError), (True, TypeError),
                     (1.5, TypeError), ([0, "cpu"], ValueError)):
        with pytest.raises(err, match="device"):
            settle_autograd(bad)
    assert settle_autograd(nn.Linear(3, 2)) is None
    if torch.cuda.is_available():
        layer = SparseLinear(30, 20, sparsity=0.5, device="cuda")
        with torch.inference_mode():
            settle_autograd(layer)


@pytest.mark.gpu
@cuda
def test_bias_gradient_cache_not_filled_under_capture():
    """Frozen values, so the bias gradient is sum_b dY from the cached vector of ones: a capture
    at a batch larger than the cache holds must not leave a vector there whose ones are written
    only at replay. An eager step after the capture (before any replay) and the replay both give
    dy.sum(0)."""
    from snack.layers import functional as Fn
    torch.manual_seed(21)
    layer = SparseLinear(256, 96, sparsity=0.9, device="cuda")
    layer.values.requires_grad_(False)
    dev = torch.device("cuda", torch.cuda.current_device())
    cached = Fn._ONES.get(dev)
    B = 2 * (cached.numel() if cached is not None else 64) + 3  # more rows than the cache holds
    x = torch.randn(B, 256, device="cuda")
    dy = torch.randn(B, 96, device="cuda")

    def step():
        layer.bias.grad = None
        layer(x).backward(dy)
    settle_autograd()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x[:1]).backward(dy[:1])  # the backward warmed up at a small batch only
        with torch.no_grad():
            layer(x)  # the forward's launch plan at the full batch (built eagerly, not captured)
    torch.cuda.current_stream().wait_stream(s)
    settle_autograd()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    got = layer.bias.grad
    big = torch.randn(B, 256, device="cuda")
    layer.bias.grad = None
    layer(big).backward(dy)  # eager, before any replay
    torch.testing.assert_close(layer.bias.grad, dy.sum(0), rtol=1e-5, atol=1e-5)
    got.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, dy.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@cuda
def test_cuda_full_pattern_layer_and_densify_match_float64_eager_and_captured():
    """A layer holding every connection runs as a dense product of its values on the GPU too:
    eager and CUDA-graph forward + backward against float64 on the CPU; densify's nn.Linear gives
    the same outputs."""
    torch.manual_seed(13)
    layer = SparseLinear(96, 64, sparsity=0.0, device="cuda")
    ref = copy.deepcopy(layer).cpu().double()
    x = torch.randn(8, 96, device="cuda")
    y = layer(x)
    y.pow(2).sum().backward()
    ref(x.cpu().double()).pow(2).sum().backward()
    for got, want in ((y, ref(x.cpu().double())), (layer.values.grad, ref.values.grad), (layer.bias.grad, ref.bias.grad)):
        assert ((got.double().cpu() - want).norm() / want.norm()).item() < 1e-5
    # the eager graph holds the parameters' AccumulateGrad nodes, made on the default stream: while
    # it lives, a captured backward reuses them and fails (the legacy stream would wait on the capture)
    del y, got
    snack.functional.settle_autograd()
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            layer.zero_grad(set_to_none=False)
            layer(static_x).pow(2).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    snack.functional.settle_autograd()
    g = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=False)
    with torch.cuda.graph(g):
        static_y = layer(static_x)
        static_y.pow(2).sum().backward()
    x2 = torch.randn(8, 96, device="cuda")
    static_x.copy_(x2)
    layer.zero_grad(set_to_none=False)
    g.replay()
    ref.zero_grad()
    ref(x2.cpu().double()).pow(2).sum().backward()
    assert ((layer.values.grad.double().cpu() - ref.values.grad).norm() / ref.values.grad.norm()).item() < 1e-5
    dense = snack.densify(copy.deepcopy(layer))
    assert type(dense) is nn.Linear and dense.weight.is_cuda
    torch.testing.assert_close(dense(x2), layer(x2), atol=1e-5, rtol=1e-5)


def test_to_coo_keeps_every_connection_and_size_errors_name_the_argument():
    """to_coo() holds every connection, zero-valued ones included (a COO made from to_dense()
    drops them), and shares the values; sizes past int32 are refused naming the argument."""
    layer = snack.SparseLinear(8, 6, sparsity=0.5)
    with torch.no_grad():
        layer.values[:3] = 0
    coo = layer.to_coo()
    assert coo.nnz == layer.nnz == 24 and snack.core.COO.from_dense(layer.to_dense().detach()).nnz == 21
    assert torch.equal(coo.indices, layer.indices) and coo.values.data_ptr() == layer.values.data_ptr()
    assert not coo.values.requires_grad and coo.shape == (6, 8)
    torch.testing.assert_close(coo.to_dense(), layer.to_dense().detach())
    meta = snack.SparseLinear(6, 4, sparsity=0.5, device="meta").to_coo()
    assert meta.nnz == 12 and meta.values.is_meta and meta.shape == (4, 6)
    with pytest.raises(ValueError, match=r"in_features must be a positive int below 2\*\*31"):
        snack.SparseLinear(2**31 + 5, 1)
    with pytest.raises(ValueError, match="weight_or_linear's weight must have 1 to"):
        snack.SparseLinear.from_dense(torch.randn(0, 4))
    with pytest.raises(ValueError, match=r"out_features must be in \[0, 2\*\*31 - 1\]"):
        snack.functional.sparse_linear(torch.randn(2, 3), torch.zeros(2, 0, dtype=torch.int32), torch.zeros(0),
                                       2**31 + 5)
