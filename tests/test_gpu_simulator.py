"""Runs tests/gpu_sim/shim_sim.py (the warp shuffles and block scheduler that snack.gpu.simulator adds
to Numba's simulator) and tests/gpu_sim/kernels_sim.py (the CUDA kernels under the simulator) in a
subprocess with NUMBA_ENABLE_CUDASIM=1, which must be set before numba.cuda is imported. On a
machine with a GPU the kernels are tested for real by tests/test_gpu_kernels.py instead.
The simulator runs one OS thread per CUDA thread under one GIL, so the subprocess spreads its
tests over up to 4 worker processes with pytest-xdist (a test extra) where there are cores for
them (on a 2-core machine with 2 workers: 12.5 minutes with the simulator's own polling block
scheduler, 3.8 with snack.gpu.simulator's)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _workers() -> list:
    """pytest's arguments to spread the tests over the machine's cores (none without xdist)."""
    n = min(4, os.cpu_count() or 1)
    if n < 2 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(n)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: tests/test_gpu_kernels.py runs the kernels for real")
def test_kernels_under_cuda_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    files = [str(ROOT / "tests" / "gpu_sim" / name) for name in ("shim_sim.py", "kernels_sim.py")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *_workers(),
                        *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
