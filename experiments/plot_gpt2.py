"""Figure of the GPT-2 benchmark, drawn only from a CSV of experiments/bench_gpt2.py (--csv).

    python experiments/plot_gpt2.py                           # -> papers/fig_gpt2.png
    python experiments/plot_gpt2.py --csv=results/bench_gpt2_cpu.csv --out=/tmp/fig.png

Three panels against sparsity: peak memory of a training step (dense as a line, Dense+Mask and
SNACK as bars, SNACK's share of dense written on its bar), inference latency (CUDA-graph GPU
time where the CSV has it, else eager time), and SNACK's inference speed-up over Dense+Mask and
over dense. Panels whose figures are all blank (memory from a CPU run) say so instead of drawing;
without the default CSV (not measured yet) nothing is drawn and the script says so.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.cli import csv_to_plot, figure_arg, read_rows  # noqa: E402
from experiments.results_io import save_figure  # noqa: E402
from experiments.plot_layer import _num  # noqa: E402

LABEL = {"snack": "SNACK (COO)", "dense": "dense", "densemask": "Dense+Mask"}
COLOR = {"snack": "C3", "dense": "C0", "densemask": "C2"}
DEFAULT_CSV = str(ROOT / "results" / "bench_gpt2.csv")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", default=DEFAULT_CSV, help="a CSV of bench_gpt2.py (default results/bench_gpt2.csv)")
    p.add_argument("--out", default=str(ROOT / "papers" / "fig_gpt2.png"),
                   help="the figure (default papers/fig_gpt2.png); its extension picks the format, none gives .png")
    args = p.parse_args(argv)
    args.out = figure_arg(p, "out", args.out)
    return args


def load(path):
    """{(phase, method, sparsity): row} with numbers as floats, and the first row (metadata)."""
    rows = read_rows(path, ("model", "n_layer", "n_embd", "method", "sparsity", "phase", "peak_mb", "eager_us",
                            "graph_us"), "bench_gpt2.py")
    table = {}
    for r in rows:
        r = dict(r)
        for k in ("sparsity", "peak_mb", "eager_us", "graph_us"):
            r[k] = _num(r.get(k))
        table[(r["phase"], r["method"], r["sparsity"])] = r
    if not any(k[1] == "dense" for k in table):
        raise SystemExit(f"{path} has no dense rows")
    return table, rows[0]


def main(argv=None):
    args = parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not csv_to_plot(args.csv, DEFAULT_CSV, "bench_gpt2.py", "; --device cpu --tiny on a CPU"):
        return None
    t, meta = load(args.csv)
    sps = sorted({k[2] for k in t if k[1] in ("snack", "densemask")})
    rest = next((r for k, r in t.items() if k[:2] == ("infer", "rest")), None)  # bench_gpt2 --rest
    dense_train, dense_infer = t.get(("train", "dense", 0.0)), t.get(("infer", "dense", 0.0))
    xs = list(range(len(sps)))
    w = 0.38
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))

    ax = axes[0]
    mem = {m: [t.get(("train", m, s), {}).get("peak_mb", math.nan) for s in sps] for m in ("densemask", "snack")}
    if all(math.isnan(v) for vs in mem.values() for v in vs):
        ax.text(0.5, 0.5, "peak memory not measured\n(CPU run)", ha="center", va="center", transform=ax.transAxes)
    else:
        for j, m in enumerate(("densemask", "snack")):
            bars = ax.bar([x + (j - 0.5) * w for x in xs], mem[m], w, color=COLOR[m], label=LABEL[m])
            if m == "snack" and dense_train and not math.isnan(dense_train["peak_mb"]):
                for b, v in zip(bars, mem[m]):
                    ax.annotate(f"{100 * v / dense_train['peak_mb']:.0f}%", (b.get_x() + b.get_width() / 2, v),
                                ha="center", va="bottom", fontsize=8)
        if dense_train and not math.isnan(dense_train["peak_mb"]):
            ax.axhline(dense_train["peak_mb"], color=COLOR["dense"], ls="--", label=LABEL["dense"])
        ax.set_ylabel("peak training memory (MiB)")
        ax.legend(fontsize=8)
    ax.set_title(f"training step, batch {meta.get('batch')} x {meta.get('seq')}")

    # one timing for every bar: graph replay when the dense row has it (a GPU run), else eager;
    # a point without that timing (a failed capture, a mismatch) is left out and named
    graph = dense_infer is not None and not math.isnan(dense_infer["graph_us"])
    key = "graph_us" if graph else "eager_us"
    missing = sorted({f"{LABEL[m]} {s:.0%}" for m in ("densemask", "snack") for s in sps
                      if math.isnan(t.get(("infer", m, s), {}).get(key, math.nan))})

    def latency(phase, m, s):
        return t.get((phase, m, s), {}).get(key, math.nan)

    ax = axes[1]
    for j, m in enumerate(("densemask", "snack")):
        ax.bar([x + (j - 0.5) * w for x in xs], [latency("infer", m, s) for s in sps], w, color=COLOR[m],
               label=LABEL[m])
    if dense_infer:
        ax.axhline(latency("infer", "dense", 0.0), color=COLOR["dense"], ls="--", label=LABEL["dense"])
    if rest is not None and not math.isnan(rest[key]):
        ax.axhline(rest[key], color="0.3", ls=":", label="the rest (blocks' layers doing no work)")
    ax.set_ylim(0, 1.45 * ax.get_ylim()[1])  # room for the legend above the bars
    ax.set_ylabel(("CUDA-graph GPU time" if graph else "eager time") + " (us)")
    ax.set_title(f"inference, {meta.get('infer_batch')} x {meta.get('infer_seq')} tokens")
    if missing:
        ax.text(0.02, 0.98, "not measured: " + ", ".join(missing), transform=ax.transAxes, va="top", fontsize=7)
        print(f"warning: no {key} for " + ", ".join(missing) + " (left out of the figure)")
    ax.legend(fontsize=8)

    ax = axes[2]
    snack_lat = [latency("infer", "snack", s) for s in sps]
    ax.plot(xs, [latency("infer", "densemask", s) / v for s, v in zip(sps, snack_lat)], "o-",
            color=COLOR["densemask"], label="over Dense+Mask")
    if dense_infer:
        ax.plot(xs, [latency("infer", "dense", 0.0) / v for v in snack_lat], "s-", color=COLOR["dense"],
                label="over dense")
        if rest is not None and not math.isnan(rest[key]):
            ax.axhline(latency("infer", "dense", 0.0) / rest[key], color="0.3", ls=":",
                       label="over dense, with layers that take no time")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_ylabel("SNACK inference speed-up (x)")
    ax.set_title("speed-up (" + ("graph" if graph else "eager") + ")")
    ax.legend(fontsize=8, loc="lower right")
    for ax in axes:
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{s:.0%}" for s in sps])
        ax.set_xlabel("sparsity of the transformer blocks' layers")
    fig.suptitle(f"GPT-2 ({meta.get('n_layer')} layers, width {meta.get('n_embd')}), {meta.get('device_name')}, "
                 f"commit {meta.get('commit')}", fontsize=10)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
