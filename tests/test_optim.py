"""snack.optim.Adam / AdamW: torch's Adam with a fused GPU step. On the CPU (and for anything the
kernel does not cover) step() is torch's own; on the GPU (marked `gpu`) the kernel path matches
torch's optimizer, survives CUDA-graph capture and works with snack.dst. The kernel itself is also
run under Numba's simulator (tests/gpu_sim/kernels_sim.py)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import snack
from snack.layers.functional import settle_autograd

from conftest import real_cuda_env


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(snack.SparseLinear(24, 16, sparsity=0.7), torch.nn.ReLU(),
                               torch.nn.Linear(16, 5)).to(device)


def _run(model, opt, steps=4, device="cpu"):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(7, 24, generator=g).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("name,kw", [("Adam", {}), ("Adam", {"weight_decay": 0.1, "amsgrad": True}),
                                     ("AdamW", {"weight_decay": 0.05})])
def test_cpu_steps_are_torchs(name, kw):
    a, b = _model(), _model()
    _run(a, getattr(snack.optim, name)(a.parameters(), lr=0.01, **kw))
    _run(b, getattr(torch.optim, name)(b.parameters(), lr=0.01, **kw))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_subclass_of_torchs_and_closure_returns_loss():
    assert issubclass(snack.optim.Adam, torch.optim.Adam)
    assert issubclass(snack.optim.AdamW, torch.optim.AdamW)
    m = _model()
    opt = snack.optim.Adam(m.parameters(), lr=0.1)
    x = torch.randn(3, 24)

    def closure():
        opt.zero_grad()
        loss = m(x).sum()
        loss.backward()
        return loss
    before = m[0].values.detach().clone()
    loss = opt.step(closure)
    assert torch.is_tensor(loss) and not torch.equal(before, m[0].values)
    assert opt.step() is None   # no closure: None, as torch's


def test_step_hooks_run_once_per_step():
    # torch wraps a class's step with its hook runner when the class's first instance is built;
    # snack's step, falling back to torch's, must not run the hooks a second time through it
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])     # torch's Adam.step is wrapped now
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    calls = []
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    mine = []  # the snack optimizer of the round (the global hook sees torch's too)
    handle = register_optimizer_step_pre_hook(lambda o, *a: calls.append("global") if o is mine[-1] else None)
    try:
        for cls in (snack.optim.Adam, snack.optim.AdamW):
            calls.clear()
            p = torch.zeros(3, requires_grad=True)
            ref = torch.zeros(3, requires_grad=True)
            opt = cls([p], lr=0.1, weight_decay=0.01)
            mine.append(opt)
            opt.register_step_pre_hook(lambda *a: calls.append("pre"))
            opt.register_step_post_hook(lambda *a: calls.append("post"))
            torch_opt = getattr(torch.optim, cls.__name__)([ref], lr=0.1, weight_decay=0.01)
            for _ in range(2):
                p.grad = torch.tensor([1.0, -2.0, 0.5])
                ref.grad = p.grad.clone()
                opt.step()
                torch_opt.step()
            assert calls == ["global", "pre", "post"] * 2, (cls.__name__, calls)
            assert torch.equal(p, ref)
    finally:
        handle.remove()


def test_step_hooks_can_replace_arguments_and_subclasses_run_them_once():
    # a pre hook returning (args, kwargs) replaces the step's arguments (here: adds a closure),
    # as torch's hook runner does; a subclass with its own step (wrapped by torch) runs every
    # hook once, its super().step() none
    p = torch.zeros(3, requires_grad=True)
    opt = snack.optim.Adam([p], lr=0.1)
    seen = []

    def closure():
        seen.append("closure")
        return torch.tensor(2.0)
    opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": closure}))
    p.grad = torch.ones(3)
    assert float(opt.step()) == 2.0 and seen == ["closure"]
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        bad = snack.optim.Adam([p], lr=0.1)
        bad.register_step_pre_hook(lambda *a: "nonsense")
        bad.step()

    class Mine(snack.optim.AdamW):
        def step(self, closure=None):
            calls.append("mine")
            return super().step(closure)
    calls = []
    q = torch.zeros(3, requires_grad=True)
    mine = Mine([q], lr=0.1)
    mine.register_step_pre_hook(lambda *a: calls.append("pre"))
    mine.register_step_post_hook(lambda *a: calls.append("post"))
    ref = torch.zeros(3, requires_grad=True)
    torch_opt = torch.optim.AdamW([ref], lr=0.1)
    for _ in range(2):
        q.grad, ref.grad = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([1.0, -2.0, 0.5])
        mine.step()
        torch_opt.step()
    assert calls == ["pre", "mine", "post"] * 2
    assert torch.equal(q, ref)


def test_profiler_sees_the_step_and_zero_grad_labels():
    # without a profiler the step and zero_grad skip torch's record_function (host time); with
    # one they carry torch's labels, as torch's optimizers do
    p = torch.zeros(4, requires_grad=True)
    opt = snack.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    opt.zero_grad()
    assert p.grad is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        p.grad = torch.ones(4)
        opt.step()
        opt.zero_grad()
    names = {e.key for e in prof.key_averages()}
    assert "Optimizer.step#Adam.step" in names and "Optimizer.zero_grad#Adam.zero_grad" in names
    assert p.grad is None
    p.grad = torch.ones(4)
    opt.zero_grad(set_to_none=False)  # torch's own: zeroed in place
    assert p.grad is not None and torch.equal(p.grad, torch.zeros(4))


def test_cpu_step_does_not_import_the_gpu_package():
    # on CPU parameters (simulator off) torch's step runs: importing snack.gpu (numba-cuda, about
    # half a second) on the first step would only slow down the first timed step
    import subprocess
    import sys
    code = ("import sys, torch, snack\n"
            "m = snack.SparseLinear(8, 4)\n"
            "o = snack.optim.Adam(m.parameters())\n"
            "m(torch.randn(2, 8)).sum().backward(); o.step()\n"
            "print('snack.gpu' in sys.modules)\n")
    env = real_cuda_env()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_bad_arguments_are_torchs():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        snack.optim.Adam(_model().parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        snack.optim.AdamW(_model().parameters(), betas=(1.5, 0.9))



@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_lazy_and_sparse_parameters_take_torchs_step(name):
    # the shared-memory check reads every parameter's storage: a lazy module's parameter before
    # its first forward (a branch not run yet) has none and raised ValueError at the step; a
    # sparse parameter raised "Cannot access data pointer" instead of torch's own error
    out = []
    for cls in (getattr(snack.optim, name), getattr(torch.optim, name)):
        torch.manual_seed(0)
        used, later = torch.nn.Linear(4, 3), torch.nn.LazyLinear(2)
        with warnings.catch_warnings():  # (torch warns of lazy modules given to an optimizer)
            warnings.simplefilter("ignore")
            opt = cls([*used.parameters(), *later.parameters()], lr=0.1)
        x = torch.ones(2, 4)
        for i in range(3):
            opt.zero_grad()
            y = used(x)
            (y.sum() + (later(y).sum() if i else 0)).backward()  # the lazy branch from step 2 on
            opt.step()
        out.append([p.detach().clone() for p in (*used.parameters(), *later.parameters())])
    for p, q in zip(*out):
        assert torch.equal(p, q)
    errors = []
    for cls in (getattr(snack.optim, name), getattr(torch.optim, name)):
        p = torch.nn.Parameter(torch.eye(3).to_sparse())
        opt = cls([p])
        p.grad = torch.eye(3).to_sparse()
        with pytest.raises(RuntimeError) as e:
            opt.step()
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "sparse" in errors[0]


_FSDP2 = """
import sys, torch, torch.distributed as dist, snack
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
out = []
for cls in (snack.optim.Adam, torch.optim.Adam, snack.optim.AdamW, torch.optim.AdamW):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fully_shard(m, mesh=mesh)  # the parameters become DTensors
    opt = cls(m.parameters(), lr=0.1, weight_decay=0.01)
    for _ in range(3):
        opt.zero_grad()
        m(torch.ones(3, 8)).square().sum().backward()
        opt.step()
    out.append([p.full_tensor() for p in m.parameters()])
for a, b in (out[:2], out[2:]):
    assert all(torch.equal(p, q) for p, q in zip(a, b))
dist.destroy_process_group()
print("same")
"""


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("sim", [False, True])
def test_fsdp2_dtensor_parameters_take_torchs_step(tmp_path, sim):
    # FSDP2 (fully_shard) makes parameters DTensors, whose storage cannot be reached from Python:
    # the shared-memory check raised at every step, on the CPU too, and the kernel path (here
    # under Numba's simulator, where CPU tensors take it) read them as plain tensors. A one-rank
    # gloo group in a child process (the process group stays out of this one)
    import subprocess
    import sys
    env = real_cuda_env(CUDA_VISIBLE_DEVICES="")
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = subprocess.run([sys.executable, "-c", _FSDP2, str(tmp_path / "init")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("same")


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_compiled_step_matches_torchs(name):
    # torch.compile of step() (the hook wrapper is made once, so dynamo's guards on it hold)
    torch.manual_seed(0)
    a = _model()
    b = copy.deepcopy(a)
    oa = getattr(snack.optim, name)(a.parameters(), lr=0.01)
    ob = getattr(torch.optim, name)(b.parameters(), lr=0.01)
    step = torch.compile(oa.step, backend="eager")
    x = torch.randn(4, a[0].in_features)
    for _ in range(3):
        for m, o, do in ((a, oa, step), (b, ob, ob.step)):
            o.zero_grad()
            m(x).square().sum().backward()
            do()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


# ---- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", [("Adam", {}), ("Adam", {"weight_decay": 0.1}),
                                     ("AdamW", {"weight_decay": 0.05, "betas": (0.8, 0.9)})])
def test_gpu_kernel_path_matches_torch(name, kw):
    a, b = _model("cuda"), _model("cuda")
    oa = getattr(snack.optim, name)(a.parameters(), lr=0.01, **kw)
    ob = getattr(torch.optim, name)(b.parameters(), lr=0.01, **kw)
    _run(a, oa, 5, "cuda")
    _run(b, ob, 5, "cuda")
    assert oa._work() is not None        # the kernel path was the one taken
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state[p], ob.state[q]
        assert sa["step"].is_cuda and float(sa["step"]) == float(sb["step"]) == 5
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.gpu
def test_gpu_large_values_tensor_and_fallbacks():
    # 1.7 M values (many grid-stride rounds); float16 parameters and amsgrad take torch's step
    torch.manual_seed(2)
    layer = snack.SparseLinear(4096, 4096, sparsity=0.9, device="cuda")
    twin = copy.deepcopy(layer)
    oa, ob = snack.optim.Adam(layer.parameters(), lr=1e-3), torch.optim.Adam(twin.parameters(), lr=1e-3)
    x = torch.randn(8, 4096, device="cuda")
    for m, o in ((layer, oa), (twin, ob)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    torch.testing.assert_close(layer.values, twin.values, rtol=1e-5, atol=1e-7)
    for kw, dtype in (({"amsgrad": True}, torch.float32), ({}, torch.float16)):
        a = snack.SparseLinear(64, 32, sparsity=0.5, device="cuda", dtype=dtype)
        b = copy.deepcopy(a)
        o1, o2 = snack.optim.Adam(a.parameters(), lr=0.01, **kw), torch.optim.Adam(b.parameters(), lr=0.01, **kw)
        for m, o in ((a, o1), (b, o2)):
            m(torch.ones(2, 64, device="cuda", dtype=dtype)).float().sum().backward()
            o.step()
        assert o1._work() is None
        assert torch.equal(a.values, b.values)


@pytest.mark.gpu
def test_gpu_step_captured_in_a_cuda_graph():
    model = _model("cuda")
    twin = copy.deepcopy(model)
    opt = snack.optim.Adam(model.parameters(), lr=0.01)
    ref = snack.optim.Adam(twin.parameters(), lr=0.01)
    x = torch.randn(7, 24, device="cuda")

    def step(m, o):
        o.zero_grad(set_to_none=False)
        m(x).square().mean().backward()
        o.step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(model, opt)               # state created before capture
    torch.cuda.current_stream().wait_stream(s)
    settle_autograd()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(model, opt)
    for _ in range(4):
        g.replay()
    for _ in range(5):                 # 1 warm-up + the captured step (not run at capture) + 4 replays
        step(twin, ref)
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert float(opt.state[model[0].values]["step"]) == 5


@pytest.mark.gpu
def test_gpu_counter_made_under_capture_is_kept_for_the_graph_only():
    """A block counter that first has to be made during a capture (its zeros are written only
    when the graph replays) is not handed to later eager steps; one made eagerly is reused by a
    capture."""
    model = _model("cuda")
    opt = snack.optim.Adam(model.parameters(), lr=0.01)
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = opt._counter(dev, 3)
    assert not opt._snack_counters.get(dev)
    eager = opt._counter(dev, 3)
    assert eager is not c and int(eager.abs().sum()) == 0
    g2 = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():  # nothing is captured on purpose: torch warns of an empty graph
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(g2):
            assert opt._counter(dev, 3) is eager


@pytest.mark.gpu
def test_gpu_dst_keeps_moments_of_survivors():
    model = _model("cuda")
    opt = snack.optim.Adam(model.parameters(), lr=0.01)
    dst = snack.dst.SET(model, opt, update_every=1, drop_fraction=0.3, decay="constant", seed=0)
    layer = model[0]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(5, 24, generator=g).cuda()
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(5, 5, device="cuda")).backward()
        opt.step()
        keys = (layer.indices[0].long() * 24 + layer.indices[1].long()).clone()
        m_old = opt.state[layer.values]["exp_avg"].clone()
        dst.step()
        nk = layer.indices[0].long() * 24 + layer.indices[1].long()
        surv_new, surv_old = torch.isin(nk, keys), torch.isin(keys, nk)
        st = opt.state[layer.values]
        assert bool((~surv_new).any())
        assert torch.equal(st["exp_avg"][surv_new], m_old[surv_old])
        assert bool((st["exp_avg"][~surv_new] == 0).all()) and bool((st["exp_avg_sq"][~surv_new] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_gpu_follows_a_learning_rate_schedule_and_changed_hyper_parameters(name):
    # the kernel launch takes the hyper-parameters at every step: a scheduler halving lr, then
    # betas and weight decay changed by hand, give torch's results
    a, b = _model("cuda"), _model("cuda")
    oa = getattr(snack.optim, name)(a.parameters(), lr=0.02, weight_decay=0.01)
    ob = getattr(torch.optim, name)(b.parameters(), lr=0.02, weight_decay=0.01)
    sa, sb = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (oa, ob))
    g = torch.Generator().manual_seed(5)
    for i in range(6):
        if i == 3:
            for o in (oa, ob):
                o.param_groups[0].update(betas=(0.8, 0.99), weight_decay=0.1)
        x = torch.randn(7, 24, generator=g).cuda()
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            s.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
