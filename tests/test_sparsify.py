"""Tests of snack.sparsify: which modules are replaced (nn.Linear, transformers' Conv1D), that
each keeps its largest-magnitude weights and its bias, uniform vs ERK totals, include/exclude,
tied and MultiheadAttention weights left dense, and the summary.
"""
import copy
import io
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snack
from snack import SparseLinear, sparsify
from snack.core import erk_densities
from snack.layers.sparsify import SparsifySummary

from conftest import tolerance

F64_ATOL = tolerance(torch.float64)[1]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 10)).double()


def _make_conv1d_class():
    """A stand-in for transformers.pytorch_utils.Conv1D (weight (nx, nf), y = x @ W + b)."""
    mod = types.ModuleType("transformers.pytorch_utils")

    class Conv1D(nn.Module):
        def __init__(self, nf, nx):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.randn(nx, nf, dtype=torch.float64) * 0.1)
            self.bias = nn.Parameter(torch.randn(nf, dtype=torch.float64) * 0.1)

        def forward(self, x):
            return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)

    Conv1D.__module__ = mod.__name__
    mod.Conv1D = Conv1D
    return Conv1D


def _check_keeps_largest(layer: SparseLinear, w: torch.Tensor):
    """layer holds round(density * n) entries of w, its values equal w there, and no dropped
    entry is larger in magnitude than a kept one."""
    r, c = layer.indices.long()
    assert torch.equal(layer.values.detach(), w[r, c])
    if 0 < layer.nnz < w.numel():
        mask = torch.zeros_like(w, dtype=torch.bool)
        mask[r, c] = True
        assert float(w.abs()[~mask].max()) <= float(w[r, c].abs().min())


def test_mlp_uniform():
    model = _mlp()
    dense = [m.weight.detach().clone() for m in model if isinstance(m, nn.Linear)]
    biases = [m.bias.detach().clone() for m in model if isinstance(m, nn.Linear)]
    out = sparsify(model, 0.8)
    assert out is model
    layers = [m for m in model if isinstance(m, SparseLinear)]
    assert len(layers) == 3 and not any(isinstance(m, nn.Linear) for m in model.modules())
    x = torch.randn(5, 20, dtype=torch.float64)
    h = x
    for layer, w, b in zip(layers, dense, biases):
        assert layer.nnz == round(0.2 * w.numel())
        assert layer.values.dtype == torch.float64 and layer.indices.dtype == torch.int32
        assert torch.equal(layer.bias.detach(), b)
        _check_keeps_largest(layer, w)
        h = F.linear(h, layer.to_dense(), b)
        if layer is not layers[-1]:
            h = torch.relu(h)
    torch.testing.assert_close(model(x), h, atol=F64_ATOL, rtol=0)
    # the replaced model trains
    loss = model(x).square().sum()
    loss.backward()
    assert all(l.values.grad is not None for l in layers)


def test_erk_vs_uniform_totals():
    shapes = [(64, 20), (48, 64), (10, 48)]
    total = sum(a * b for a, b in shapes)
    _, su = sparsify(_mlp(), 0.9, summary=True)
    model, se = sparsify(_mlp(), 0.9, distribution="erk", summary=True)
    assert isinstance(se, SparsifySummary)
    for s in (su, se):
        assert abs(s.nnz - 0.1 * total) <= len(shapes)           # rounding per layer only
        assert s.weights_before == total
    assert [r.shape for r in se.rows] == shapes
    dens = erk_densities(shapes, 0.9)
    for row, d, (o, i) in zip(se.rows, dens, shapes):
        assert row.nnz == round(min(d, 1.0) * o * i)
    # ERK: the small output layer is denser than the large middle layer
    assert se.rows[2].density > se.rows[1].density
    assert len({round(r.density, 2) for r in su.rows}) == 1


def test_conv1d_from_transformers():
    Conv1D = _make_conv1d_class()
    torch.manual_seed(2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(36, 12)     # nf = 36 outputs, nx = 12 inputs
            self.c_proj = Conv1D(12, 36)
            self.head = nn.Linear(12, 5).double()

        def forward(self, x):
            return self.head(self.c_proj(torch.tanh(self.c_attn(x))))

    model = Block()
    w_attn = model.c_attn.weight.detach().t().clone()      # (out, in)
    b_attn = model.c_attn.bias.detach().clone()
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    sparsify(model, 0.5)
    assert isinstance(model.c_attn, SparseLinear) and isinstance(model.c_proj, SparseLinear)
    assert (model.c_attn.out_features, model.c_attn.in_features) == (36, 12)
    _check_keeps_largest(model.c_attn, w_attn)
    assert torch.equal(model.c_attn.bias.detach(), b_attn)
    y = model(x)
    assert y.shape == (2, 3, 5)
    ref = F.linear(torch.tanh(F.linear(x, model.c_attn.to_dense(), model.c_attn.bias)),
                   model.c_proj.to_dense(), model.c_proj.bias)
    torch.testing.assert_close(y, F.linear(ref, model.head.to_dense(), model.head.bias), atol=F64_ATOL, rtol=0)
    assert [r.kind for r in sparsify.last_summary.rows] == ["Conv1D", "Conv1D", "Linear"]


def test_conv1d_outside_transformers_is_ignored():
    class Conv1D(nn.Module):   # same name, not from transformers
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

    for module in (__name__, "my_transformers_utils", "sentence_transformers.models", "x_transformers"):
        Conv1D.__module__ = module  # (a package whose name merely contains "transformers")
        model = nn.Sequential(Conv1D(), nn.Linear(4, 4))
        sparsify(model, 0.5)
        assert isinstance(model[0], Conv1D) and isinstance(model[1], SparseLinear), module


def test_include_exclude():
    model = nn.Sequential()
    model.add_module("enc", nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    model.add_module("dec", nn.Linear(8, 4))
    m1 = sparsify(_copy(model), 0.5, include=["enc.*"])
    assert isinstance(m1.enc[0], SparseLinear) and isinstance(m1.enc[1], SparseLinear)
    assert isinstance(m1.dec, nn.Linear)
    m2 = sparsify(_copy(model), 0.5, exclude="enc.1")
    assert isinstance(m2.enc[0], SparseLinear) and isinstance(m2.enc[1], nn.Linear)
    assert isinstance(m2.dec, SparseLinear)
    m3 = sparsify(_copy(model), 0.5, include=lambda name, m: m.out_features == 4)
    assert isinstance(m3.dec, SparseLinear) and isinstance(m3.enc[0], nn.Linear)
    m4 = sparsify(_copy(model), 0.5, include=["enc.*", "dec"], exclude=[lambda n, m: n.endswith("0")])
    assert [type(m).__name__ for m in (m4.enc[0], m4.enc[1], m4.dec)] == ["Linear", "SparseLinear", "SparseLinear"]
    with pytest.raises(TypeError, match="include"):
        sparsify(_copy(model), 0.5, include=[3])


def _copy(m):
    import copy
    return copy.deepcopy(m)


def test_tied_and_attention_weights_are_left_dense():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(30, 16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.mlp = nn.Linear(16, 16)
            self.lm_head = nn.Linear(16, 30, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids):
            h = self.wte(ids)
            h = h + self.attn(h, h, h, need_weights=False)[0]
            return self.lm_head(torch.relu(self.mlp(h)))

    model = LM()
    model, s = sparsify(model, 0.5, summary=True)
    assert isinstance(model.mlp, SparseLinear)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.wte.weight
    assert isinstance(model.attn.out_proj, nn.Linear)
    assert {n for n, _ in s.skipped} == {"lm_head", "attn.out_proj"}
    assert model(torch.randint(0, 30, (2, 5))).shape == (2, 5, 30)


def test_shared_module_replaced_everywhere_and_frozen_kept():
    shared = nn.Linear(6, 6)
    shared.weight.requires_grad_(False)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    sparsify(model, 0.5)
    assert isinstance(model[0], SparseLinear) and model[0] is model[2]
    assert not model[0].values.requires_grad and model[0].bias.requires_grad
    assert len(sparsify.last_summary.rows) == 1


def test_root_linear_and_eval_mode():
    lin = nn.Linear(10, 7)
    out = sparsify(lin, 0.7)
    assert isinstance(out, SparseLinear) and out.nnz == 21
    model = _mlp().eval()
    sparsify(model, 0.5)
    assert not model[0].training


def test_summary_table_and_bad_args():
    model, s = sparsify(_mlp(), 0.75, summary=True)
    assert snack.sparsify.last_summary is s
    text = str(s)
    for name in ("0", "2", "4", "total"):
        assert any(line.split()[0] == name for line in text.splitlines()[1:])
    assert s.params_before == sum(o * i + o for o, i in [(64, 20), (48, 64), (10, 48)])
    assert s.params_after == s.nnz + 64 + 48 + 10
    assert s.bytes_after == s.nnz * (8 + 8) + (64 + 48 + 10) * 8        # float64 value + 2 int32 + bias
    assert s.bytes_before == s.params_before * 8
    with pytest.raises(ValueError, match="distribution"):
        sparsify(_mlp(), 0.5, distribution="er")
    with pytest.raises(ValueError, match="sparsity"):
        sparsify(_mlp(), 1.0)
    with pytest.raises(TypeError, match="model"):
        sparsify("model")
    empty, s0 = sparsify(nn.ReLU(), 0.5, summary=True)
    assert s0.rows == [] and s0.nnz == 0


def test_transformer_encoder_keeps_working_in_eval_mode():
    # nn.TransformerEncoder(Layer)'s inference fast path reads linear1/linear2's dense .weight;
    # once they are sparse the layers must take their ordinary path and give the dense result
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                enable_nested_tensor=True).eval()
    x = torch.randn(3, 5, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=pad)
        ref_layer = enc.layers[0](x)
    sparse = sparsify(_copy(enc), 0.0)  # every connection kept: the same function
    assert isinstance(sparse.layers[0].linear1, SparseLinear) and isinstance(sparse.layers[1].linear2, SparseLinear)
    with torch.no_grad():
        got = sparse(x, src_key_padding_mask=pad)
        got_layer = sparse.layers[0](x)
    keep = ~pad  # the fast path leaves padded positions at 0, the ordinary path computes them
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_layer, ref_layer, rtol=1e-5, atol=1e-5)
    # and it trains
    sparse.train()
    sparse(x, src_key_padding_mask=pad).sum().backward()
    assert sparse.layers[0].linear1.values.grad is not None
    # densify gives the fast path back: the flags sparsify turned off, and the fast path's result
    # (padded positions at 0) again
    assert not sparse.use_nested_tensor and not sparse.layers[0].activation_relu_or_gelu
    dense = snack.densify(sparse.eval())
    assert dense.use_nested_tensor and all(l.activation_relu_or_gelu == 1 for l in dense.layers)
    assert not any("snack" in k for m in dense.modules() for k in vars(m))
    with torch.no_grad():
        back = dense(x, src_key_padding_mask=pad)
    assert back.is_nested or torch.equal(back[0, 3:], torch.zeros_like(back[0, 3:]))
    torch.testing.assert_close(back[keep], ref[keep], rtol=1e-5, atol=1e-5)
    # a layer left sparse keeps its layer, and the encoder, off the fast path
    part = snack.densify(sparsify(_copy(enc), 0.5), exclude="layers.1.linear2")
    assert part.layers[0].activation_relu_or_gelu == 1 and not part.layers[1].activation_relu_or_gelu
    assert not part.use_nested_tensor


def test_subclasses_hooks_and_parametrizations_are_left_dense_with_a_warning():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(nn.Linear):  # no forward of its own: replaced like nn.Linear
        pass

    hooked = nn.Linear(6, 6)
    calls = []
    hooked.register_forward_hook(lambda *a: calls.append(1))
    param = nn.utils.parametrizations.weight_norm(nn.Linear(6, 6))
    model = nn.Sequential(Scaled(6, 6), Plain(6, 6), hooked, param, nn.Linear(6, 6))
    x = torch.randn(2, 6)
    with torch.no_grad():
        y0 = model[0](x)
    with pytest.warns(UserWarning, match="left these layers dense") as rec:
        model, s = sparsify(model, 0.5, summary=True)
    text = str(rec[0].message)
    assert "Scaled" in text and "hooks" in text and "parametrized" in text
    assert {n for n, _ in s.skipped} == {"0", "2", "3"}
    assert type(model[0]) is Scaled and type(model[2]) is nn.Linear and not isinstance(model[3], SparseLinear)
    assert isinstance(model[1], SparseLinear) and isinstance(model[4], SparseLinear)
    torch.testing.assert_close(model[0](x), y0)
    model(x)
    assert calls == [1]


def test_instance_forwards_state_dict_hooks_and_a_parametrized_bias_are_left_dense():
    """A forward replaced on the instance (as accelerate's hooks do), state-dict hooks and a
    parametrized bias would be lost by the replacement: those layers stay dense, named in the
    warning, and the model computes what it did."""
    import functools
    import torch.nn.utils.parametrize as P

    class Id(nn.Module):
        def forward(self, t):
            return t

    wrapped = nn.Linear(6, 6)
    inner = wrapped.forward
    wrapped.forward = functools.partial(lambda mod, t: 10 * inner(t), wrapped)
    loading = nn.Linear(6, 6)
    loading._register_load_state_dict_pre_hook(lambda *a: None)
    saving = nn.Linear(6, 6)
    saving._register_state_dict_hook(lambda *a: None)
    pbias = nn.Linear(6, 6)
    P.register_parametrization(pbias, "bias", Id())
    model = nn.Sequential(wrapped, loading, saving, pbias, nn.Linear(6, 6))
    x = torch.randn(2, 6)
    with torch.no_grad():
        y0 = model[0](x)
    with pytest.warns(UserWarning, match="left these layers dense") as rec:
        model, s = sparsify(model, 0.5, summary=True)
    why = dict(s.skipped)
    assert set(why) == {"0", "1", "2", "3"} and isinstance(model[4], SparseLinear)
    assert "on the instance" in why["0"] and "load state dict" in why["1"] and "state dict" in why["2"]
    assert "bias is parametrized" in why["3"] and "weight" not in why["3"]
    assert all(w in str(rec[0].message) for w in why.values())
    torch.testing.assert_close(model[0](x), y0)
    # what such wrappers leave behind once undone is replaced as a plain layer: a forward put back
    # as the class's own bound method (accelerate's remove_hook_from_module), weight_norm removed
    restored = nn.Linear(6, 6)
    restored.forward = functools.partial(lambda mod, t: mod(t), restored)
    restored.forward = nn.Linear.forward.__get__(restored)
    unnormed = nn.utils.parametrizations.weight_norm(nn.Linear(6, 6))
    P.remove_parametrizations(unnormed, "weight")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = sparsify(nn.Sequential(restored, unnormed), 0.5)
    assert all(isinstance(m, SparseLinear) for m in model)


def test_an_empty_include_selects_nothing_and_a_shared_bias_stays_tied():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for empty in ([], set(), ()):
        sparsify(model, 0.5, include=empty)
        assert not any(isinstance(m, SparseLinear) for m in model)
    sparsify(model, 0.5)
    for empty in ([], ()):
        snack.densify(model, include=empty)
        assert all(isinstance(m, SparseLinear) for m in model)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.bias = a.bias
    model, s = sparsify(nn.Sequential(a, b, nn.Linear(4, 4)), 0.5, summary=True)
    assert model[0].bias is model[1].bias and type(model[0]) is nn.Linear
    assert dict(s.skipped) == {"0": "bias shared with another module (tied)",
                               "1": "bias shared with another module (tied)"}
    assert isinstance(model[2], SparseLinear)


def test_layers_left_without_connections_are_named_and_erk_errors_name_the_module():
    model = nn.Sequential(nn.Linear(784, 300), nn.Linear(300, 100), nn.Linear(100, 10))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sparsify(model, 0.99999)
    texts = [str(w.message) for w in rec if "no connection" in str(w.message)]
    assert len(texts) == 1 and "1 (300 -> 100)" in texts[0] and "2 (100 -> 10)" in texts[0]
    assert rec[0].filename == __file__  # the caller's line, not the library's
    assert model[1].nnz == 0 and model[0].nnz > 0
    bad = nn.Sequential(nn.Linear(8, 8), nn.Linear(0, 4))
    with pytest.raises(ValueError, match="module '1'"):
        sparsify(bad, 0.5, distribution="erk")
    assert all(type(m) is nn.Linear for m in bad)


def test_warns_when_nothing_matches_or_model_is_already_sparse():
    with pytest.warns(UserWarning, match="include pattern 'decoder.*' matches no"):
        sparsify(_mlp(), 0.5, include="decoder.*")
    with pytest.warns(UserWarning, match="exclude pattern 'x' matches no"):
        sparsify(_mlp(), 0.5, exclude=["x"])
    model = sparsify(_mlp(), 0.5, include={"0", "2"})  # a set of patterns
    assert [type(m) for m in model] == [SparseLinear, nn.ReLU, SparseLinear, nn.ReLU, nn.Linear]
    model = sparsify(_mlp(), 0.5)
    with pytest.warns(UserWarning, match="sparse already"):
        sparsify(model, 0.9)
    assert all(m.density == pytest.approx(0.5, abs=0.02) for m in model.modules() if isinstance(m, SparseLinear))


def test_a_shared_module_matches_by_any_of_its_names():
    shared = nn.Linear(6, 6)
    model = nn.Sequential(nn.Sequential(shared), nn.ReLU(), nn.Sequential(shared), nn.Linear(6, 2))
    sparsify(model, 0.5, include="2.*")  # the second place's name
    assert isinstance(model[0][0], SparseLinear) and model[0][0] is model[2][0]
    assert isinstance(model[3], nn.Linear)
    model = nn.Sequential(nn.Sequential(shared), nn.ReLU(), nn.Sequential(shared), nn.Linear(6, 2))
    sparsify(model, 0.5, exclude=["2.0"])
    assert model[0][0] is shared and isinstance(model[3], SparseLinear)


# ---- densify: the way back -----------------------------------------------------------------------


def test_densify_mlp_round_trip_keeps_outputs_weights_and_flags():
    model = _mlp(7)
    dense = [m.weight.detach().clone() for m in model if isinstance(m, nn.Linear)]
    sparsify(model, 0.8)
    model[0].values.requires_grad_(False)
    model.eval()
    x = torch.randn(5, 20, dtype=torch.float64)
    y_sparse = model(x)
    layers = [m for m in model if isinstance(m, SparseLinear)]
    assert snack.densify(model) is model
    assert [type(m) for m in model if not isinstance(m, nn.ReLU)] == [nn.Linear] * 3
    torch.testing.assert_close(model(x), y_sparse, atol=F64_ATOL, rtol=0)
    for lin, sl, w in zip([m for m in model if isinstance(m, nn.Linear)], layers, dense):
        r, c = sl.indices.long()
        mask = torch.zeros_like(w, dtype=torch.bool)
        mask[r, c] = True
        assert torch.equal(lin.weight.detach(), torch.where(mask, w, torch.zeros_like(w)))
        assert torch.equal(lin.bias.detach(), sl.bias.detach())
        assert lin.weight.dtype == torch.float64 and not lin.training
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad


def test_densify_conv1d_goes_back_to_conv1d():
    Conv1D = _make_conv1d_class()
    torch.manual_seed(3)
    model = nn.Sequential(Conv1D(36, 12), nn.Tanh(), Conv1D(12, 36))
    keys = {k: v.shape for k, v in model.state_dict().items()}
    sparsify(model, 0.5)
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    y_sparse = model(x)
    snack.densify(model)
    assert type(model[0]) is Conv1D and type(model[2]) is Conv1D
    assert {k: v.shape for k, v in model.state_dict().items()} == keys   # loads into the original model
    torch.testing.assert_close(model(x), y_sparse, atol=F64_ATOL, rtol=0)


def test_densify_gpt2_state_dict_loads_into_a_fresh_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    sparsify(model, 0.9)
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        y_sparse = model(ids).logits
    snack.densify(model)
    assert not any(isinstance(m, SparseLinear) for m in model.modules())
    fresh = transformers.GPT2LMHeadModel(cfg).eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, y_sparse, atol=1e-5, rtol=1e-5)
    attn = fresh.transformer.h[0].attn.c_attn.weight          # (in, out) = (32, 96), 90% zeros
    assert attn.shape == (32, 96) and abs(float((attn == 0).float().mean()) - 0.9) < 0.01


def test_densify_selection_shared_modules_and_a_bare_layer():
    shared = SparseLinear(8, 8, sparsity=0.5, dtype=torch.float64)
    model = nn.Sequential(shared, nn.ReLU(), shared, SparseLinear(8, 3, sparsity=0.5, dtype=torch.float64))
    snack.densify(model, exclude="3")
    assert type(model[0]) is nn.Linear and model[0] is model[2]     # replaced once, everywhere
    assert isinstance(model[3], SparseLinear)
    snack.densify(model, include=lambda name, m: m.out_features == 3)
    assert type(model[3]) is nn.Linear
    bare = SparseLinear(4, 2, sparsity=0.5)
    lin = snack.densify(bare)
    assert type(lin) is nn.Linear and torch.equal(lin.weight, bare.to_dense().detach())


def test_a_lazy_layer_is_converted_once_initialized():
    model = nn.Sequential(nn.LazyLinear(5), nn.ReLU(), nn.Linear(5, 2))
    with pytest.warns(UserWarning, match=r"0: LazyLinear is not initialized yet \(run a forward pass before sparsify\)"):
        model, s = sparsify(model, 0.5, summary=True)
    assert [n for n, _ in s.skipped] == ["0"] and isinstance(model[2], SparseLinear)
    x = torch.randn(3, 7)
    y = model(x)                      # initializes it (it becomes an nn.Linear)
    sparsify(model, 0.0, include="0")
    assert isinstance(model[0], SparseLinear) and model[0].in_features == 7
    torch.testing.assert_close(model(x), y)


def _saved_and_loaded(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_densify_leaves_hooked_layers_and_names_remove_hooks():
    model = nn.Sequential(SparseLinear(6, 5, sparsity=0.5), nn.ReLU(), SparseLinear(5, 2, sparsity=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = snack.dst.RigL(model, opt, update_every=2, total_steps=10)
    with pytest.warns(UserWarning, match="remove_hooks") as rec:
        snack.densify(model)
    assert "register them after densify" in str(rec[0].message)
    # a copy (deepcopy, or torch.save / torch.load) carries the hooks as no-ops: densify drops them
    for copied in (copy.deepcopy(model), _saved_and_loaded(model)):
        assert isinstance(copied[0], SparseLinear) and copied[0]._forward_hooks
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dense = snack.densify(copied)
        assert type(dense[0]) is nn.Linear and type(dense[2]) is nn.Linear
        x = torch.randn(3, 6)
        torch.testing.assert_close(dense(x), model(x))
    assert all(isinstance(model[i], SparseLinear) and model[i]._forward_hooks for i in (0, 2))
    assert isinstance(model[0], SparseLinear) and isinstance(model[2], SparseLinear)
    dst.remove_hooks()
    snack.densify(model)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear


def test_densify_bad_input_and_nothing_to_do():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        snack.densify("model")
    with pytest.warns(UserWarning, match="no SparseLinear"):
        snack.densify(nn.Sequential(nn.Linear(3, 2)))
    with pytest.warns(UserWarning, match="matches no SparseLinear"):
        snack.densify(nn.Sequential(SparseLinear(3, 2, sparsity=0.5)), include="nope*")


def test_a_weight_of_an_unsupported_dtype_is_named_with_its_module():
    """A float8 weight (floating, but without kernels) is refused with a TypeError naming the
    module, and the model is left as it was."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    model[2].weight.data = model[2].weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"^sparsify: module '2': weight must be a floating tensor .*float8_e4m3fn"):
        snack.sparsify(model, sparsity=0.5)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
