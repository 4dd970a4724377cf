"""Kernel benchmark: SNACK-COO SpMM / transposed SpMM / SDDMM against dense cuBLAS, Dense+Mask and
cuSPARSE (torch.sparse CSR), side by side in one run, on the GPU.

For each shape (out x in), sparsity and batch B it checks every op against a float64 reference
(outputs poisoned with NaN first), then times the forward, dX, the SDDMM and the whole backward
(dX and dv: `snack.gpu.spmm_t_sddmm`, fused from B = 9 to 32, and its two separate ops):
  - GPU time: CUDA-graph replay (triton.testing.do_bench_cudagraph), median;
  - eager time (triton.testing.do_bench, L2 flushed), median: GPU time from the call's first to
    its last kernel after the flush; host time shows only where it outlasts the flush kernel
    queued before it (~60 us of GPU work), so the host-bound figure is the wall time below;
and the HBM roofline fraction of the SNACK forward (bytes: 8 per non-zero for the int32 row and
column plus the value's size, and B * (in + out) elements of X and Y: 12 * nnz + 4 * B * (in + out)
in float32, 10 * nnz + 2 * B * (in + out) in float16 / bfloat16; over the measured copy bandwidth). Writes a tidy CSV (one row per op and method) with the GPU,
versions and git commit; `experiments/plot_kernels.py` draws the figures from it.
Also measures host overhead: wall time of 1000 back-to-back forward calls at B = 1 against
torch.nn.functional.linear with the dense weight (5 rounds, the methods taking turns, median).

Usage (GPU machine):  python experiments/bench_kernels.py [--quick] [--out CSV]
(--quick: 4096 x 4096, the 12 target points, written to results/bench_kernels_quick.csv; an
explicit --shapes, --sparsity or --batch still wins over --quick's). --dtype float16 / bfloat16
times every method in that dtype (cuBLAS then uses the tensor cores; SNACK accumulates in fp32)
and writes results/bench_kernels[_quick]_<dtype>.csv by default.
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
from experiments.cli import comma_list, fill_unset, out_arg, shape_arg  # noqa: E402
from experiments.results_io import MAX_REL_ERR, git_commit, write_csv  # noqa: E402

DEFAULT_SHAPES = ["4096x4096", "2304x768", "768x768", "3072x768", "768x3072"]
# the grid, and what --quick takes instead for each option not given on the command line
DEFAULTS = dict(shapes=",".join(DEFAULT_SHAPES), sparsity="0.5,0.8,0.9,0.95,0.99", batch="1,8,32,128,512")
QUICK = dict(shapes="4096x4096", sparsity="0.9,0.95,0.99", batch="1,8,32,128")


def require_gpu(script: str, triton: bool = True) -> None:
    """Exit with one line when this machine cannot run `script`: no CUDA GPU, or (triton=True,
    the scripts that time with triton.testing) no triton. Call it before importing triton or
    snack.gpu, so that a CPU machine gets the reason instead of an import traceback."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU and torch sees none (torch.cuda.is_available() is "
                         f"False, torch {torch.__version__}): run it on the GPU machine")
    if triton and importlib.util.find_spec("triton") is None:
        raise SystemExit(f"{script} times with triton.testing, and triton is not installed: "
                         "pip install triton (torch's CUDA wheels bring it)")


def run_metadata(dtype: str, **extra) -> dict:
    """What every GPU result row carries: the GPU, the versions (torch, numba, numba-cuda, triton,
    CUDA, Python), the git commit, the dtype, `extra` (e.g. the measured copy bandwidth) and
    snack.gpu's launch mode. Needs a CUDA GPU, triton and snack.gpu (see require_gpu)."""
    import numba
    import triton

    import snack.gpu as G
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, numba=numba.__version__,
                numba_cuda=_version("numba-cuda"), triton=triton.__version__, cuda=torch.version.cuda,
                commit=git_commit(), python=platform.python_version(), dtype=dtype, **extra,
                launch=G.launch_mode())


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of repeats."""
    from triton.testing import do_bench
    n = 1 << 28  # 1 GiB of float32
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3)


def forward_floor_bytes(nnz: int, batch: int, n_out: int, n_in: int, esize: int = 4) -> int:
    """Bytes SNACK's forward must move at least: an int32 row and column and a value per
    non-zero, and X and Y once (the roofline's numerator)."""
    return (8 + esize) * nnz + esize * batch * (n_in + n_out)


def cusparse_csr(topo, values: torch.Tensor) -> torch.Tensor:
    """The pattern as a torch.sparse CSR tensor with int32 indices, the index width SNACK reads
    (torch's `to_sparse_csr()` gives int64, which cuSPARSE reads more slowly)."""
    return torch.sparse_csr_tensor(topo.row_ptr, topo.cols.contiguous(), values.detach(), topo.shape)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.double()
    if not torch.isfinite(a).all():
        return float("inf")
    den = ref.norm().item()
    return (a - ref).norm().item() / (den if den > 0 else 1.0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=argparse.SUPPRESS,
                    help=f"comma list of OUTxIN (default {DEFAULTS['shapes']}; --quick: {QUICK['shapes']})")
    ap.add_argument("--sparsity", default=argparse.SUPPRESS,
                    help=f"comma list (default {DEFAULTS['sparsity']}; --quick: {QUICK['sparsity']})")
    ap.add_argument("--batch", default=argparse.SUPPRESS,
                    help=f"comma list (default {DEFAULTS['batch']}; --quick: {QUICK['batch']})")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="the dtype every method runs in (default float32)")
    ap.add_argument("--quick", action="store_true",
                    help="the target points: --shapes, --sparsity, --batch not given take --quick's values")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager timings (eager_us left NaN)")
    ap.add_argument("--out", default=None,
                    help="CSV path (default results/bench_kernels.csv, with --quick results/bench_kernels_quick.csv; "
                         "_<dtype> before .csv for float16 / bfloat16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random patterns and inputs")
    args = ap.parse_args(argv)
    fill_unset(args, QUICK if args.quick else DEFAULTS)
    args.shape_list = ["{}x{}".format(*shape_arg(ap, "shapes", v))
                       for v in comma_list(ap, "shapes", args.shapes, str.strip)]
    args.sparsity_list = comma_list(ap, "sparsity", args.sparsity, float, lambda s: 0.0 <= s < 1.0,
                                    "numbers in [0, 1)")
    args.batch_list = comma_list(ap, "batch", args.batch, int, lambda b: b >= 1, "batch sizes >= 1")
    if args.out is None:
        args.out = str(ROOT / "results" / ("bench_kernels" + ("_quick" if args.quick else "") +
                                           ("" if args.dtype == "float32" else f"_{args.dtype}") + ".csv"))
    out_arg(ap, "out", args.out)
    return args


def main(argv=None):
    args = parse_args(argv)
    require_gpu("bench_kernels.py")
    from triton.testing import do_bench, do_bench_cudagraph
    from tqdm import tqdm

    import snack.gpu as G
    from snack.core import COO
    from snack.core.reference import sddmm_reference, spmm_reference, spmm_t_reference

    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    shapes, sparsities, batches = args.shape_list, args.sparsity_list, args.batch_list

    bw = copy_bandwidth()
    meta = run_metadata(args.dtype, copy_bw_TBs=round(bw / 1e12, 3))
    print(meta)
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    grid = [(s, sp, b) for s in shapes for sp in sparsities for b in batches]
    for shape, sp, B in tqdm(grid, desc="bench", file=sys.stderr):
        n_out, n_in = (int(v) for v in shape.split("x"))
        coo = COO.random((n_out, n_in), density=1.0 - sp, generator=gen, dtype=dtype, device=dev)
        topo, v = coo.topology, coo.values
        _ = topo.row_ptr, topo.col_ptr, topo.col_perm, topo.rows_by_col  # build metadata once
        W = coo.to_dense()
        M = (W != 0).to(dtype)
        W_csr = cusparse_csr(topo, v)
        x = torch.randn(B, n_in, device=dev, dtype=dtype)
        dy = torch.randn(B, n_out, device=dev, dtype=dtype)
        xT = x.t().contiguous()
        y = torch.empty(B, n_out, device=dev, dtype=dtype)
        dx = torch.empty(B, n_in, device=dev, dtype=dtype)
        dv = torch.empty(coo.nnz, device=dev, dtype=dtype)

        # correctness, outputs poisoned first
        xd, dyd, vd = x.double(), dy.double(), v.double()
        errs, refs = {}, {}
        for name, fn, out, ref in [
            ("forward", lambda: G.spmm(x, topo, v, out=y), y, lambda: spmm_reference(xd, topo.indices, vd, n_out)),
            ("dX", lambda: G.spmm_t(dy, topo, v, out=dx), dx, lambda: spmm_t_reference(dyd, topo.indices, vd, n_in)),
            ("SDDMM", lambda: G.sddmm(dy, x, topo, out=dv), dv, lambda: sddmm_reference(dyd, xd, topo.indices)),
        ]:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            refs[name] = ref()
            errs[name] = rel_err(out, refs[name])
        # the whole backward (dX and dv) as a layer runs it: one fused launch from B = 9 to 32
        # (snack.gpu.fuses_backward), else spmm_t and sddmm
        bdx, bdv = G.spmm_t_sddmm(dy, x, topo, v)
        errs["backward"] = max(rel_err(bdx, refs["dX"]), rel_err(bdv, refs["SDDMM"]))
        # and the two separate ops (the rows of method snack_separate)
        sdx, sdv = G.spmm_t_sddmm(dy, x, topo, v, fused=False)
        errs["backward_separate"] = max(rel_err(sdx, refs["dX"]), rel_err(sdv, refs["SDDMM"]))
        errs["cusparse_csr"] = rel_err(torch.mm(W_csr, xT).t(), refs["forward"])  # the baseline's too
        del bdx, bdv, sdx, sdv
        del refs
        bad = {k: e for k, e in errs.items() if k != "cusparse_csr" and not e <= MAX_REL_ERR[args.dtype]}
        if bad:
            raise SystemExit(f"wrong result at {shape}, sparsity {sp}, B = {B} (relative errors "
                             f"{', '.join(f'{k} {e:.2e}' for k, e in bad.items())}): nothing timed")
        nnz = coo.nnz
        esize = v.element_size()
        floor_bytes = forward_floor_bytes(nnz, B, n_out, n_in, esize)
        methods = {
            "forward": {
                "snack": (lambda: G.spmm(x, topo, v), lambda: G.spmm(x, topo, v, out=y)),
                "dense": (lambda: F.linear(x, W), None),
                "dense_mask": (lambda: F.linear(x, W * M), None),
                "cusparse_csr": (lambda: torch.mm(W_csr, xT), None),
            },
            "dX": {
                "snack": (lambda: G.spmm_t(dy, topo, v), lambda: G.spmm_t(dy, topo, v, out=dx)),
                "dense": (lambda: dy @ W, None),
                "dense_mask": (lambda: dy @ (W * M), None),
            },
            "SDDMM": {
                "snack": (lambda: G.sddmm(dy, x, topo), lambda: G.sddmm(dy, x, topo, out=dv)),
                "dense": (lambda: dy.t() @ x, None),
                "dense_mask": (lambda: (dy.t() @ x) * M, None),
            },
            "backward": {
                "snack": (lambda: G.spmm_t_sddmm(dy, x, topo, v), None),
                "snack_separate": (lambda: G.spmm_t_sddmm(dy, x, topo, v, fused=False), None),
                "dense": (lambda: (dy @ W, dy.t() @ x), None),
                "dense_mask": (lambda: (dy @ (W * M), (dy.t() @ x) * M), None),
            },
        }
        for op, ms in methods.items():
            for method, (eager_fn, graph_fn) in ms.items():
                gfn = graph_fn or eager_fn
                try:
                    g_us = do_bench_cudagraph(gfn, rep=30, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001 - recorded in the CSV
                    print(f"graph timing failed for {op}/{method}: {e}", file=sys.stderr)
                    g_us = float("nan")
                try:
                    e_us = float("nan") if args.no_eager else \
                        do_bench(eager_fn, warmup=10, rep=40, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001 - recorded in the CSV (e.g. a dtype a library lacks)
                    print(f"eager timing failed for {op}/{method}: {e}", file=sys.stderr)
                    e_us = float("nan")
                rows.append(dict(meta, shape=shape, out_features=n_out, in_features=n_in, sparsity=sp,
                                 batch=B, nnz=nnz, op=op, method=method, graph_us=round(g_us, 3),
                                 eager_us=round(e_us, 3),
                                 rel_err=(errs["backward_separate"] if method == "snack_separate"
                                          else errs[op] if method == "snack"
                                          else errs["cusparse_csr"] if method == "cusparse_csr" else ""),
                                 roofline_frac=round(floor_bytes / bw / (g_us * 1e-6), 4)
                                 if (method == "snack" and op == "forward") else ""))
        W = M = W_csr = None  # freed before the next point's are made

    # host overhead: 1000 back-to-back calls at B = 1, 90 % sparsity, 4096 x 4096
    coo = COO.random((4096, 4096), density=0.1, generator=gen, dtype=dtype, device=dev)
    W = coo.to_dense()
    x1 = torch.randn(1, 4096, device=dev, dtype=dtype)
    # (5 rounds, the two methods taking turns; the median round per method)
    fns = {"snack": lambda: G.spmm(x1, coo.topology, coo.values), "dense": lambda: F.linear(x1, W)}
    walls = {name: [] for name in fns}
    for name, fn in fns.items():
        for _ in range(50):
            fn()
    for _ in range(5):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(1000):
                fn()
            torch.cuda.synchronize()
            walls[name].append((time.perf_counter() - t0) * 1e3)  # us per call
    overhead = {name: statistics.median(w) for name, w in walls.items()}
    for name in fns:
        rows.append(dict(meta, shape="4096x4096", out_features=4096, in_features=4096, sparsity=0.9, batch=1,
                         nnz=coo.nnz, op="forward_1000_calls_wall", method=name, graph_us="",
                         eager_us=round(overhead[name], 3), rel_err="", roofline_frac=""))

    write_csv(args.out, rows)
    print_summary(rows)
    print(f"host: 1000 forward calls at B=1 (median of 5 rounds): snack {overhead['snack']:.1f} us/call "
          f"(rounds {', '.join(f'{w:.1f}' for w in walls['snack'])}), F.linear dense {overhead['dense']:.1f} "
          f"us/call (rounds {', '.join(f'{w:.1f}' for w in walls['dense'])})")
    print(f"wrote {args.out}")


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return "unknown"


def print_summary(rows):
    """A short table: graph-replay time of each op, and SNACK's speedups."""
    from collections import defaultdict
    t = defaultdict(dict)
    for r in rows:
        if r["op"] in ("forward", "dX", "SDDMM", "backward"):
            t[(r["shape"], r["sparsity"], r["batch"], r["op"])][r["method"]] = r
    print(f"{'shape':>10} {'sp':>5} {'B':>4} {'op':>7} {'snack':>8} {'dense':>8} {'d+mask':>8} {'cusp':>8}"
          f" {'x dense':>7} {'x d+m':>6} {'x cusp':>6} {'roof':>5} {'eager':>8} {'err':>8}")
    for (shape, sp, B, op), m in t.items():
        s = m["snack"]["graph_us"]
        d = m.get("dense", {}).get("graph_us", float("nan"))
        dm = m.get("dense_mask", {}).get("graph_us", float("nan"))
        cs = m.get("cusparse_csr", {}).get("graph_us", float("nan"))
        rf = m["snack"]["roofline_frac"]
        print(f"{shape:>10} {sp:>5} {B:>4} {op:>7} {s:8.2f} {d:8.2f} {dm:8.2f} {cs:8.2f} {d / s:7.2f} {dm / s:6.2f}"
              f" {cs / s:6.2f} {rf if rf == '' else f'{rf:.2f}':>5} {m['snack']['eager_us']:8.2f} {m['snack']['rel_err']:8.1e}")


if __name__ == "__main__":
    main()
