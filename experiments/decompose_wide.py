"""Where the 32-wide forward SpMM's time goes: the same launch with phases left out.

At one shape, for each sparsity and batch size, times (CUDA-graph replay, median, us) the forward
`snack.gpu.spmm` on the 32-wide kernels as they run by default, then with the phases named by
`snack.gpu.ops.WIDE_PROBE`'s bits left out (the results are then wrong, and are not checked):
staging of the X chunk, the rows, the output flush, the lane-owned products, their shared-memory
reads alone (the FMAs kept, on a value made from each entry's column), and staging, rows and flush
together (an empty launch with the same grid and shared memory). Each setting is timed with and without
the memset that zeroes the output before the kernel adds its column chunks' partial rows
(without it the outputs are wrong too). The default's result is checked against a float64 dense
product first.

Usage: python experiments/decompose_wide.py [--shape 4096x4096] [--sparsity 0.9,0.95,0.99]
           [--batch 32] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
from experiments.bench_kernels import require_gpu, run_metadata  # noqa: E402
from experiments.cli import add_grid, grid, out_arg  # noqa: E402
from experiments.results_io import write_csv  # noqa: E402

# (name, probe bits): see snack.gpu.kernels.make_spmm_wide_kernel(probe=)
SETTINGS = [("full", 0), ("no staging", 1), ("no rows", 2), ("no flush", 4), ("no products", 8),
            ("no product reads", 16), ("staging only", 2 | 4), ("rows only", 1 | 4),
            ("rows only, no product reads", 1 | 4 | 16), ("empty", 1 | 2 | 4)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid(ap, batch="32")
    ap.add_argument("--csv", default=None, help="also write the timings to this CSV")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random patterns and inputs")
    args = ap.parse_args(argv)
    n_out, n_in, sparsities, batches = grid(ap, args)  # options checked before the GPU check
    if args.csv:
        out_arg(ap, "csv", args.csv)
    require_gpu("decompose_wide.py")
    from triton.testing import do_bench_cudagraph

    import snack.gpu as G
    from snack.core import COO
    from snack.gpu import ops

    def bench(fn):
        return do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(args.seed)
    meta = run_metadata("float32")  # in every CSV row
    rows = []
    real_zero = ops.zero
    for sp in sparsities:
        coo = COO.random((n_out, n_in), density=1.0 - sp, generator=gen, device=dev)
        topo, v = coo.topology, coo.values
        for B in batches:
            x = torch.randn(B, n_in, device=dev)
            y = torch.empty(B, n_out, device=dev)
            y.fill_(float("nan"))
            G.spmm(x, topo, v, out=y, wide=True)
            ref = x.double() @ coo.to_dense().double().T  # (W is built once more below for cuBLAS)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-5:
                sys.exit(f"the default forward is wrong at sparsity {sp}, B = {B}: relative error {err:.2e}")
            wd = coo.to_dense()
            dense = bench(lambda: torch.nn.functional.linear(x, wd))
            print(f"sparsity {sp}, B = {B} (dense cuBLAS {dense:.2f} us; relative error {err:.1e})")
            for name, probe in SETTINGS:
                times = []
                for memset in (True, False):
                    ops.WIDE_PROBE = probe
                    if not memset:
                        ops.zero = lambda t: t
                    try:
                        times.append(bench(lambda: G.spmm(x, topo, v, out=y, wide=True)))
                    finally:
                        ops.WIDE_PROBE = 0
                        ops.zero = real_zero
                print(f"  {name:14s} {times[0]:7.2f} us   without the memset {times[1]:7.2f} us", flush=True)
                rows.append(dict(meta, shape=args.shape, sparsity=sp, batch=B, setting=name, probe=probe,
                                 us=round(times[0], 3), us_no_memset=round(times[1], 3), dense_us=round(dense, 3)))
    if args.csv:
        write_csv(args.csv, rows)
        print("wrote", args.csv)


if __name__ == "__main__":
    main()
