"""Sweep of the SNACK kernels' launch parameters on the GPU.

For each sparsity and batch size at one shape, times (CUDA-graph replay, median, us) the forward,
dX and SDDMM of every setting: tiled kernels (batch tile BT x threads per block) and 32-wide
kernels (column chunks x split x threads), after checking each setting's results against
float64 dense products. Dense cuBLAS is printed alongside for scale. Used to choose the defaults
in gpu/ops.py (`choose_tile`, `WIDE_FROM`, `_wide_plan`).

With `--wide-modes` the 32-wide SpMMs are also timed in each row mode named (`snack.gpu.ops.wide_mode`:
auto = the defaults, warp, rows4, own; and gather, the kernels that read x as transposed batch
tiles; every setting names `wide`, so the gathering that is the default at <= 2.5 % density
from B = 32 is timed only under `gather`), e.g. the A/B behind `ops.WIDE_OWN`:
`--batch 32,128 --bt 8 --threads 1024 --chunks auto --split auto --wide-modes warp,own`.
`--own-threads` also sweeps the block size the lane-owned wide SpMMs are compiled and launched
with (`ops.WIDE_OWN_THREADS`, its launch bound, so 65536 / threads registers per thread), e.g.
`--batch 32,64 --bt 8 --threads 1024 --chunks 4,5,6 --split auto --wide-modes own
--own-threads 512,640,768` (640 threads keep 96 registers; with 5 chunks a block's 158 rows make
1.97 rows per group of 8 lanes, as 125 rows over 64 groups do at 512). `--row-order on,off` times
the wide SpMMs with and without `ops.WIDE_ORDER` (rows in segment-length order from B = 33), e.g.
`--sparsity 0.9,0.95 --batch 32,64,128 --bt 8 --threads 1024 --chunks auto --split auto
--wide-modes auto,own --row-order on,off --ops fwd,dx`.

Usage: python experiments/tune_kernels.py [--sparsity 0.9,0.99] [--batch 8,32,128] [--csv out.csv]
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
from experiments.cli import add_grid, auto_int, comma_list, grid, out_arg  # noqa: E402
from experiments.results_io import write_csv  # noqa: E402

OPS = ("fwd", "dx", "sddmm")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid(ap)
    ap.add_argument("--bt", default="1,2,4,8", help="batch tiles of the tiled kernels")
    ap.add_argument("--threads", default="256,512,1024", help="threads per block, multiples of 32 up to 1024")
    ap.add_argument("--chunks", default="auto,3,4,6,8", help="column chunks of the wide kernels (auto: the default rule)")
    ap.add_argument("--split", default="1,2,auto", help="chunk groups per row block (auto: one chunk per block)")
    ap.add_argument("--wide-from", type=int, default=16, help="smallest B for which wide settings are tried")
    ap.add_argument("--wide-modes", default="auto",
                    help="row modes of the wide SpMMs to time (auto,warp,rows4,own,gather; see ops.wide_mode)")
    ap.add_argument("--own-threads", default="auto",
                    help="block sizes of the lane-owned wide SpMMs (ops.WIDE_OWN_THREADS; auto: the default), "
                         "multiples of 32 up to 1024; --threads must be at least as large")
    ap.add_argument("--row-order", default="auto",
                    help="row orders of the wide SpMMs whose lane groups take a row each (ops.WIDE_ORDER): "
                         "auto (the default), on, off; e.g. on,off for the A/B behind it")
    ap.add_argument("--ops", default="fwd,dx,sddmm", help="the ops to time, among fwd, dx, sddmm")
    ap.add_argument("--csv", default=None, help="also write the timings to this CSV")
    args = ap.parse_args(argv)
    # every option checked before the GPU check: a usage error names the option
    threads_ok = "multiples of 32 in [32, 1024]"
    own_threads = comma_list(ap, "own-threads", args.own_threads, auto_int,
                             lambda t: t is None or (32 <= t <= 1024 and t % 32 == 0), f"auto or {threads_ok}")
    orders = comma_list(ap, "row-order", args.row_order, str.strip, lambda o: o in ("auto", "on", "off"),
                        "among auto, on, off")
    n_out, n_in, sparsities, batches = grid(ap, args)
    bts = comma_list(ap, "bt", args.bt, int, lambda b: b in (1, 2, 4, 8), "batch tiles among 1, 2, 4, 8")
    threads = comma_list(ap, "threads", args.threads, int, lambda t: 32 <= t <= 1024 and t % 32 == 0, threads_ok)
    chunks = comma_list(ap, "chunks", args.chunks, auto_int, lambda c: c is None or c >= 1, "auto or positive ints")
    splits = comma_list(ap, "split", args.split, auto_int, lambda c: c is None or c >= 1, "auto or positive ints")
    ops = comma_list(ap, "ops", args.ops, str.strip, lambda o: o in OPS, f"among {', '.join(OPS)}")
    if args.csv:
        out_arg(ap, "csv", args.csv)
    require_gpu("tune_kernels.py")
    from triton.testing import do_bench_cudagraph
    import snack.gpu as G
    from snack.core import COO
    from snack.gpu import ops as gops
    modes = args.wide_modes.split(",")
    for m in modes:
        if m not in gops.WIDE_MODES:
            ap.error(f"--wide-modes: {m!r} is not one of {gops.WIDE_MODES}")
    meta = run_metadata("float32")  # in every CSV row
    rows = []

    def bench(fn):
        return do_bench_cudagraph(fn, rep=15, return_mode="median") * 1e3

    print(f"{'sp':>5} {'B':>4} {'config':>16} {'thr':>5} {'fwd':>8} {'dX':>8} {'sddmm':>8}   dense {'':>6}")
    for sp in sparsities:
        coo = COO.random((n_out, n_in), density=1 - sp, seed=0, device="cuda")
        topo, v = coo.topology, coo.values
        wd = coo.to_dense().double()
        for B in batches:
            x = torch.randn(B, n_in, device="cuda")
            dy = torch.randn(B, n_out, device="cuda")
            y = torch.empty(B, n_out, device="cuda")
            dx = torch.empty(B, n_in, device="cuda")
            dv = torch.empty(coo.nnz, device="cuda")
            yref = x.double() @ wd.T
            dxref = dy.double() @ wd
            rr, cc = topo.indices[0].long(), topo.indices[1].long()
            dvref = (dy.double().T @ x.double())[rr, cc]
            wdf = wd.float()
            t_dense = bench(lambda: torch.mm(x, wdf.T, out=y))
            configs = [dict(bt=bt, wide=False) for bt in bts if bt == 1 or bt <= 2 * B]
            if B >= args.wide_from:
                configs += [dict(wide=True, chunks=ch, split=s, mode=m, own=ot, order=o) for ch in chunks
                            for s in splits for m in modes for ot in own_threads for o in orders]
            for cfg in configs:
                mode = cfg.pop("mode", "auto")
                own = cfg.pop("own", None)
                order = cfg.pop("order", "auto")
                knobs = (gops.WIDE_OWN_THREADS, gops.WIDE_OWN_BOUND, gops.WIDE_ORDER)
                if own is not None:
                    gops.WIDE_OWN_THREADS = own
                    gops.WIDE_OWN_BOUND = None
                if order != "auto":
                    gops.WIDE_ORDER = order == "on"
                sd_cfg = {k: v for k, v in cfg.items() if k != "split"}
                try:
                    for th in threads:
                        res = {}
                        failed = False
                        with gops.wide_mode(mode):
                            try:
                                y.fill_(float("nan"))
                                dx.fill_(float("nan"))
                                G.spmm(x, topo, v, out=y, threads=th, **cfg)
                                G.spmm_t(dy, topo, v, out=dx, threads=th, **cfg)
                                checks = [("fwd", y, yref), ("dx", dx, dxref)]
                                if "sddmm" in ops:
                                    dv.fill_(float("nan"))
                                    G.sddmm(dy, x, topo, out=dv, threads=th, **sd_cfg)
                                    checks.append(("sddmm", dv, dvref))
                                for name, got, ref in checks:
                                    err = ((got.double() - ref).norm() / ref.norm()).item()
                                    if not err < 1e-5:
                                        raise AssertionError(f"{name} relative error {err}")
                                fns = {"fwd": lambda: G.spmm(x, topo, v, out=y, threads=th, **cfg),
                                       "dx": lambda: G.spmm_t(dy, topo, v, out=dx, threads=th, **cfg),
                                       "sddmm": lambda: G.sddmm(dy, x, topo, out=dv, threads=th, **sd_cfg)}
                                for op in ops:
                                    res[op] = bench(fns[op])
                            except Exception as e:  # noqa: BLE001
                                print("failed:", cfg, mode, th, repr(e)[:200])
                                failed = True
                        if failed:
                            continue
                        if cfg["wide"]:
                            name = f"wide c{cfg['chunks'] or 'a'} s{cfg['split'] or 'a'}"
                            name += "" if mode == "auto" else f" {mode}"
                            name += "" if own is None else f" o{own}"
                            name += "" if order == "auto" else f" order-{order}"
                        else:
                            name = f"bt{cfg['bt']}"
                        rows.append(dict(meta, shape=args.shape, sparsity=sp, batch=B, config=name, threads=th,
                                         dense=t_dense, **res))
                        print(f"{sp:5} {B:4} {name:>16} {th:5} " + " ".join(f"{res.get(o, float('nan')):8.2f}"
                              for o in ("fwd", "dx", "sddmm")) + f"   {t_dense:8.2f}", flush=True)
                finally:
                    gops.WIDE_OWN_THREADS, gops.WIDE_OWN_BOUND, gops.WIDE_ORDER = knobs
    if args.csv and rows:
        write_csv(args.csv, rows, fieldnames=sorted({k for r in rows for k in r}, key=list(rows[0]).index))
        print(f"wrote {args.csv}")
    elif args.csv:
        print(f"no setting ran: {args.csv} not written")
    # best setting per point
    print("\nbest forward per point:")
    best = {}
    for r in rows:
        k = (r["sparsity"], r["batch"])
        if "fwd" in r and (k not in best or r["fwd"] < best[k]["fwd"]):
            best[k] = r
    for (sp, B), r in sorted(best.items()):
        print(f"{sp:5} {B:4} {r['config']:>16} {r['threads']:5} {r['fwd']:8.2f}  ({r['dense'] / r['fwd']:.2f}x dense)")


if __name__ == "__main__":
    main()
