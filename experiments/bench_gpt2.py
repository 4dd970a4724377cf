"""GPT-2 end to end: peak training memory and CUDA-graph inference latency, SNACK vs dense vs Dense+Mask.

    python experiments/bench_gpt2.py                          # GPU: GPT-2 small (124 M), 90 / 95 / 99 %
    python experiments/bench_gpt2.py --sparsities=0.99 --infer_batch=1
    python experiments/bench_gpt2.py --sparsities=0.99 --rest  # also the model without the 48 layers' work
    python experiments/bench_gpt2.py --device=cpu --tiny      # smoke test, seconds (its own CSV)

The model is transformers' GPT2LMHeadModel built from a GPT2Config (random weights: no download;
the values of the weights change neither time nor memory), dropout off, fp32, TF32 off as torch's
default. For each sparsity the transformer blocks' Conv1D layers (attention c_attn / c_proj, MLP
c_fc / c_proj: 48 layers, 85 M of GPT-2 small's 124 M parameters) become
    snack      `snack.sparsify(model, sparsity)`: SparseLinear, the largest magnitudes kept
    densemask  the same masks on the dense weights, applied at every forward (a torch
               parametrization W * M, so the weight gradient is masked too)
and `dense` is the unchanged model. The tied lm_head / token embedding, the position embedding
and the layer norms stay dense in every method (sparsify leaves tied weights alone).
Measured per method:
    train   steps of AdamW (torch's, the same for every method; --optimizer snack-adamw takes
            snack.optim.AdamW) on `batch` x `seq` random tokens with the language-model loss:
            peak memory (torch.cuda.max_memory_allocated over three steps, above what was
            allocated before the model was built: weights, gradients, optimizer state,
            activations) and the eager step time (median, L2 flushed)
    infer   logits of `infer_batch` x `infer_seq` tokens under torch.no_grad(): GPU time from
            replays of the forward captured in a CUDA graph (checked first: output poisoned,
            replayed, compared) and the eager time (median, L2 flushed)
Before timing, every SNACK model's logits are compared with the Dense+Mask model's (same masks,
same weights; column rel_err).
With --rest a fourth method, `rest`, times the inference of the model without the converted
layers' work: each of them returns an uninitialized output of its shape (no GPU work; the logits
are meaningless and not checked). Its graph time is what the dense rest of the model (embeddings,
attention, layer norms, the LM head) costs, so `graph_us - rest` is what the 48 layers cost in
each method, and rest bounds any end-to-end speed-up a sparse layer can give.
Writes a tidy CSV (one row per method x phase x sparsity, with the GPU, versions, git commit and
ratios vs dense and vs Dense+Mask: > 1 means SNACK uses less) and prints a table. Figure:
experiments/plot_gpt2.py. About 2 minutes on the H200 at the defaults.
On the CPU (--device cpu) times are wall-clock medians and memory / graph columns are blank.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import snack  # noqa: E402
from experiments.bench_layer import _sync, capture, environment, eager_us, graph_us  # noqa: E402
from experiments.cli import comma_list, fill_unset, out_arg  # noqa: E402
from experiments.results_io import write_csv  # noqa: E402

METHODS = ("snack", "dense", "densemask")
NAN = float("nan")


# the model and run sizes, and what --tiny takes instead for each of them not given on the command line
DEFAULTS = dict(n_layer=12, n_embd=768, n_head=12, vocab=50257, batch=8, seq=256, infer_batch=1, infer_seq=128,
                warmup_ms=25, rep_ms=200)
TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab=512, batch=2, seq=16, infer_batch=1, infer_seq=16,
            warmup_ms=5, rep_ms=20)
HELP = dict(n_layer="transformer blocks", n_embd="width", n_head="attention heads", vocab="vocabulary size",
            batch="training batch (sequences)", seq="training sequence length",
            infer_batch="inference batch (sequences)", infer_seq="inference sequence length",
            warmup_ms="warm-up of each timing, ms", rep_ms="length of each timing, ms")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="where the model runs (default cuda; cpu: wall-clock times, no graph / memory)")
    p.add_argument("--sparsities", default="0.9,0.95,0.99",
                   help="comma list in [0, 1): the blocks' layers' sparsities (default 0.9,0.95,0.99)")
    for key, default in DEFAULTS.items():
        p.add_argument(f"--{key}", type=int, default=argparse.SUPPRESS,
                       help=f"{HELP[key]} (default {default}; --tiny: {TINY[key]})")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "snack-adamw"],
                   help="the training step's optimizer, the same for every method: torch.optim.AdamW "
                        "(default) or snack.optim.AdamW")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and the tokens")
    p.add_argument("--tiny", action="store_true",
                   help="2 layers of width 64, short sequences: a smoke test (explicit sizes still win)")
    p.add_argument("--rest", action="store_true",
                   help="also time the inference of the model whose converted layers do no work "
                        "(method `rest`): the dense rest's share of the latency")
    p.add_argument("--out", default=None,
                   help="CSV path (default results/bench_gpt2[_cpu][_tiny].csv: a --tiny run keeps the full-size "
                        "run's CSV)")
    args = p.parse_args(argv)
    fill_unset(args, TINY if args.tiny else DEFAULTS)
    args.sparsity_list = comma_list(p, "sparsities", args.sparsities, float, lambda s: 0.0 <= s < 1.0,
                                    "numbers in [0, 1)")
    for k in ("n_layer", "n_embd", "n_head", "vocab", "batch", "seq", "infer_batch", "infer_seq"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1, got {getattr(args, k)}")
    for k in ("warmup_ms", "rep_ms"):
        if not getattr(args, k) > 0:
            p.error(f"--{k} must be > 0, got {getattr(args, k)}")
    if args.n_embd % args.n_head:
        p.error(f"--n_embd ({args.n_embd}) must be a multiple of --n_head ({args.n_head})")
    if args.out is None:
        args.out = str(ROOT / "results" / ("bench_gpt2" + ("" if args.device == "cuda" else "_cpu")
                                           + ("_tiny" if args.tiny else "") + ".csv"))
    out_arg(p, "out", args.out)
    return args


# ---- the models -----------------------------------------------------------------------------------
def dense_model(args) -> nn.Module:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise SystemExit("bench_gpt2 needs transformers: pip install -e '.[experiments]'") from e
    torch.manual_seed(args.seed)
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=max(args.seq, args.infer_seq, 16), n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False)
    return GPT2LMHeadModel(cfg).eval()


class _Mask(nn.Module):
    """W -> W * M (a parametrization: the mask is applied at every forward and masks the
    gradient of the underlying weight too)."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, w):
        return w * self.mask


def sparse_pair(dense: nn.Module, sparsity: float):
    """(SNACK model, Dense+Mask model with the same masks, sparsify's summary), built on the CPU."""
    sp = copy.deepcopy(dense)
    sp, summary = snack.sparsify(sp, sparsity, summary=True)
    dm = copy.deepcopy(dense)
    for row in summary.rows:
        layer = sp.get_submodule(row.name)
        target = dm.get_submodule(row.name)
        with torch.no_grad():
            mask = (layer.to_dense() != 0).to(target.weight.dtype)
            if type(target).__name__ == "Conv1D":  # weight stored (in, out)
                mask = mask.t().contiguous()
            target.weight.mul_(mask)
        parametrize.register_parametrization(target, "weight", _Mask(mask))
    return sp, dm, summary


class _NoWork(nn.Module):
    """Stands in for a converted layer in the `rest` model: an uninitialized (..., out_features)
    output, no GPU work (inside a CUDA graph an allocation is free)."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return x.new_empty(*x.shape[:-1], self.out_features)


def rest_model(dense: nn.Module, summary) -> nn.Module:
    """A copy of `dense` with every layer that `summary` lists converted replaced by _NoWork."""
    rest = copy.deepcopy(dense)
    for row in summary.rows:
        parent, _, name = row.name.rpartition(".")
        old = rest.get_submodule(row.name)
        out = old.nf if type(old).__name__ == "Conv1D" else old.out_features
        setattr(rest.get_submodule(parent) if parent else rest, name, _NoWork(out))
    return rest


# ---- measurements ---------------------------------------------------------------------------------
def make_optimizer(model, args):
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "snack-adamw":
        return snack.optim.AdamW(params, lr=1e-5)
    return torch.optim.AdamW(params, lr=1e-5)


def train_step(model, device, args):
    """One AdamW training step of `model` (on `device`, in train mode) on the run's random tokens,
    as a function returning the loss."""
    opt = make_optimizer(model, args)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        return out.loss
    return step


def warm_up(build, device, args) -> None:
    """One throwaway training step of build()'s model, then nothing kept but what the libraries
    keep for good: cuBLAS / cuBLASLt allocate a workspace per thread (this one, and autograd's
    worker of the device, which runs the backward's GEMMs) at their first GEMMs, which would
    otherwise count in the peak memory of whichever method runs first. (measure_train frees
    the model's memory before it takes its baseline.)"""
    float(train_step(build().to(device).train(), device, args)().detach())


def measure_train(build, device, args) -> Dict[str, float]:
    """Peak memory (MiB, the column peak_mb) above the baseline before `build()` and the eager step time (us)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    model = build().to(device).train()
    step = train_step(model, device, args)
    losses = [float(step().detach()) for _ in range(3)]
    _sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20 if device.type == "cuda" else NAN
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite training loss {losses}")
    t = eager_us(step, device, args)
    return dict(peak_mb=peak, eager_us=t, loss=losses[-1])


def measure_infer(model, ids, device, args, expected=None, check=True) -> Dict[str, float]:
    """Eager and CUDA-graph forward latency (us) of the logits; graph_check says whether the
    replayed graph reproduced the eager logits ("not checked" where `check` is False)."""
    model = model.to(device).eval()

    def fwd():
        with torch.no_grad():
            return model(input_ids=ids).logits

    ref = fwd() if expected is None else expected
    res = dict(eager_us=eager_us(fwd, device, args), graph_us=NAN, graph_check="")
    if device.type == "cuda":
        try:
            g, out = capture(fwd)
        except Exception as e:  # a model whose forward cannot be captured: say so, keep the eager time
            res["graph_check"] = f"capture failed: {type(e).__name__}"
            return res
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ok = bool(torch.allclose(out, ref, rtol=1e-3, atol=1e-3)) if check else True
        res["graph_check"] = ("ok" if ok else "MISMATCH") if check else "not checked"
        if ok:
            res["graph_us"] = graph_us(fwd, g, args)
        del g, out
    return res


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- driver ---------------------------------------------------------------------------------------
def add_ratios(rows: List[dict]) -> None:
    """x_vs_dense / x_vs_densemask = other / SNACK (> 1: SNACK uses less) per phase, sparsity."""
    by = {}
    for r in rows:
        by.setdefault((r["phase"], r["sparsity"]), {})[r["method"]] = r
    dense = {r["phase"]: r for r in rows if r["method"] == "dense"}
    for (phase, _), m in by.items():
        for r in m.values():
            for col in ("peak_mb", "eager_us", "graph_us"):
                for other, ref in (("dense", dense.get(phase)), ("densemask", m.get("densemask"))):
                    v = r.get(col, NAN)
                    o = ref.get(col, NAN) if ref else NAN
                    r[f"{col}_{other}_over_this"] = o / v if (v and v == v and o == o) else NAN


def print_table(rows: List[dict], env: dict, args) -> None:
    print(f"GPT-2 n_layer={args.n_layer} n_embd={args.n_embd} on {env['device_name']} (commit {env['commit']}); "
          f"train batch {args.batch} x {args.seq}, infer {args.infer_batch} x {args.infer_seq}, {args.optimizer}")
    print(f"{'phase':5s} {'sparsity':>8s} {'method':10s} {'peak MiB':>9s} {'eager us':>10s} {'graph us':>10s} "
          f"{'mem dense/this':>14s} {'graph D+M/this':>14s} {'rel_err':>8s}")
    for r in rows:
        print(f"{r['phase']:5s} {r['sparsity']:8.2f} {r['method']:10s} {r['peak_mb']:9.1f} {r['eager_us']:10.1f} "
              f"{r['graph_us']:10.1f} {r['peak_mb_dense_over_this']:14.2f} {r['graph_us_densemask_over_this']:14.2f} "
              f"{format(r['rel_err'], '.1e') if r['rel_err'] != '' else '':>8}")


def print_rest(rows: List[dict]) -> None:
    """The converted layers' share of the inference latency: each method's time minus `rest`'s
    (graph replay on the GPU, else eager), and the speed-up the whole model would show if those
    layers took no time at all."""
    col = "graph_us" if any(r["graph_us"] == r["graph_us"] for r in rows if r["method"] == "rest") else "eager_us"
    infer = [r for r in rows if r["phase"] == "infer"]
    rest = next(r[col] for r in infer if r["method"] == "rest")
    dense = next((r[col] for r in infer if r["method"] == "dense"), NAN)
    print(f"inference, {col[:-3]} time: the model without the converted layers' work (rest) {rest:.1f} us; "
          f"the layers alone (method - rest):")
    print(f"  dense {dense - rest:.1f} us")
    for s in sorted({r["sparsity"] for r in infer if r["method"] == "snack"}):
        sn, dm = (next((r[col] for r in infer if r["method"] == m and r["sparsity"] == s), NAN)
                  for m in ("snack", "densemask"))
        print(f"  at {s:.2f}: snack {sn - rest:.1f} us, densemask {dm - rest:.1f} us "
              f"({(dm - rest) / (sn - rest):.2f}x; the whole model {dm / sn:.2f}x)")
    print(f"  with layers that took no time the whole model would be {dense / rest:.2f}x faster than dense")


def main(argv=None) -> List[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (use --device cpu for a smoke test)")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **k):
            return x
    env = environment(device)
    dense = dense_model(args)
    n_params = sum(p.numel() for p in dense.parameters())
    g = torch.Generator(device="cpu").manual_seed(args.seed + 2)
    ids = torch.randint(0, args.vocab, (args.infer_batch, args.infer_seq), generator=g).to(device)
    meta = dict(model="gpt2", n_layer=args.n_layer, n_embd=args.n_embd, n_params=n_params, dtype="float32",
                optimizer=args.optimizer, batch=args.batch, seq=args.seq, infer_batch=args.infer_batch,
                infer_seq=args.infer_seq, **env)
    rows = []
    jobs = [("dense", None)] + [(m, s) for s in args.sparsity_list for m in ("snack", "densemask")]
    pairs = {}
    if device.type == "cuda":
        warm_up(lambda: copy.deepcopy(dense), device, args)
    for method, sparsity in tqdm(jobs, desc="gpt2", unit="model"):
        if method == "dense":
            build, summary = (lambda: copy.deepcopy(dense)), None
        else:
            if sparsity not in pairs:
                pairs[sparsity] = sparse_pair(dense, sparsity)
            sp, dm, summary = pairs[sparsity]
            src = sp if method == "snack" else dm
            build = (lambda src=src: copy.deepcopy(src))
        err = ""
        if method == "snack":  # the SNACK logits against Dense+Mask's, before any timing
            with torch.no_grad():
                a = copy.deepcopy(pairs[sparsity][0]).to(device).eval()(input_ids=ids).logits
                b = copy.deepcopy(pairs[sparsity][1]).to(device).eval()(input_ids=ids).logits
            err = rel_err(a, b)
            if not err < 1e-3:
                raise RuntimeError(f"SNACK's logits differ from Dense+Mask's at sparsity {sparsity}: rel_err {err:.2e}")
            del a, b
        tr = measure_train(build, device, args)
        model = build()
        inf = measure_infer(model, ids, device, args)
        del model
        conv = dict(converted_layers=len(summary.rows) if summary else 0,
                    params_after=summary.params_after if summary else n_params)
        s = 0.0 if sparsity is None else sparsity
        rows.append(dict(meta, method=method, sparsity=s, phase="train", peak_mb=tr["peak_mb"],
                         eager_us=tr["eager_us"], graph_us=NAN, graph_check="", rel_err=err, loss=tr["loss"], **conv))
        rows.append(dict(meta, method=method, sparsity=s, phase="infer", peak_mb=NAN, eager_us=inf["eager_us"],
                         graph_us=inf["graph_us"], graph_check=inf["graph_check"], rel_err=err, loss="", **conv))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.rest:
        s0 = args.sparsity_list[0]
        if s0 not in pairs:
            pairs[s0] = sparse_pair(dense, s0)
        summary = pairs[s0][2]
        model = rest_model(dense, summary)
        inf = measure_infer(model, ids, device, args, check=False)
        del model
        rows.append(dict(meta, method="rest", sparsity=NAN, phase="infer", peak_mb=NAN, eager_us=inf["eager_us"],
                         graph_us=inf["graph_us"], graph_check=inf["graph_check"], rel_err="",
                         loss="", converted_layers=len(summary.rows), params_after=n_params - summary.params_before))
    add_ratios(rows)
    out = write_csv(args.out, rows)
    print_table(rows, env, args)
    if args.rest:
        print_rest(rows)
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
