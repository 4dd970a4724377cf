"""experiments/targets.py reads each target of the kernels and the layer from the benchmark CSVs, and the README's
"Targets at a glance" table is what it prints for the committed CSVs."""
import csv
import re
import sys
from pathlib import Path

import pytest

from conftest import one_line_exit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import targets  # noqa: E402


def _rewrite(src: Path, dst: Path, edit):
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        edit(r)
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return dst


def _snack_us(op, sparsity, batch):
    return next(float(r["graph_us"]) for r in targets._rows(targets.KERNELS_CSV)
                if (r["op"], r["method"], r["sparsity"], r["batch"]) == (op, "snack", sparsity, batch))


def _by_name(checks):
    return {c.name: c for c in checks}


@pytest.mark.parametrize("marker, flag", [("targets", ""), ("targets-h100", " --h100")])
def test_readme_table_is_what_the_committed_csvs_give(marker, flag):
    readme = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {marker}:begin -->\n(.*?)\n<!-- {marker}:end -->", readme, flags=re.S)
    assert m, f"README.md lost its {marker} table markers"
    checks = targets.warm_checks(h100=bool(flag))
    assert m.group(1).strip() == targets.markdown(checks).strip(), (
        f"README's {marker} table differs from `python experiments/targets.py --markdown{flag}`")


@pytest.mark.parametrize("ratio, met", [(10.0, True), (9.99, False)])
def test_kernel_target_met_exactly_at_its_value(tmp_path, ratio, met):
    """Dense+Mask's time at 95%, B = 8 set to `ratio` x SNACK's: met from 10x on."""
    t = _snack_us("forward", "0.95", "8")

    def edit(r):
        if (r["op"], r["method"], r["sparsity"], r["batch"]) == ("forward", "dense_mask", "0.95", "8"):
            r["graph_us"] = repr(ratio * t)

    path = _rewrite(targets.KERNELS_CSV, tmp_path / "k.csv", edit)
    c = _by_name(targets.kernel_checks(path))["forward 95%, B = 8: x Dense+Mask"]
    assert c.value == pytest.approx(ratio) and c.met is met and c.target == 10


def test_dx_target_reports_the_worst_point(tmp_path):
    """dX made 2.5x the forward at 99%, B = 32 only: the dX target fails there and names it."""
    t = _snack_us("forward", "0.99", "32")

    def edit(r):
        if (r["op"], r["method"], r["sparsity"], r["batch"]) == ("dX", "snack", "0.99", "32"):
            r["graph_us"] = repr(2.5 * t)

    checks = targets.kernel_checks(_rewrite(targets.KERNELS_CSV, tmp_path / "k.csv", edit))
    (dx,) = [c for c in checks if c.name.startswith("dX within 2x")]
    assert not dx.met and dx.value == pytest.approx(0.4) and "99%, B = 32" in dx.name


def test_layer_memory_target_uses_dense_over_snack(tmp_path):
    def edit(r):
        if r["phase"] == "train" and r["B"] == "8":
            r["peak_mb"] = "100" if r["method"] == "dense" else ("21" if r["method"] == "snack" else r["peak_mb"])

    checks = _by_name(targets.layer_checks(_rewrite(targets.LAYER_CSV, tmp_path / "l.csv", edit)))
    c = checks["training B = 8: peak memory, dense / SNACK (<= 20% of dense)"]
    assert c.value == pytest.approx(100 / 21) and not c.met



def test_missing_csv_names_the_file(tmp_path):
    msg = one_line_exit(targets.kernel_checks, tmp_path / "nothing.csv")
    assert "nothing.csv does not exist" in msg and "--kernels-csv" in msg and "bench_kernels.py" in msg


def _write(path: Path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_kernel_targets_read_the_4096_rows_of_a_csv_of_several_shapes(tmp_path):
    """A CSV holding other shapes too (bench_kernels.py's default grid) gives the same targets as
    its 4096 x 4096 rows alone, whichever shape comes last; one with none of them is one line
    naming the shapes it has."""
    rows = targets._rows(targets.KERNELS_CSV)
    other = [dict(r, shape="768x768", out_features="768", in_features="768",
                  graph_us=repr(100 * float(r["graph_us"])) if r["method"] == "snack" and r["graph_us"] else r["graph_us"])
             for r in rows]
    mixed = targets.kernel_checks(_write(tmp_path / "k.csv", rows + other))
    assert [(c.name, c.value) for c in mixed] == [(c.name, c.value) for c in targets.kernel_checks()]
    msg = one_line_exit(targets.kernel_checks, _write(tmp_path / "gpt2.csv", other))
    assert "no rows at 4096x4096" in msg and "768x768" in msg


def test_layer_targets_read_the_4096_rows_only(tmp_path):
    with open(targets.LAYER_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    other = [dict(r, in_features="1024", out_features="512", peak_mb="1") for r in rows]
    mixed = targets.layer_checks(_write(tmp_path / "l.csv", rows + other))
    assert [(c.name, c.value) for c in mixed] == [(c.name, c.value) for c in targets.layer_checks()]
    msg = one_line_exit(targets.layer_checks, _write(tmp_path / "quick.csv", other))
    assert "no rows at 4096x4096" in msg and "512x1024" in msg and "--layer-csv" in msg


def test_rows_that_cannot_count_are_refused(tmp_path):
    """Two runs in one file, a point timed twice, a wrong SNACK result, a graph that failed its
    check, missing 1000-call rows: one line each, never a target read from them."""
    k = targets._rows(targets.KERNELS_CSV)
    with open(targets.LAYER_CSV, newline="") as f:
        lay = list(csv.DictReader(f))
    cases = [
        (targets.kernel_checks, k + [dict(k[0], commit="abc1234")], "mixes runs (commit"),
        (targets.kernel_checks, k + [dict(k[0])], "two snack rows at sparsity"),
        (targets.kernel_checks, [dict(r, rel_err="0.5") if r["method"] == "snack" and r["rel_err"] else r
                                 for r in k], "relative error of 0.5"),
        (targets.kernel_checks, [r for r in k if r["op"] != targets.WALL], "forward_1000_calls_wall"),
        (targets.layer_checks, [dict(r, graph_check="MISMATCH") if r["method"] == "densemask" else r
                                for r in lay], "densemask train B = 1"),
        (targets.layer_checks, [dict(r, sparsity="0.99") for r in lay], "no rows at sparsity 0.9"),
        # a baseline whose timing failed (nan) is not a SNACK target missed; nor a cold column of a warm run
        (targets.kernel_checks, [dict(r, graph_us="nan") if (r["method"], r["sparsity"], r["batch"], r["op"])
                                 == ("cusparse_csr", "0.99", "128", "forward") else r for r in k],
         "graph_us of cusparse_csr at sparsity 0.99, B = 128 (forward) is not a number ('nan')"),
        (targets.layer_cold_checks, [dict(r, graph_cold_us="nan") for r in lay], "graph_cold_us of"),
        (targets.kernel_checks, [dict(r, dtype="bfloat16") for r in k], "has no float32 rows"),
    ]
    for i, (fn, rows, want) in enumerate(cases):
        msg = one_line_exit(fn, _write(tmp_path / f"c{i}.csv", rows))
        assert want in msg, (i, msg)
    # rows at another sparsity beside the 90% ones are left out
    mixed = targets.layer_checks(_write(tmp_path / "sp.csv", lay + [dict(r, sparsity="0.99", peak_mb="1") for r in lay]))
    assert [(c.name, c.value) for c in mixed] == [(c.name, c.value) for c in targets.layer_checks()]


def test_cli_refuses_csvs_it_cannot_read_in_one_line(tmp_path, capsys):
    """A missing file, another script's CSV, an empty or header-only file, a binary file, a
    non-cold CSV with --cold, a CSV without a target point: one line each, no traceback."""
    res = ROOT / "results"
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header.csv").write_text("gpu,commit,shape,sparsity,batch,op,method,graph_us,eager_us,roofline_frac\n")
    (tmp_path / "binary.csv").write_bytes(b"\xff\xfe\x00garbage")
    rows = [r for r in targets._rows(targets.KERNELS_CSV) if r["sparsity"] != "0.99"]
    _write(tmp_path / "part.csv", rows)
    cases = [(["--kernels-csv", str(tmp_path / "none.csv")], "does not exist"),
             (["--kernels-csv", str(res / "bench_layer.csv")], "lacks the column(s) gpu"),
             (["--layer-csv", str(res / "bench_kernels.csv")], "lacks the column(s) device_name"),
             (["--kernels-csv", str(res / "bench_kernels_gpt2.csv")], "no rows at 4096x4096"),
             (["--kernels-csv", str(tmp_path / "empty.csv")], "lacks the column(s)"),
             (["--kernels-csv", str(tmp_path / "header.csv")], "has no rows"),
             (["--kernels-csv", str(tmp_path / "binary.csv")], "not a readable CSV"),
             (["--kernels-csv", str(tmp_path)], "cannot be read"),
             (["--cold", "--kernels-csv", str(targets.KERNELS_CSV)], "lacks the column(s) cold_us"),
             (["--cold", "--layer-csv", str(targets.LAYER_CSV.with_name("bench_layer.csv"))],
              "lacks the column(s) graph_cold_us"),
             (["--kernels-csv", str(tmp_path / "part.csv")], "has no cusparse_csr row at sparsity 0.99, B = 1")]
    for argv, what in cases:
        msg = one_line_exit(targets.main, argv)
        assert what in msg, (argv, msg)
    assert capsys.readouterr().out == ""


def test_cli_prints_every_target(capsys):
    checks = targets.main([])
    out = capsys.readouterr().out
    assert len(checks) == len(out.strip().splitlines()) - 1
    assert out.strip().endswith(f"met: {sum(c.met for c in checks)} of {len(checks)}")
    assert {c.part for c in checks} == {"kernels", "layer"}
    cold = targets.main(["--cold"])
    assert cold and all(c.name.startswith("cold L2") for c in cold)
    h100 = targets.main(["--h100"])
    assert [c.name for c in h100] == [c.name for c in checks]
    assert all("H100" in c.source for c in h100) and not any("H100" in c.source for c in checks)
    with pytest.raises(SystemExit):
        targets.main(["--cold", "--h100"])
