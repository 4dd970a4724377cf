"""An on-disk cache of the compiled SNACK kernels, so that a process loads a kernel another
process compiled instead of compiling it again (1-4 s per kernel variant with Numba and NVVM).

What is stored: one file per kernel variant, signature and GPU architecture, holding the kernel's
entry name, its cubin (the machine code the driver loads) and the cubin's SHA-256 (a file whose
cubin does not match is ignored, compiled again and rewritten). A file is written once, to a
temporary name beside it, then renamed, so that processes sharing the directory (pytest-xdist
workers, data-parallel ranks) never read a half-written file; each variant has a file of its
own, so two processes never race for one index.

The file name is a digest of everything the code depends on: the source of `gpu/kernels.py`
(the kernels, their device functions and intrinsics all live there; any other file a kernel's
functions come from is added), the kernel's name, the values its factory closed over (batch
tile, dtype kinds, flags, and the device functions built for them with their own values and
compile options), its compile options (launch bound), the argument types, the compute
capability, the numba-cuda, cuda-bindings, NVVM and driver versions and Numba's optimisation
level. A change to any of them gives a new name, so a stale file is never loaded; old files
are left for the user to delete (`python -m snack.gpu.cache --clear`).

Where: `$SNACK_KERNEL_CACHE` if set ("0" or "" turns the cache off), else
`$XDG_CACHE_HOME/snack/kernels` (default `~/.cache/snack/kernels`). A directory that cannot be
written gives one warning and compiled-but-unsaved kernels, never an error. Only the launch path
that launches kernels through the driver ("driver", the default) uses the cache; Numba's own
dispatcher ("numba" mode) and the simulator compile as before.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import types
import warnings
from pathlib import Path
from typing import Optional, Tuple

ENV = "SNACK_KERNEL_CACHE"
_MAGIC = b"SNACK-CUBIN 2\n"
_stats = {"hits": 0, "misses": 0, "stored": 0}
_digests = {}
_toolchain = None
_warned = False


def cache_dir() -> Optional[Path]:
    """The directory kernels are cached in, or None when the cache is off."""
    v = os.environ.get(ENV)
    if v is not None:
        return None if v.strip().lower() in ("", "0", "off", "false", "no") else Path(v).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "snack" / "kernels"


def stats() -> dict:
    """Counts since the process started: kernels loaded from the cache ("hits"), compiled because
    they were not there ("misses", with the cache on) and written to it ("stored")."""
    return dict(_stats)


def _file_digest(path: str) -> str:
    d = _digests.get(path)
    if d is None:
        try:
            d = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:  # source not on disk: a key that changes from process to process, never a stale hit
            d = os.urandom(16).hex()
        d = _digests[path] = f"{Path(path).name}:{d}"
    return d


def toolchain() -> Tuple:
    """What the machine code depends on beyond the kernel itself (needs a GPU: the driver and
    NVVM are asked for their versions)."""
    global _toolchain
    if _toolchain is None:
        import numba
        import numba_cuda
        from cuda import bindings
        from numba.cuda.cudadrv import driver, nvvm
        _toolchain = (numba_cuda.__version__, bindings.__version__, numba.config.OPT,
                      tuple(driver.driver.get_version()), tuple(nvvm.NVVM().get_version()))
    return _toolchain


def _describe(o, files: set) -> str:
    """A text that names `o` by value: a closure cell of a kernel (factory arguments, the device
    functions made for them). Functions are named by module, name and first line, with their own
    cells; their code is covered by the digest of their source files, collected in `files`.
    Not Numba's pickle of the cells: that includes state Numba fills in while compiling (a type's
    alignment), so the same kernel would get another key once something else was compiled."""
    if o is None or isinstance(o, (bool, int, float, str, bytes)):
        return repr(o)
    if isinstance(o, (tuple, list)):
        return "(" + ",".join(_describe(x, files) for x in o) + ")"
    if isinstance(o, dict):
        return "{" + ",".join(f"{k!r}:{_describe(v, files)}" for k, v in sorted(o.items(), key=lambda kv: repr(kv[0]))) + "}"
    py_func = getattr(o, "py_func", None)
    if py_func is not None and hasattr(o, "targetoptions"):  # a Numba dispatcher (a device function)
        return f"dispatcher[{_describe(py_func, files)},{_describe(dict(o.targetoptions), files)}]"
    defn = getattr(o, "_defn", None)
    if isinstance(defn, types.FunctionType) and type(o).__name__ == "_Intrinsic":  # a Numba intrinsic
        return f"intrinsic[{_describe(defn, files)}]"
    if isinstance(o, types.FunctionType):
        files.add(o.__code__.co_filename)
        cells = tuple(c.cell_contents for c in (o.__closure__ or ()))
        return f"function[{o.__module__}.{o.__qualname__}:{o.__code__.co_firstlineno},{_describe(cells, files)}]"
    raise TypeError(f"cannot name a kernel's closure value of type {type(o).__qualname__} for the kernel cache")


def variant_key(dispatcher, sig, cc, tools) -> str:
    """The digest a compiled kernel is stored under (see the module docstring); pure: the same
    inputs give the same digest in any process, before or after other kernels were compiled."""
    files = {str(Path(__file__).with_name("kernels.py"))}
    desc = _describe(dispatcher, files)
    h = hashlib.sha256()
    for part in [repr(tuple(tools)), repr(tuple(cc)), dispatcher.py_func.__name__, desc,
                 repr(tuple(str(t) for t in sig))] + [_file_digest(f) for f in sorted(files)]:
        b = part.encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def path_for(directory: Path, name: str, key: str) -> Path:
    return Path(directory) / f"{name}-{key[:40]}.cubin"


def read(path: Path) -> Optional[Tuple[str, bytes]]:
    """(entry name, cubin) from a cache file, or None when it is missing, not one, or its cubin
    does not match the digest stored with it."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data.startswith(_MAGIC):
        return None
    head, sep, cubin = data[len(_MAGIC):].partition(b"\n")
    entry, _, digest = head.decode("ascii", "replace").partition(" ")
    if not sep or not entry or not cubin or digest != hashlib.sha256(cubin).hexdigest():
        return None
    return entry, cubin


def _warn(what: str, writable: bool = True):
    """One warning per process: the cache does not work here (`what`), and what to do about it."""
    global _warned
    if not _warned:
        _warned = True
        fix = f"set {ENV} to a writable directory, or to 0 to turn the cache off" if writable else \
            f"set {ENV}=0 to turn the cache off"
        warnings.warn(f"SNACK {what}; such kernels are compiled in every process: {fix}.", RuntimeWarning,
                      stacklevel=4)


def _cubin_bytes(obj) -> bytes:
    """The bytes of what Numba's linker returns (a cuda.core ObjectCode, or bytes)."""
    code = getattr(obj, "code", obj)
    if isinstance(code, (str, os.PathLike)):
        return Path(code).read_bytes()
    return bytes(code)


def _load(ctx, entry: str, cubin: bytes):
    """The driver handle of kernel `entry` of `cubin`, loaded into Numba's context `ctx`."""
    try:
        from cuda.core import ObjectCode
        image = ObjectCode.from_cubin(cubin, name=entry)
    except ImportError:
        image = cubin
    return ctx.create_module_image(image).get_function(entry).handle


def write(path: Path, entry: str, cubin: bytes) -> bool:
    """Stores (entry name, cubin) at `path` atomically; False (and one warning per process) when
    the directory cannot be written."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            cubin = bytes(cubin)
            f.write(_MAGIC + f"{entry} {hashlib.sha256(cubin).hexdigest()}\n".encode("ascii") + cubin)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as e:
        _warn(f"cannot write its kernel cache ({e})")
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def compiled_library(dispatcher, sig):
    """Numba's code library of `dispatcher` compiled for `sig` (compiled now unless it was
    before): its `get_cufunc().handle` is the kernel in the current CUDA context."""
    return dispatcher.compile(sig)._codelibrary


def _cache_path(dispatcher, sig, cc) -> Optional[Path]:
    """The file `dispatcher`'s kernel for `sig` and capability `cc` is kept in; None when the
    cache is off or the kernel cannot be named (one warning)."""
    d = cache_dir()
    if d is None:
        return None
    try:
        key = variant_key(dispatcher, sig, cc, toolchain())
    except TypeError as e:  # a closure value the cache cannot name: compiled, not cached
        _warn(f"cannot cache a kernel ({e})", writable=False)
        return None
    return path_for(d, dispatcher.py_func.__name__, key)


def kernel_handle(dispatcher, sig) -> Tuple[object, bool]:
    """(driver handle, compiled) of `dispatcher` for the numba signature `sig` in the current CUDA
    context: loaded from the cache when it holds the kernel (compiled False), else compiled by
    Numba (compiled True) and stored."""
    from numba import cuda
    ctx = cuda.current_context()
    cc = ctx.device.compute_capability
    path = _cache_path(dispatcher, sig, cc)
    got = read(path) if path is not None else None
    if got is not None:
        entry, cubin = got
        try:
            handle = _load(ctx, entry, cubin)
        except Exception:  # a damaged file: compiled and written again below
            handle = None
        if handle is not None:
            _stats["hits"] += 1
            return handle, False
    lib = compiled_library(dispatcher, sig)
    handle = lib.get_cufunc().handle
    if path is None:
        return handle, True
    _stats["misses"] += 1
    try:
        cubin = _cubin_bytes(lib.get_cubin(cc=cc))
    except Exception as e:  # a numba-cuda whose linker returns something else: no cache, no error
        _warn(f"cannot read a compiled kernel's machine code ({e!r})", writable=False)
        return handle, True
    if write(path, lib._entry_name, cubin):
        _stats["stored"] += 1
    return handle, True


def files(directory: Optional[Path] = None):
    """The cache files in `directory` (default: `cache_dir()`), sorted by name."""
    d = cache_dir() if directory is None else Path(directory)
    if d is None or not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(".cubin"))


def main(argv=None) -> int:
    """python -m snack.gpu.cache [--clear]: where the kernel cache is, how many kernels and bytes
    it holds; --clear deletes its files (and their temporary files, should a writer have died)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m snack.gpu.cache", description=main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("--clear", action="store_true", help="delete the cached kernels")
    args = ap.parse_args(argv)
    d = cache_dir()
    if d is None:
        print(f"the kernel cache is off ({ENV}={os.environ.get(ENV)!r})")
        return 0
    fs = files(d)
    print(f"{d}: {len(fs)} kernels, {sum(p.stat().st_size for p in fs) / 2**20:.1f} MiB")
    if args.clear:
        tmp = [p for p in d.iterdir() if p.is_file() and p.name.endswith(".tmp") and ".cubin." in p.name] if d.is_dir() else []
        for p in fs + tmp:
            p.unlink(missing_ok=True)
        print(f"deleted {len(fs)} kernels" + (f" and {len(tmp)} temporary files" if tmp else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
