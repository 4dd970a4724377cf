"""Every SNACK kernel variant compiles to real sm_90 PTX (numba.cuda.compile_ptx, no GPU needed):
catches typing errors that the simulator, which runs the kernels as Python, lets through. The
variants are compiled in one process per core (up to 4)."""
import subprocess
import sys
from pathlib import Path

from conftest import real_cuda_env

ROOT = Path(__file__).resolve().parents[1]

CODE = """
import os
from snack.gpu.ptx import compile_all, variants, uses_local_memory
res = compile_all((9, 0), workers=min(4, os.cpu_count() or 1))
assert len(res) == len(variants()) > 40, len(res)
for name, ptx in res.items():
    assert '.target sm_90' in ptx, name
    assert '.entry' in ptx, name
    assert not uses_local_memory(ptx), name + ' spills an array to local memory'
    # the thread-block cluster variants sum through distributed shared memory between two barriers
    if '_cluster' in name:
        assert ptx.count('barrier.cluster.wait') == 2 and 'ld.shared::cluster.f32' in ptx, name
        assert 'atom.global' not in ptx, name + ' adds with atomics'
assert sum('_cluster' in n for n in res) >= 40
# each variant carries the launch bounds its dispatcher is compiled with (the gathering SpMMs:
# 256 threads, 4 blocks per SM, i.e. 64 registers)
bounds = {name: d.targetoptions.get('launch_bounds') for name, d, sig in variants()}
for name, ptx in res.items():
    b = bounds[name]
    if b:
        b = (b,) if isinstance(b, int) else tuple(b)
        assert '.maxntid %d' % b[0] in ptx, name
        assert len(b) < 2 or b[1] == 0 or '.minnctapersm %d' % b[1] in ptx, name
gathers = [n for n in res if n.startswith('snack_spmm_gather_')]
assert len(gathers) == 20 and all('.maxntid 256' in res[n] and '.minnctapersm 4' in res[n] for n in gathers)
print('compiled', len(res))
"""


def test_every_kernel_compiles_to_sm90_ptx():
    env = real_cuda_env()
    r = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "compiled" in r.stdout


ONE_VARIANT = """
from numba.cuda import dispatcher
from snack.gpu import ptx
before = dispatcher.get_current_device
name, d, sig = next(v for v in ptx.variants() if v[0] == 'snack_spmm_own_bt4_bfloat16')
res = ptx._compile_slice(((8, 0), 0, 1 << 30))  # the first variant only
assert list(res) == [ptx.variants()[0][0]], list(res)
for cc in ((9, 0), (8, 0)):
    with ptx._device_functions_for(cc):
        assert dispatcher.get_current_device().compute_capability == cc
        text, _ = __import__('numba').cuda.compile_ptx(d.py_func, sig, cc=cc)
    assert dispatcher.get_current_device is before
    assert '.target sm_%d%d' % cc in text, text[:400]
try:
    with ptx._device_functions_for((9, 0)):
        raise KeyError('inside')
except KeyError:
    pass
assert dispatcher.get_current_device is before
print('ok')
"""


def test_device_functions_compile_for_the_requested_capability_and_the_patch_is_undone():
    """A kernel whose device functions NVVM inlines compiles without a GPU for the capability
    asked for, and numba-cuda's current-device lookup is restored after the block, also when the
    block raises."""
    env = real_cuda_env()
    r = subprocess.run([sys.executable, "-c", ONE_VARIANT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ok" in r.stdout
