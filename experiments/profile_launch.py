"""Host-overhead profiles on the GPU machine (4096 x 4096, 90 %).

    python experiments/profile_launch.py            cProfile of 2000 snack.gpu.spmm calls at B = 1
                                                    (top entries by own time)
    python experiments/profile_launch.py --train 32 host time to enqueue each part of an eager
                                                    training step (SparseLinear vs nn.Linear, Adam;
                                                    --optimizer snack-adam: snack.optim.Adam;
                                                    --cprofile: then a cProfile of SNACK's step)
    python experiments/profile_launch.py --kernels 32 GPU time per kernel of a captured training
                                                    step (torch.profiler over 20 graph replays),
                                                    SNACK and dense, each Adam implementation
The --train numbers are wall time of 200 calls without synchronizing in between (what the host
spends per call) and with a final synchronize (what the call costs when host and GPU overlap).
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
from experiments.bench_kernels import require_gpu  # noqa: E402


def profile_spmm():
    import snack.gpu as G
    from snack.core import COO
    coo = COO.random((4096, 4096), density=0.1, seed=0, device="cuda")
    x = torch.randn(1, 4096, device="cuda")
    for _ in range(20):
        G.spmm(x, coo.topology, coo.values)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        G.spmm(x, coo.topology, coo.values)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def _timed(fn, n=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / n, 1e6 * (time.perf_counter() - t0) / n


def _layer_step(name: str, B: int, optimizer: str, capturable: bool):
    """(layer, x, dy, Adam, training step) for `name` ('snack': SparseLinear 4096 x 4096 at 90%,
    'dense': nn.Linear) at batch B, with bench_layer's optimizer choice and step."""
    import snack
    from experiments.bench_layer import make_adam, make_step
    m = (snack.SparseLinear(4096, 4096, sparsity=0.9, device="cuda") if name == "snack"
         else torch.nn.Linear(4096, 4096, device="cuda"))
    x = torch.randn(B, 4096, device="cuda", requires_grad=True)
    dy = torch.randn(B, 4096, device="cuda")
    opt = make_adam(m, argparse.Namespace(optimizer=optimizer), capturable=capturable)
    return m, x, dy, opt, make_step(m, "train", x, dy, opt)


def profile_train(B: int, optimizer: str = "adam", cprofile: bool = False):
    torch.manual_seed(0)
    print(f"{'':8s} {'part':12s} {'host us':>9s} {'wall us':>9s}")
    for name in ("snack", "dense"):
        m, x, dy, opt, step = _layer_step(name, B, optimizer, capturable=False)

        for _ in range(20):
            step()

        def infer():
            with torch.no_grad():
                m(x)
        parts = [("step", step), ("forward", lambda: m(x)), ("fwd no_grad", infer),
                 ("fwd + bwd", lambda: m(x).backward(dy)), ("adam step", opt.step),
                 ("zero_grad", lambda: opt.zero_grad(set_to_none=True))]
        for part, fn in parts:
            host, wall = _timed(fn)
            print(f"{name:8s} {part:12s} {host:9.1f} {wall:9.1f}")
        if cprofile and name == "snack":
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(500):
                step()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def profile_kernels(B: int):
    from torch.profiler import ProfilerActivity, profile
    from experiments.bench_layer import _events_us, capture
    torch.manual_seed(0)
    for opt_name in ("snack-adam", "adam", "adam-fused"):
        for name in ("snack", "dense"):
            step = _layer_step(name, B, opt_name, capturable=True)[4]  # keeps the layer alive
            g, _ = capture(step)
            for _ in range(20):
                g.replay()
            median_us = _events_us(g.replay, None, n=200)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    g.replay()
                torch.cuda.synchronize()
            print(f"=== {name} layer, {opt_name}: replay median {median_us:.1f} us")
            total = 0.0
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
                if e.device_time_total <= 0:
                    continue
                total += e.device_time_total / 20
                print(f"  {e.device_time_total / 20:8.1f} us/step  {e.count / 20:4.1f} per step  {e.key[:100]}")
            print(f"  sum of kernels {total:.1f} us/step")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=None, metavar="B")
    ap.add_argument("--optimizer", default=None, choices=["adam", "snack-adam"],
                    help="--train's optimizer (default adam); --kernels runs every Adam implementation")
    ap.add_argument("--cprofile", action="store_true", help="with --train: a cProfile of SNACK's step after it")
    ap.add_argument("--kernels", type=int, default=None, metavar="B")
    args = ap.parse_args(argv)
    for name in ("train", "kernels"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be a batch size >= 1, got {getattr(args, name)}")
    if args.train is not None and args.kernels is not None:
        ap.error("give one of --train and --kernels, not both")
    if args.optimizer is not None and args.train is None:
        ap.error("--optimizer applies to --train only (--kernels profiles every Adam implementation; "
                 "the default profile has no optimizer)")
    if args.cprofile and args.train is None:
        ap.error("--cprofile applies to --train only (the default profile is a cProfile already)")
    return args


def main(argv=None):
    args = parse_args(argv)
    require_gpu("profile_launch.py", triton=False)
    if args.kernels is not None:
        profile_kernels(args.kernels)
    elif args.train is not None:
        profile_train(args.train, args.optimizer or "adam", args.cprofile)
    else:
        profile_spmm()


if __name__ == "__main__":
    main()
