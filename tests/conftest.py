"""Shared test settings: tolerances per dtype, seeded generators, GPU skipping, hypothesis profile.

Tolerances are set here once per dtype and used by every numerical test (`assert_close_dtype`).
They follow the rule "at most a couple of times torch's own error at that dtype": float64 and
float32 compare sums of a few hundred products, float16/bfloat16 results are rounded once from
float32 accumulators, so their error is about one rounding of the output (2**-11 / 2**-8
relative). Index results are always compared exactly.
Trade-off: hypothesis runs few examples (profile "snack", selected by default; "snack-long"
via --hypothesis-profile) so that the suite stays fast on a 2-core CI machine.
"""
from __future__ import annotations

import contextlib
import gc
import os
import zlib

import numpy as np
import pytest
import torch

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("snack", deadline=None, max_examples=25, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("snack-long", deadline=None, max_examples=500,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("snack")
except ImportError:  # hypothesis is a test extra; property tests skip themselves without it
    pass


# (rtol, atol) for a result of this dtype against a float64 reference computed from the same
# (already rounded) inputs.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerance(dtype: torch.dtype):
    """(rtol, atol) for comparing a `dtype` result against a float64 reference."""
    return TOLERANCES[dtype]


def ladder(n: int, dtype: torch.dtype):
    """(indices (2, 2n) int32 canonical, float32 values, e) of the (n, n) matrix with
    W[r, r] = 1 + e_r and W[r, r + 1 mod n] = -1, where e_r is exact in `dtype` (float16 or
    bfloat16) but 1 + e_r is not: with all-equal inputs every output of Y = X W^T and of
    dX = dY W is a multiple of some e, exact in fp32, and 0 or a multiple of 2^-7 (bfloat16) /
    2^-10 (float16) if the values were rounded to `dtype` first (mixed-precision tests)."""
    from snack.core import canonicalize
    r = torch.arange(n, dtype=torch.int32)
    e = 2.0 ** (-10 if dtype == torch.bfloat16 else -13) * (1 + r % 7).float()
    idx, vals, _ = canonicalize(torch.cat([torch.stack([r, r]), torch.stack([r, (r + 1) % n])], 1), (n, n),
                                torch.cat([1 + e, -torch.ones(n)]))
    return idx, vals, e


def assert_close_dtype(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = None, **kw):
    """assert_close with the tolerance of `dtype` (default: actual's dtype), compared in float64."""
    rtol, atol = tolerance(dtype or actual.dtype)
    torch.testing.assert_close(actual.detach().to(torch.float64), expected.detach().to(torch.float64),
                               rtol=rtol, atol=atol, **kw)


def real_cuda_env(**extra) -> dict:
    """os.environ for a child process that must see the real CUDA target (the simulator switch
    NUMBA_ENABLE_CUDASIM, which another test may have set in this process, left out)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(extra)
    return env


def pytest_collection_modifyitems(config, items):
    """Skips tests marked `gpu` where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def backward_threading(monkeypatch) -> list:
    """A list that gets, at every backward of a loss made by `F.cross_entropy`, whether autograd's
    multithreading (the worker thread for the GPU) was on where that backward ran."""
    import torch.nn.functional as F
    seen, loss_fn = [], F.cross_entropy

    def cross_entropy(*args, **kwargs):
        loss = loss_fn(*args, **kwargs)
        loss.register_hook(lambda g: seen.append(torch._C._is_multithreading_enabled()))
        return loss

    monkeypatch.setattr(F, "cross_entropy", cross_entropy)
    return seen


@pytest.fixture
def seed(request) -> int:
    """A seed fixed per test (a hash of its id): reruns are reproducible, tests differ."""
    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A torch.Generator seeded per test."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """A numpy Generator seeded per test."""
    return np.random.default_rng(seed)


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - very old torch
    TorchDispatchMode = object


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces while active (`max_numel`, and the op in
    `worst`): the tests use it to show that nothing of the dense weight's size is allocated."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.worst = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.worst = t.numel(), func
        return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item (`item.rep_call`), for the fixture below."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


_WORKER_CONTEXTS = set()


@pytest.fixture(autouse=True)
def _autograd_worker_context(request):
    """Gives autograd's worker thread for each GPU a current CUDA context before a GPU test runs.

    The thread starts without one, and when the first backward that runs on it in a process begins
    with a cuBLAS call (a dense `addmm`'s backward, as a layer at sparsity 0 runs), torch warns
    "Attempting to run cuBLAS, but there was no current CUDA context!" and sets it. Which test
    meets that first depends on the order tests reach a process, so the GPU runs that make autograd
    warnings errors (`-W error::UserWarning:torch.autograd.graph`) failed now and then. One
    elementwise backward per device, once per process, makes the context current on that thread."""
    if "gpu" in request.node.keywords and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if i not in _WORKER_CONTEXTS:
                t = torch.ones(1, device=torch.device("cuda", i), requires_grad=True)
                (t * 2).sum().backward()
                _WORKER_CONTEXTS.add(i)
    yield


@pytest.fixture(autouse=True)
def _cuda_rng_after_a_failed_capture(request):
    """One failed CUDA-graph capture fails one test, not every GPU test after it.

    A capture that fails (`capture_end` raising) leaves torch's CUDA generator marked as being
    captured, and every later random draw on that device then raises "Offset increment outside
    graph capture encountered unexpectedly". After a GPU test that failed, a generator in that
    state gets a fresh state, seeded as before."""
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.failed or "gpu" not in request.node.keywords or not torch.cuda.is_initialized():
        return
    for i in range(torch.cuda.device_count()):
        try:
            torch.empty(1, device=torch.device("cuda", i)).uniform_()
        except RuntimeError as e:
            if "Offset increment outside graph capture" not in str(e):
                raise
            stuck = torch.cuda.default_generators[i]
            fresh = torch.Generator(device=torch.device("cuda", i))
            fresh.manual_seed(stuck.initial_seed())
            stuck.graphsafe_set_state(fresh.graphsafe_get_state())


@contextlib.contextmanager
def collector_off():
    """Python's cyclic garbage collector off inside (on again after, if it was): only explicit
    gc.collect() calls free reference cycles there."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def one_line_exit(fn, *args) -> str:
    """fn(*args) must stop with a one-line message (SystemExit with text); returns it."""
    with pytest.raises(SystemExit) as e:
        fn(*args)
    msg = e.value.code
    assert isinstance(msg, str) and msg and "\n" not in msg, msg
    return msg
