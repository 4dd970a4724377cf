"""Benchmark of the CPU backend against dense torch.mm: forward, input gradient, value gradient.

    python experiments/bench_cpu.py                     # 4096 x 4096, 90% sparse, B in 1, 32, 128
    python experiments/bench_cpu.py --batches=1,8 --sparsity=0.95 --rounds=9

For each batch size B it times, float32, side by side in alternating rounds (so that a noisy
neighbour hurts both sides alike):
    forward   snack.core.cpu.spmm(x, W)      vs dense torch.mm(x, W_dense.t())
    dX        snack.core.cpu.spmm_t(dy, W)   vs dense torch.mm(dy, W_dense)
    SDDMM     snack.core.cpu.sddmm(dy, x, W) vs dense torch.mm(dy.t(), x) (the dense weight gradient)
(SNACK and dense both write into outputs allocated once, with `out=`),
plus torch's own CSR matmul (`torch.mm(W_csr, x.t())`, MKL) as a second sparse baseline for the
two SpMMs. Before timing, each op's result is checked (the SDDMM against (dy^T x) at W's non-zeros,
in float64). Every timing is the median over `--rounds` x `--repeats` calls (the minimum is kept
too: on a shared machine the median carries other processes' load, the minimum does not); the
ratio is dense / snack of the medians (> 1: snack is faster). Prints a table and writes
results/bench_cpu.csv with the machine, load average, versions and git commit. About a minute.
Trade-off: wall-clock time of one call as a user makes it, including the X^T copy and the
Python overhead, not an isolated kernel time.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import torch
from tqdm import tqdm

from snack.core import COO
from snack.core import cpu

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
from experiments.cli import comma_list, out_arg  # noqa: E402
from experiments.results_io import git_commit, write_csv  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in_features", type=int, default=4096, help="the layer's inputs (default 4096)")
    p.add_argument("--out_features", type=int, default=4096, help="the layer's outputs (default 4096)")
    p.add_argument("--sparsity", type=float, default=0.9, help="in [0, 1) (default 0.9)")
    p.add_argument("--batches", type=str, default="1,32,128", help="comma list of batch sizes (default 1,32,128)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the methods taking turns (default 5)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pattern and inputs")
    p.add_argument("--out", type=str, default=str(ROOT / "results" / "bench_cpu.csv"),
                   help="CSV path (default results/bench_cpu.csv)")
    a = p.parse_args(argv)
    a.batch_list = comma_list(p, "batches", a.batches, int, lambda b: b >= 1, "batch sizes >= 1")
    if not 0.0 <= a.sparsity < 1.0:
        p.error(f"--sparsity must be in [0, 1), got {a.sparsity}")
    for name in ("in_features", "out_features", "rounds", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    for name in ("warmup", "threads"):
        if getattr(a, name) < 0:
            p.error(f"--{name} must be >= 0, got {getattr(a, name)}")
    out_arg(p, "out", a.out)
    return a


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_ops(x: torch.Tensor, dy: torch.Tensor, topo, vals: torch.Tensor, wd: torch.Tensor) -> None:
    """The three timed ops against references, before any timing: the SpMMs against dense
    float32 products, the SDDMM (dv_k = sum_b dy[b, r_k] x[b, c_k]) against (dy^T x)[r_k, c_k]
    in float64. Loose tolerances: float32 sums of hundreds of terms. Raises AssertionError."""
    torch.testing.assert_close(cpu.spmm(x, topo, vals), x @ wd.t(), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(cpu.spmm_t(dy, topo, vals), dy @ wd, rtol=1e-4, atol=1e-3)
    rows, cols = topo.indices[0].long(), topo.indices[1].long()
    dv_ref = (dy.double().t() @ x.double())[rows, cols]
    torch.testing.assert_close(cpu.sddmm(dy, x, topo).double(), dv_ref, rtol=1e-4, atol=1e-3)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_blocks(fns: dict, rounds: int, repeats: int, warmup: int) -> dict:
    """{name: [seconds per call]}: `rounds` rounds; in each, every fn in turn (order alternating
    between rounds) runs `warmup` untimed calls and then `repeats` timed calls back to back.

    A pause precedes each block: OpenMP worker threads (torch's and Numba's are two separate
    runtimes) busy-wait for a few milliseconds after a parallel region, and on a 2-core machine
    the spinning threads of one would slow the other's next call. Calls of one op back to back
    are what a user's loop sees; alternating single calls of two runtimes measures their fight.
    """
    times = {k: [] for k in fns}
    names = list(fns)
    for rnd in range(rounds):
        for k in (names if rnd % 2 == 0 else names[::-1]):
            f = fns[k]
            time.sleep(0.05)
            for _ in range(warmup):
                f()
            for _ in range(repeats):
                times[k].append(timed(f))
    return times


def main(argv=None) -> list:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    n_out, n_in = args.out_features, args.in_features
    w = COO.random((n_out, n_in), density=1.0 - args.sparsity, seed=args.seed)
    topo, vals = w.topology, w.values
    wd = w.to_dense()
    csr = torch.sparse_csr_tensor(topo.row_ptr.long(), topo.cols.long(), vals, w.shape)
    csr_t = torch.sparse_csr_tensor(topo.col_ptr.long(), topo.rows_by_col.long(), vals[topo.col_perm],
                                    (n_in, n_out))
    meta = dict(cpu=cpu_model(), cores=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, numba=numba.__version__, python=platform.python_version(),
                commit=git_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                loadavg_1min=round(os.getloadavg()[0], 2))
    rows = []
    bar = tqdm(total=3 * len(args.batch_list), desc="bench_cpu", unit="op", file=sys.stderr)
    for B in args.batch_list:
        x = torch.randn(B, n_in)
        dy = torch.randn(B, n_out)
        check_ops(x, dy, topo, vals, wd)  # correctness first
        y_out = torch.empty(B, n_out)
        dx_out = torch.empty(B, n_in)
        dv_out = torch.empty(w.nnz)
        # dense writes into outputs made once too: a fresh 64 MB weight gradient per call would
        # time the allocator's page faults (3.7 or 18 ms for the same product, run to run)
        y_dense, dx_dense, gw_dense = torch.empty(B, n_out), torch.empty(B, n_in), torch.empty(n_out, n_in)
        ops = {
            "forward": {"snack": lambda: cpu.spmm(x, topo, vals, out=y_out),
                        "dense": lambda: torch.mm(x, wd.t(), out=y_dense),
                        "torch_csr": lambda: torch.mm(csr, x.t())},
            "dX": {"snack": lambda: cpu.spmm_t(dy, topo, vals, out=dx_out),
                   "dense": lambda: torch.mm(dy, wd, out=dx_dense),
                   "torch_csr": lambda: torch.mm(csr_t, dy.t())},
            "SDDMM": {"snack": lambda: cpu.sddmm(dy, x, topo, out=dv_out),
                      "dense": lambda: torch.mm(dy.t(), x, out=gw_dense)},
        }
        for op, fns in ops.items():
            bar.set_postfix_str(f"B = {B}, {op}")
            t = bench_blocks(fns, args.rounds, args.repeats, args.warmup)
            bar.update()
            med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            mins = {k: min(v) * 1e3 for k, v in t.items()}
            rows.append(dict(op=op, B=B, in_features=n_in, out_features=n_out, sparsity=args.sparsity,
                             nnz=w.nnz, dtype="float32", calls=args.rounds * args.repeats,
                             snack_ms=round(med["snack"], 4), snack_min_ms=round(mins["snack"], 4),
                             dense_ms=round(med["dense"], 4), dense_min_ms=round(mins["dense"], 4),
                             torch_csr_ms=round(med["torch_csr"], 4) if "torch_csr" in med else "",
                             ratio_dense_over_snack=round(med["dense"] / med["snack"], 3),
                             ratio_csr_over_snack=(round(med["torch_csr"] / med["snack"], 3)
                                                   if "torch_csr" in med else ""),
                             **meta))
    bar.close()
    print(f"{meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}, numba {meta['numba']}, "
          f"commit {meta['commit']}, load {meta['loadavg_1min']}")
    print(f"W {n_out} x {n_in}, sparsity {args.sparsity}, nnz {w.nnz}, float32, "
          f"median of {args.rounds} x {args.repeats} calls")
    print(f"{'op':8s} {'B':>4s} {'snack ms':>9s} {'dense ms':>9s} {'csr ms':>8s} {'dense/snack':>12s} "
          f"{'csr/snack':>10s} {'(min: snack':>12s} {'dense)':>7s}")
    for r in rows:
        csr_ms = f"{r['torch_csr_ms']:8.2f}" if r["torch_csr_ms"] != "" else f"{'-':>8s}"
        csr_ratio = f"{r['ratio_csr_over_snack']:10.2f}" if r["ratio_csr_over_snack"] != "" else f"{'-':>10s}"
        print(f"{r['op']:8s} {r['B']:4d} {r['snack_ms']:9.2f} {r['dense_ms']:9.2f} {csr_ms} "
              f"{r['ratio_dense_over_snack']:12.2f} {csr_ratio} {r['snack_min_ms']:12.2f} {r['dense_min_ms']:7.2f}")
    out = write_csv(args.out, rows)
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
    warnings.filterwarnings("ignore", message=".*Sparse invariant checks.*")
    main(sys.argv[1:])
