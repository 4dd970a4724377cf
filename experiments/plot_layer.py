"""Figures of the one-layer benchmark, drawn only from a CSV of experiments/bench_layer.py (--csv).

    python experiments/plot_layer.py                          # -> papers/fig_layer.png
    python experiments/plot_layer.py --csv=results/bench_layer_cpu.csv --out=/tmp/fig.png

Six panels, against batch size B: training-step time and inference time per method (CUDA-graph
GPU time where the CSV has it, else eager time; a CSV from `bench_layer.py --cold_l2` adds each
method's graph time with a cold L2 as a dashed line), SNACK's speed-up over dense and over
Dense+Mask (graph, graph with a cold L2 where measured, and eager), peak training memory, and
energy per training step.
Trade-off: one figure per sparsity (the CSV's first, or --sparsity); panels whose figures are
all blank (e.g. memory and energy from a CPU run) say so instead of drawing.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))

from experiments.cli import csv_to_plot, figure_arg, read_rows  # noqa: E402
from experiments.results_io import save_figure  # noqa: E402

LABEL = {"snack": "SNACK (COO)", "dense": "dense", "densemask": "Dense+Mask", "cusparse": "cuSPARSE CSR"}
STYLE = {"snack": ("C3", "o"), "dense": ("C0", "s"), "densemask": ("C2", "^"), "cusparse": ("C1", "D")}
DEFAULT_CSV = str(ROOT / "results" / "bench_layer.csv")
# speed-up bars: a colour per (phase, baseline) in the order train / dense, train / Dense+Mask,
# inference / dense, inference / Dense+Mask; a fill per timing: (hatch, alpha, legend words)
SPEEDUP_COLOURS = ("tab:blue", "tab:green", "tab:purple", "tab:olive")
TIMING_FILL = {"graph": ("", 1.0, "graph"), "graph_cold": ("////", 1.0, "graph, cold L2"), "eager": ("", 0.4, "eager")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", default=DEFAULT_CSV, help="a CSV of bench_layer.py (default results/bench_layer.csv)")
    p.add_argument("--out", default=str(ROOT / "papers" / "fig_layer.png"),
                   help="the figure (default papers/fig_layer.png); its extension picks the format, none gives .png")
    p.add_argument("--sparsity", type=float, default=None,
                   help="the CSV's sparsity to draw (default: its first row's)")
    args = p.parse_args(argv)
    args.out = figure_arg(p, "out", args.out)
    return args


def _num(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def load(path, sparsity=None):
    """Rows of the CSV at one sparsity, numbers as floats."""
    rows = read_rows(path, ("method", "phase", "sparsity", "B", "eager_us", "graph_us"), "bench_layer.py")
    keep = sparsity if sparsity is not None else _num(rows[0]["sparsity"])
    out = []
    for r in rows:
        if abs(_num(r["sparsity"]) - keep) > 1e-9:
            continue
        r = dict(r)
        for k in ("B", "eager_us", "graph_us", "graph_cold_us", "peak_mb", "energy_mj", "eager_vs_dense",
                  "graph_vs_dense", "graph_cold_vs_dense", "eager_vs_densemask", "graph_vs_densemask",
                  "graph_cold_vs_densemask"):
            r[k] = _num(r.get(k))
        out.append(r)
    if not out:
        raise SystemExit(f"{path} has no rows at sparsity {keep}")
    if all(math.isnan(r["B"]) or (math.isnan(r["eager_us"]) and math.isnan(r["graph_us"])) for r in out):
        raise SystemExit(f"{path} holds no timing at sparsity {keep} (no row has a batch size and a number "
                         "in eager_us or graph_us): nothing to draw")
    return out, keep


def _series(rows, method, phase, key):
    pts = sorted((r["B"], r[key]) for r in rows if r["method"] == method and r["phase"] == phase)
    return [b for b, _ in pts], [v for _, v in pts]


def _has(rows, key, phase=None):
    return any(not math.isnan(r[key]) for r in rows if phase is None or r["phase"] == phase)


def _blank(ax, what):
    ax.text(0.5, 0.5, f"no {what} in the CSV", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def draw(rows, sparsity):
    """The figure of `rows` (from `load`), not saved; its axes are `fig.axes` row by row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in LABEL if any(r["method"] == m for r in rows)]
    r0 = rows[0]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    time_key = "graph_us" if _has(rows, "graph_us") else "eager_us"
    kind = "CUDA-graph GPU time" if time_key == "graph_us" else "eager time"
    for ax, phase, title in ((axes[0, 0], "train", "training step (fwd + bwd + Adam)"),
                             (axes[0, 1], "infer", "inference (no_grad forward)")):
        for m in methods:
            b, v = _series(rows, m, phase, time_key)
            pts = [(x, y) for x, y in zip(b, v) if not math.isnan(y)]
            if pts:
                c, mk = STYLE[m]
                ax.plot(*zip(*pts), marker=mk, color=c, label=LABEL[m])
            if time_key == "graph_us":
                b, v = _series(rows, m, phase, "graph_cold_us")
                pts = [(x, y) for x, y in zip(b, v) if not math.isnan(y)]
                if pts:
                    c, mk = STYLE[m]
                    ax.plot(*zip(*pts), ls="--", marker=mk, mfc="none", color=c, label=f"{LABEL[m]}, cold L2")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel(f"{kind} per step (us)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()

    ax = axes[0, 2]
    bs = sorted({r["B"] for r in rows})
    bars = []  # one colour per (phase, baseline), one fill per timing
    for colour, (phase, base) in zip(SPEEDUP_COLOURS, [(p, b) for p in ("train", "infer") for b in ("dense", "densemask")]):
        for t, (hatch, alpha, how) in TIMING_FILL.items():
            _, v = _series(rows, "snack", phase, f"{t}_vs_{base}")
            if v and not all(math.isnan(x) for x in v):
                bars.append((f"{phase} vs {LABEL[base]} ({how})", v, colour, hatch, alpha))
    if bars:
        width = 0.8 / len(bars)
        for i, (lab, v, colour, hatch, alpha) in enumerate(bars):
            ax.bar([j + i * width for j in range(len(bs))], v, width, label=lab, color=colour, alpha=alpha,
                   hatch=hatch, edgecolor="white" if hatch else None, linewidth=0)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(bs))], [str(int(b)) for b in bs])
        ax.set_xlabel("batch size B")
        ax.set_ylabel("SNACK speed-up (x)")
        ax.set_title("SNACK speed-up (> 1: faster)")
        top = max((x for bar in bars for x in bar[1] if not math.isnan(x)), default=1.0)
        ncol = 2 if len(bars) > 4 else 1
        ax.set_ylim(0, top * (1.15 + 0.075 * math.ceil(len(bars) / ncol)))  # room above the bars for the legend
        ax.legend(fontsize=6 if len(bars) > 8 else 7, ncol=ncol, loc="upper center")
    else:
        _blank(ax, "speed-ups")

    for ax, key, what, ylabel in ((axes[1, 0], "peak_mb", "peak memory", "peak memory of a training step (MiB)"),
                                  (axes[1, 1], "energy_mj", "energy", "energy per training step (mJ)")):
        if not _has(rows, key, "train"):
            _blank(ax, what)
            continue
        drawn = []  # the methods with a training value (cuSPARSE has inference rows only)
        for m in methods:
            b, v = _series(rows, m, "train", key)
            if v and not all(math.isnan(x) for x in v):
                drawn.append((m, b, v))
        width = 0.8 / len(drawn)
        for i, (m, b, v) in enumerate(drawn):
            c, _ = STYLE[m]
            ax.bar([bs.index(x) + i * width for x in b], v, width, color=c, label=LABEL[m])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(bs))], [str(int(b)) for b in bs])
        ax.set_xlabel("batch size B")
        ax.set_ylabel(ylabel)
        ax.set_title(what + " (training)")
        top = max((x for _, _, v in drawn for x in v if not math.isnan(x)), default=1.0)
        ax.set_ylim(0, top * 1.2)  # room above the bars for the legend
        ax.legend(ncol=len(drawn), fontsize=8, loc="upper center")

    ax = axes[1, 2]
    if _has(rows, "eager_us") and time_key == "graph_us":
        for m in methods:
            for phase, ls in (("train", "-"), ("infer", "--")):
                b, v = _series(rows, m, phase, "eager_us")
                pts = [(x, y) for x, y in zip(b, v) if not math.isnan(y)]
                if pts:
                    c, mk = STYLE[m]
                    ax.plot(*zip(*pts), ls=ls, marker=mk, color=c, label=f"{LABEL[m]} {phase}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel("eager time per call (us)")
        ax.set_title("eager (as a user calls it, L2 flushed)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    else:
        _blank(ax, "separate eager timing")

    amp = r0.get("autocast") or "off"
    prec = "fp32" if amp == "off" else f"fp32 weights, autocast {amp}"
    fig.suptitle(f"one layer {r0['out_features']} x {r0['in_features']}, sparsity {sparsity:g}, {prec} - "
                 f"{r0.get('device_name', '')}, torch {r0.get('torch', '')}, commit {r0.get('commit', '')}, "
                 f"SNACK backend {r0.get('snack_backend', '')}"
                 + (f", optimizer {r0['optimizer']} for every method" if r0.get("optimizer") else ""), fontsize=10)
    fig.tight_layout()
    return fig


def plot(rows, sparsity, out):
    """Draws `rows` and saves the figure at `out` (its extension gives the format); returns the path."""
    import matplotlib.pyplot as plt
    fig = draw(rows, sparsity)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out, dpi=130)
    plt.close(fig)
    return out


def main(argv=None):
    args = parse_args(argv)
    if not csv_to_plot(args.csv, DEFAULT_CSV, "bench_layer.py", "; --device=cpu on a CPU"):
        return None
    rows, sparsity = load(args.csv, args.sparsity)
    out = plot(rows, sparsity, args.out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
