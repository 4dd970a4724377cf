"""torch.compile, torch.export and torch.library: SparseLinear traced into one graph
(fullgraph=True), exported and loaded back, the custom ops checked by torch.library.opcheck,
results and gradients equal to eager and to float64, a pattern changed in place seen by a
compiled model, bad input still rejected; on the GPU a compiled model trained through SET / RigL
updates, in the default mode and with CUDA graphs.
"""
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snack
from snack import SparseLinear
from snack.core import uniform_indices
from snack.layers import library

from conftest import assert_close_dtype


def _mlp(bias=True, dtype=torch.float64, device="cpu", sizes=(37, 29, 11), sparsity=0.7):
    torch.manual_seed(2)
    mods = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            mods.append(nn.GELU())
        mods.append(SparseLinear(a, b, bias=bias, sparsity=sparsity, device=device, dtype=dtype))
    return nn.Sequential(*mods)


def _grads(model, x):
    return [p.grad.clone() for p in model.parameters()] + ([x.grad.clone()] if x.requires_grad else [])


def _run(model, x, loss_of=lambda y: (y * y).sum()):
    model.zero_grad(set_to_none=True)
    x.grad = None
    y = model(x)
    loss_of(y).backward()
    return y.detach(), _grads(model, x)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_grad", [True, False])
def test_opcheck(bias, x_grad):
    """torch.library.opcheck: schema, fake (meta) implementation, autograd registration and
    AOT dispatch of both custom ops on random float64 inputs."""
    torch.manual_seed(0)
    layer = SparseLinear(23, 17, bias=bias, sparsity=0.6, dtype=torch.float64)
    x = torch.randn(5, 23, dtype=torch.float64, requires_grad=x_grad)
    args = (x, layer.indices, layer.values, layer.bias, 17)
    torch.library.opcheck(library.sparse_linear_op, args)
    dy = torch.randn(5, 17, dtype=torch.float64)
    for need in [(True, True, bias), (False, True, False), (True, False, bias), (False, False, True)]:
        torch.library.opcheck(library.sparse_linear_backward_op,
                              (dy, x.detach(), layer.indices, layer.values.detach(), 17) + need)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("lead", [(6,), (2, 3), (1,)])
@pytest.mark.parametrize("bias", [True, False])
def test_fullgraph_matches_eager_and_float64(backend, lead, bias):
    model = _mlp(bias=bias)
    x = torch.randn(*lead, 37, dtype=torch.float64, requires_grad=True)
    y_e, g_e = _run(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    y_c, g_c = _run(compiled, x)
    assert_close_dtype(y_c, y_e)
    for a, b in zip(g_c, g_e):
        assert_close_dtype(a, b)
    # and against a dense float64 model
    dense = nn.Sequential(*[m if not isinstance(m, SparseLinear) else
                            _dense_linear(m) for m in model])
    y_d, g_d = _run(dense, x)
    assert_close_dtype(y_c, y_d)
    assert_close_dtype(g_c[-1], g_d[-1])   # dX


def _dense_linear(m: SparseLinear) -> nn.Linear:
    lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(m.to_dense())
        if m.bias is not None:
            lin.bias.copy_(m.bias)
    return lin


def test_gradcheck_through_compiled_function():
    torch.manual_seed(1)
    layer = SparseLinear(9, 7, sparsity=0.5, dtype=torch.float64)
    fn = torch.compile(lambda x, v, b: snack.functional.sparse_linear(x, layer.indices, v, 7, b),
                       backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (x, layer.values.detach().clone().requires_grad_(),
                                         layer.bias.detach().clone().requires_grad_()))


def test_torch_export_round_trip(tmp_path):
    """torch.export: the exported graph holds the custom op (no graph break, no dense weight), a
    dynamic batch dimension works, and the program saves and loads."""
    model = _mlp()
    x = torch.randn(5, 37, dtype=torch.float64)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("snack.sparse_linear.default") == 2
    assert not any("mm" in t or "linear" in t.replace("sparse_linear", "") for t in targets)
    path = tmp_path / "mlp.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    for b in (5, 1, 13):
        xb = torch.randn(b, 37, dtype=torch.float64)
        assert_close_dtype(loaded.module()(xb), model(xb))


def test_compiled_model_follows_pattern_changed_in_place():
    """A compiled model looks the topology up when its op runs: indices rewritten in place (as
    snack.dst does) change the result without a recompile."""
    model = _mlp()
    layer = model[0]
    from torch._dynamo.utils import counters
    x = torch.randn(4, 37, dtype=torch.float64)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    before = compiled(x)
    new_idx = uniform_indices((29, 37), nnz=layer.nnz, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        layer.indices.copy_(new_idx.to(layer.indices))
    after = compiled(x)
    assert counters["stats"]["unique_graphs"] == 1
    assert not torch.allclose(before, after)
    assert_close_dtype(after, model(x))


@pytest.mark.parametrize("cls", ["SET", "RigL"])
def test_dynamic_sparse_training_of_a_compiled_model(cls):
    """SET / RigL on a compiled model: the same losses and patterns as eagerly over 30 steps (10
    updates), and no recompile per step (RigL's gradient capture, on update steps only, runs
    eagerly: at most one more graph pair for those steps)."""
    from torch._dynamo.utils import counters
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _mlp(dtype=torch.float32, sizes=(20, 30, 5))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dst = getattr(snack.dst, cls)(model, opt, update_every=3, drop_fraction=0.3, decay="constant", seed=1)
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(model, backend="aot_eager") if compiled else model
        g = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(30):
            x, t = torch.randn(8, 20, generator=g), torch.randn(8, 5, generator=g)
            loss = F.mse_loss(f(x), t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            dst.step()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), [m.indices.clone() for m in model if isinstance(m, SparseLinear)]))
        if compiled:
            assert counters["stats"]["unique_graphs"] <= (1 if cls == "SET" else 3)
    (l_e, i_e), (l_c, i_c) = runs
    assert all(torch.equal(a, b) for a, b in zip(i_e, i_c))
    torch.testing.assert_close(l_c, l_e, rtol=1e-5, atol=1e-6)


def test_compiled_model_rejects_bad_input():
    model = _mlp()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(ValueError, match="in_features"):
        compiled(torch.randn(4, 36, dtype=torch.float64))
    with pytest.raises(TypeError, match="same dtype"):
        compiled(torch.randn(4, 37, dtype=torch.float32))


def test_compiled_under_cpu_autocast():
    model = _mlp(dtype=torch.float32)
    x = torch.randn(3, 37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
        torch._dynamo.reset()
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert_close_dtype(got, want)


def test_eager_calls_do_not_use_the_custom_op(monkeypatch):
    """Eager calls keep the cheaper autograd Function: the custom op runs only when compiled."""
    model = _mlp()
    x = torch.randn(3, 37, dtype=torch.float64, requires_grad=True)

    def fail(*a, **k):
        raise AssertionError("custom op called eagerly")
    monkeypatch.setattr(library, "sparse_linear_op", fail)
    model(x).sum().backward()


# ---- GPU ---------------------------------------------------------------------------------------
def _dst_training(device, B, cls, compile_kw):
    """(losses, parameters, indices) of 6 Adam steps of a two-layer model with SET / RigL updates
    every 2 steps, eager (compile_kw None) or compiled with torch.compile(**compile_kw)."""
    model = _mlp(dtype=torch.float32, device=device, sizes=(700, 900, 300), sparsity=0.9)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dst = getattr(snack.dst, cls)(model, opt, update_every=2, drop_fraction=0.2, decay="constant", seed=4)
    g = torch.Generator(device=device).manual_seed(5)
    xs = [torch.randn(B, 700, device=device, generator=g) for _ in range(6)]
    ts = [torch.randn(B, 300, device=device, generator=g) for _ in range(6)]
    torch._dynamo.reset()
    f = torch.compile(model, **compile_kw) if compile_kw is not None else model
    losses = []
    for x, t in zip(xs, ts):
        if compile_kw is not None and compile_kw.get("mode") == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = F.mse_loss(f(x), t)
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()        # set_to_none=True: no .grad kept from a CUDA graph's pool
        dst.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (torch.stack(losses), [p.detach().clone() for p in model.parameters()],
            [m.indices.clone() for m in model if isinstance(m, SparseLinear)])


def _same_training(a, b):
    (l_e, p_e, i_e), (l_c, p_c, i_c) = a, b
    assert all(torch.equal(x, y) for x, y in zip(i_e, i_c))
    torch.testing.assert_close(l_c, l_e, rtol=1e-4, atol=1e-6)
    for x, y in zip(p_c, p_e):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_compiled_training_on_the_cpu_follows_eager_through_rigl_updates():
    """RigL's gradient capture stays eager in a compiled model (torch.compiler.disable, applied
    when the first DST object is made): every update grows from captured gradients (traced, the
    capture would get none: a warning, here an error, and the layer skipped), and the run follows
    the eager one. Not bit for bit: on the CPU the dense gradient scores come from torch.mm, whose
    last bits may depend on the buffers' alignment, and a near tie then picks another connection
    (1 run in ~12 under load); on the GPU the same comparison is exact."""
    import warnings
    from snack.layers.dst import DynamicSparseTraining
    start = [m.indices.clone() for m in _mlp(dtype=torch.float32, sizes=(700, 900, 300), sparsity=0.9)
             if isinstance(m, SparseLinear)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no gradient was captured")
        (l_e, p_e, i_e), (l_c, p_c, i_c) = (_dst_training("cpu", 16, "RigL", kw) for kw in (None, {"backend": "aot_eager"}))
    assert getattr(DynamicSparseTraining._keep, "_torchdynamo_disable", False)  # the capture is kept out of graphs
    torch.testing.assert_close(l_c, l_e, rtol=1e-3, atol=1e-5)
    for s0, e, c in zip(start, i_e, i_c):
        keys = [set((t[0].long() * 100000 + t[1].long()).tolist()) for t in (s0, e, c)]
        assert len(keys[2]) == len(keys[0]) and keys[2] != keys[0]  # updated, same number of connections
        assert len(keys[1] & keys[2]) >= 0.99 * len(keys[1])


def test_importing_snack_leaves_torch_dynamo_unimported():
    # torch._dynamo takes about a second to import; snack needs it only once a model is compiled
    # or a DST object is made
    code = ("import sys, torch, snack, snack.dst; assert 'torch._dynamo' not in sys.modules, 'imported'; "
            "assert not hasattr(snack.dst.DynamicSparseTraining._keep, '_torchdynamo_disable')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("B,cls", [(8, "SET"), (32, "SET"), (32, "RigL")])
def test_cuda_compiled_training_matches_eager_through_dst_updates(B, cls):
    """torch.compile (inductor, default mode) of a two-layer model trained on the GPU: the same
    losses, values and patterns as eagerly over 6 Adam steps with SET / RigL updates."""
    _same_training(_dst_training("cuda", B, cls, None), _dst_training("cuda", B, cls, {}))


@pytest.mark.gpu
def test_cuda_reduce_overhead_training():
    """torch.compile(mode="reduce-overhead") (CUDA-graph trees) of the same training: the same
    losses, values and patterns as eagerly, through SET updates."""
    _same_training(_dst_training("cuda", 8, "SET", None),
                   _dst_training("cuda", 8, "SET", {"mode": "reduce-overhead"}))
