"""The first call of each SNACK op in a new process, with the on-disk kernel cache empty, full and off.

A kernel variant is compiled the first time a process launches it, unless `snack.gpu.cache`
holds it from an earlier process. This script runs, one after another, fresh processes that each
make the first call of forward, dX, SDDMM (with the bias gradient) and the whole backward at
every (sparsity, batch) point, and times each call (wall clock around the call and a
synchronize: what a user waits for), in this order:
  - "empty": a new, empty cache directory (every kernel compiled and stored),
  - "full": the same directory again, `--full-runs` times (every kernel loaded),
  - "off": `SNACK_KERNEL_CACHE=0` (compiled, nothing stored).
The cache used is a temporary directory (yours is not touched) unless `--cache-dir` is given.
Each process also checks its forward against the float64 product, so no call is timed on
results nobody looked at.

Usage (GPU machine):  python experiments/bench_first_use.py [--sparsity 0.9,0.95,0.99]
                      [--batch 1,8,32,128] [--shape 4096x4096] [--dtype float32] [--full-runs 2]
                      [--out results/bench_first_use.csv]
Writes a tidy CSV (one row per run, point and op, plus each run's import and whole-process
times, with the GPU, versions and git commit) and prints each run's totals.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))

from experiments.cli import add_grid, grid, out_arg  # noqa: E402
from experiments.results_io import write_csv  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")
OPS = ("fwd", "dx", "sddmm", "bwd")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid(ap)
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="the ops' dtype (default float32)")
    ap.add_argument("--full-runs", type=int, default=2, help="processes run with the full cache")
    ap.add_argument("--cache-dir", default=None, help="the cache directory to fill (default: a temporary one); "
                                                      "it must not exist yet or be empty")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random patterns and inputs")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_first_use.csv"),
                    help="CSV path (default results/bench_first_use.csv)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measured process
    args = ap.parse_args(argv)
    args.n_out, args.n_in, args.sparsity_list, args.batch_list = grid(ap, args)
    if args.full_runs < 1:
        ap.error(f"--full-runs must be >= 1, got {args.full_runs}")
    if args.cache_dir is not None and Path(args.cache_dir).exists() and any(Path(args.cache_dir).iterdir()):
        ap.error(f"--cache-dir must be a new or empty directory (the first run needs an empty cache), "
                 f"got {args.cache_dir!r}")
    if not args.child:  # (a measured process writes no file)
        out_arg(ap, "out", args.out)
    return args


def child(args) -> dict:
    """The measured process: first calls at every point, their times, the cache's counts."""
    t0 = time.perf_counter()
    import torch

    import snack.gpu as G
    from snack.core import COO
    from snack.gpu import cache
    t_import = time.perf_counter() - t0
    from experiments.bench_kernels import rel_err  # after the timed imports (it imports torch too)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    rows, worst = [], 0.0
    for sp in args.sparsity_list:
        coo = COO.random((args.n_out, args.n_in), density=1.0 - sp, generator=gen, device="cuda")
        t, v = coo.topology, coo.values.to(dtype)
        for B in args.batch_list:
            x = torch.randn(B, args.n_in, generator=gen).to(dtype).cuda()
            dy = torch.randn(B, args.n_out, generator=gen).to(dtype).cuda()
            out = {}
            calls = (("fwd", lambda: G.spmm(x, t, v)), ("dx", lambda: G.spmm_t(dy, t, v)),
                     ("sddmm", lambda: G.sddmm(dy, x, t, bias_grad=True)),
                     ("bwd", lambda: G.spmm_t_sddmm(dy, x, t, v, bias_grad=True)))
            for op, fn in calls:
                torch.cuda.synchronize()
                s = time.perf_counter()
                out[op] = fn()
                torch.cuda.synchronize()
                rows.append(dict(sparsity=sp, B=B, op=op, seconds=time.perf_counter() - s))
            ref = x.double() @ coo.to_dense().to(dtype).double().T
            worst = max(worst, rel_err(out["fwd"], ref))
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[args.dtype]
    if not worst < tol:
        raise SystemExit(f"the forward is off by {worst:.3g} (relative) against float64: nothing written")
    return dict(rows=rows, import_s=t_import, total_s=time.perf_counter() - t0, stats=cache.stats(),
                worst_forward_error=worst)


def _run_child(argv, cache_value: str) -> dict:
    env = dict(os.environ, SNACK_KERNEL_CACHE=cache_value)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--child"], env=env,
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"a measured process failed (SNACK_KERNEL_CACHE={cache_value}):\n"
                         f"{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    # (imported here: a measured process imports torch inside its timed part)
    from experiments.bench_kernels import require_gpu, run_metadata
    require_gpu("bench_first_use.py")  # (run_metadata records triton's version)
    child_argv = _strip_option(_strip_option(argv, "--out"), "--cache-dir")
    tmp = None
    if args.cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="snack-kernels-")
        cache_dir = tmp.name
    else:
        cache_dir = args.cache_dir
    meta = dict(run_metadata(args.dtype), shape=f"{args.n_out}x{args.n_in}")
    runs = [("empty", cache_dir)] + [("full", cache_dir)] * args.full_runs + [("off", "0")]
    rows = []
    try:
        for i, (state, value) in enumerate(runs, 1):
            res = _run_child(child_argv, value)
            st = res["stats"]
            calls = sum(r["seconds"] for r in res["rows"])
            print(f"run {i} ({state}): first calls {calls:.2f} s, import {res['import_s']:.2f} s, process "
                  f"{res['total_s']:.2f} s; kernels loaded {st['hits']}, compiled {st['misses'] or '-'}, "
                  f"stored {st['stored']}", flush=True)
            base = dict(run=i, cache=state, **meta)
            rows += [dict(base, sparsity=r["sparsity"], B=r["B"], op=r["op"], seconds=round(r["seconds"], 5),
                          loaded=st["hits"], compiled=st["misses"]) for r in res["rows"]]
            rows.append(dict(base, sparsity="", B="", op="import torch + snack.gpu", seconds=round(res["import_s"], 5),
                             loaded="", compiled=""))
            rows.append(dict(base, sparsity="", B="", op="process up to the last call",
                             seconds=round(res["total_s"], 5), loaded=st["hits"], compiled=st["misses"]))
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"wrote {write_csv(args.out, rows)}")


def _strip_option(argv, name):
    """argv without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
