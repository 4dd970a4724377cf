"""SNACK on a second GPU (marked `gpu`; needs two CUDA devices): tensors on cuda:1 while the
current device is cuda:0, both devices in turn, a layer's training step and CUDA-graph capture
there. Every result is compared with a float64 reference (the ops through test_gpu_kernels._run_all)."""
import pytest
import torch
import torch.nn.functional as F

from test_gpu_kernels import _run_all

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _check_ops(dev, shape, B, density, seed, **kw):
    from snack.core import COO
    coo = COO.random(shape, density=density, seed=seed, device=dev)
    _run_all(coo, B, torch.float32, torch.Generator().manual_seed(seed), **kw)


# tiled kernels with > 48 KB of shared memory (a per-device kernel attribute), the 32-wide
# kernels with atomics (a zeroed output) and without
CASES = [((300, 4096), 8, 0.05, {}), ((257, 1000), 3, 0.1, {}),
         ((200, 3000), 40, 0.05, {"wide": True}), ((200, 3000), 40, 0.05, {"wide": True, "chunks": 3, "split": 1})]


@pytest.mark.parametrize("shape,B,density,kw", CASES)
def test_ops_on_a_device_that_is_not_current(shape, B, density, kw):
    assert torch.cuda.current_device() == 0
    _check_ops("cuda:1", shape, B, density, seed=1, **kw)
    assert torch.cuda.current_device() == 0  # the caller's device is left as it was


def test_ops_on_both_devices_in_turn():
    for dev in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):
        for shape, B, density, kw in CASES[:3]:
            _check_ops(dev, shape, B, density, seed=2, **kw)


def test_layer_training_step_on_the_second_device():
    import snack
    torch.manual_seed(3)
    layer = snack.SparseLinear(1024, 300, sparsity=0.9, device="cuda:1")
    opt = snack.optim.Adam(layer.parameters(), lr=1e-2)
    w0 = layer.to_dense().detach().cpu().double()
    b0 = layer.bias.detach().cpu().double()
    x = torch.randn(48, 1024, device="cuda:1")
    y = layer(x)
    (y.square().sum()).backward()
    wd = w0.clone().requires_grad_()
    bd = b0.clone().requires_grad_()
    yd = F.linear(x.cpu().double(), wd, bd)
    yd.square().sum().backward()
    torch.testing.assert_close(y.cpu().double(), yd, rtol=1e-5, atol=1e-4)
    r, c = layer.indices.long().cpu()
    torch.testing.assert_close(layer.values.grad.cpu().double(), wd.grad[r, c], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(layer.bias.grad.cpu().double(), bd.grad, rtol=1e-4, atol=1e-3)
    # the optimizer's kernel on cuda:1 against torch's Adam on a CPU copy
    ref = torch.nn.Parameter(layer.values.detach().cpu().clone())
    ref.grad = layer.values.grad.detach().cpu().clone()
    ref_opt = torch.optim.Adam([ref], lr=1e-2)
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(layer.values.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_graph_capture_on_the_second_device():
    import snack
    torch.manual_seed(4)
    with torch.cuda.device(1):
        layer = snack.SparseLinear(512, 256, sparsity=0.95, device="cuda")
        x = torch.randn(16, 512, device="cuda")
        with torch.no_grad():
            layer(x)
            g = torch.cuda.CUDAGraph()
            # a capture stream of this device: torch.cuda.graph's default one is created once,
            # on whichever device was current at its first use
            with torch.cuda.graph(g, stream=torch.cuda.Stream()):
                y = layer(x)
        y.fill_(float("nan"))
        x.copy_(torch.randn(16, 512))
        g.replay()
        torch.cuda.synchronize()
        ref = F.linear(x.cpu().double(), layer.to_dense().detach().cpu().double(), layer.bias.detach().cpu().double())
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-4)
