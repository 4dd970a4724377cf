"""The CPU kernels' on-disk Numba cache under processes that save at the same time (core/jit.py).

Two processes compile different signatures of one function on a cold cache and save them at
once; the steps of Numba's save are slowed so that they interleave (process A picks a data file
number and writes the index; B reads the index before A wrote it, picks the same number, writes
its index later; A's data lands last). A third process then loads both signatures. With Numba's
plain cache it gets float64 code for the int64 signature (the control); with `njit_cached` the
saves are serialised and both signatures load their own code.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

JIT_PY = Path(__file__).resolve().parents[1] / "core" / "jit.py"

TOY = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("snack_jit", {jit!r})
jit = importlib.util.module_from_spec(spec); spec.loader.exec_module(jit)
from numba import njit
decorate = jit.njit_cached() if {locked!r} else njit(cache=True)

@decorate
def f(x):
    return x * 2 + 1
"""

RUNNER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
role, barrier = sys.argv[1], Path(sys.argv[2])
import numpy as np
from numba.core import caching

F = caching.IndexDataCacheFile
save_index, save_data = F._save_index, F._save_data
# A: index written 1 s after its read, data 2 s after that; B: both 2 s after its read.
def slow_index(self, overloads):
    time.sleep(1.0 if role == "A" else 2.0)
    return save_index(self, overloads)
def slow_data(self, name, data):
    time.sleep(2.0 if role == "A" else 0.0)
    return save_data(self, name, data)
if role in ("A", "B"):
    F._save_index, F._save_data = slow_index, slow_data
    (barrier / role).touch()
    deadline = time.time() + 60
    while not ((barrier / "A").exists() and (barrier / "B").exists()):
        assert time.time() < deadline, "the other process never started"
        time.sleep(0.005)
import toy
if role == "A":
    print(repr(toy.f(np.float64(1.5))))
elif role == "B":
    print(repr(toy.f(np.int64(3))))
else:
    a, b = toy.f(np.float64(1.5)), toy.f(np.int64(3))
    print(repr(a), repr(b), type(b).__name__, sum(toy.f.stats.cache_hits.values()))
"""


def _race(tmp_path: Path, locked: bool):
    (tmp_path / "toy.py").write_text(TOY.format(jit=str(JIT_PY), locked=locked))
    (tmp_path / "runner.py").write_text(RUNNER)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")
    cmd = [sys.executable, str(tmp_path / "runner.py")]
    args = [str(barrier), str(tmp_path)]
    t0 = time.time()
    procs = {role: subprocess.Popen(cmd + [role] + args, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for role in ("A", "B")}
    outs = {role: p.communicate(timeout=300) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == 0, outs[role][1]
    assert outs["A"][0].split() == ["4.0"] and outs["B"][0].split() == ["7"]
    elapsed = time.time() - t0
    c = subprocess.run(cmd + ["C"] + args, env=env, capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, c.stderr
    return c.stdout.split(), elapsed, sorted(os.listdir(tmp_path / "cache" / os.listdir(
        tmp_path / "cache")[0]))


@pytest.mark.slow
def test_numba_plain_cache_mixes_up_signatures_saved_at_once(tmp_path):
    """Control: the harness does make the saves interleave (with Numba 0.68's own cache, the
    int64 signature then loads the float64 machine code). Should a Numba release serialise its
    saves, this fails, and core/jit.py's lock can go."""
    out, _, files = _race(tmp_path, locked=False)
    a, b, b_type, hits = out
    assert a == "4.0"
    assert b_type == "float", (
        f"Numba's own cache kept the signatures apart ({out}, files {files}): the race the "
        "lock in core/jit.py guards against did not happen")


@pytest.mark.slow
def test_locked_cache_keeps_signatures_saved_at_once_apart(tmp_path):
    out, elapsed, files = _race(tmp_path, locked=True)
    a, b, b_type, hits = out
    assert (a, b, b_type) == ("4.0", "7", "int"), (out, files)
    assert hits == "2", f"both signatures should load from the cache: {out}"
    data = [f for f in files if f.endswith(".nbc")]
    assert len(data) == 2, files
    # serialised: A's save (3 s) and B's (2 s) ran one after the other, not side by side
    assert elapsed >= 5.0, elapsed


def test_njit_cached_rejects_cache_option():
    import importlib.util
    spec = importlib.util.spec_from_file_location("snack_jit_t", JIT_PY)
    jit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jit)
    with pytest.raises(TypeError, match="cache"):
        jit.njit_cached(cache=False)


def test_cpu_kernels_use_the_locked_cache():
    from numba.core.registry import CPUDispatcher

    from snack.core import cpu
    from snack.core.jit import LockedFunctionCache

    kernels = [v for v in vars(cpu).values() if isinstance(v, CPUDispatcher)
               and v._cache.__class__.__name__ != "NullCache"]
    assert len(kernels) >= 7
    assert all(isinstance(k._cache, LockedFunctionCache) for k in kernels), kernels
