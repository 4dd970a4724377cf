"""snack.graphs.CapturedStep: a training step replayed from a CUDA graph.

On the CPU it runs the step eagerly (and checks its arguments); on the GPU (marked `gpu`) a
small sparse MLP trained through replays follows the same run trained eagerly, step for step,
through a learning-rate change (a new capture), a last batch of another size (eager), and SET
or RigL updates (RigL's steps before an update eager)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import snack
from snack.graphs import CapturedStep


def _model(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(snack.SparseLinear(40, 33, sparsity=0.8), nn.ReLU(),
                         snack.SparseLinear(33, 7, sparsity=0.7)).to(device)


def _step_fn(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def test_on_the_cpu_it_runs_the_step_eagerly():
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def fn(x, y):
        calls.append((x, y))
        return _step_fn(model, opt)(x, y), {"n": x.shape[0]}

    step = CapturedStep(fn, model=model, optimizer=opt)
    x, y = torch.randn(8, 40), torch.randint(0, 7, (8,))
    before = model[0].values.detach().clone()
    loss, extra = step(x, y)
    assert calls[0][0] is x and calls[0][1] is y  # the caller's tensors, not copies
    assert not loss.requires_grad and loss.grad_fn is None and extra == {"n": 8}
    assert not torch.equal(before, model[0].values.detach())  # the step ran
    step(x[:5], y[:5])
    assert (step.eager_steps, step.replays, step.captures, step.capture_s) == (2, 0, 0, 0.0)


def test_outputs_keep_their_container_types():
    """A namedtuple, an OrderedDict, a defaultdict (with its factory), a torch.return_types tuple
    and nested lists come back as such, every tensor detached (a namedtuple used to fail after the
    step had run, a defaultdict came back a dict)."""
    import collections
    Out = collections.namedtuple("Out", "loss parts")
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = _step_fn(model, opt)

    def fn(x, y):
        loss = inner(x, y)
        return Out(loss, [loss * 2, collections.OrderedDict(a=loss), collections.defaultdict(list, b=loss),
                          torch.max(loss.reshape(1), 0)])

    out = CapturedStep(fn, model=model, optimizer=opt)(torch.randn(4, 40), torch.randint(0, 7, (4,)))
    assert type(out) is Out and type(out.parts) is list and type(out.parts[1]) is collections.OrderedDict
    assert type(out.parts[2]) is collections.defaultdict and out.parts[2].default_factory is list
    assert type(out.parts[3]) is type(torch.max(torch.ones(1), 0))
    assert not any(t.requires_grad for t in (out.loss, out.parts[0], out.parts[1]["a"], out.parts[2]["b"],
                                              out.parts[3].values))
    torch.testing.assert_close(out.parts[0], 2 * out.loss)


def test_bad_arguments_raise():
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="fn must be callable"):
        CapturedStep(None, model=model)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        CapturedStep(lambda: None, model=[model])
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        CapturedStep(lambda: None, model=model, optimizer="adam")
    for bad in (object(), snack.dst.RigL):  # (the class itself, not an instance)
        with pytest.raises(TypeError, match="dst must be a snack.dst object"):
            CapturedStep(lambda: None, model=model, dst=bad)
    with pytest.raises(ValueError, match="warmup_steps must be >= 1, got 0"):
        CapturedStep(lambda: None, model=model, warmup_steps=0)
    with pytest.raises(TypeError, match="warmup_steps must be an int"):
        CapturedStep(lambda: None, model=model, warmup_steps=2.0)
    step = CapturedStep(_step_fn(model, opt), model=model, optimizer=opt)
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a tensor, got list"):
        step(torch.randn(2, 40), [0, 1])
    assert step.eager_steps == 0


def test_capture_stream_needs_a_cuda_device():
    with pytest.raises(ValueError, match="device must be a CUDA device, got cpu"):
        snack.graphs.capture_stream("cpu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="but torch sees"):
        snack.graphs.capture_stream(f"cuda:{n}")
    if not n:
        with pytest.raises(ValueError, match="capture_stream needs a CUDA device, and torch sees none"):
            snack.graphs.capture_stream()


def _run(device, dst_kind, graphed, steps=30, batch=16, last=11, tensor_lr=False, schedule=True):
    """Trains `steps` steps (the last one on `last` examples) with Adam, the lr halved after step
    12 (with `tensor_lr`: torch's capturable Adam with its lr a tensor on the GPU, on a cosine
    schedule that changes it at every step, or constant without `schedule`); returns (per-step losses, the model, the
    CapturedStep or None)."""
    model = _model(device)
    if tensor_lr:
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(3e-3, device=device), capturable=True)
        sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if schedule
                 else torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))
    else:
        opt = snack.optim.Adam(model.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 12, gamma=0.5)
    dst = None
    if dst_kind != "none":
        dst = {"set": snack.dst.SET, "rigl": snack.dst.RigL}[dst_kind](
            model, opt, drop_fraction=0.3, update_every=5, end_step=steps, seed=1)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(batch if t < steps - 1 else last, 40, generator=g),
             torch.randint(0, 7, (batch if t < steps - 1 else last,), generator=g)) for t in range(steps)]
    fn = _step_fn(model, opt)
    step = CapturedStep(fn, model=model, optimizer=opt, dst=dst) if graphed else None
    losses = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        loss = step(x, y) if graphed else fn(x, y)
        losses.append(float(loss.detach()))
        sched.step()
        if dst is not None:
            dst.step()
    return losses, model, step


@pytest.mark.gpu
@pytest.mark.parametrize("dst_kind", ["none", "set", "rigl"])
def test_replays_train_as_the_eager_loop(dst_kind):
    want, eager_model, _ = _run("cuda", dst_kind, graphed=False)
    got, model, step = _run("cuda", dst_kind, graphed=True)
    # same data, same updates: the losses agree to the kernels' rounding (atomic sums)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    for a, b in zip(model, eager_model):
        if isinstance(a, snack.SparseLinear):
            assert torch.equal(a.indices, b.indices)  # the same SET / RigL choices
            torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)
    # 3 warm-up steps, a capture at step 4; the lr halves after step 12 and 24: at steps 13 and 25
    # one warm-up step and a capture; step 30 (11 examples) eager; RigL: the steps before its
    # updates (5, 10, 15, 20, 25) eager too, so step 25's warm-up moves to step 26
    rigl = 5 if dst_kind == "rigl" else 0
    assert step.captures == 3 and step.capture_s > 0
    assert step.eager_steps == 3 + 2 + 1 + rigl
    assert step.replays == 30 - step.eager_steps


@pytest.mark.gpu
@pytest.mark.parametrize("dst_kind", ["none", "set"])
def test_a_tensor_learning_rate_changes_in_the_replays_without_a_new_capture(dst_kind):
    """A scheduler that changes a tensor lr in place at every step: one capture serves the whole
    run, and the replays follow the eager run's learning rates."""
    want, eager_model, _ = _run("cuda", dst_kind, graphed=False, tensor_lr=True)
    got, model, step = _run("cuda", dst_kind, graphed=True, tensor_lr=True)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    for a, b in zip(model, eager_model):
        if isinstance(a, snack.SparseLinear):
            assert torch.equal(a.indices, b.indices)
            torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)
    assert step.captures == 1 and step.eager_steps == 3 + 1 and step.replays == 26
    # the schedule matters to the losses: with the lr fixed at 3e-3 they part far beyond the
    # tolerance above, so the agreement shows that the replays read each step's lr
    fixed, _, _ = _run("cuda", dst_kind, graphed=False, tensor_lr=True, schedule=False)
    assert max(abs(a - b) / abs(b) for a, b in zip(fixed, want)) > 1e-3


@pytest.mark.gpu
def test_replayed_outputs_are_the_graphs_and_invalidate_captures_again():
    model = _model("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = CapturedStep(_step_fn(model, opt), model=model, warmup_steps=1)  # no optimizer given
    x, y = torch.randn(16, 40, device="cuda"), torch.randint(0, 7, (16,), device="cuda")
    step(x, y)                     # warm-up
    a = step(x, y)                 # capture + replay
    b = step(x, y)                 # replay
    assert a is b and not b.requires_grad and step.captures == 1 and step.replays == 2
    opt.param_groups[0]["lr"] = 0.01  # not seen without `optimizer=`: the old graph replays
    step(x, y)
    assert step.captures == 1
    step.invalidate()
    step(x, y)                     # one warm-up
    step(x, y)                     # a new capture
    assert step.captures == 2 and step.eager_steps == 2


@pytest.mark.gpu
def test_a_first_step_on_the_cpu_does_not_keep_a_model_moved_to_cuda_eager():
    """The inputs' form is fixed by the first call that could be captured: steps on the CPU
    before the model moves to CUDA leave the later CUDA steps free to be captured."""
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = CapturedStep(_step_fn(model, opt), model=model, optimizer=opt, warmup_steps=1)
    step(torch.randn(16, 40), torch.randint(0, 7, (16,)))  # eager, on the CPU
    model.cuda()
    x, y = torch.randn(16, 40, device="cuda"), torch.randint(0, 7, (16,), device="cuda")
    step(x, y)   # warm-up
    step(x, y)   # capture + replay
    step(x, y)   # replay
    assert (step.eager_steps, step.captures, step.replays) == (2, 1, 2)
