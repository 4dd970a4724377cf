"""experiments/targets.py reads each target of the kernels and the layer from the benchmark CSVs, and the README's
"Targets at a glance" table is what it prints for the committed CSVs."""
import csv
import re
import sys
from pathlib import Path

import pytest

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
    with pytest.raises(FileNotFoundError, match="nothing.csv"):
        targets.kernel_checks(tmp_path / "nothing.csv")


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
