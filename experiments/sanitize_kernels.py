"""Runs every SNACK kernel variant (and the fused Adam steps) once on small odd shapes and checks the results; meant to be run
under `compute-sanitizer --tool memcheck` and `--tool racecheck` on the GPU machine, with
`--report-api-errors no` (the CUDA bindings probe driver entry points the driver lacks, 34
`cuGetProcAddress_v2` errors on the host that would otherwise count as errors), e.g.
    compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 3 \
        python experiments/sanitize_kernels.py --sums cluster --own --dtypes float32 --shapes 2
Under the sanitizers one shape in one dtype takes about a minute (every variant is compiled and
instrumented); --dtypes and --shapes split a run over several calls.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
from experiments.bench_kernels import require_gpu  # noqa: E402


# (out, in, B, density) of W and the batch: odd shapes; with --staging, full 32-row batch tiles
# and runs of 32 columns
SHAPES = [(37, 53, 1, 0.3), (23, 41, 2, 0.2), (64, 29, 3, 0.2), (19, 77, 9, 0.5), (5, 40, 33, 0.9),
          (70, 11, 70, 0.1)]
STAGING_SHAPES = [(5, 40, 33, 0.9), (21, 70, 64, 0.4), (9, 96, 45, 0.5)]


def _run_ops(G, x, dy, t, v, bias, B, tiled, opts, dt, refs):
    """Every op once with launch options `opts` (forward with and without bias, dX, SDDMM with
    and without db, and for B <= 32 the fused backward); the worst relative error against the
    float64 references (fp16/bf16 errors divided by 100)."""
    yref, ybref, dxref, dvref = refs
    worst = 0.0
    t.cache.clear()
    sd = {k: w for k, w in opts.items() if k != "split"}
    for got, ref in ((G.spmm(x, t, v, **opts), yref), (G.spmm(x, t, v, bias=bias, **opts), ybref),
                     (G.spmm_t(dy, t, v, **opts), dxref), (G.sddmm(dy, x, t, **sd), dvref)):
        e = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        worst = max(worst, e if dt == torch.float32 else e / 100)
    dv, db = G.sddmm(dy, x, t, bias_grad=True, **sd)  # with the bias gradient
    pairs = [(dv, dvref), (db, dy.double().sum(0))]
    if B <= 32 and not tiled:  # the fused backward (dX, dv, db in one launch), same chunks and split
        fk = {k: w for k, w in opts.items() if k != "wide"}
        pairs += zip(G.spmm_t_sddmm(dy, x, t, v, bias_grad=True, fused=True, **fk),
                     (dxref, dvref, dy.double().sum(0)))
    for got, ref in pairs:
        e = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        worst = max(worst, e if dt == torch.float32 else e / 100)
    return worst


def main(sums=("atomic", "parts", "cluster"), tiled=False, own=False, staging=False, mixed=False, dtypes=None,
         shapes=None, gather=False):
    """sums: the ways of adding the wide kernels' partial results to run ("atomic" and "parts":
    ops.PARTIAL_SUMS with ops.CLUSTER_SUMS off; "cluster": the SpMMs' chunk groups through
    thread-block clusters, ops.CLUSTER_SUMS = True);
    tiled: only the batch-tiled kernels (every op forced off the 32-wide ones, no fused backward),
    a shorter run; own: only the lane-owned wide SpMMs (ops.WIDE_OWN), a shorter run; staging:
    only shapes with full 32-row batch tiles and runs of 32 columns (the wide kernels' staging a
    128-byte line per load, and its leftovers), float32 and float16, a shorter run; mixed:
    float32 values and bias with float16 / bfloat16 x and dy (the mixed-precision variants of the
    SpMMs), every variant; gather: only the SpMMs that read x as transposed batch tiles (the
    gathering ones: wide_mode "gather", every dtype), a shorter run. Prints one line per shape as it
    goes (a sanitizer run cut short still shows how far it got). dtypes: only these activation dtypes (names, e.g. ("float32",)) of
    the run's; shapes: only the run's shapes at these positions (0-based), for sanitizer runs
    split over several calls."""
    import snack.gpu as G
    from snack.core import COO
    from snack.gpu import ops
    partial_sums, cluster_sums = ops.PARTIAL_SUMS, ops.CLUSTER_SUMS
    from snack.core.reference import sddmm_reference, spmm_reference, spmm_t_reference
    worst = 0.0
    run_shapes = STAGING_SHAPES if staging else SHAPES
    shapes = run_shapes if shapes is None else [run_shapes[k] for k in shapes]
    runs = [(mode, shape) for mode in (sums[:1] if tiled else sums) for shape in shapes]
    for n, (mode, (o, i, B, d)) in enumerate(runs):
        print(f"[{n + 1}/{len(runs)}] sums={mode} W {o} x {i}, B = {B}, density {d}", flush=True)
        ops.PARTIAL_SUMS = "atomic" if mode == "cluster" else mode
        ops.CLUSTER_SUMS = mode == "cluster"
        dts = ((torch.float16, torch.bfloat16) if mixed else (torch.float32, torch.float16) if staging
               else (torch.float32, torch.float16, torch.bfloat16))
        if dtypes is not None:
            dts = tuple(dt for dt in dts if str(dt).removeprefix("torch.") in dtypes)
        for dt in dts:
            vdt = torch.float32 if mixed else dt  # the values' and the bias's dtype
            coo = COO.random((o, i), density=d, seed=o + i, device="cuda", dtype=vdt)
            x = torch.randn(B, i, device="cuda", dtype=dt)
            dy = torch.randn(B, o, device="cuda", dtype=dt)
            t, v = coo.topology, coo.values
            bias = torch.randn(o, device="cuda", dtype=vdt)
            yref = spmm_reference(x.double(), t.indices, v.double(), o)
            ybref = yref + bias.double()
            dxref = spmm_t_reference(dy.double(), t.indices, v.double(), i)
            dvref = sddmm_reference(dy.double(), x.double(), t.indices)
            # the default variant, then the 32-wide kernels forced (the columns in one chunk,
            # one block looping over small chunks, and three chunks on three blocks adding up
            # as `mode` says) with a warp per row, with a row per group of 8 lanes and (the
            # SpMMs) with lane-owned non-zeros; the forward with and without bias
            owned = ({"wide": True, "mode": "own"}, {"wide": True, "chunks": 3, "split": 1, "mode": "own"},
                     {"wide": True, "chunks": 3, "mode": "own"})
            wide = ({"wide": True, "mode": "warp"}, {"wide": True, "mode": "rows4"},
                    {"wide": True, "chunks": 3, "split": 1, "mode": "warp"},
                    {"wide": True, "chunks": 3, "split": 1, "mode": "rows4"},
                    {"wide": True, "chunks": 3, "mode": "warp"}, {"wide": True, "chunks": 3, "mode": "rows4"}) + owned
            gathering = ({"wide": True, "mode": "gather"},)
            variants = (({"wide": False},) if tiled else owned if own else gathering if gather else wide if staging
                        else ({},) + wide)
            for opts in variants:
                opts = dict(opts)
                with ops.wide_mode(opts.pop("mode", "auto"), sddmm=True):
                    worst = max(worst, _run_ops(G, x, dy, t, v, bias, B, tiled, opts, dt,
                                                (yref, ybref, dxref, dvref)))
    ops.PARTIAL_SUMS, ops.CLUSTER_SUMS = partial_sums, cluster_sums
    # the fused Adam step (AdamW's decay too) against torch's, several grid-stride rounds
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        p = torch.randn(300_001, device="cuda")
        ref = p.clone().requires_grad_()
        opt = cls([ref], lr=0.01, weight_decay=0.1)
        m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device="cuda")
        for _ in range(2):
            grad = torch.randn_like(p)
            ref.grad = grad.clone()
            opt.step()
            step += 1
            G.adam_step(p, grad, m, v, step, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                        decoupled=cls is torch.optim.AdamW)
        worst = max(worst, ((p - ref.detach()).norm() / ref.norm()).item())
    # two tensors per launch, step counts advanced by the kernel (three tensors: two launches)
    ps = [torch.randn(n, device="cuda") for n in (300_001, 77, 5000)]
    refs = [p.clone().requires_grad_() for p in ps]
    opt = torch.optim.Adam(refs, lr=0.01)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    steps, counter = [torch.zeros((), device="cuda") for _ in ps], torch.zeros(2, dtype=torch.int32, device="cuda")
    for _ in range(2):
        grads = [torch.randn_like(p) for p in ps]
        for r, gr in zip(refs, grads):
            r.grad = gr.clone()
        opt.step()
        G.adam_steps(ps, grads, ms, vs, steps, counter=counter, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8)
    assert [float(s) for s in steps] == [2.0] * 3 and int(counter.abs().sum()) == 0
    worst = max([worst] + [((p - r.detach()).norm() / r.norm()).item() for p, r in zip(ps, refs)])
    torch.cuda.synchronize()
    print(f"sanitize run done, worst scaled relative error {worst:.2e}")
    assert worst < 1e-4


def cli(argv=None):
    """The command line: the options checked, then the machine (one line when it has no CUDA GPU), then main()."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sums", nargs="+", choices=["atomic", "parts", "cluster"], default=["atomic", "parts", "cluster"],
                    help="how the wide kernels add partial results (snack.gpu.ops.PARTIAL_SUMS with CLUSTER_SUMS off, "
                         "or the SpMMs' thread-block clusters); default all three")
    ap.add_argument("--tiled", action="store_true",
                    help="only the batch-tiled kernels (and Adam): a shorter run for the sanitizers")
    ap.add_argument("--own", action="store_true",
                    help="only the lane-owned wide SpMMs (and Adam): a shorter run for the sanitizers")
    ap.add_argument("--staging", action="store_true",
                    help="only shapes with full 32-row batch tiles and runs of 32 columns (the wide "
                         "kernels' line-at-a-time staging), float32 and float16: a shorter run")
    ap.add_argument("--gather", action="store_true",
                    help="only the SpMMs that read x as transposed batch tiles (wide mode gather; "
                         "every dtype): a shorter run")
    ap.add_argument("--mixed", action="store_true",
                    help="float32 values and bias with float16 / bfloat16 activations (the SpMMs' "
                         "mixed-precision variants), every variant")
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "float16", "bfloat16"],
                    help="only these activation dtypes of the run's (default: all of them)")
    ap.add_argument("--shapes", nargs="+", type=int, metavar="K",
                    help="only the run's shapes at these 0-based positions (default: all), to split a "
                         "sanitizer run over several calls")
    a = ap.parse_args(argv)
    if a.tiled + a.own + a.staging + a.mixed + a.gather > 1:
        ap.error("give at most one of --tiled, --own, --staging, --mixed, --gather")
    n_shapes = len(STAGING_SHAPES if a.staging else SHAPES)
    if a.shapes is not None and not all(0 <= k < n_shapes for k in a.shapes):
        ap.error(f"--shapes: positions must be in [0, {n_shapes}) for this run, got {a.shapes}")
    run_dtypes = {"float16", "bfloat16"} if a.mixed else {"float32", "float16"} if a.staging else None
    if a.dtypes is not None and run_dtypes is not None and not set(a.dtypes) & run_dtypes:
        ap.error(f"--dtypes: this run has {sorted(run_dtypes)} activations only, got {a.dtypes}")
    require_gpu("sanitize_kernels.py", triton=False)
    main(tuple(a.sums), a.tiled, a.own, a.staging, a.mixed, a.dtypes, a.shapes, a.gather)


if __name__ == "__main__":
    cli()
