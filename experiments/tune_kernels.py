"""Sweep of the SNACK kernels' launch parameters (batch tile BT, threads per block) on the GPU.

Prints the CUDA-graph replay time (median, us) of forward, dX and SDDMM for each setting at
4096 x 4096; used to choose the defaults in gpu/ops.py. Usage: python experiments/tune_kernels.py
"""
from __future__ import annotations

import argparse

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--sparsity", default="0.9,0.99")
    ap.add_argument("--batch", default="1,8,32,128")
    ap.add_argument("--bt", default="1,2,4,8,16,32")
    ap.add_argument("--threads", default="128,256,512,1024")
    args = ap.parse_args(argv)
    from triton.testing import do_bench_cudagraph
    import snack.gpu as G
    from snack.core import COO
    n_out, n_in = (int(v) for v in args.shape.split("x"))
    print(f"{'sp':>5} {'B':>4} {'config':>8} {'thr':>5} {'fwd':>8} {'dX':>8} {'sddmm':>8}")
    for sp in [float(s) for s in args.sparsity.split(",")]:
        coo = COO.random((n_out, n_in), density=1 - sp, seed=0, device="cuda")
        topo, v = coo.topology, coo.values
        for B in [int(b) for b in args.batch.split(",")]:
            x = torch.randn(B, n_in, device="cuda")
            dy = torch.randn(B, n_out, device="cuda")
            y = torch.empty(B, n_out, device="cuda")
            dx = torch.empty(B, n_in, device="cuda")
            dv = torch.empty(coo.nnz, device="cuda")
            configs = [dict(bt=bt, wide=False) for bt in (int(b) for b in args.bt.split(","))
                       if bt == 1 or bt <= 2 * B]
            if B >= 8:
                configs += [dict(wide=True, chunks=ch) for ch in (None, 4, 6)]
            for cfg in configs:
                for th in [int(t) for t in args.threads.split(",")]:
                    res = []
                    for fn in (lambda: G.spmm(x, topo, v, out=y, threads=th, **cfg),
                               lambda: G.spmm_t(dy, topo, v, out=dx, threads=th, **cfg),
                               lambda: G.sddmm(dy, x, topo, out=dv, threads=th, **cfg)):
                        try:
                            res.append(do_bench_cudagraph(fn, rep=15, return_mode="median") * 1e3)
                        except Exception as e:  # noqa: BLE001
                            print("failed:", cfg, e)
                            res.append(float("nan"))
                    name = f"bt{cfg['bt']}" if not cfg["wide"] else f"wide/{cfg['chunks'] or 'auto'}"
                    print(f"{sp:5} {B:4} {name:>8} {th:5} {res[0]:8.2f} {res[1]:8.2f} {res[2]:8.2f}", flush=True)


if __name__ == "__main__":
    main()
