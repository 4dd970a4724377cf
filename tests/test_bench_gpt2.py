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


def test_bench_gpt2_rest_is_the_model_without_its_converted_layers(tmp_path, capsys):
    """--rest adds an inference row for the model whose converted layers do no work: the layers
    are gone from it (no SparseLinear, no Conv1D in the blocks), its output has the logits'
    shape, and the layers' share of each method's time is printed."""
    import torch

    from experiments import bench_gpt2
    args = bench_gpt2.parse_args(["--device", "cpu", "--tiny"])
    dense = bench_gpt2.dense_model(args)
    _, _, summary = bench_gpt2.sparse_pair(dense, 0.9)
    rest = bench_gpt2.rest_model(dense, summary)
    kinds = {type(m).__name__ for m in rest.modules()}
    assert "Conv1D" not in kinds and "SparseLinear" not in kinds and "_NoWork" in kinds
    assert type(dense.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # the original is left alone
    ids = torch.randint(0, args.vocab, (1, 7))
    with torch.no_grad():
        assert rest(input_ids=ids).logits.shape == dense(input_ids=ids).logits.shape == (1, 7, args.vocab)
    out = tmp_path / "gpt2.csv"
    rows = bench_gpt2.main(["--device", "cpu", "--tiny", "--sparsities", "0.9", "--rest", "--out", str(out)])
    with open(out, newline="") as f:
        written = [r for r in csv.DictReader(f) if r["method"] == "rest"]
    assert len(written) == 1 and written[0]["phase"] == "infer" and float(written[0]["eager_us"]) > 0
    assert int(written[0]["converted_layers"]) == 8 and written[0]["graph_check"] == ""
    assert len(rows) == 2 * 3 + 1
    text = capsys.readouterr().out
    assert "the layers alone" in text and "at 0.90: snack" in text
    from experiments import plot_gpt2
    png = plot_gpt2.main(["--csv", str(out), "--out", str(tmp_path / "fig.png")])  # rest drawn as a line
    assert png.exists() and "warning" not in capsys.readouterr().out


def test_bench_gpt2_rejects_bad_arguments():
    from experiments import bench_gpt2
    with pytest.raises(SystemExit):
        bench_gpt2.parse_args(["--sparsities", "1.5"])
    with pytest.raises(SystemExit):
        bench_gpt2.parse_args(["--n_embd", "65", "--n_head", "4"])
    with pytest.raises(SystemExit):
        bench_gpt2.parse_args(["--batch", "0"])
