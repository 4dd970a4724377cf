"""experiments/bench_gpt2.py and plot_gpt2.py end to end on the CPU with a 2-layer GPT-2 (--tiny):
every method's rows are written, SNACK's logits match Dense+Mask's, the Conv1D layers of the
blocks are the ones converted, and the figure is drawn from the CSV."""
import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers")  # a test extra: installed wherever the tests are


def test_bench_gpt2_tiny_on_cpu(tmp_path):
    from experiments import bench_gpt2, plot_gpt2
    out = tmp_path / "gpt2.csv"
    rows = bench_gpt2.main(["--device", "cpu", "--tiny", "--sparsities", "0.9,0.99", "--out", str(out)])
    with open(out, newline="") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) == 2 * (1 + 2 * 2)  # (dense + 2 sparsities x 2 methods) x 2 phases
    got = {(r["method"], float(r["sparsity"]), r["phase"]) for r in written}
    for s in (0.9, 0.99):
        for m in ("snack", "densemask"):
            assert {(m, s, "train"), (m, s, "infer")} <= got
    assert {("dense", 0.0, "train"), ("dense", 0.0, "infer")} <= got
    n_params = int(written[0]["n_params"])
    for r in written:
        assert float(r["eager_us"]) > 0
        if r["method"] == "snack":
            assert float(r["rel_err"]) < 1e-5
            assert int(r["converted_layers"]) == 4 * 2  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
            assert int(r["params_after"]) < n_params
        if r["phase"] == "train":
            assert float(r["loss"]) > 0
    png = plot_gpt2.main(["--csv", str(out), "--out", str(tmp_path / "fig.png")])
    assert png.exists() and png.stat().st_size > 10_000


def test_bench_gpt2_rejects_bad_arguments():
    from experiments import bench_gpt2
    with pytest.raises(SystemExit):
        bench_gpt2.parse_args(["--sparsities", "1.5"])
    with pytest.raises(SystemExit):
        bench_gpt2.parse_args(["--n_embd", "65", "--n_head", "4"])
    with pytest.raises(SystemExit):
        bench_gpt2.parse_args(["--batch", "0"])
