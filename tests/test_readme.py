"""The README's Python examples run as written, on the CPU, one after the other in one namespace
(as a reader would paste them), and do what their comments say."""
import re
from pathlib import Path

import torch
import torch.nn as nn

import snack

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks() -> list:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_the_api_examples():
    blocks = _python_blocks()
    assert len(blocks) >= 4
    assert "snack.SparseLinear(" in blocks[0] and "snack.dst." in "".join(blocks)


def test_readme_connection_count_is_the_layers():
    said = re.search(r"SparseLinear\(1024, 512, sparsity=0\.9\)\s*# ([\d,]+) random connections", _python_blocks()[0])
    assert said, "the README's first example no longer states its number of connections"
    assert snack.SparseLinear(1024, 512, sparsity=0.9).values.numel() == int(said.group(1).replace(",", ""))


def test_readme_python_examples_run_and_do_what_they_say():
    torch.manual_seed(0)
    # what the DST loop takes from its context: a loader of MNIST-shaped batches, 101 of them so
    # that the 100th step is an update step
    loader = [(torch.randn(8, 784), torch.randint(0, 10, (8,))) for _ in range(101)]
    ns = {"loader": loader}  # (F: the first block imports it)
    blocks = _python_blocks()

    def run(i):
        exec(compile(blocks[i], f"README.md python block {i + 1}", "exec"), ns)

    # block 1: the layer, its parameters and what sparsify did
    run(0)
    layer = ns["layer"]
    assert isinstance(layer, snack.SparseLinear) and layer.values.numel() == round(0.05 * 1024 * 512)
    assert ns["y"].shape == (32, 512)
    dense = ns["x"] @ layer.to_dense().T + layer.bias
    torch.testing.assert_close(ns["y"], dense, rtol=1e-4, atol=1e-4)
    model = ns["model"]
    sparse = [m for m in model if isinstance(m, snack.SparseLinear)]
    assert len(sparse) == 3 and not any(type(m) is nn.Linear for m in model)
    exported = ns["exported"]   # densify on a copy: nn.Linear with the sparse layers' weights
    dense_layers = [m for m in exported if isinstance(m, nn.Linear)]
    assert len(dense_layers) == 3 and not any(isinstance(m, snack.SparseLinear) for m in exported)
    for d, s in zip(dense_layers, sparse):
        assert torch.equal(d.weight, s.to_dense().detach()) and torch.equal(d.bias, s.bias)
    W = ns["W"]
    assert tuple(W.shape) == (512, 1024) and W.indices.shape[1] == layer.values.numel()
    torch.testing.assert_close(torch.as_tensor(W.to_scipy("csr").toarray()), layer.to_dense().detach())

    # block 2: RigL updated once, at step 100, keeping every layer's nnz
    nnz = [m.values.numel() for m in sparse]
    run(1)
    dst = ns["dst"]
    assert dst.last_update is not None and dst.last_update.step == 100
    assert dst.last_update.grown == dst.last_update.dropped > 0
    assert [m.values.numel() for m in sparse] == [m.indices.shape[1] for m in sparse] == nnz

    # the rest: torch.compile (lazy: nothing compiles until it is called) and the optimizer
    for i in range(2, len(blocks)):
        run(i)
    assert isinstance(ns["opt"], torch.optim.Adam)
    # the CapturedStep loop: every step eager on the CPU, RigL's update at step 100 done
    step = ns["step"]
    assert (step.eager_steps, step.replays, step.captures) == (len(loader), 0, 0)
    assert ns["rigl"].last_update is not None and ns["rigl"].last_update.step == 100
