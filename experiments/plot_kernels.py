"""Figures from a CSV of experiments/bench_kernels.py (--csv, default results/bench_kernels.csv);
draws nothing it has not read from the CSV.

  papers/fig_kernels.png: for the 4096 x 4096 layer, GPU time (CUDA-graph replay, median) of
  the forward for SNACK, dense cuBLAS, Dense+Mask and cuSPARSE against the batch size, one panel
  per sparsity, log scale; plus SNACK's dX and SDDMM and its fraction of the HBM roofline.
With --markdown it prints the README's tables from the CSV instead: the grid (forward against
dense, Dense+Mask and cuSPARSE, roofline, dX, SDDMM, backward; one row per sparsity and batch)
and the target points (forward, speed-ups, roofline; one row per sparsity). With --markdown
--cold it prints the cold-L2 table from results/bench_cold.csv (experiments/bench_cold.py), and
--cold alone draws papers/fig_kernels_cold.png from it (warm and cold L2 side by side).

Usage: python experiments/plot_kernels.py [--csv results/bench_kernels.csv] [--out papers/fig_kernels.png]
       python experiments/plot_kernels.py --markdown [--csv results/bench_kernels.csv]
           (the README's grid table from the default CSV; its target-point table from
           --csv results/bench_kernels_quick.csv)
       python experiments/plot_kernels.py --markdown --cold [--csv results/bench_cold.csv]
       python experiments/plot_kernels.py --cold [--csv results/bench_cold.csv] [--out papers/fig_kernels_cold.png]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))

from experiments.cli import csv_to_plot, figure_arg, read_rows  # noqa: E402
from experiments.results_io import save_figure  # noqa: E402

DEFAULT_CSV = str(ROOT / "results" / "bench_kernels.csv")
COLD_CSV = str(ROOT / "results" / "bench_cold.csv")
DEFAULT_OUT = str(ROOT / "papers" / "fig_kernels.png")
COLD_OUT = str(ROOT / "papers" / "fig_kernels_cold.png")
COLUMNS = ("shape", "op", "method", "sparsity", "batch", "graph_us", "roofline_frac")
_ESIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


# each method's label and colour in the figures
STYLES = {"snack": ("SNACK", "C3"), "dense": ("dense cuBLAS", "C0"), "dense_mask": ("Dense+Mask", "C1"),
          "cusparse_csr": ("cuSPARSE CSR", "C2")}


def _time_axes(ax, title: str) -> None:
    """A panel of GPU time against the batch size: log-log, labelled, gridded."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("batch B")
    ax.set_ylabel("GPU time, us (graph replay, median)")
    ax.grid(True, which="both", alpha=0.3)


def _timed(r) -> bool:
    return r["graph_us"] not in ("", "nan", None)


def _no_rows(rows, shape: str, source: str) -> SystemExit:
    """One line: `source` has no rows for `shape`; the shapes of `rows`, to pass to --shape."""
    have = sorted({r["shape"] for r in rows})
    return SystemExit(f"no rows for shape {shape} in {source}"
                      + (f" (its shapes: {', '.join(have)}; --shape picks one)" if have else ""))


def _num(x: float) -> str:
    """A time as the README writes it: 3 significant digits, at most one decimal."""
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def markdown_tables(rows, shape: str, source: str) -> str:
    """The README's grid and target-point tables for `shape` from bench_kernels.py rows."""
    t = defaultdict(dict)  # (sparsity, batch) -> {(op, method): graph us}
    roof = {}
    for r in rows:
        if r["shape"] != shape or not _timed(r):
            continue
        k = (float(r["sparsity"]), int(r["batch"]))
        t[k][(r["op"], r["method"])] = float(r["graph_us"])
        if r["op"] == "forward" and r["method"] == "snack" and r["roofline_frac"]:
            roof[k] = float(r["roofline_frac"])
    if not t:
        raise _no_rows([r for r in rows if _timed(r)], shape, source)

    def g(k, op, m="snack"):
        return t[k].get((op, m), float("nan"))
    head = ("| sparsity | B | SNACK fwd | dense | Dense+Mask | cuSPARSE | x dense | x D+M | x cuSPARSE | roofline "
            "| SNACK dX | SNACK SDDMM | dX / fwd | SDDMM / fwd | backward | dX + SDDMM |")
    out = [head, "|" + " --- |" * (head.count("|") - 1)]
    for k in sorted(t):
        f = g(k, "forward")
        d, dm, cs = g(k, "forward", "dense"), g(k, "forward", "dense_mask"), g(k, "forward", "cusparse_csr")
        dx, sd = g(k, "dX"), g(k, "SDDMM")
        out.append(f"| {k[0]:g} | {k[1]} | {_num(f)} | {_num(d)} | {_num(dm)} | {_num(cs)} | {d / f:.2f} | "
                   f"{dm / f:.2f} | {cs / f:.2f} | {100 * roof.get(k, float('nan')):.0f}% | {_num(dx)} | {_num(sd)} | "
                   f"{dx / f:.2f} | {sd / f:.2f} | {_num(g(k, 'backward'))} | {_num(g(k, 'backward', 'snack_separate'))} |")
    batches = sorted({b for _, b in t})
    out += ["", "| sparsity | " + " | ".join(f"B = {b}" for b in batches) + " |",
            "| --- |" + " --- |" * len(batches)]
    for sp in sorted({s for s, _ in t}):
        cells = []
        for b in batches:
            k = (sp, b)
            if k not in t:
                cells.append("")
                continue
            f = g(k, "forward")
            cells.append(f"{f:.2f}: {g(k, 'forward', 'dense') / f:.2f} / {g(k, 'forward', 'dense_mask') / f:.2f} / "
                         f"{g(k, 'forward', 'cusparse_csr') / f:.2f}x, {100 * roof.get(k, float('nan')):.0f}%")
        out.append(f"| {sp:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


COLD_COLUMNS = ("shape", "method", "sparsity", "batch", "warm_us", "cold_us", "roofline_frac_cold")  # bench_cold.py


def cold_table(rows, shape: str, source: str) -> str:
    """The README's cold-L2 table from bench_cold.py rows: per point SNACK's forward warm -> cold
    (us), its cold speed-ups over dense / Dense+Mask / cuSPARSE and its cold roofline fraction."""
    t = defaultdict(dict)  # (sparsity, batch) -> {method: row}
    for r in rows:
        if r["shape"] == shape:
            t[(float(r["sparsity"]), int(r["batch"]))][r["method"]] = r
    if not t:
        raise _no_rows(rows, shape, source)
    batches = sorted({b for _, b in t})
    out = ["| sparsity | " + " | ".join(f"B = {b}" for b in batches) + " |", "| --- |" + " --- |" * len(batches)]
    for sp in sorted({s for s, _ in t}):
        cells = []
        for b in batches:
            m = t.get((sp, b), {})
            if "snack" not in m:
                cells.append("")
                continue
            c = float(m["snack"]["cold_us"])
            x = " / ".join(f"{float(m[n]['cold_us']) / c:.2f}" if n in m else "-"
                           for n in ("dense", "dense_mask", "cusparse_csr"))
            cells.append(f"{float(m['snack']['warm_us']):.2f} -> {c:.2f}: {x}x, "
                         f"{100 * float(m['snack']['roofline_frac_cold']):.0f}%")
        out.append(f"| {sp:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def draw_cold(rows, shape: str, source: str, out: str) -> str:
    """papers/fig_kernels_cold.png from bench_cold.py rows: per sparsity, each method's forward
    against B with a warm L2 (solid) and a cold one (dashed); the last two panels, SNACK's
    speed-up over dense and over cuSPARSE, warm and cold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = defaultdict(dict)  # (sparsity, method, state) -> {B: us}
    for r in rows:
        if r["shape"] == shape:
            for state in ("warm", "cold"):
                data[(float(r["sparsity"]), r["method"], state)][int(r["batch"])] = float(r[f"{state}_us"])
    if not data:
        raise _no_rows(rows, shape, source)
    sps = sorted({k[0] for k in data})
    fig, axes = plt.subplots(1, len(sps) + 2, figsize=(4.0 * (len(sps) + 2), 3.8))
    for ax, sp in zip(axes, sps):
        for m, (label, color) in STYLES.items():
            for state, ls in (("warm", "-"), ("cold", "--")):
                d = data.get((sp, m, state))
                if d:
                    bs = sorted(d)
                    ax.plot(bs, [d[b] for b in bs], marker="o", ms=3, color=color, ls=ls, label=f"{label}, {state} L2")
        _time_axes(ax, f"{shape}, sparsity {sp:g}: forward")
    axes[0].legend(fontsize=6)
    for ax, base in zip(axes[len(sps):], ("dense", "cusparse_csr")):
        for i, sp in enumerate(sps):
            for state, ls in (("warm", "-"), ("cold", "--")):
                s_, b_ = data.get((sp, "snack", state), {}), data.get((sp, base, state), {})
                bs = sorted(set(s_) & set(b_))
                if bs:
                    ax.plot(bs, [b_[b] / s_[b] for b in bs], marker="o", ms=3, color=f"C{i + 4}", ls=ls,
                            label=f"sparsity {sp:g}, {state} L2")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch B")
        ax.set_ylabel("speed-up (> 1: SNACK faster)")
        ax.set_title(f"SNACK's speed-up over {STYLES[base][0]}")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out, dpi=130)
    plt.close(fig)
    print(f"wrote {out}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=None,
                    help="the CSV to read: one of bench_kernels.py (default results/bench_kernels.csv), or with "
                         "--cold one of bench_cold.py (default results/bench_cold.csv)")
    ap.add_argument("--out", default=None,
                    help="the figure (default papers/fig_kernels.png, --cold: papers/fig_kernels_cold.png); "
                         "its extension picks the format, none gives .png")
    ap.add_argument("--shape", default="4096x4096", help="the CSV's shape to draw, OUTxIN (default 4096x4096)")
    ap.add_argument("--markdown", action="store_true", help="print the README tables instead of drawing")
    ap.add_argument("--cold", action="store_true",
                    help="bench_cold.py's CSV instead: its figure (papers/fig_kernels_cold.png), or with "
                         "--markdown the README's cold-L2 table")
    args = ap.parse_args(argv)
    if args.csv is None:
        args.csv = COLD_CSV if args.cold else DEFAULT_CSV
    if args.out is None:
        args.out = COLD_OUT if args.cold else DEFAULT_OUT
    if not args.markdown:  # (a table is printed, nothing written)
        args.out = figure_arg(ap, "out", args.out)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.cold:
        if not csv_to_plot(args.csv, COLD_CSV, "bench_cold.py", " on a GPU"):
            return None
        rows = read_rows(args.csv, COLD_COLUMNS, "bench_cold.py")
        if args.markdown:
            text = cold_table(rows, args.shape, args.csv)
            print(text)
            return text
        return draw_cold(rows, args.shape, args.csv, args.out)
    if not csv_to_plot(args.csv, DEFAULT_CSV, "bench_kernels.py", " on a GPU"):
        return None
    if args.markdown:
        text = markdown_tables(read_rows(args.csv, COLUMNS, "bench_kernels.py"), args.shape, args.csv)
        print(text)
        return text
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = read_rows(args.csv, COLUMNS, "bench_kernels.py")
    drawn = [r for r in every if r["op"] in ("forward", "dX", "SDDMM") and _timed(r)]
    rows = [r for r in drawn if r["shape"] == args.shape]
    if not rows:
        raise _no_rows(drawn, args.shape, args.csv)
    sps = sorted({float(r["sparsity"]) for r in rows})
    data = defaultdict(dict)  # (sparsity, op, method) -> {B: us}
    roof = defaultdict(dict)
    for r in rows:
        key = (float(r["sparsity"]), r["op"], r["method"])
        data[key][int(r["batch"])] = float(r["graph_us"])
        if r["method"] == "snack" and r["op"] == "forward" and r["roofline_frac"]:
            roof[float(r["sparsity"])][int(r["batch"])] = float(r["roofline_frac"])
    fig, axes = plt.subplots(1, len(sps) + 1, figsize=(4.2 * (len(sps) + 1), 3.8))
    for ax, sp in zip(axes, sps):
        for m, (label, color) in STYLES.items():
            d = data.get((sp, "forward", m))
            if d:
                bs = sorted(d)
                ax.plot(bs, [d[b] for b in bs], marker="o", color=color, ls="-", label=label + " fwd")
        for op, ls in (("dX", "--"), ("SDDMM", ":")):
            d = data.get((sp, op, "snack"))
            if d:
                bs = sorted(d)
                ax.plot(bs, [d[b] for b in bs], marker=".", color="C3", ls=ls, label=f"SNACK {op}")
        _time_axes(ax, f"{args.shape}, sparsity {sp:g}")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for sp in sps:
        d = roof.get(sp)
        if d:
            bs = sorted(d)
            ax.plot(bs, [100 * d[b] for b in bs], marker="o", label=f"sparsity {sp:g}")
    ax.axhline(50, color="gray", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_title("SNACK forward: % of HBM roofline")
    ax.set_xlabel("batch B")
    dtype = rows[0].get("dtype") or "float32"
    ax.set_ylabel(f"% of roofline ({8 + _ESIZE.get(dtype, 4)} B/nnz + X, Y)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    gpu = rows[0].get("gpu", "")
    fig.suptitle(f"SNACK-COO kernels on {gpu}, {dtype} (commit {rows[0].get('commit', '?')})", fontsize=10)
    fig.tight_layout()
    import os
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    save_figure(fig, args.out, dpi=130)
    plt.close(fig)
    print(f"wrote {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
