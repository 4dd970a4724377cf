"""One sparse layer end to end: SNACK SparseLinear vs dense nn.Linear vs Dense+Mask (vs cuSPARSE).

    python experiments/bench_layer.py                               # GPU: 4096 x 4096, 90%, B 1..128
    python experiments/bench_layer.py --sparsity=0.95 --batches=1,32
    python experiments/bench_layer.py --device=cpu --quick          # smoke test, seconds (its own CSV)
    python experiments/bench_layer.py --autocast=bfloat16           # mixed precision, as users train

For each batch size B, on one layer (in = out = 4096, fp32, TF32 off as torch's default), the
same random pattern and values in every method:
    snack      snack.SparseLinear (COO values + int32 indices)
    dense      nn.Linear with the dense weight
    densemask  nn.Linear whose forward uses W * M every call, weight gradient masked by a hook
    cusparse   inference only: torch.mm(W_csr, X^T contiguous) (torch.sparse CSR -> cuSPARSE)
With --autocast bfloat16 (or float16) every method's forward runs under torch.autocast with that
dtype, as a mixed-precision training loop runs it: the weights, their gradients and Adam stay
float32, nn.Linear multiplies in the half dtype on the tensor cores (its weight cast every step),
SparseLinear casts only x (on the GPU its kernels read the fp32 values beside half activations,
accumulate in fp32 and write the output in the half dtype; on the CPU the math runs in fp32 and
the result is returned in the half dtype), cuSPARSE
takes a CSR copy of W in that dtype (autocast has no rule for sparse matmuls); dY is given in the
autocast dtype. Autocast's weight-cast cache is off (CUDA-graph capture needs it off; each layer
runs once per step, so the cache would save nothing).
It measures
    train      one step: forward, backward (dX and the weight gradient; x requires grad),
               Adam step (--optimizer adam-fused takes torch's fused Adam kernel, --optimizer
               snack-adam snack.optim.Adam; the same optimizer for every method). The eager
               time and the peak memory use Adam(capturable=False), torch's default and what
               a user's eager loop runs; the graph time and the energy use capturable=True,
               which capture needs (its step count lives on the GPU; torch's Adam then costs
               more per step). The CSV's adam_capturable column says so per row.
               --backward_thread caller runs every method's backward on the calling thread
               (torch.autograd.set_multithreading_enabled(False)) instead of autograd's
               worker thread for the GPU, where a Python backward (SNACK's) waits for the GIL
    infer      forward under torch.no_grad()
as eager time (triton.testing.do_bench: median, L2 flushed: the GPU time from the step's
first to its last kernel after the flush; host time shows where it outlasts the ~60 us flush
kernel queued before the step, as a training step's does), CUDA-graph time (the whole step captured in torch.cuda.graph, replays
timed with triton.testing.do_bench_cudagraph, median: GPU time), peak memory of a step
(torch.cuda.max_memory_allocated above what was allocated before the layer was built: weights,
gradients, Adam state, input, output and temporaries; cuBLAS's one-off workspaces, one per
thread including autograd's worker, are allocated before any method runs) and energy per step (NVML's total-energy
counter across replays of the captured step for >= --energy_seconds). Every replayed graph is
checked first: its output is poisoned with NaN, the graph replayed, the output compared.
The graph time replays the step back to back, so what a method reads and fits in the L2 (50 MB
on the H200: SNACK's COO at 90% does, dense's weight does not) can stay there from one step to
the next; --cold_l2 adds graph_cold_us, each step after a 256 MB read (see graph_cold_us).
Writes a tidy CSV (one row per method x phase x B, with the GPU, versions, git commit, the
backend SNACK ran on, every figure and ratios vs dense and vs Dense+Mask; > 1 means SNACK
uses less) and a JSON of the configuration beside it; prints a short table. Figures:
experiments/plot_layer.py. About 3 minutes on the H200 at the default settings.
Trade-off: a single isolated layer shows the kernels and the per-call overhead clearly but not
a network's overlap of host and device work; the eager numbers carry the overhead beyond the
flush (for the forward alone, `bench_kernels.py`'s 1000-call wall time is the host-bound figure).
On the CPU (--device cpu) timings are wall-clock medians and graph/memory/energy are blank.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import snack  # noqa: E402
from snack.layers import backend as snack_backend  # noqa: E402
from experiments.cli import comma_list, fill_unset, out_arg  # noqa: E402
from experiments.cuda_workspaces import make_cublas_workspaces  # noqa: E402
from experiments.results_io import git_commit, write_csv, write_text  # noqa: E402

METHODS = ("snack", "dense", "densemask", "cusparse")
NAN = float("nan")


# the layer and run sizes, and what --quick takes instead for each of them not given on the command line
DEFAULTS = dict(in_features=4096, out_features=4096, batches="1,8,32,128", warmup_ms=25, rep_ms=200,
                energy_seconds=2.0)
QUICK = dict(in_features=512, out_features=384, batches="1,8", warmup_ms=5, rep_ms=20, energy_seconds=0.2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="where the layer runs (default cuda; cpu: wall-clock times, no graph / memory / energy)")
    p.add_argument("--sparsity", type=float, default=0.9, help="the layer's sparsity, in [0, 1) (default 0.9)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list of the methods to time (default {','.join(METHODS)}; "
                        "cusparse times inference only, and not on the CPU)")
    for key, default in DEFAULTS.items():
        p.add_argument(f"--{key}", type=type(default), default=argparse.SUPPRESS,
                       help=f"(default {default}; --quick: {QUICK[key]})")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adam-fused", "snack-adam"],
                   help="the training step's optimizer, the same for every method: torch.optim.Adam "
                        "with its default (foreach) implementation, or fused=True, or snack.optim.Adam")
    p.add_argument("--autocast", default="off", choices=["off", "bfloat16", "float16"],
                   help="run every method's forward under torch.autocast with this dtype (weights and "
                        "Adam stay float32)")
    p.add_argument("--backward_thread", default="device", choices=["device", "caller"],
                   help="where every method's training step runs its backward: autograd's worker "
                        "thread for the GPU (torch's default) or the calling thread "
                        "(torch.autograd.set_multithreading_enabled(False))")
    p.add_argument("--cold_l2", action="store_true",
                   help="also time every captured step with a cold L2 (GPU only): a graph of copies of "
                        "the step, each after a 256 MB read, minus a graph of the reads alone "
                        "(experiments/bench_cold.py's replay timing); column graph_cold_us")
    p.add_argument("--seed", type=int, default=0, help="seed of the layer's pattern and the inputs")
    p.add_argument("--quick", action="store_true",
                   help="small layer, few repeats: a smoke test (explicit sizes still win)")
    p.add_argument("--out", default=None,
                   help="CSV path (default results/bench_layer[_cpu][_adam_fused|_snack_adam]"
                        "[_autocast_<dtype>][_backward_caller][_quick].csv: a run with another optimizer, "
                        "autocast, backward thread or --quick keeps the default run's CSV); the run's "
                        "configuration is written beside it as a .json of the same name")
    args = p.parse_args(argv)
    fill_unset(args, QUICK if args.quick else DEFAULTS)
    if args.cold_l2 and args.device != "cuda":
        p.error("--cold_l2 times CUDA graphs: it needs --device cuda")
    if not 0.0 <= args.sparsity < 1.0:
        p.error(f"--sparsity must be in [0, 1), got {args.sparsity}")
    for key in ("in_features", "out_features"):
        if getattr(args, key) < 1:
            p.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    for key in ("warmup_ms", "rep_ms", "energy_seconds"):
        if not getattr(args, key) > 0:
            p.error(f"--{key} must be > 0, got {getattr(args, key)}")
    args.batch_list = comma_list(p, "batches", args.batches, int, lambda b: b >= 1, "batch sizes >= 1")
    args.method_list = comma_list(p, "methods", args.methods, str.strip, lambda m: m in METHODS,
                                  f"among {', '.join(METHODS)}")
    if args.out is None:
        name = "bench_layer" + ("" if args.device == "cuda" else "_cpu") + \
            ("" if args.optimizer == "adam" else "_" + args.optimizer.replace("-", "_")) + \
            ("" if args.autocast == "off" else f"_autocast_{args.autocast}") + \
            ("" if args.backward_thread == "device" else "_backward_caller") + \
            ("_cold_l2" if args.cold_l2 else "") + ("_quick" if args.quick else "") + ".csv"
        args.out = str(ROOT / "results" / name)
    if Path(args.out).suffix.lower() == ".json":
        p.error(f"--out {args.out}: the run's configuration is written beside the CSV as "
                f"{Path(args.out).with_suffix('.json').name}, the same file; give --out a .csv path")
    out_arg(p, "out", args.out)
    if config_path(args.out).exists() and not config_path(args.out).is_file():
        p.error(f"--out {args.out}: the run's configuration goes to {config_path(args.out)}, which is not a file")
    return args


def config_path(out) -> Path:
    """Where the run's configuration (JSON) is written beside its CSV `out`."""
    return Path(out).with_suffix(".json")


# ---- the three layers ---------------------------------------------------------------------------
class DenseMask(nn.Module):
    """y = x @ (W * M).T + b with M fixed, the mask applied at every call; W and M are dense
    (out, in). Autograd through W * M masks the weight gradient (dL/dW = dL/d(W*M) * M), as a
    mask-based sparse training code needs: no second mask on the gradient."""

    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.weight = nn.Parameter(weight * mask)
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None
        self.register_buffer("mask", mask.to(weight.dtype))

    def forward(self, x):
        return F.linear(x, self.weight * self.mask, self.bias)


class CuSparse(nn.Module):
    """Inference only: Y = (W_csr @ X^T).T with torch.sparse CSR (cuSPARSE on the GPU). With
    `amp` (a half dtype: the run's --autocast) W is kept in that dtype and x cast to it, since
    autocast has no rule for sparse matmuls."""

    def __init__(self, layer: snack.SparseLinear, amp: Optional[torch.dtype] = None):
        super().__init__()
        topo = snack_backend.get_topology(layer.indices, (layer.out_features, layer.in_features))
        dtype = amp or layer.values.dtype
        # int32 indices, as SNACK reads them (cuSPARSE reads int64 ones more slowly)
        self.w = torch.sparse_csr_tensor(topo.row_ptr, topo.cols.contiguous(),
                                         layer.values.detach().to(dtype, copy=True), topo.shape)
        self.bias = layer.bias.detach().to(dtype, copy=True) if layer.bias is not None else None

    def forward(self, x):
        y = torch.mm(self.w, x.to(self.w.dtype).t().contiguous()).t()
        return y + self.bias if self.bias is not None else y


def build(method: str, ref: snack.SparseLinear, dense_w: torch.Tensor,
          amp: Optional[torch.dtype] = None) -> nn.Module:
    """A layer computing the same function as `ref` (a SparseLinear) by `method`; dense_w is
    ref's dense weight (out, in); amp: the autocast dtype, if any (cuSPARSE's W takes it)."""
    if method == "snack":
        return copy.deepcopy(ref)
    if method == "dense":
        lin = nn.Linear(ref.in_features, ref.out_features, device=dense_w.device, dtype=dense_w.dtype)
        with torch.no_grad():
            lin.weight.copy_(dense_w)
            lin.bias.copy_(ref.bias)
        return lin
    if method == "densemask":
        mask = torch.zeros_like(dense_w, dtype=torch.bool)
        idx = ref.indices.long()
        mask[idx[0], idx[1]] = True
        return DenseMask(dense_w, mask, ref.bias.detach())
    if method == "cusparse":
        return CuSparse(ref, amp)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


# ---- the two phases -------------------------------------------------------------------------------
def autocast_context(device: torch.device, amp: Optional[torch.dtype]):
    """torch.autocast on `device` with dtype amp (weight-cast cache off), or nothing for None."""
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp, cache_enabled=False)


def make_step(model: nn.Module, phase: str, x: torch.Tensor, dy: torch.Tensor,
              opt: Optional[torch.optim.Optimizer], amp: Optional[torch.dtype] = None,
              backward_thread: str = "device") -> Callable[[], torch.Tensor]:
    """train: zero grads, y = model(x), y.backward(dy) (dX and the weight gradient), opt.step();
    infer: y = model(x) under no_grad. Returns y (the forward output) either way. With amp (a
    half dtype) the forward runs under torch.autocast with it. backward_thread "caller" runs the
    backward on the calling thread (torch.autograd.set_multithreading_enabled(False)) instead of
    autograd's worker thread for the GPU (torch's default, "device")."""
    if phase == "infer":
        def infer():
            with torch.no_grad(), autocast_context(x.device, amp):
                return model(x)
        return infer
    threads = (torch.autograd.set_multithreading_enabled if backward_thread == "caller"
               else lambda enabled: contextlib.nullcontext())

    def train():
        opt.zero_grad(set_to_none=True)
        x.grad = None
        with autocast_context(x.device, amp):
            y = model(x)
        with threads(False):
            y.backward(dy)
        opt.step()
        return y
    return train


# ---- measurement -------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_us(fn, device, args) -> float:
    """Median time of one call in microseconds: triton.testing.do_bench on the GPU (L2 flushed),
    wall clock on the CPU."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _events_us(fn, args)
        return 1e3 * do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    for _ in range(3):
        fn()
    times, t_end = [], time.perf_counter() + args.rep_ms / 1e3
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _events_us(fn, args, n: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return 1e3 * statistics.median(times)


def capture(fn) -> tuple:
    """(graph, static output) of fn captured in torch.cuda.graph after a side-stream warm-up
    (each preceded by `settle_autograd`: no AccumulateGrad node of an earlier pass reused)."""
    from snack.layers.functional import settle_autograd
    settle_autograd()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    settle_autograd()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    # the static output without its autograd graph: kept with it, that graph's AccumulateGrad
    # nodes (made on the capture stream) would be reused by the next eager pass on another stream
    return g, out.detach()


def check_graph(g, out: torch.Tensor, expected: torch.Tensor) -> bool:
    """Poisons the static output, replays, and compares with the eager result (to 1e-3, or to
    2e-2 for half-precision outputs: the two runs' fp32 sums may round to neighbouring values)."""
    out.detach().fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    tol = 1e-3 if out.dtype in (torch.float32, torch.float64) else 2e-2
    return out.dtype == expected.dtype and bool(torch.allclose(out.float(), expected.float(), rtol=tol, atol=tol))


def graph_us(fn, g, args) -> float:
    """GPU time of one step from CUDA-graph replay, microseconds (median)."""
    try:
        from triton.testing import do_bench_cudagraph
    except ImportError:
        do_bench_cudagraph = None
    if do_bench_cudagraph is not None:
        from snack.layers.functional import settle_autograd
        settle_autograd()  # (its warm-up call runs on a new stream: no node of an earlier pass reused)
        with torch.cuda.stream(torch.cuda.Stream()):
            return 1e3 * do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median")
    return _events_us(g.replay, args)


COLD_COPIES, COLD_REPLAYS = 10, 10
_flush_buf = None


def _flush_buffer() -> torch.Tensor:
    """The 256 MB buffer whose read evicts the L2 (made once, on the current GPU, and kept)."""
    global _flush_buf
    if _flush_buf is None:
        from experiments.bench_cold import FLUSH_BYTES
        _flush_buf = torch.ones(FLUSH_BYTES // 4, device="cuda")
    return _flush_buf


def graph_cold_us(fn) -> float:
    """GPU time of one step with a cold L2, microseconds: a graph of COLD_COPIES copies of the
    step, each after a read of a 256 MB buffer, minus a graph of the reads alone, per copy
    (median of COLD_REPLAYS replays; experiments/bench_cold.replay_us). The buffer is made once
    and kept (allocated before a method's baseline, so no step's peak memory counts it)."""
    from experiments.bench_cold import replay_us
    from snack.layers.functional import settle_autograd
    buf = _flush_buffer()

    def flush():
        buf.sum()
    settle_autograd()  # (as graph_us: no autograd node of an earlier pass reused on a new stream)
    reads = replay_us(lambda: None, COLD_COPIES, COLD_REPLAYS, flush)
    return replay_us(fn, COLD_COPIES, COLD_REPLAYS, flush) - reads


def _nvml_handle(device):
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        p = torch.cuda.get_device_properties(device)
        bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:
            return None


def energy_per_step(g, handle, seconds: float) -> tuple:
    """(millijoules per replay, average watts) over replays of g for >= `seconds`."""
    if handle is None:
        return NAN, NAN
    import pynvml
    torch.cuda.synchronize()
    e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
    n = 0
    while True:
        for _ in range(100):
            g.replay()
        n += 100
        if time.perf_counter() - t0 >= seconds:
            torch.cuda.synchronize()
            if time.perf_counter() - t0 >= seconds:
                break
    e1, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
    return (e1 - e0) / n, (e1 - e0) / 1e3 / (t1 - t0)


def make_adam(model: nn.Module, args, capturable: bool = False) -> torch.optim.Optimizer:
    """Adam (lr 1e-6) in the implementation --optimizer names: torch's default (foreach), torch's
    fused, or snack.optim.Adam (its GPU step is capturable whatever `capturable` says)."""
    if args.optimizer == "snack-adam":
        return snack.optim.Adam(model.parameters(), lr=1e-6, capturable=capturable)
    return torch.optim.Adam(model.parameters(), lr=1e-6, capturable=capturable,
                            fused=True if args.optimizer == "adam-fused" else None)


def measure(method: str, phase: str, B: int, ref: snack.SparseLinear, dense_w: torch.Tensor,
            args, nvml) -> Dict[str, object]:
    """Every figure of one (method, phase, B)."""
    device = dense_w.device
    amp = None if args.autocast == "off" else getattr(torch, args.autocast)
    row = dict(method=method, phase=phase, B=B, eager_us=NAN, graph_us=NAN, graph_cold_us=NAN, peak_mb=NAN,
               energy_mj=NAN, power_w=NAN, graph_check="n/a",
               adam_capturable="eager and peak: False, graph and energy: True" if phase == "train" else "")
    if method == "cusparse" and phase == "train":
        return row
    g = torch.Generator(device=device).manual_seed(args.seed + B)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        _sync(device)
        base = torch.cuda.memory_allocated(device)
    model = build(method, ref, dense_w, amp)
    x = torch.randn(B, ref.in_features, device=device, generator=g, requires_grad=phase == "train")
    dy = torch.randn(B, ref.out_features, device=device, generator=g, dtype=amp or torch.float32)
    opt = make_adam(model, args) if phase == "train" else None
    fn = make_step(model, phase, x, dy, opt, amp, args.backward_thread)
    for _ in range(2):
        fn()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    row["eager_us"] = eager_us(fn, device, args)
    if device.type == "cuda":
        if phase == "train":   # a capturable optimizer for the graph (its state on the device)
            del opt
            opt = make_adam(model, args, capturable=True)
            fn = make_step(model, phase, x, dy, opt, amp, args.backward_thread)
        try:
            gr, out = capture(fn)
            with torch.no_grad(), autocast_context(device, amp):
                expected = model(x)
            ok = check_graph(gr, out, expected)
            row["graph_check"] = "ok" if ok else "MISMATCH"
            if not ok:  # a graph that does not compute the step: nothing of it is timed
                raise RuntimeError("the replayed graph's output differs from the eager step's")
            row["graph_us"] = graph_us(fn, gr, args)
            row["energy_mj"], row["power_w"] = energy_per_step(gr, nvml, args.energy_seconds)
            if args.cold_l2:
                row["graph_cold_us"] = graph_cold_us(fn)
            del gr, out
        except Exception as e:  # keep the other figures; say why in the CSV
            if row.get("graph_check") != "MISMATCH":
                row["graph_check"] = f"error: {type(e).__name__}: {str(e)[:120]}"
    del model, opt, fn, x, dy
    return row


# ---- bookkeeping -------------------------------------------------------------------------------------
def environment(device: torch.device) -> Dict[str, str]:
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:
            return ""
    env = dict(device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                            else platform.processor() or platform.machine()),
               torch=torch.__version__, cuda=torch.version.cuda or "", numba=version("numba"),
               triton=version("triton"), python=platform.python_version(), commit=git_commit(),
               date=datetime.datetime.now().isoformat(timespec="seconds"),
               snack_backend=snack_backend.backend_name(device, torch.float32),
               tf32=str(torch.backends.cuda.matmul.allow_tf32),
               captured_two_branches=str(snack.layers.functional.CAPTURED_TWO_BRANCHES))
    return env


RATIO_OF = {"eager_us": "eager", "graph_us": "graph", "graph_cold_us": "graph_cold", "peak_mb": "mem",
            "energy_mj": "energy"}


def add_ratios(rows: List[dict]) -> None:
    """For each row: <metric>_vs_dense = dense's figure / this row's (and _vs_densemask), same
    phase and B; > 1 means this method is faster / leaner."""
    by = {(r["method"], r["phase"], r["B"]): r for r in rows}
    for r in rows:
        for base in ("dense", "densemask"):
            b = by.get((base, r["phase"], r["B"]))
            for metric, short in RATIO_OF.items():
                num = b[metric] if b is not None else NAN
                den = r[metric]
                ok = isinstance(num, float) and isinstance(den, float) and den > 0 and \
                    not (math.isnan(num) or math.isnan(den))
                r[f"{short}_vs_{base}"] = num / den if ok else NAN


def print_table(rows: List[dict], env: dict, args) -> None:
    print(f"{env['device_name']}  torch {env['torch']}  numba {env['numba']}  triton {env['triton']}  "
          f"commit {env['commit']}  snack backend: {env['snack_backend']}")
    prec = "fp32" if args.autocast == "off" else f"fp32 weights, forward under autocast({args.autocast})"
    print(f"layer {args.out_features} x {args.in_features}, sparsity {args.sparsity}, {prec}, optimizer "
          f"{args.optimizer}; times in us "
          "(eager / graph), peak MiB; x = speed-up vs dense / vs Dense+Mask (graph, else eager)")
    cold = args.cold_l2
    print(f"{'phase':6s} {'B':>4s} {'method':10s} {'eager':>9s} {'graph':>9s} {'peak MiB':>9s} "
          f"{'mJ/step':>8s} {'x dense':>8s} {'x D+M':>7s}" + (f" {'cold L2':>9s} {'x dense':>8s} {'x D+M':>7s}"
                                                            if cold else "") + " check")
    for r in rows:
        if r["method"] == "cusparse" and r["phase"] == "train":
            continue
        key = "graph" if not math.isnan(r.get("graph_vs_dense", NAN)) else "eager"
        print(f"{r['phase']:6s} {r['B']:4d} {r['method']:10s} {r['eager_us']:9.1f} {r['graph_us']:9.1f} "
              f"{r['peak_mb']:9.1f} {r['energy_mj']:8.3f} {r[key + '_vs_dense']:8.2f} "
              f"{r[key + '_vs_densemask']:7.2f}" + (f" {r['graph_cold_us']:9.1f} {r['graph_cold_vs_dense']:8.2f} "
                                                     f"{r['graph_cold_vs_densemask']:7.2f}" if cold else "")
              + f" {r['graph_check']}")


def main(argv=None) -> List[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is visible; use --device cpu --quick for a smoke test")
    methods = args.method_list
    if device.type == "cpu":
        methods = [m for m in methods if m != "cusparse"] or methods
    batches = args.batch_list
    torch.manual_seed(args.seed)
    ref = snack.SparseLinear(args.in_features, args.out_features, sparsity=args.sparsity, device=device)
    dense_w = ref.to_dense().detach()
    if device.type == "cuda":
        # cuBLAS's workspaces (per thread: this one and autograd's worker) made before any
        # method, so that they are not counted in whichever method's step runs a GEMM first
        make_cublas_workspaces(device)
        if args.cold_l2:  # the flush buffer, before any method's baseline
            _flush_buffer()
    env = environment(device)
    nvml = _nvml_handle(device) if device.type == "cuda" else None
    rows = []
    for B in batches:
        for phase in ("train", "infer"):
            for m in methods:
                r = measure(m, phase, B, ref, dense_w, args, nvml)
                rows.append(r)
                print(f"  {phase} B={B} {m}: eager {r['eager_us']:.1f} us, graph {r['graph_us']:.1f} us, "
                      f"{r['graph_check']}", file=sys.stderr, flush=True)
    add_ratios(rows)
    common = dict(in_features=args.in_features, out_features=args.out_features, sparsity=args.sparsity,
                  nnz=ref.nnz, dtype="float32", autocast=args.autocast, optimizer=args.optimizer,
                  backward_thread=args.backward_thread, **env)
    rows = [{**common, **r} for r in rows]
    print_table(rows, env, args)
    out = write_csv(args.out, [{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()}
                               for r in rows])
    write_text(config_path(out), json.dumps(vars(args), indent=1) + "\n")
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
    main(sys.argv[1:])
