"""The on-disk cache of compiled kernels (snack.gpu.cache): its keys (CPU, every variant, in two
processes), its files (CPU), and on the GPU a second process that loads every kernel the first one
compiled and gets the same bits."""
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from snack.gpu import cache

from conftest import real_cuda_env

ROOT = Path(__file__).resolve().parents[1]

KEYS = """
import json
from snack.gpu import cache, ptx
v = ptx.variants()
keys = [cache.variant_key(d, sig, (9, 0), ("tools", 1)) for _, d, sig in v]
name, d, sig = v[0]
other = [cache.variant_key(d, sig, (8, 0), ("tools", 1)), cache.variant_key(d, sig, (9, 0), ("tools", 2)),
         cache.variant_key(d, sig[:-1] + (sig[0],), (9, 0), ("tools", 1))]
# compiling kernels (and so their device functions) leaves every key as it was
compiled = ptx._compile_slice(((9, 0), 0, -(-len(v) // 3)))  # three variants, far apart in the list
after = [cache.variant_key(d, sig, (9, 0), ("tools", 1)) for _, d, sig in v]
print(json.dumps({"keys": keys, "other": other, "compiled": len(compiled), "after": after}))
"""


def test_keys_are_the_same_in_every_process_and_distinct_for_every_variant():
    env = real_cuda_env()
    runs = []
    for seed in ("1", "2"):  # str hashing differs between the two processes
        r = subprocess.run([sys.executable, "-c", KEYS], cwd=ROOT, env=dict(env, PYTHONHASHSEED=seed),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    keys = runs[0]["keys"]
    assert runs[0]["compiled"] == 3 and runs[0]["after"] == keys
    assert len(keys) > 400 and len(set(keys)) == len(keys)
    assert runs[1] == runs[0]
    # another capability, toolchain or signature gives another key
    assert len(set(runs[0]["other"]) | {keys[0]}) == 4


def test_files_round_trip_and_a_damaged_file_reads_as_missing(tmp_path):
    p = cache.path_for(tmp_path / "sub", "snack_spmm_bt8_float32", "ab" * 32)
    assert p.name == "snack_spmm_bt8_float32-" + "ab" * 20 + ".cubin"
    assert cache.read(p) is None
    blob = bytes(range(256)) * 40 + b"\n\n"  # machine code may hold any byte, newlines too
    assert cache.write(p, "_ZN6cudapy4snackE", blob)
    assert cache.read(p) == ("_ZN6cudapy4snackE", blob)
    assert [f.name for f in p.parent.iterdir()] == [p.name]  # no temporary file left
    assert cache.write(p, "other", b"x")  # rewritten in place
    assert cache.read(p) == ("other", b"x")
    data = p.read_bytes()
    assert data.count(b"\n", 0, len(data) - 1) >= 2 and b"other " in data  # magic, "entry sha256", cubin
    # what Numba's linker returns: a cuda.core ObjectCode holding bytes (or a path), or bytes
    import types
    assert cache._cubin_bytes(types.SimpleNamespace(code=blob)) == blob == cache._cubin_bytes(bytearray(blob))
    assert cache._cubin_bytes(types.SimpleNamespace(code=str(p))) == data
    flipped = data[:-1] + bytes([data[-1] ^ 1])  # one bit of the machine code
    head = data[:data.index(b"\n") + 1]
    for bad in (b"", data[:5], b"ELF" + data, head + b"entry-without-code", data[:-1], flipped,
                head + b"other\nx", head + b"other 00\nx"):
        p.write_bytes(bad)
        assert cache.read(p) is None, bad[:40]
    p.write_bytes(data)
    assert cache.read(p) == ("other", b"x")


def test_a_directory_that_cannot_be_written_warns_once_and_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_warned", False)
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not cache.write(blocker / "k.cubin", "e", b"code")
        assert not cache.write(blocker / "k2.cubin", "e", b"code")
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and cache.ENV in msgs[0], msgs
    assert list(tmp_path.iterdir()) == [blocker]


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "snack" / "kernels"
    monkeypatch.setenv(cache.ENV, str(tmp_path / "k"))
    assert cache.cache_dir() == tmp_path / "k"
    for off in ("0", "", "off", "OFF ", "false", "no"):
        monkeypatch.setenv(cache.ENV, off)
        assert cache.cache_dir() is None, off


RUN = """
import hashlib, json, time
t0 = time.perf_counter()
import torch
torch.use_deterministic_algorithms(True)  # bit-identical outputs from run to run
import snack.gpu as G
from snack.core import COO
from snack.core.reference import sddmm_reference, spmm_reference, spmm_t_reference
from snack.gpu import cache
g = torch.Generator().manual_seed(5)
digests, errors = [], []
for shape, B, density, dtype in [((4096, 4096), 32, 0.1, torch.float32), ((4096, 4096), 128, 0.01, torch.float32),
                                 ((513, 1025), 8, 0.05, torch.bfloat16), ((300, 7000), 33, 0.02, torch.float16),
                                 ((96, 7), 1, 0.3, torch.float32)]:
    coo = COO.random(shape, density=density, generator=g, device="cuda")
    o, i = shape
    t, v = coo.topology, coo.values.to(dtype)
    x = torch.randn(B, i, generator=g).to(dtype).cuda()
    dy = torch.randn(B, o, generator=g).to(dtype).cuda()
    outs = [G.spmm(x, t, v), G.spmm_t(dy, t, v), G.sddmm(dy, x, t)]
    if B <= 32:
        outs += list(G.spmm_t_sddmm(dy, x, t, v, bias_grad=True))
    torch.cuda.synchronize()
    xd, dyd, vd = x.double(), dy.double(), v.double()
    refs = [spmm_reference(xd, t.indices, vd, o), spmm_t_reference(dyd, t.indices, vd, i),
            sddmm_reference(dyd, xd, t.indices)]
    refs += [refs[1], refs[2], dyd.sum(0)][:len(outs) - 3]
    for got, ref in zip(outs, refs):
        digests.append(hashlib.sha256(got.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
        errors.append(((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item())
print(json.dumps({"stats": cache.stats(), "seconds": time.perf_counter() - t0, "digests": digests,
                  "errors": errors}))
"""


def _run(env):
    r = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_a_second_process_loads_every_kernel_the_first_compiled(tmp_path):
    env = real_cuda_env()
    env[cache.ENV] = str(tmp_path / "kernels")
    first = _run(env)
    files = sorted((tmp_path / "kernels").glob("*.cubin"))
    assert first["stats"]["hits"] == 0 and first["stats"]["misses"] == first["stats"]["stored"] == len(files) > 5
    second = _run(env)
    assert second["stats"] == {"hits": len(files), "misses": 0, "stored": 0}
    assert second["digests"] == first["digests"]
    assert max(second["errors"]) < 2e-2 and max(first["errors"]) < 2e-2
    assert second["seconds"] < first["seconds"]
    print(f"compiled {len(files)} kernels: {first['seconds']:.1f} s; loaded: {second['seconds']:.1f} s")
    # a damaged file is compiled again and rewritten; the others still load
    files[0].write_bytes(files[0].read_bytes()[:200])
    third = _run(env)
    assert third["stats"] == {"hits": len(files) - 1, "misses": 1, "stored": 1}
    assert third["digests"] == first["digests"]
    # with the cache off nothing is read or written
    env[cache.ENV] = "0"
    off = _run(env)
    assert off["stats"] == {"hits": 0, "misses": 0, "stored": 0} and off["digests"] == first["digests"]


def test_command_line_lists_and_clears_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    assert cache.main([]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path}: 0 kernels, 0.0 MiB"
    for i in range(3):
        assert cache.write(cache.path_for(tmp_path, f"k{i}", f"{i:064x}"), "e", b"x" * 2**19)
    (tmp_path / "k9.cubin.abc.tmp").write_bytes(b"half")  # a writer that died
    (tmp_path / "notes.txt").write_text("not ours")
    assert [p.name[:2] for p in cache.files()] == ["k0", "k1", "k2"]
    assert cache.main([]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path}: 3 kernels, 1.5 MiB"
    assert cache.main(["--clear"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "deleted 3 kernels and 1 temporary files"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    monkeypatch.setenv(cache.ENV, "0")
    assert cache.main(["--clear"]) == 0 and "off" in capsys.readouterr().out
    assert cache.files() == []
