"""The forward's GPU time with a cold L2 against a warm one: SNACK, dense, Dense+Mask, cuSPARSE.

bench_kernels.py's GPU times come from replaying a CUDA graph of the op back to back
(`do_bench_cudagraph`), so whatever an op reads and fits in the L2 (50 MB on the H200) can stay
there from one replay to the next: SNACK's COO arrays at 90% (20 MB at 4096 x 4096) and
cuSPARSE's CSR do, dense's 64 MB weight does not. This script times every method's forward in
both states, two ways, so that the ratios can be read without that question:
  - cold: before every copy of the op the graph reads a 256 MB buffer (a sum: the L2 then holds
    clean lines of that buffer only, so the op pays neither for cached inputs nor for
    write-backs); warm: no reads (the op's own previous copy ran just before);
  - replay (warm_us, cold_us; the primary columns, on bench_kernels' footing): a graph of
    `copies` copies of the op, each preceded by the read when cold, timed whole; cold_us
    subtracts a graph of the reads alone (flush_us); medians over the replays, per copy;
  - events (event_warm_us, event_cold_us): every copy between two timing events
    (`torch.cuda.Event(enable_timing=True, external=True)`: record nodes in the graph), so
    nothing but the op falls inside the interval, median over copies and replays; the record
    nodes cost time of their own (event_gap_us: an interval with nothing in it), so these read
    higher than the replay columns; and an op's dirty output lines, written back during the
    next copy's read, count in the replay's cold time but not in the op's own interval.
Each point first checks SNACK's output against the dense product; SNACK's HBM roofline fraction
(bench_kernels' bytes over the measured copy bandwidth) is given warm and cold.

Usage (GPU machine):  python experiments/bench_cold.py [--sparsity 0.9,0.95,0.99] [--batch 1,8,32,128]
                      [--shape 4096x4096] [--copies 20] [--replays 10] [--out results/bench_cold.csv]
Writes a tidy CSV (one row per point and method, with the GPU, versions and git commit, the times
above and the speed-ups of SNACK over each method, warm and cold, on the replay columns) and
prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
from experiments.bench_kernels import (copy_bandwidth, cusparse_csr, forward_floor_bytes,  # noqa: E402
                                       require_gpu, rel_err, run_metadata)
from experiments.cli import add_grid, grid, out_arg  # noqa: E402
from experiments.results_io import write_csv  # noqa: E402

FLUSH_BYTES = 256 * 2 ** 20  # > 5x the H200's L2
METHODS = ("snack", "dense", "dense_mask", "cusparse_csr")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid(ap)
    ap.add_argument("--copies", type=int, default=20, help="copies of the op per captured graph")
    ap.add_argument("--replays", type=int, default=10, help="replays of each graph")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random patterns and inputs")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_cold.csv"),
                    help="CSV path (default results/bench_cold.csv)")
    args = ap.parse_args(argv)
    args.n_out, args.n_in, args.sparsity_list, args.batch_list = grid(ap, args)
    for key in ("copies", "replays"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    out_arg(ap, "out", args.out)
    return args


def _graph(fn, copies: int, flush=None, marks=None):
    """A CUDA graph of `copies` copies of fn(), each preceded by flush() when given and, with
    marks (pairs of external timing events), recorded between its pair; warmed up and uploaded."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (plans, cuBLAS heuristics, pools)
        for _ in range(3):
            if flush is not None:
                flush()
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            if flush is not None:
                flush()
            if marks is not None:
                marks[i][0].record()
            fn()
            if marks is not None:
                marks[i][1].record()
    g.replay()  # (the first replay uploads the graph)
    torch.cuda.synchronize()
    return g


def timed_graph_us(fn, copies: int, replays: int, flush=None) -> float:
    """Median GPU time (us) of fn() from `copies` copies captured in one CUDA graph, each between
    two timing events, each preceded by flush() when given; `replays` replays of that graph.
    The interval also holds the record nodes' own cost (`event_gap_us`: fn doing nothing)."""
    marks = [(torch.cuda.Event(enable_timing=True, external=True),
              torch.cuda.Event(enable_timing=True, external=True)) for _ in range(copies)]
    g = _graph(fn, copies, flush, marks)
    times = []
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
        times += [start.elapsed_time(end) * 1e3 for start, end in marks]
    del g
    return statistics.median(times)


def replay_us(fn, copies: int, replays: int, flush=None) -> float:
    """GPU time (us) of one replay of a graph of `copies` copies of fn() (each preceded by flush()
    when given) over `copies`, median of `replays` replays: bench_kernels' graph time when
    flush is None. With a flush, subtract replay_us(lambda: None, ..., flush) for fn's cold time."""
    g = _graph(fn, copies, flush)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    del g
    return statistics.median(times)


def main(argv=None):
    args = parse_args(argv)  # options checked before the GPU check
    require_gpu("bench_cold.py")  # (run_metadata records triton's version)
    import snack.gpu as G
    from snack.core import COO

    dev = torch.device("cuda")
    meta = run_metadata("float32")
    buf = torch.ones(FLUSH_BYTES // 4, device=dev)

    def flush():
        buf.sum()

    bw = copy_bandwidth()
    gap_us = timed_graph_us(lambda: None, args.copies, args.replays)  # two record nodes, nothing between

    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for sp in args.sparsity_list:
        coo = COO.random((args.n_out, args.n_in), density=1.0 - sp, generator=gen, device=dev)
        topo, v = coo.topology, coo.values
        W = coo.to_dense()
        M = (W != 0).float()
        W_csr = cusparse_csr(topo, v)
        for B in args.batch_list:
            x = torch.randn(B, args.n_in, device=dev)
            xT = x.t().contiguous()
            y = torch.empty(B, args.n_out, device=dev)
            y.fill_(float("nan"))
            G.spmm(x, topo, v, out=y)
            err = rel_err(y, x.double() @ W.double().T)
            if not err < 1e-5:
                raise SystemExit(f"SNACK's forward is wrong at sparsity {sp}, B = {B}: relative error {err:.2e}")
            fns = {"snack": lambda: G.spmm(x, topo, v, out=y), "dense": lambda: F.linear(x, W),
                   "dense_mask": lambda: F.linear(x, W * M), "cusparse_csr": lambda: torch.mm(W_csr, xT)}
            flush_us = replay_us(lambda: None, args.copies, args.replays, flush)
            got = {}
            for name, fn in fns.items():
                got[name] = dict(
                    warm_us=replay_us(fn, args.copies, args.replays),
                    cold_us=replay_us(fn, args.copies, args.replays, flush) - flush_us,
                    event_warm_us=timed_graph_us(fn, args.copies, args.replays),
                    event_cold_us=timed_graph_us(fn, args.copies, args.replays, flush))
            floor = forward_floor_bytes(coo.nnz, B, args.n_out, args.n_in)
            roof = {state: round(floor / bw / (got["snack"][f"{state}_us"] * 1e-6), 4) for state in ("warm", "cold")}
            for name in METHODS:
                t, ts = got[name], got["snack"]
                row = dict(meta, shape=args.shape, sparsity=sp, batch=B, nnz=coo.nnz, op="forward",
                           method=name, **{k: round(u, 3) for k, u in t.items()},
                           flush_us=round(flush_us, 3), event_gap_us=round(gap_us, 3),
                           snack_speedup_warm=round(t["warm_us"] / ts["warm_us"], 3),
                           snack_speedup_cold=round(t["cold_us"] / ts["cold_us"], 3),
                           roofline_frac_warm=roof["warm"] if name == "snack" else "",
                           roofline_frac_cold=roof["cold"] if name == "snack" else "", rel_err=err)
                rows.append(row)
            print(f"sparsity {sp}, B = {B}: " + ", ".join(
                f"{n} {got[n]['warm_us']:.2f} / {got[n]['cold_us']:.2f}" for n in METHODS)
                + f" us (warm / cold L2); SNACK's roofline {roof['warm']:.0%} / {roof['cold']:.0%}", flush=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
