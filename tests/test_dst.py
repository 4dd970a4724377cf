"""Tests of snack.dst (SET, RigL): the invariants of dynamic sparse training on COO weights.

Small MLPs of SparseLinear trained on random data: nnz preserved, indices canonical / unique /
in range / int32 after every update, the pattern changes only on update steps, regrown values
and optimizer moments exactly 0, survivors keep value and moments (matched by coordinate), the
dropped set is the smallest-|v| one (SET per sign), RigL grows where a float64 dense gradient is
largest, runs are deterministic, checkpoints round-trip bit for bit, the schedule, bad
arguments, and no tensor of the dense weight's size during an update.
"""
import copy
import math

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import MaxNumel

from snack import SparseLinear
from snack.layers.dst import (DynamicSparseTraining, RigL, SET, _free_ranks_to_keys,
                              _sample_distinct, cosine_drop_fraction)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _mlp(seed=0, sizes=(20, 33, 17, 5), sparsity=0.8):
    torch.manual_seed(seed)
    mods = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            mods.append(nn.ReLU(inplace=True))
        mods.append(SparseLinear(a, b, sparsity=sparsity))
    return nn.Sequential(*mods)


def _sparse(model):
    return [m for m in model.modules() if isinstance(m, SparseLinear)]


def _data(n, seed=1, in_f=20, out_f=5, batch=8):
    g = _gen(seed)
    return [(torch.randn(batch, in_f, generator=g), torch.randn(batch, out_f, generator=g))
            for _ in range(n)]


def _optimizer(name, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _keys(layer):
    idx = layer.indices.long()
    return idx[0] * layer.in_features + idx[1]


def _check_canonical(layer):
    idx = layer.indices
    assert idx.dtype == torch.int32 and idx.shape == (2, layer.values.shape[0])
    assert idx.is_contiguous()
    if idx.shape[1]:
        assert int(idx[0].min()) >= 0 and int(idx[0].max()) < layer.out_features
        assert int(idx[1].min()) >= 0 and int(idx[1].max()) < layer.in_features
    k = _keys(layer)
    assert bool((k[1:] > k[:-1]).all())           # sorted row-major and unique


def _snapshot(layer, opt):
    """keys, values, grad and every (nnz,) optimizer state tensor, cloned."""
    st = {n: v.clone() for n, v in opt.state.get(layer.values, {}).items()
          if isinstance(v, torch.Tensor) and v.dim() == 1 and n != "step"}
    grad = layer.values.grad.clone() if layer.values.grad is not None else None
    return _keys(layer).clone(), layer.indices.clone(), layer.values.detach().clone(), grad, st


def _train_step(model, opt, x, y):
    F.mse_loss(model(x), y).backward()
    opt.step()


# ---- invariants over a training run ------------------------------------------------------------
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("cls", [SET, RigL])
def test_invariants_over_many_updates(cls, opt_name):
    model = _mlp()
    layers = _sparse(model)
    nnz0 = [l.nnz for l in layers]
    opt = _optimizer(opt_name, model.parameters())
    dst = cls(model, opt, update_every=3, drop_fraction=0.3, decay="constant", seed=1)
    n_updates = changed = 0
    for t, (x, y) in enumerate(_data(30), start=1):
        _train_step(model, opt, x, y)
        before = [_snapshot(l, opt) for l in layers]
        summary = dst.step()
        assert (summary is not None) == (t % 3 == 0)
        assert dst.num_steps == t
        for li, (l, (ok, oidx, ov, og, ost)) in enumerate(zip(layers, before)):
            _check_canonical(l)
            assert l.nnz == nnz0[li] and l.values.shape == (nnz0[li],)
            if summary is None:                    # pattern and state untouched
                assert torch.equal(l.indices, oidx) and torch.equal(l.values, ov)
                continue
            nk = _keys(l)
            surv_new, surv_old = torch.isin(nk, ok), torch.isin(ok, nk)
            n_grown = int((~surv_new).sum())
            assert n_grown == int((~surv_old).sum())                    # grown == dropped
            row = summary.layers[li]
            assert row.dropped == row.grown == n_grown and row.nnz == l.nnz
            changed += n_grown
            # survivors keep value, gradient and moments (keys ascending on both sides)
            v = l.values.detach()
            assert torch.equal(v[surv_new], ov[surv_old])
            assert torch.equal(l.values.grad[surv_new], og[surv_old])
            assert torch.all(l.values.grad[~surv_new] == 0)
            st = opt.state[l.values]
            assert set(ost) <= set(st) and ost
            for name, old in ost.items():
                assert torch.equal(st[name][surv_new], old[surv_old]), name
                assert torch.all(st[name][~surv_new] == 0), name          # regrown moments 0
            assert torch.all(v[~surv_new] == 0)                             # regrown values 0
            if opt_name == "adam":
                assert st["step"].dim() == 0 and float(st["step"]) == t     # scalar state untouched
        if summary is not None:
            n_updates += 1
            # the layers compute with the new pattern (the topology cache saw the change)
            x0 = x[:3]
            h = x0
            for m in model:
                h = F.linear(h, m.to_dense(), m.bias) if isinstance(m, SparseLinear) else torch.relu(h)
            torch.testing.assert_close(model(x0.clone()), h, atol=1e-5, rtol=1e-5)
        opt.zero_grad(set_to_none=False)
    assert n_updates == 10 and changed > 0


def test_set_drops_smallest_by_sign_and_grows_free_coordinates():
    layer = SparseLinear(40, 30, sparsity=0.7)
    g = _gen(4)
    with torch.no_grad():
        v = torch.randn(layer.nnz, generator=g)
        v[:5] = 0.0                                    # zeros count as positives, dropped first
        layer.values.copy_(v)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = SET(layer, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0)
    old = _keys(layer).clone()
    s = dst.step()
    pos = (v >= 0).nonzero().flatten()
    neg = (v < 0).nonzero().flatten()
    k_pos, k_neg = round(0.3 * pos.numel()), round(0.3 * neg.numel())
    drop_pos = pos[torch.argsort(v[pos])[:k_pos]]                   # smallest positives
    drop_neg = neg[torch.argsort(v[neg], descending=True)[:k_neg]]  # negatives closest to 0
    expected = set(old[torch.cat([drop_pos, drop_neg])].tolist())
    new = _keys(layer)
    assert set(old.tolist()) - set(new.tolist()) == expected
    grown = set(new.tolist()) - set(old.tolist())
    assert len(grown) == k_pos + k_neg == s.grown
    assert not grown & set(old.tolist())              # only coordinates free before the update
    assert all(0 <= k < 40 * 30 for k in grown)


def test_update_rebuilds_topology_right_away(monkeypatch):
    """The topology is rebuilt at the update itself, not at the next eager call: a replayed CUDA
    graph runs no Python, so it only sees a pattern already written into the topology's arrays."""
    from snack.layers import backend
    layer = SparseLinear(40, 30, sparsity=0.7)
    layer(torch.randn(2, 40))
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = SET(layer, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0)
    builds = []
    real = backend._build_topology
    monkeypatch.setattr(backend, "_build_topology", lambda *a: builds.append(1) or real(*a))
    dst.step()
    assert len(builds) == 1
    monkeypatch.setattr(backend, "_build_topology", None)   # no build may happen from here on
    topo = backend.get_topology(layer.indices, (30, 40))
    counts = torch.bincount(layer.indices[0].long(), minlength=30)
    assert torch.equal(topo.row_ptr[1:].long(), counts.cumsum(0))


def test_update_failing_to_build_the_topology_leaves_the_layer_as_it_was(monkeypatch):
    """A failure while the new pattern's topology is built (out of memory, say) leaves indices,
    values, their gradient and Adam's moments as before the update, all in one order; the layer
    then computes as before and a later update works."""
    from snack.layers import backend
    torch.manual_seed(5)
    layer = SparseLinear(40, 30, sparsity=0.7)
    x = torch.randn(3, 40)
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    layer(x).square().sum().backward()
    opt.step()
    dst = SET(layer, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0)
    before = [layer.indices.clone(), layer.values.detach().clone(), layer.values.grad.clone(),
              opt.state[layer.values]["exp_avg"].clone(), opt.state[layer.values]["exp_avg_sq"].clone()]
    y0 = layer(x).detach()

    def fail(*a):
        raise MemoryError("out of memory while building the topology")
    monkeypatch.setattr(backend, "_build_topology", fail)
    with pytest.raises(MemoryError):
        dst.step()
    monkeypatch.undo()
    after = [layer.indices, layer.values.detach(), layer.values.grad,
             opt.state[layer.values]["exp_avg"], opt.state[layer.values]["exp_avg_sq"]]
    for name, a, b in zip(("indices", "values", "grad", "exp_avg", "exp_avg_sq"), after, before):
        assert torch.equal(a, b), name
    torch.testing.assert_close(layer(x).detach(), y0)
    assert dst.step() is not None
    assert not torch.equal(layer.indices, before[0])


@pytest.mark.parametrize("block", [2**21, 20, 5])
def test_rigl_drops_smallest_and_grows_largest_dense_gradient(block):
    model = _mlp(seed=3, sizes=(13, 7, 6), sparsity=0.6)
    l1, l2 = _sparse(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dst = RigL(model, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0,
               grad_block_numel=block)
    g = _gen(5)
    batches = [(torch.randn(5, 13, generator=g), torch.randn(5, 6, generator=g)) for _ in range(2)]
    # float64 dense reference of the same two accumulated micro-batches
    w1 = l1.to_dense().double().detach().requires_grad_()
    w2 = l2.to_dense().double().detach().requires_grad_()
    for x, y in batches:
        h = torch.relu(F.linear(x.double(), w1, l1.bias.double()))
        ((F.linear(h, w2, l2.bias.double()) - y.double()) ** 2).sum().backward()
    for x, y in batches:                                 # gradient accumulation: two calls per layer
        ((model(x) - y) ** 2).sum().backward()
    opt.step()
    olds = [(_keys(l).clone(), l.values.detach().clone()) for l in (l1, l2)]
    s = dst.step()
    for l, w, (ok, ov), row in zip((l1, l2), (w1, w2), olds, s.layers):
        k = round(0.3 * ok.numel())
        assert row.dropped == row.grown == k > 0
        nk = _keys(l)
        dropped = set(ok.tolist()) - set(nk.tolist())
        assert dropped == set(ok[torch.argsort(ov.abs())[:k]].tolist())
        score = w.grad.abs().flatten().clone()
        score[ok] = -1.0                                 # held coordinates cannot be grown
        expected = set(torch.topk(score, k).indices.tolist())
        assert set(nk.tolist()) - set(ok.tolist()) == expected
        _check_canonical(l)


def test_rigl_scores_add_the_backward_passes_through_one_forward():
    # two losses on one forward, each with its own backward (retain_graph): the growth score is
    # |dL/dW| of their sum, as values.grad accumulates it, not the last backward's alone
    layer = SparseLinear.from_dense(torch.randn(6, 8, generator=_gen(2)), sparsity=0.5)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = RigL(layer, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0)
    g = _gen(4)
    x, t1, t2 = torch.randn(5, 8, generator=g), torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    out = layer(x)
    ((out - t1) ** 2).sum().backward(retain_graph=True)
    (out * t2).sum().backward()
    w = layer.to_dense().double().detach().requires_grad_()
    ref = F.linear(x.double(), w)  # (from a bare weight: no bias)
    (((ref - t1.double()) ** 2).sum() + (ref * t2.double()).sum()).backward()
    torch.testing.assert_close(dst.grow_scores(layer, (0, 6), (0, 8)).double(), w.grad.abs(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [SET, RigL])
@pytest.mark.parametrize("shape,nnz,fraction", [((3, 4), 11, 0.5), ((10, 10), 90, 0.99), ((5, 5), 21, 0.9)])
def test_an_update_capped_by_free_coordinates_uses_them_all(cls, shape, nnz, fraction):
    # round(f * nnz) above the free coordinates: every free coordinate is grown (SET shares
    # them between its sign groups in proportion, the remainder to the largest fractions)
    numel = shape[0] * shape[1]
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[torch.randperm(numel, generator=_gen(1))[:nnz]] = True
    # both signs present, in groups of unequal size
    layer = SparseLinear.from_dense(torch.randn(shape, generator=_gen(3)), mask=mask.view(shape))
    assert layer.nnz == nnz
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = cls(layer, opt, update_every=1, drop_fraction=fraction, decay="constant", seed=0)
    layer(torch.randn(4, shape[1], generator=_gen(5))).sum().backward()
    free = shape[0] * shape[1] - nnz
    assert round(fraction * nnz) > free
    before = set(_keys(layer).tolist())
    row = dst.step().layers[0]
    assert row.dropped == row.grown == free
    after = set(_keys(layer).tolist())
    assert len(after - before) == free and len(after) == nnz
    _check_canonical(layer)


def test_an_update_inside_an_autocast_region_scores_in_float32(monkeypatch):
    # dst.step() called inside a torch.autocast region: RigL's dY^T X products run in fp32 all
    # the same (autocast would make them bf16), so the pattern equals the one an update outside
    # the region makes from the same gradients
    scored = []
    real = RigL.grow_scores

    def spy(self, layer, rows, cols):
        out = real(self, layer, rows, cols)
        scored.append(out.dtype)
        return out
    monkeypatch.setattr(RigL, "grow_scores", spy)
    patterns = []
    for inside in (False, True):
        model = _mlp(seed=4, sizes=(40, 60, 9), sparsity=0.7)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dst = RigL(model, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0)
        x, y = _data(1, seed=6, in_f=40, out_f=9, batch=16)[0]
        F.mse_loss(model(x), y).backward()
        opt.step()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
            dst.step()
        patterns.append([_keys(l).clone() for l in _sparse(model)])
    assert scored and set(scored) == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(*patterns))


def test_rigl_keeps_activations_only_on_update_steps_and_warns_without_gradient():
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = RigL(model, opt, update_every=2, seed=0, decay="constant")
    (x, y), = _data(1)
    _train_step(model, opt, x, y)
    assert not dst._captured                  # step 1 is not an update step: nothing kept
    assert dst.step() is None
    _train_step(model, opt, x, y)
    assert len(dst._captured) == 3            # step 2 is: X and dY of every layer
    assert dst.step().grown > 0
    assert not dst._captured
    dst.step()
    before = [l.indices.clone() for l in _sparse(model)]
    with pytest.warns(RuntimeWarning, match="no gradient was captured"):
        s = dst.step()                        # update step without forward/backward
    assert all(r.skipped and r.grown == 0 for r in s.layers)
    assert all(torch.equal(b, l.indices) for b, l in zip(before, _sparse(model)))
    dst.remove_hooks()


@pytest.mark.parametrize("cls,where", [(SET, "values"), (RigL, "values"), (RigL, "gradient")])
def test_nan_stops_the_update_before_any_layer_changes(cls, where):
    """NaN in a layer's values (or, for RigL, in what it captured for the grow scores) makes the
    update step raise a ValueError naming the layer, with every layer, the optimizer state and the
    step count as they were; once the NaN is gone the same step updates."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = cls(model, opt, update_every=1, seed=0, decay="constant")
    (x, y), = _data(1)
    _train_step(model, opt, x, y)
    layers = _sparse(model)
    if where == "values":
        with torch.no_grad():
            layers[2].values[3] = float("nan")
        match = "layer '4': values hold"
    else:
        dst._captured[id(layers[1])][0] = (dst._captured[id(layers[1])][0][0],
                                           torch.full_like(dst._captured[id(layers[1])][0][1], float("nan")))
        match = "layer '2': its captured output gradient hold"
    before = [(l.indices.clone(), l.values.detach().clone()) for l in layers]
    with pytest.raises(ValueError, match=match):
        dst.step()
    assert dst.num_steps == 0
    for (i, v), l in zip(before, layers):
        assert torch.equal(i, l.indices) and torch.equal(v.nan_to_num(), l.values.detach().nan_to_num())
    with torch.no_grad():
        layers[2].values.nan_to_num_(0.0)
    _train_step(model, opt, x, y)
    assert dst.step().grown > 0 and dst.num_steps == 1
    dst.remove_hooks()


@pytest.mark.parametrize("where", ["gradient", "input"])
def test_rigl_refuses_inf_in_what_it_captured(where):
    """An inf in a captured output gradient (an fp16 backward that overflowed: GradScaler skips the
    optimizer step, the loop may still call dst.step()) or input meets the ReLU's zeros in dY^T X
    as inf * 0 = NaN, which torch.topk ranks highest: the update step raises ValueError naming the
    layer, changes nothing, is not counted and drops the records, so that the next forward and
    backward make the same update step from their own gradient."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dst = RigL(model, opt, update_every=1, seed=0, decay="constant")
    layers = _sparse(model)
    (x, y), = _data(1)
    if where == "input":
        x[0, 0] = float("inf")                   # layer 0's captured X (the loss made finite)
    out = model(x).nan_to_num(0.0, 0.0, 0.0)
    g = torch.randn_like(out)
    if where == "gradient":
        g[0, 0] = float("inf")                   # reaches every layer's captured dY
    out.backward(g)
    assert not any(bool(torch.isnan(t).any()) for recs in dst._captured.values() for r in recs for t in r)
    match = f"layer '0': its captured {'output gradient' if where == 'gradient' else 'input'} hold.s. NaN or inf"
    before = [l.indices.clone() for l in layers]
    with pytest.raises(ValueError, match=match + r".*not counted.*GradScaler"):
        dst.step()
    assert dst.num_steps == 0 and not dst._captured
    assert all(torch.equal(b, l.indices) for b, l in zip(before, layers))
    opt.zero_grad()                              # (the inf gradient, as GradScaler would drop it)
    _train_step(model, opt, *_data(1)[0])
    s = dst.step()
    assert s.step == 1 and s.grown > 0 and dst.num_steps == 1


def test_rigl_under_a_grad_scaler_whose_first_steps_overflow():
    """The README's recipe for torch.amp.GradScaler with fp16 autocast: on an update step whose
    backward overflowed (the captured fp16 dY holds inf, the scaler skips the optimizer step)
    dst.step() raises ValueError, which the loop catches; the update is then made, once, from the
    next step's finite gradient (it was made from the NaN scores before)."""
    torch.manual_seed(0)
    model = nn.Sequential(SparseLinear(16, 12, sparsity=0.7), nn.ReLU(), SparseLinear(12, 4, sparsity=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)   # overflows fp16 at first
    dst = RigL(model, opt, update_every=1, seed=0, decay="constant")
    x, y = torch.randn(8, 16) * 4, torch.randint(0, 4, (8,))
    refused, updates = 0, []
    for _ in range(40):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        try:
            s = dst.step()
        except ValueError as e:
            assert scaler.get_scale() < scale and "NaN or inf" in str(e)   # a skipped step only
            refused += 1
            continue
        updates.append(s.step)
        if s.grown:
            break
    assert refused > 0 and updates == [1] and dst.num_steps == 1
    assert all(torch.isfinite(l.values).all() for l in _sparse(model))


@pytest.mark.parametrize("cls", [SET, RigL])
def test_inf_in_the_values_is_ranked_not_refused(cls):
    """Unlike NaN, an inf value has a magnitude: it is kept as the largest (as from_dense prunes
    it), the update goes on; only what RigL captured for its scores must be finite (a single
    layer, whose output gradient stays finite here: in a deeper model the inf reaches the other
    layers' captured dY and X, which are refused)."""
    layer = SparseLinear(20, 10, sparsity=0.7)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = cls(layer, opt, update_every=1, seed=0, decay="constant")
    with torch.no_grad():
        layer.values[3] = -float("inf")
    key = int(_keys(layer)[3])
    layer(_data(1)[0][0]).sum().backward()      # a finite output gradient
    assert dst.step().grown > 0 and key in set(_keys(layer).tolist())


def test_rigl_does_not_capture_inside_torch_func_transforms():
    """Per-sample gradients with torch.func.vmap(grad(...)) through layers under RigL: the hook
    keeps nothing inside a transform (its tensors cannot outlive it: scoring them raised), so an
    update step after it behaves as one without backward (layers unchanged, a warning); an
    ordinary backward in the same step is captured alone, giving the pattern it gives without
    the transform."""
    from torch.func import functional_call, grad, vmap

    def run(with_func):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        dst = RigL(model, opt, update_every=1, seed=0, decay="constant")
        params = {k: v.detach() for k, v in model.named_parameters()}
        (x, y), = _data(1)

        def loss(p, xi, yi):
            return F.mse_loss(functional_call(model, p, (xi[None],)), yi[None])
        if with_func:
            before = [l.indices.clone() for l in _sparse(model)]
            per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
            assert per_sample["0.values"].shape == (8, _sparse(model)[0].nnz)
            assert not dst._captured
            with pytest.warns(RuntimeWarning, match="no gradient was captured.*torch.func"):
                s = dst.step()
            assert all(r.skipped == "no gradient captured" for r in s.layers) and dst.num_steps == 1
            assert all(torch.equal(b, l.indices) for b, l in zip(before, _sparse(model)))
            grad(loss)(params, x[0], y[0])               # then the transform and a backward
        else:                                            # the same step count, nothing captured
            with pytest.warns(RuntimeWarning, match="no gradient was captured"):
                dst.step()
        F.mse_loss(model(x), y).backward()
        assert dst.step().grown > 0
        return [l.indices.clone() for l in _sparse(model)]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


@pytest.mark.parametrize("cls", [SET, RigL])
def test_a_failing_update_is_not_counted(cls, monkeypatch):
    """Whatever raises inside an update step (here a RuntimeError from the growth, as a subclass's
    grow_scores might), the call did not happen: the step count is as before it (the next call
    is the same update step), the captured records are dropped, no layer changed."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dst = cls(model, opt, update_every=2, seed=0, decay="constant")
    data = _data(2)
    _train_step(model, opt, *data[0])
    assert dst.step() is None
    _train_step(model, opt, *data[1])

    def boom(*args):
        raise RuntimeError("boom")
    monkeypatch.setattr(cls, "grow", boom)
    before = [l.indices.clone() for l in _sparse(model)]
    with pytest.raises(RuntimeError, match="boom"):
        dst.step()
    assert dst.num_steps == 1 and not dst._captured
    assert all(torch.equal(b, l.indices) for b, l in zip(before, _sparse(model)))
    monkeypatch.undo()
    _train_step(model, opt, *data[1])             # captured again: step 2 is still to come
    s = dst.step()
    assert s.step == 2 and s.grown > 0 and all(not r.skipped for r in s.layers)


def test_rigl_captures_an_input_given_as_a_keyword():
    """layer(x=...) (the keyword of SparseLinear.forward) under RigL: the hook finds the input by
    keyword as by position (it read inputs[0], an IndexError in the user's forward), and the
    update is the one of the positional call."""
    def run(keyword):
        layer = SparseLinear.from_dense(torch.randn(6, 8, generator=_gen(2)), sparsity=0.5)
        opt = torch.optim.SGD(layer.parameters(), lr=0.0)
        dst = RigL(layer, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0)
        x = torch.randn(5, 8, generator=_gen(3))
        (layer(x=x) if keyword else layer(x)).pow(2).sum().backward()
        assert dst.step().grown > 0
        return layer.indices.clone()

    assert torch.equal(run(True), run(False))


def test_a_capture_hook_pickled_without_kwargs_still_captures():
    """A hook registered before the kwargs form (a model pickled by an older snack) is called
    as (module, args, output): it forwards just the same."""
    from snack.layers.dst import _CaptureHook
    layer = SparseLinear(8, 6, sparsity=0.5)
    dst = RigL(layer, torch.optim.SGD(layer.parameters(), lr=0.0), update_every=1)
    x = torch.randn(3, 8)
    out = layer.forward(x)                       # no hook: called by hand below
    _CaptureHook(dst)(layer, (x,), out)
    assert len(dst._captured[id(layer)]) == 1
    _CaptureHook()(layer, (x,), out)             # a copy's no-op hook, either form
    _CaptureHook()(layer, (x,), {}, out)
    assert len(dst._captured[id(layer)]) == 1

def test_rigl_hooks_do_not_follow_copies_of_the_model():
    import io
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = RigL(model, opt, update_every=1, seed=0)
    clone = copy.deepcopy(model)                       # the copy does not feed dst
    buf = io.BytesIO()
    torch.save(model, buf)                             # nor does torch.save carry dst along
    assert len(buf.getvalue()) < 20000
    (x, y), = _data(1)
    F.mse_loss(clone(x), y).backward()
    assert not dst._captured
    _train_step(model, opt, x, y)
    assert len(dst._captured) == 3
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    F.mse_loss(loaded(x), y).backward()                # a loaded model runs with a no-op hook
    assert dst.step().grown > 0


# ---- determinism and checkpoints ---------------------------------------------------------------
def _run(cls, dst_seed, steps=12, model_seed=0):
    model = _mlp(seed=model_seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = cls(model, opt, update_every=2, total_steps=steps, seed=dst_seed)
    for x, y in _data(steps):
        _train_step(model, opt, x, y)
        opt.zero_grad()
        dst.step()
    return [(l.indices.clone(), l.values.detach().clone()) for l in _sparse(model)]


@pytest.mark.parametrize("cls", [SET, RigL])
def test_deterministic_with_seed(cls):
    a, b = _run(cls, 7), _run(cls, 7)
    for (ia, va), (ib, vb) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(va, vb)
    if cls is SET:
        c = _run(cls, 8)
        assert any(not torch.equal(ia, ic) for (ia, _), (ic, _) in zip(a, c))


def test_default_seed_follows_torch_manual_seed():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(42)
    s1 = SET(model, opt).seed
    torch.manual_seed(42)
    assert SET(model, opt).seed == s1


@pytest.mark.parametrize("cls", [SET, RigL])
def test_checkpoint_round_trip(cls):
    data = _data(12, seed=9)
    kw = dict(update_every=2, total_steps=12)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = cls(model, opt, seed=5, **kw)
    for x, y in data[:6]:
        _train_step(model, opt, x, y)
        opt.zero_grad()
        dst.step()
    sd_m, sd_o, sd_d = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                        copy.deepcopy(dst.state_dict()))
    assert sd_d["step"] == 6
    # the model's state_dict holds indices and values and loads back bit for bit
    model2 = _mlp(seed=123)
    assert any(not torch.equal(a.indices, b.indices) for a, b in zip(_sparse(model), _sparse(model2)))
    model2.load_state_dict(sd_m)
    for a, b in zip(_sparse(model), _sparse(model2)):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
        assert b.indices.dtype == torch.int32
    x0 = data[0][0]
    assert torch.equal(model(x0.clone()), model2(x0.clone()))
    # resuming the run from the three checkpoints reproduces it exactly
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(sd_o)
    dst2 = cls(model2, opt2, seed=999, **kw)
    dst2.load_state_dict(sd_d)
    for x, y in data[6:]:
        for m, o, d in ((model, opt, dst), (model2, opt2, dst2)):
            _train_step(m, o, x, y)
            o.zero_grad()
            d.step()
    assert dst.last_update is not None and dst2.last_update.step == dst.last_update.step
    for a, b in zip(_sparse(model), _sparse(model2)):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


# ---- schedule ----------------------------------------------------------------------------------
def test_cosine_schedule_values():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dst = RigL(model, opt, total_steps=1000)                       # paper defaults
    assert dst.drop_fraction == 0.3 and dst.update_every == 100 and dst.end_step == 750
    assert dst.drop_fraction_at(0) == pytest.approx(0.3)
    assert dst.drop_fraction_at(375) == pytest.approx(0.15)
    assert dst.drop_fraction_at(250) == pytest.approx(0.15 * (1 + math.cos(math.pi / 3)))
    assert dst.drop_fraction_at(750) == 0.0 and dst.drop_fraction_at(900) == 0.0
    for t in (1, 100, 333, 700):
        assert dst.drop_fraction_at(t) == pytest.approx(0.3 / 2 * (1 + math.cos(math.pi * t / 750)))
        assert cosine_drop_fraction(t, 0.3, 750) == pytest.approx(dst.drop_fraction_at(t))
    assert [t for t in range(1, 1001) if dst.is_update_step(t)] == [100, 200, 300, 400, 500, 600, 700]
    dst.remove_hooks()
    const = SET(model, opt, update_every=10, end_step=50, decay="constant", drop_fraction=0.2)
    assert const.drop_fraction_at(10) == 0.2 and const.drop_fraction_at(50) == 0.0
    forever = SET(model, opt, update_every=10)                     # no horizon: constant, never stops
    assert forever.end_step is None and forever.drop_fraction_at(10**6) == 0.3
    assert forever.is_update_step(10**6)


def test_summary_uses_the_scheduled_fraction():
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = RigL(model, opt, update_every=4, total_steps=16, seed=0)   # end_step 12
    seen = []
    for x, y in _data(16):
        _train_step(model, opt, x, y)
        opt.zero_grad()
        s = dst.step()
        if s is not None:
            seen.append(s.step)
            assert s.drop_fraction == pytest.approx(cosine_drop_fraction(s.step, 0.3, 12))
            for row, l in zip(s.layers, _sparse(model)):
                assert row.grown == round(s.drop_fraction * l.nnz)
            assert "dropped" in str(s)
    assert seen == [4, 8]
    assert dst.last_update.step == 8


def test_end_step_stops_updates():
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = SET(model, opt, update_every=3, end_step=10, decay="constant", seed=0)
    steps, frozen = [], None
    for t, (x, y) in enumerate(_data(24), start=1):
        _train_step(model, opt, x, y)
        opt.zero_grad()
        if dst.step() is not None:
            steps.append(t)
        if t == 9:
            frozen = [l.indices.clone() for l in _sparse(model)]
    assert steps == [3, 6, 9]
    assert all(torch.equal(a, l.indices) for a, l in zip(frozen, _sparse(model)))


# ---- edge cases --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [SET, RigL])
@pytest.mark.filterwarnings("ignore:SparseLinear .* holds no connection")
def test_empty_dense_and_nearly_dense_layers(cls):
    torch.manual_seed(0)
    model = nn.Sequential(SparseLinear(6, 5, sparsity=0.99),   # nnz = 0
                          SparseLinear(5, 4, sparsity=0.0),    # dense: nothing free
                          SparseLinear(4, 10, sparsity=0.1),   # 36 of 40: fewer free than dropped
                          SparseLinear(10, 1, sparsity=0.0),
                          SparseLinear(1, 1, sparsity=0.0))    # 1 x 1
    layers = _sparse(model)
    assert layers[0].nnz == 0 and layers[1].nnz == 20 and layers[2].nnz == 36
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dst = cls(model, opt, update_every=1, drop_fraction=0.5, decay="constant", seed=3)
    for x, y in _data(4, in_f=6, out_f=1):
        _train_step(model, opt, x, y)
        opt.zero_grad()
        before = [_keys(l).clone() for l in layers]
        s = dst.step()
        for l, b, row in zip(layers, before, s.layers):
            _check_canonical(l)
            assert l.nnz == b.numel()
        assert [r.grown for r in s.layers][:2] == [0, 0] and s.layers[3].grown == 0
        assert 0 < s.layers[2].grown <= 4                      # all 4 free coordinates at most
        assert int((~torch.isin(_keys(layers[2]), before[2])).sum()) == s.layers[2].grown


def test_layers_argument_selects_layers():
    model = _mlp()
    l1, l2, l3 = _sparse(model)
    opt = torch.optim.Adam([l2.values, l2.bias], lr=1e-2)
    dst = SET(model, opt, layers=[l2, l2], update_every=1, seed=0, decay="constant")
    assert [m for _, m in dst.layers] == [l2] and dst.layers[0][0] == "2"
    before = (l1.indices.clone(), l3.indices.clone(), l2.indices.clone())
    dst.step()
    assert torch.equal(before[0], l1.indices) and torch.equal(before[1], l3.indices)
    assert not torch.equal(before[2], l2.indices)
    # one layer, or a ModuleList of them (iterated, not taken as one module)
    for layers, want in ((l3, [l3]), (nn.ModuleList([l1, l3]), [l1, l3])):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        assert [m for _, m in SET(model, opt, layers=layers, seed=0).layers] == want


def test_rank_sampling_helpers():
    keys = torch.tensor([1, 3, 4, 9], dtype=torch.int64)
    free = [k for k in range(12) if k not in keys.tolist()]
    assert _free_ranks_to_keys(torch.arange(8), keys).tolist() == free
    assert _free_ranks_to_keys(torch.tensor([0, 5]), torch.empty(0, dtype=torch.int64)).tolist() == [0, 5]
    g = _gen(0)
    for n, k in ((100, 7), (10, 9), (10, 10), (5, 0), (1, 1)):     # both branches
        s = _sample_distinct(n, k, g)
        assert s.numel() == k and torch.equal(s, torch.unique(s))
        assert k == 0 or (int(s.min()) >= 0 and int(s.max()) < n)
    for n, k in ((5, 6), (5, -1)):
        with pytest.raises(ValueError, match="k must be in"):
            _sample_distinct(n, k, g)
    counts = torch.zeros(10)
    for _ in range(3000):
        counts[_sample_distinct(10, 3, g)] += 1
    assert torch.all((counts - 900).abs() < 120), counts           # uniform over [0, n)


# ---- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [SET, RigL])
def test_no_dense_sized_allocation_during_update(cls):
    out_f, in_f = 512, 2048
    torch.manual_seed(0)
    layer = SparseLinear(in_f, out_f, sparsity=0.99)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    extra = {"grad_block_numel": 2**15} if cls is RigL else {}
    dst = cls(layer, opt, update_every=1, decay="constant", seed=0, **extra)
    layer(torch.randn(4, in_f)).pow(2).sum().backward()
    opt.step()
    with MaxNumel() as mode:
        s = dst.step()
    assert s.grown == round(0.3 * layer.nnz) or cls is SET
    assert s.grown > 1000
    assert mode.max_numel < out_f * in_f // 10, (mode.max_numel, mode.worst)
    _check_canonical(layer)


# ---- bad arguments -----------------------------------------------------------------------------
def _bad_cases():
    m = _mlp()
    ok = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, ok, [
        (dict(model=nn.Sequential(nn.Linear(3, 3))), ValueError, "no snack.SparseLinear"),
        (dict(model="net"), TypeError, "model must be"),
        (dict(optimizer=[1, 2]), TypeError, "optimizer must be"),
        (dict(optimizer=torch.optim.SGD([_sparse(m)[0].bias], lr=0.1)), ValueError, "does not hold"),
        (dict(drop_fraction=1.0), ValueError, "drop_fraction"),
        (dict(drop_fraction=-0.1), ValueError, "drop_fraction"),
        (dict(drop_fraction=float("nan")), ValueError, "drop_fraction"),
        (dict(drop_fraction="0.3"), TypeError, "drop_fraction must be a number in .0, 1., got str"),
        (dict(update_every=0), ValueError, "update_every"),
        (dict(update_every=1.5), TypeError, "update_every"),
        (dict(end_step=0), ValueError, "end_step"),
        (dict(total_steps=-5), ValueError, "total_steps"),
        (dict(decay="linear"), ValueError, "decay"),
        (dict(seed="a"), TypeError, "seed"),
        (dict(layers=[nn.Linear(2, 2)]), TypeError, r"layers\[0\]"),
        (dict(layers=[]), ValueError, "layers is empty"),
        (dict(layers=5), TypeError, "layers must be an iterable of snack.SparseLinear modules .*got int"),
    ]


@pytest.mark.parametrize("case", range(17))
@pytest.mark.parametrize("cls", [SET, RigL])
def test_bad_arguments_raise(cls, case):
    m, ok, cases = _bad_cases()
    assert len(cases) == 17
    kw, exc, match = cases[case]
    args = dict(model=m, optimizer=ok)
    args.update(kw)
    with pytest.raises(exc, match=match):
        cls(args.pop("model"), args.pop("optimizer"), **args)


def test_bad_rigl_block_and_state_dict():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="grad_block_numel"):
        RigL(m, opt, grad_block_numel=0)
    dst = SET(m, opt)
    with pytest.raises(ValueError, match="rng_state"):
        dst.load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="step"):
        dst.load_state_dict({"step": -1, "rng_state": dst.state_dict()["rng_state"]})
    # a bad state changes nothing (the step count, the generator and the seed stay as they were)
    sd = dst.state_dict()
    for bad, exc, match in (({"rng_state": torch.zeros(3)}, TypeError, r"state\['rng_state'\]"),
                            ({"rng_state": sd["rng_state"].float()}, TypeError, r"state\['rng_state'\]"),
                            ({"seed": "x"}, TypeError, r"state\['seed'\] must be an int")):
        with pytest.raises(exc, match=match):
            dst.load_state_dict({**sd, "step": 9, **bad})
        assert dst.num_steps == sd["step"] and dst.seed == sd["seed"]
        assert torch.equal(dst._gen.get_state(), sd["rng_state"])
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        SET(m, opt, seed=2**70)


def test_a_tensor_drop_fraction_a_checkpoint_of_another_schedule_and_a_step_after_remove_hooks():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert SET(m, opt, drop_fraction=torch.tensor(0.25)).drop_fraction == 0.25
    with pytest.warns(UserWarning, match="end_step=500 is past total_steps=100"):
        SET(m, opt, total_steps=100, end_step=500)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SET(m, opt, total_steps=100, end_step=101)      # updates to the last step
    sd = SET(m, opt, update_every=5, decay="constant").state_dict()
    dst = SET(m, opt, update_every=50, decay="constant")
    with pytest.warns(UserWarning, match=r"schedule differs: update_every=5 \(here 50\); the run goes on"):
        dst.load_state_dict(sd)
    assert dst.update_every == 50 and dst.num_steps == sd["step"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SET(m, opt, update_every=5, decay="constant").load_state_dict(sd)   # the same schedule: silent
    rigl = RigL(m, opt, update_every=1, decay="constant")
    rigl.remove_hooks()
    with pytest.raises(RuntimeError, match=r"RigL.step\(\) after remove_hooks\(\)"):
        rigl.step()
    assert rigl.num_steps == 0
    s = SET(m, opt, update_every=1)
    s.remove_hooks()                                    # SET has none: it steps on
    assert s.step() is not None


def test_public_names():
    import snack.dst
    assert snack.dst.SET is SET and snack.dst.RigL is RigL
    assert issubclass(SET, DynamicSparseTraining) and issubclass(RigL, DynamicSparseTraining)


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cls", [SET, RigL])
def test_cuda_matches_cpu_pattern(cls):
    runs = []
    for dev in ("cpu", "cuda"):
        model = _mlp().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)     # values stay put: same drops
        dst = cls(model, opt, update_every=1, decay="constant", seed=2)
        x, y = _data(1)[0]
        F.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
        dst.step()
        for l in _sparse(model):
            _check_canonical(l)
        runs.append([l.indices.cpu() for l in _sparse(model)])
    if cls is SET:   # RigL's float32 gradients may differ in the last bits between devices
        assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
def test_cuda_graph_captured_before_update_replays_new_pattern():
    """A training step captured in a CUDA graph, then SET updates between replays: each replay
    computes with the current pattern (the same loss and gradients as an eager step)."""
    from experiments.bench_layer import capture
    torch.manual_seed(3)
    layer = SparseLinear(700, 900, sparsity=0.9, device="cuda")
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    dst = SET(layer, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=1)
    x = torch.randn(32, 700, device="cuda")
    t = torch.randn(32, 900, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(layer(x), t)
        loss.backward()
        return loss
    g, static_loss = capture(step)
    for _ in range(3):
        with torch.no_grad():
            layer.values.normal_()            # SET drops by magnitude: a new pattern each time
        old = layer.indices.clone()
        dst.step()
        assert not torch.equal(old, layer.indices)
        static_loss.fill_(float("nan"))
        layer.values.grad.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        got_loss, got_grad = static_loss.clone(), layer.values.grad.clone()
        w = layer.to_dense().detach().double().requires_grad_()
        ref = F.mse_loss(F.linear(x.double(), w, layer.bias.detach().double()), t.double())
        ref.backward()
        idx = layer.indices.long()
        torch.testing.assert_close(got_loss.double(), ref.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got_grad.double(), w.grad[idx[0], idx[1]], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("cls", [SET, RigL])
def test_frozen_layers_keep_their_pattern(cls):
    # a frozen layer's regrown connections would start at 0 and never train: it is left alone,
    # also when the optimizer holds only the trainable parameters
    model = _mlp()
    l1, l2, l3 = _sparse(model)
    l1.values.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    dst = cls(model, opt, update_every=1, seed=0, decay="constant")
    assert [m for _, m in dst.layers] == [l2, l3] and [(n, m) for n, m in dst.skipped] == [("0", l1)]
    before = [l.indices.clone() for l in (l1, l2, l3)]
    for x, y in _data(2):
        opt.zero_grad()
        _train_step(model, opt, x, y)
        dst.step()
    assert torch.equal(before[0], l1.indices)
    assert not torch.equal(before[1], l2.indices) and not torch.equal(before[2], l3.indices)
    # frozen after the DST was built: left alone from then on, with a warning naming it
    l2.values.requires_grad_(False)
    frozen = l2.indices.clone()
    for x, y in _data(1):
        opt.zero_grad()
        _train_step(model, opt, x, y)
        with pytest.warns(RuntimeWarning, match="layer.s. 2 are frozen"):
            summary = dst.step()
    assert torch.equal(frozen, l2.indices) and not torch.equal(before[2], l3.indices)
    assert [r.skipped for r in summary.layers] == ["frozen", ""]
    l2.values.requires_grad_(True)
    with pytest.raises(ValueError, match=r"layers\[0\] is frozen"):
        cls(model, opt, layers=[l1])
    for l in (l2, l3):
        l.values.requires_grad_(False)
    with pytest.raises(ValueError, match="every snack.SparseLinear .* is frozen"):
        cls(model, opt)


def test_default_end_step_is_three_quarters_of_total_steps_floored_at_least_1():
    """end_step's default is max(1, int(0.75 * total_steps)), as the docstring says (it said
    0.75 * total_steps, which for total_steps=10 is 7.5, not the 7 used)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # (no update ever happens for the small ones)
        got = {n: SET(model, opt, total_steps=n).end_step for n in (1, 2, 3, 10, 101)}
    assert got == {1: 1, 2: 1, 3: 2, 10: 7, 101: 75}
    assert "max(1, int(0.75 * total_steps))" in " ".join(DynamicSparseTraining.__doc__.split())


def test_schedule_without_any_update_warns():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="no update will ever happen"):
        SET(model, opt, update_every=5, end_step=5)
    with pytest.warns(UserWarning, match="no update will ever happen"):
        SET(model, opt, update_every=100, total_steps=100)  # end_step 75
