"""The performance targets of the kernels and of the layer, read from the committed CSVs.

    python experiments/targets.py              # one line per target: met / NOT met, value, target
    python experiments/targets.py --markdown   # the README's table ("Targets at a glance")
    python experiments/targets.py --cold       # the same targets read on the cold-L2 timings
    python experiments/targets.py --h100       # the same targets on the latest H100 runs (README,
                                               # "On an H100"; the targets are stated for the H200)

Every value is a ratio in which larger is better (a speed-up, a fraction of the roofline, dense's
bytes or energy over SNACK's), so a target is met when value >= target. The targets are read on
the warm tables (graph replay back to back, `bench_kernels.py --quick`, `bench_layer.py
--optimizer snack-adam`), as the targets are stated; `--cold` reads the same ratios on
`bench_cold.py` and `bench_layer.py --cold_l2`, which show what a model sees when other work
evicts the L2 between calls. Only a CSV's rows at 4096 x 4096, the shape the targets are stated
at, are read; a CSV that cannot give every target (another script's, no row at that shape, a
target point missing) stops with one line saying why. The notebook papers/figures.ipynb prints
the same checks.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
KERNELS_CSV = ROOT / "results" / "bench_kernels_quick.csv"
LAYER_CSV = ROOT / "results" / "bench_layer_snack_adam.csv"
KERNELS_COLD_CSV = ROOT / "results" / "bench_cold.csv"
LAYER_COLD_CSV = ROOT / "results" / "bench_layer_snack_adam_cold_l2.csv"
KERNELS_H100_CSV = ROOT / "results" / "bench_kernels_quick_h100.csv"
LAYER_H100_CSV = ROOT / "results" / "bench_layer_snack_adam_h100.csv"
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))

from experiments.cli import read_rows  # noqa: E402
from experiments.results_io import MAX_REL_ERR  # noqa: E402


@dataclass(frozen=True)
class Check:
    part: str       # "kernels" or "layer"
    name: str
    value: float    # larger is better
    target: float
    source: str     # CSV file name, commit and GPU of the run
    percent: bool = False  # a fraction, shown as a percentage (else a ratio, shown as 1.23x)

    @property
    def met(self) -> bool:
        return self.value >= self.target

    def show(self, v: float) -> str:
        return f"{100 * v:.1f}%" if self.percent else f"{v:.2f}x"


# The layer every target is stated at (the kernels' `shape`, the layer's out_features x in_features):
# a CSV's rows of other shapes are left out.
SHAPE = (4096, 4096)
WALL = "forward_1000_calls_wall"  # the op of bench_kernels' host-overhead rows
# What each CSV must have (else one line naming the script that writes it): columns, writer, option.
KERNELS_OF = (("gpu", "commit", "shape", "sparsity", "batch", "op", "method", "graph_us", "eager_us",
               "roofline_frac"), "bench_kernels.py --quick", "--kernels-csv")
LAYER_OF = (("device_name", "commit", "in_features", "out_features", "phase", "B", "method", "eager_us",
                 "graph_us", "peak_mb", "energy_mj"), "bench_layer.py --optimizer snack-adam", "--layer-csv")
KERNELS_COLD_OF = (("gpu", "commit", "shape", "sparsity", "batch", "method", "cold_us"), "bench_cold.py",
                   "--kernels-csv (with --cold)")
LAYER_COLD_OF = (("device_name", "commit", "in_features", "out_features", "phase", "B", "method",
                      "graph_cold_us"), "bench_layer.py --optimizer snack-adam --cold_l2", "--layer-csv (with --cold)")


def _rows(path: Path, of=KERNELS_OF) -> List[dict]:
    """The rows of the CSV at `path` at the targets' shape; one line (SystemExit) when the file
    cannot be read, is not the CSV `of` describes, or has no row at that shape (its shapes named)."""
    columns, writer, option = of
    rows = read_rows(path, columns, writer, option)
    if "shape" in columns:
        def shape(r):
            return r["shape"]
    else:
        def shape(r):
            return f"{r['out_features']}x{r['in_features']}"
    want = "x".join(map(str, SHAPE))
    for key in ("commit", columns[0]):  # one run per file: its rows are compared with each other
        seen = sorted({r[key] for r in rows})
        if len(seen) > 1:
            raise SystemExit(f"{path} mixes runs ({key} {', '.join(seen)}): give {option} the CSV of one run "
                             f"of experiments/{writer}")
    timed = [r for r in rows if r.get("op") != WALL]  # (bench_kernels writes WALL at 4096 x 4096 whatever its grid)
    if not any(shape(r) == want for r in timed):
        raise SystemExit(f"{path} has no rows at {want}, the shape the targets are stated at (it has "
                         f"{', '.join(sorted({shape(r) for r in timed}))}): give {option} a CSV written by "
                         f"experiments/{writer}")
    return [r for r in rows if shape(r) == want]


def _source(path: Path, row: dict, gpu_key: str) -> str:
    return f"`{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}` at `{row['commit']}`, {row[gpu_key]}"


class _Points:
    """{key: {method: row}} of a CSV's rows; `get(key, method, field)` is the row's number, or one
    line (SystemExit) saying which point, method or number the CSV lacks."""

    def __init__(self, rows, key, path: Path, what):
        self.t, self.path, self.what = defaultdict(dict), path, what
        for r in rows:
            k = key(r)
            if r["method"] in self.t[k]:
                raise SystemExit(f"{path} has two {r['method']} rows at {what(k)}: one row per point and method")
            self.t[k][r["method"]] = r

    def __contains__(self, key):
        return key in self.t

    def get(self, key, method: str, field: str) -> float:
        row = self.t.get(key, {}).get(method)
        if row is None:
            raise SystemExit(f"{self.path} has no {method} row at {self.what(key)}, a point of the targets")
        try:
            v = float(row[field])
        except ValueError:
            v = math.nan
        if not math.isfinite(v):  # (nan: a timing that failed, or a column of another kind of run)
            raise SystemExit(f"{self.path}: {field} of {method} at {self.what(key)} is not a number "
                             f"({row[field]!r}): it was not measured")
        return v


# The speed-up targets, read warm and cold: (sparsity, B, baseline method, its name, target) for
# the kernels' forward; (phase, B, baseline method, its name, target) for the layer.
FORWARD_SPEEDUPS = ([(0.95, B, "dense_mask", "Dense+Mask", 10) for B in (1, 8, 32)]
                    + [(0.9, B, "dense", "dense", 3) for B in (1, 8, 32)]
                    + [(sp, B, "cusparse_csr", "cuSPARSE", 1.5) for sp in (0.9, 0.95, 0.99)
                       for B in (1, 8, 32, 128)])
LAYER_SPEEDUPS = ([("train", 32, "densemask", "Dense+Mask", 10), ("train", 32, "dense", "dense", 4)]
                  + [("infer", B, base, what, need) for B in (1, 8, 32)
                     for base, what, need in (("densemask", "Dense+Mask", 6), ("dense", "dense", 3))])


def _forward_speedups(t: _Points, field: str, src, prefix="") -> List[Check]:
    return [Check("kernels", f"{prefix}forward {sp:.0%}, B = {B}: x {what}",
                  t.get((sp, B, "forward"), base, field) / t.get((sp, B, "forward"), "snack", field), need, src)
            for sp, B, base, what, need in FORWARD_SPEEDUPS]


def _layer_speedups(t: _Points, field: str, src, prefix="") -> List[Check]:
    return [Check("layer", f"{prefix}{'training' if phase == 'train' else 'inference'} B = {B}, graph: x {what}",
                  t.get((phase, B), base, field) / t.get((phase, B), "snack", field), need, src)
            for phase, B, base, what, need in LAYER_SPEEDUPS]


def _kernel_points(rows, path: Path) -> _Points:
    return _Points(rows, lambda r: (float(r["sparsity"]), int(r["batch"]), r.get("op", "forward")), path,
                   lambda k: f"sparsity {k[0]}, B = {k[1]} ({k[2]})")


def _layer_points(rows, path: Path) -> _Points:
    return _Points(rows, lambda r: (r["phase"], int(r["B"])), path, lambda k: f"{k[0]}, B = {k[1]}")


def kernel_checks(path: Path = KERNELS_CSV) -> List[Check]:
    """The kernels' targets at 4096 x 4096 on the 12 target points (forward, dX, SDDMM, graph
    time) and the 1000-call eager host-overhead test."""
    rows = [r for r in _rows(path, KERNELS_OF) if r.get("dtype", "float32") == "float32"]
    if not rows:
        raise SystemExit(f"{path} has no float32 rows, the dtype the kernels' targets are stated in: give "
                         f"{KERNELS_OF[2]} a CSV written by experiments/{KERNELS_OF[1]} (--dtype float32)")
    src = _source(path, rows[0], "gpu")
    for r in rows:  # a wrong result's timings count for nothing
        err = r.get("rel_err", "")
        if r["method"] == "snack" and err != "" and not float(err) <= MAX_REL_ERR["float32"]:
            raise SystemExit(f"{path}: SNACK's {r['op']} at sparsity {r['sparsity']}, B = {r['batch']} has a "
                             f"relative error of {err}: its timings do not count")
    q = _kernel_points([r for r in rows if r["graph_us"]], path)

    def t(sp, B, op="forward"):
        return q.get((sp, B, op), "snack", "graph_us")

    out = _forward_speedups(q, "graph_us", src)
    for B in (1, 8, 32):
        roof = q.get((0.9, B, "forward"), "snack", "roofline_frac")
        out.append(Check("kernels", f"forward 90%, B = {B}: fraction of the HBM roofline", roof, 0.5, src,
                         percent=True))
    for op in ("dX", "SDDMM"):
        worst = min(((t(sp, B) / t(sp, B, op)), sp, B)
                    for sp in (0.9, 0.95, 0.99) for B in (1, 8, 32, 128))
        out.append(Check("kernels", f"{op} within 2x of the forward, all 12 points (forward / {op}, "
                            f"worst: {worst[1]:.0%}, B = {worst[2]})", worst[0], 0.5, src))
    wall = _kernel_points([r for r in rows if r["op"] == WALL], path)
    key = (0.9, 1, WALL)
    out.append(Check("kernels", "eager 90%, B = 1: 1000 calls, wall time x F.linear",
                     wall.get(key, "dense", "eager_us") / wall.get(key, "snack", "eager_us"), 1.0, src))
    return out


def _layer_rows(path: Path, of) -> List[dict]:
    """_rows of a bench_layer CSV, at the targets' sparsity (90%) and dtype (float32) only; one
    line (SystemExit) where none is left, or where a replayed graph did not compute its step."""
    rows = [r for r in _rows(path, of) if float(r.get("sparsity", 0.9)) == 0.9
            and r.get("dtype", "float32") == "float32" and r.get("autocast", "off") in ("off", "")]
    if not rows:
        raise SystemExit(f"{path} has no rows at sparsity 0.9, float32 without autocast, the point the layer's "
                         f"targets are stated at: give {of[2]} a CSV written by experiments/{of[1]}")
    bad = [f"{r['method']} {r['phase']} B = {r['B']}" for r in rows
           if r.get("graph_check", "ok") not in ("ok", "", "n/a")]
    if bad:
        raise SystemExit(f"{path}: the replayed graph failed its check for {', '.join(bad)} "
                         "(graph_check): its timings do not count")
    return rows


def layer_checks(path: Path = LAYER_CSV) -> List[Check]:
    """The layer's targets at 4096 x 4096: its training step (forward + backward + Adam) and
    inference."""
    rows = _layer_rows(path, LAYER_OF)
    src = _source(path, rows[0], "device_name") + (f", optimizer {rows[0]['optimizer']}" if rows[0].get("optimizer") else "")
    L = _layer_points(rows, path)

    def x(phase, B, key):
        return L.get((phase, B), "dense", key) / L.get((phase, B), "snack", key)

    out = _layer_speedups(L, "graph_us", src)
    out.insert(2, Check("layer", "training B = 32, eager: x dense", x("train", 32, "eager_us"), 3, src))
    for B in (1, 8, 32):
        out.append(Check("layer", f"training B = {B}: peak memory, dense / SNACK (<= 20% of dense)",
                         x("train", B, "peak_mb"), 5, src))
    for B in (1, 8, 32):
        out.append(Check("layer", f"training B = {B}: energy per step, dense / SNACK (<= 25% of dense)",
                         x("train", B, "energy_mj"), 4, src))
    return out


def kernel_cold_checks(path: Path = KERNELS_COLD_CSV) -> List[Check]:
    """The kernels' forward speed-up targets read on the cold-L2 timings (`bench_cold.py`)."""
    rows = _rows(path, KERNELS_COLD_OF)
    return _forward_speedups(_kernel_points(rows, path), "cold_us", _source(path, rows[0], "gpu"), "cold L2, ")


def layer_cold_checks(path: Path = LAYER_COLD_CSV) -> List[Check]:
    """The layer's speed-up targets read on the cold-L2 timings (`bench_layer.py --cold_l2`)."""
    rows = _layer_rows(path, LAYER_COLD_OF)
    return _layer_speedups(_layer_points(rows, path), "graph_cold_us", _source(path, rows[0], "device_name"),
                           "cold L2, ")


def lines(checks: List[Check]) -> str:
    width = max(len(c.name) for c in checks)
    body = [f"{'met    ' if c.met else 'NOT met'}  {c.part:7s}  {c.name:{width}s}  {c.show(c.value):>7s} "
            f"(target {c.show(c.target)})" for c in checks]
    body.append(f"met: {sum(c.met for c in checks)} of {len(checks)}")
    return "\n".join(body)


def markdown(checks: List[Check]) -> str:
    """A markdown table: one row per target, the sources listed under it."""
    out = ["| part | what | measured | target | met |", "| --- | --- | --- | --- | --- |"]
    for c in checks:
        out.append(f"| {c.part} | {c.name} | {c.show(c.value)} | {c.show(c.target)} | "
                   f"{'yes' if c.met else '**no**'} |")
    sources = sorted({c.source for c in checks})
    out.append("")
    out.append(f"{sum(c.met for c in checks)} of {len(checks)} met. Measured: " + "; ".join(sources) + ".")
    return "\n".join(out)


def warm_checks(kernels_csv: Optional[Path] = None, layer_csv: Optional[Path] = None,
                h100: bool = False) -> List[Check]:
    """Every target on the warm tables: the H200's CSVs (the README's table), or the H100's with
    h100; a path given replaces its default."""
    k, l = (KERNELS_H100_CSV, LAYER_H100_CSV) if h100 else (KERNELS_CSV, LAYER_CSV)
    return kernel_checks(kernels_csv or k) + layer_checks(layer_csv or l)


def main(argv: Optional[List[str]] = None) -> List[Check]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="print the README's markdown table")
    ap.add_argument("--cold", action="store_true", help="read the targets on the cold-L2 CSVs")
    ap.add_argument("--h100", action="store_true", help="read the targets on the H100 CSVs")
    ap.add_argument("--kernels-csv", type=Path, default=None,
                    help="the kernels' CSV, from bench_kernels.py --quick (default results/bench_kernels_quick.csv, "
                         "--h100: results/bench_kernels_quick_h100.csv); with --cold one from bench_cold.py "
                         "(default results/bench_cold.csv). Its 4096x4096 rows are read")
    ap.add_argument("--layer-csv", type=Path, default=None,
                    help="the layer's CSV, from bench_layer.py --optimizer snack-adam (default "
                         "results/bench_layer_snack_adam.csv, --h100: results/bench_layer_snack_adam_h100.csv); "
                         "with --cold one from bench_layer.py --cold_l2 (default "
                         "results/bench_layer_snack_adam_cold_l2.csv). Its 4096 x 4096 rows are read")
    a = ap.parse_args(argv)
    if a.cold and a.h100:
        ap.error("--cold and --h100 cannot be combined (no cold-L2 runs on the H100)")
    if a.cold:
        checks = (kernel_cold_checks(a.kernels_csv or KERNELS_COLD_CSV)
                  + layer_cold_checks(a.layer_csv or LAYER_COLD_CSV))
    else:
        checks = warm_checks(a.kernels_csv, a.layer_csv, h100=a.h100)
    print(markdown(checks) if a.markdown else lines(checks))
    return checks


if __name__ == "__main__":
    main()
