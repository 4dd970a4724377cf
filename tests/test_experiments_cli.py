"""The experiment scripts' command lines, on the CPU: --quick / --tiny fill in only the options not
given, refused combinations and missing inputs end in a one-line message (status 2 for a usage
error), the GPU-only scripts say they need a GPU instead of failing on an import, and
bench_cpu.py checks the SDDMM it times. Everything runs in process except the one
check that lives in a script's `__main__`."""
import argparse
import csv
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import one_line_exit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")


def _usage_error(capsys, fn, *args):
    """fn(*args) must stop like argparse's own errors: status 2, the reason on stderr's last line."""
    with pytest.raises(SystemExit) as e:
        fn(*args)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]



# ---- --quick / --tiny: defaults only for what was not given ------------------------------------
def test_bench_gpt2_tiny_keeps_explicit_sizes():
    from experiments import bench_gpt2 as b
    a = b.parse_args(["--device", "cpu", "--tiny", "--batch", "4", "--seq", "32"])
    assert (a.batch, a.seq) == (4, 32)
    assert (a.n_layer, a.n_embd, a.vocab, a.infer_seq, a.rep_ms) == (2, 64, 512, 16, 20)  # the rest tiny
    a = b.parse_args(["--device", "cpu", "--tiny"])
    assert {k: getattr(a, k) for k in b.TINY} == b.TINY
    a = b.parse_args(["--n_layer", "3"])
    assert {k: getattr(a, k) for k in b.DEFAULTS if k != "n_layer"} == {k: v for k, v in b.DEFAULTS.items()
                                                                         if k != "n_layer"}
    assert a.n_layer == 3


def test_bench_layer_quick_keeps_explicit_sizes():
    from experiments import bench_layer as b
    a = b.parse_args(["--device", "cpu", "--quick", "--batches", "1,32", "--in_features", "1024", "--rep_ms", "50"])
    assert (a.batches, a.in_features, a.rep_ms) == ("1,32", 1024, 50)
    assert (a.out_features, a.warmup_ms, a.energy_seconds) == (384, 5, 0.2)
    a = b.parse_args(["--device", "cpu", "--quick"])
    assert {k: getattr(a, k) for k in b.QUICK} == b.QUICK
    a = b.parse_args([])
    assert {k: getattr(a, k) for k in b.DEFAULTS} == b.DEFAULTS


def test_smoke_runs_keep_the_full_runs_csvs():
    """bench_gpt2 --tiny and bench_layer --quick write CSVs of their own by default, never the
    committed full-size results (results/bench_gpt2_cpu.csv, results/bench_layer.csv), and git
    ignores them."""
    from experiments import bench_gpt2, bench_layer
    name = {tuple(a): Path(bench_gpt2.parse_args(a).out).name for a in
            ([], ["--device", "cpu"], ["--device", "cpu", "--tiny"], ["--tiny"])}
    assert name == {(): "bench_gpt2.csv", ("--device", "cpu"): "bench_gpt2_cpu.csv",
                    ("--device", "cpu", "--tiny"): "bench_gpt2_cpu_tiny.csv", ("--tiny",): "bench_gpt2_tiny.csv"}
    assert bench_gpt2.parse_args(["--tiny", "--out", "x.csv"]).out == "x.csv"
    name = {tuple(a): Path(bench_layer.parse_args(a).out).name for a in
            (["--quick"], ["--device", "cpu", "--quick"], ["--device", "cpu", "--quick", "--optimizer", "snack-adam"])}
    assert name == {("--quick",): "bench_layer_quick.csv", ("--device", "cpu", "--quick"): "bench_layer_cpu_quick.csv",
                    ("--device", "cpu", "--quick", "--optimizer", "snack-adam"): "bench_layer_cpu_snack_adam_quick.csv"}
    smoke = ["results/bench_gpt2_cpu_tiny.csv", "results/bench_gpt2_tiny.csv", "results/bench_layer_cpu_quick.csv",
             "results/bench_layer_cpu_quick.json"]
    r = subprocess.run(["git", "check-ignore", *smoke, "results/bench_gpt2_cpu.csv", "results/bench_layer.csv"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.stdout.split() == smoke


def test_bench_gpt2_checks_its_timing_lengths(capsys):
    from experiments import bench_gpt2 as b
    for opt in ("--warmup_ms", "--rep_ms"):
        for bad in ("-1", "0"):
            assert f"{opt} must be > 0, got {bad}" in _usage_error(capsys, b.parse_args, ["--device", "cpu", opt, bad])
    assert b.parse_args(["--device", "cpu", "--warmup_ms", "1", "--rep_ms", "1"]).rep_ms == 1


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adam", "snack-adam"])
def test_bench_layer_gpu_graphs_reuse_no_autograd_node_across_streams(tmp_path, optimizer):
    """On the GPU every captured step is checked (output poisoned, replayed, compared) and the
    timing's own captures reuse no AccumulateGrad node of an earlier pass made on another stream
    (torch warns about that: kept alive, the captured step's graph did so); a step's peak memory
    does not depend on which method ran first. With snack-adam the steps are also timed with a
    cold L2 (--cold_l2: its own captures, the same checks)."""
    import warnings
    from experiments import bench_layer as b
    cold = ["--cold_l2"] if optimizer == "snack-adam" else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = b.main(["--quick", "--batches", "8,8", "--methods", "snack,dense,densemask", "--optimizer", optimizer,
                       "--energy_seconds", "0.05", "--out", str(tmp_path / "layer.csv"), *cold])
    stream = [str(w.message)[:120] for w in caught if "AccumulateGrad node's stream" in str(w.message)]
    assert stream == []
    assert len(rows) == 12 and all(r["graph_check"] == "ok" for r in rows)
    assert all(r["graph_us"] > 0 and r["eager_us"] > 0 for r in rows)
    if cold:  # positive, and the ratios computed from the cold times
        assert all(r["graph_cold_us"] > 0 for r in rows)
        for r in rows:
            # (add_ratios pairs each row with the last dense row of its phase and B)
            d = [q for q in rows if q["method"] == "dense" and q["phase"] == r["phase"] and q["B"] == r["B"]][-1]
            assert r["graph_cold_vs_dense"] == pytest.approx(d["graph_cold_us"] / r["graph_cold_us"])
    else:
        assert all(math.isnan(r["graph_cold_us"]) for r in rows)
    # the same step measured twice has the same peak memory: no one-off allocation (cuBLAS's
    # workspace of autograd's thread) is charged to the first method that runs a GEMM there
    for m in ("snack", "dense", "densemask"):
        first, second = [r["peak_mb"] for r in rows if r["method"] == m and r["phase"] == "train"]
        assert abs(first - second) < 0.5, (m, first, second)


@pytest.mark.gpu
def test_cublas_workspaces_made_first_leave_a_dense_step_nothing_behind():
    """In a fresh process: after make_cublas_workspaces, a dense layer's training step (forward
    with a bias, backward on autograd's thread) leaves no allocation behind once its tensors are
    gone; without it, the step leaves cuBLAS's workspaces (the benchmarks' peak memory would
    charge them to the first method)."""
    code = """
import torch, torch.nn as nn
from experiments.cuda_workspaces import make_cublas_workspaces
def step_leaves():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    lin = nn.Linear(256, 128, device="cuda")
    x = torch.randn(16, 256, device="cuda", requires_grad=True)
    lin(x).sum().backward()
    del lin, x
    from snack.layers.functional import settle_autograd
    settle_autograd()  # (autograd's worker has released the pass)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - base
import sys
if sys.argv[1] == "first":
    make_cublas_workspaces("cuda")
print(step_leaves())
"""
    left = {}
    for mode in ("first", "not"):
        r = subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        left[mode] = int(r.stdout.split()[-1])
    assert left["first"] < 2 ** 16  # (at most a few small blocks in flight)
    assert left["not"] >= 2 ** 20  # (the control: the workspaces do stay)


@pytest.mark.gpu
def test_bench_cold_times_inside_the_graph_and_sees_the_l2(tmp_path):
    """bench_cold's two timings: a known GPU sleep reads about its length in both, reading a
    buffer that fits in the L2 is not faster after the flush than without it (and the replay's
    subtraction of the flush leaves a positive time), and a tiny grid writes one checked row per
    method with positive times."""
    from experiments import bench_cold as bc
    sleep = bc.timed_graph_us(lambda: torch.cuda._sleep(2_000_000), copies=3, replays=2)
    assert 200 < sleep < 10_000  # 2 M cycles at 0.2-10 GHz... in practice ~1-1.4 ms
    sleep_replay = bc.replay_us(lambda: torch.cuda._sleep(2_000_000), copies=3, replays=2)
    assert 0.8 * sleep < sleep_replay < 1.2 * sleep, (sleep, sleep_replay)
    small = torch.ones(4 * 2 ** 20, device="cuda")  # 16 MB
    big = torch.ones(bc.FLUSH_BYTES // 4, device="cuda")
    warm = bc.timed_graph_us(lambda: small.sum(), copies=10, replays=3)
    cold = bc.timed_graph_us(lambda: small.sum(), copies=10, replays=3, flush=lambda: big.sum())
    assert cold >= 0.95 * warm, (warm, cold)
    warm = bc.replay_us(lambda: small.sum(), copies=10, replays=5)
    flush = bc.replay_us(lambda: None, copies=10, replays=5, flush=lambda: big.sum())
    cold = bc.replay_us(lambda: small.sum(), copies=10, replays=5, flush=lambda: big.sum()) - flush
    assert cold >= 0.9 * warm > 0, (warm, cold)
    rows = bc.main(["--shape", "1536x1024", "--sparsity", "0.9", "--batch", "8", "--copies", "4",
                    "--replays", "2", "--out", str(tmp_path / "cold.csv")])
    assert [r["method"] for r in rows] == list(bc.METHODS)
    for r in rows:
        assert min(r["warm_us"], r["cold_us"], r["event_warm_us"], r["event_cold_us"]) > 0, r
        assert r["rel_err"] < 1e-5 and r["flush_us"] > 0 and r["event_gap_us"] >= 0
    assert rows[0]["snack_speedup_warm"] == rows[0]["snack_speedup_cold"] == 1.0
    assert 0 < rows[0]["roofline_frac_cold"] < 1.5 and rows[1]["roofline_frac_cold"] == ""


def test_bench_layer_rejects_bad_batches(capsys):
    from experiments import bench_layer as b
    assert "--batches must be" in _usage_error(capsys, b.parse_args, ["--batches", "1,x"])
    assert "--batches must be" in _usage_error(capsys, b.parse_args, ["--batches", "0"])


def test_bench_layer_rejects_no_methods_and_an_out_its_config_would_overwrite(capsys, tmp_path, monkeypatch):
    """--methods '' or an unknown method, and an --out whose configuration JSON (written beside
    it, same name, .json) would be the same file: usage errors before anything runs."""
    from experiments import bench_layer as b
    monkeypatch.setattr(b, "measure", lambda *a, **k: pytest.fail("the benchmark ran"))
    cpu = ["--device", "cpu", "--quick"]
    assert "--methods must be a comma-separated list, got ''" in _usage_error(capsys, b.main, [*cpu, "--methods", ""])
    assert "--methods must be among snack, dense" in _usage_error(capsys, b.main, [*cpu, "--methods", "snack,sparse"])
    for out in ("r.json", "r.JSON"):
        msg = _usage_error(capsys, b.main, [*cpu, "--out", str(tmp_path / out)])
        assert "configuration" in msg and "the same file" in msg and "--out" in msg
    (tmp_path / "r.json").mkdir()
    assert "which is not a file" in _usage_error(capsys, b.main, [*cpu, "--out", str(tmp_path / "r.csv")])
    a = b.parse_args([*cpu, "--methods", "dense, snack", "--out", str(tmp_path / "run")])
    assert a.method_list == ["dense", "snack"] and b.config_path(a.out) == tmp_path / "run.json"


def test_bench_kernels_quick_keeps_explicit_grid():
    from experiments import bench_kernels as b
    a = b.parse_args(["--quick", "--shapes", "768x768", "--sparsity", "0.5", "--batch", "4,64"])
    assert (a.shape_list, a.sparsity_list, a.batch_list) == (["768x768"], [0.5], [4, 64])
    assert a.out == str(ROOT / "results" / "bench_kernels_quick.csv")
    a = b.parse_args(["--quick", "--batch", "2"])
    assert (a.shape_list, a.sparsity_list, a.batch_list) == (["4096x4096"], [0.9, 0.95, 0.99], [2])
    a = b.parse_args([])
    assert a.shape_list == b.DEFAULT_SHAPES and a.batch_list == [1, 8, 32, 128, 512]
    assert a.sparsity_list == [0.5, 0.8, 0.9, 0.95, 0.99] and a.out == str(ROOT / "results" / "bench_kernels.csv")


def test_bench_kernels_half_dtypes_write_their_own_csv():
    from experiments import bench_kernels as b
    assert b.parse_args(["--quick", "--dtype", "bfloat16"]).out == str(ROOT / "results" / "bench_kernels_quick_bfloat16.csv")
    assert b.parse_args(["--dtype", "float16"]).out == str(ROOT / "results" / "bench_kernels_float16.csv")
    assert b.parse_args(["--dtype", "float16", "--out", "x.csv"]).out == "x.csv"
    # bench_layer: another optimizer or autocast keeps the default run's CSV (Figure 2's)
    from experiments import bench_layer as bl
    names = {tuple(a): Path(bl.parse_args(a).out).name for a in
             ([], ["--optimizer", "adam-fused"], ["--optimizer", "snack-adam", "--autocast", "bfloat16"],
              ["--device", "cpu"], ["--optimizer", "snack-adam", "--backward_thread", "caller"])}
    assert names == {(): "bench_layer.csv", ("--optimizer", "adam-fused"): "bench_layer_adam_fused.csv",
                     ("--optimizer", "snack-adam", "--autocast", "bfloat16"):
                         "bench_layer_snack_adam_autocast_bfloat16.csv",
                     ("--device", "cpu"): "bench_layer_cpu.csv",
                     ("--optimizer", "snack-adam", "--backward_thread", "caller"):
                         "bench_layer_snack_adam_backward_caller.csv"}


def test_bench_layer_backward_on_the_calling_thread(tmp_path):
    """--backward_thread caller runs each training step's backward with autograd's multithreading
    off (and only the backward: it is on again after the step); the CSV says so."""
    from experiments import bench_layer as b
    layer = b.build("snack", b.snack.SparseLinear(16, 8, sparsity=0.5), torch.zeros(8, 16))
    x, dy = torch.randn(3, 16, requires_grad=True), torch.randn(3, 8)
    seen = []
    layer.register_full_backward_hook(lambda *a: seen.append(torch._C._is_multithreading_enabled()))
    opt = torch.optim.Adam(layer.parameters())
    for thread, want in (("caller", False), ("device", True)):
        b.make_step(layer, "train", x, dy, opt, backward_thread=thread)()
        assert seen.pop() is want and torch._C._is_multithreading_enabled()
    out = tmp_path / "layer.csv"
    rows = b.main(["--device", "cpu", "--quick", "--batches", "2", "--rep_ms", "5", "--methods", "snack,dense",
                   "--backward_thread", "caller", "--out", str(out)])
    assert all(r["backward_thread"] == "caller" and float(r["eager_us"]) > 0 for r in rows)
    with open(out, newline="") as f:
        assert {r["backward_thread"] for r in csv.DictReader(f)} == {"caller"}


def test_bench_layer_autocast_on_the_cpu(tmp_path):
    """--autocast runs every method's forward under torch.autocast: the outputs come back in the
    half dtype, the CSV says so, and the default CSV name carries it."""
    from experiments import bench_layer as b
    assert b.parse_args(["--device", "cpu", "--autocast", "bfloat16"]).out.endswith(
        "bench_layer_cpu_autocast_bfloat16.csv")
    out = tmp_path / "layer.csv"
    rows = b.main(["--device", "cpu", "--quick", "--autocast", "bfloat16", "--batches", "3",
                   "--rep_ms", "5", "--out", str(out)])
    assert {(r["method"], r["phase"]) for r in rows} == {(m, p) for m in ("snack", "dense", "densemask")
                                                         for p in ("train", "infer")}
    assert all(r["autocast"] == "bfloat16" for r in rows)
    assert all(float(r["eager_us"]) > 0 for r in rows)
    with open(out, newline="") as f:
        assert {r["autocast"] for r in csv.DictReader(f)} == {"bfloat16"}
    layer = b.build("snack", b.snack.SparseLinear(16, 8, sparsity=0.5), torch.zeros(8, 16))
    x, dy = torch.randn(3, 16, requires_grad=True), torch.randn(3, 8, dtype=torch.bfloat16)
    opt = torch.optim.Adam(layer.parameters())
    y = b.make_step(layer, "train", x, dy, opt, torch.bfloat16)()
    assert y.dtype == torch.bfloat16 and x.grad is not None and x.grad.dtype == torch.float32
    assert b.make_step(layer, "infer", x, dy, None, torch.bfloat16)().dtype == torch.bfloat16
    assert b.make_step(layer, "infer", x, dy, None)().dtype == torch.float32


@pytest.mark.parametrize("argv,match", [
    (["--shapes", "4096"], "--shapes must be OUTxIN with positive ints"),
    (["--shapes", "4096x4096,0x8"], "--shapes must be OUTxIN"),
    (["--shapes", ","], "--shapes must be a comma-separated list"),
    (["--sparsity", "1.5"], "--sparsity must be"),
    (["--batch", "0"], "--batch must be"),
    (["--batch", "a,b"], "--batch must be"),
])
def test_bench_kernels_rejects_bad_grid(capsys, argv, match):
    from experiments import bench_kernels as b
    assert match in _usage_error(capsys, b.parse_args, argv)


# ---- refused combinations ---------------------------------------------------------------------
@pytest.mark.parametrize("argv,match", [
    (["--kernels", "32", "--optimizer", "snack-adam"], "--optimizer applies to --train only"),
    (["--optimizer", "adam"], "--optimizer applies to --train only"),
    (["--cprofile"], "--cprofile applies to --train only"),
    (["--kernels", "32", "--cprofile"], "--cprofile applies to --train only"),
    (["--train", "8", "--kernels", "8"], "one of --train and --kernels"),
    (["--train", "0"], "--train must be"),
])
def test_profile_launch_refuses_options_that_would_do_nothing(capsys, argv, match):
    from experiments import profile_launch as p
    assert match in _usage_error(capsys, p.parse_args, argv)


def test_profile_launch_takes_optimizer_and_cprofile_with_train():
    from experiments import profile_launch as p
    a = p.parse_args(["--train", "8", "--optimizer", "snack-adam", "--cprofile"])
    assert (a.train, a.optimizer, a.cprofile, a.kernels) == (8, "snack-adam", True, None)


def test_ncu_kernels_rejects_a_malformed_case(capsys):
    from experiments import ncu_kernels as n
    for case in ("0.9", "0.9:x", "1.5:8", "0.9:8:narrow"):
        assert "a case is sparsity:B" in _usage_error(capsys, n.parse_cases, [case])
    assert n.parse_cases(["0.99:8", "0.9:32:wide"]) == [(0.99, 8, {}), (0.9, 32, {"wide": True})]


def test_train_mnist_refuses_dst_without_a_sparse_model():
    from experiments import train_mnist as tm
    with pytest.raises(ValueError, match="add sparse to --models"):
        tm.parse_config(["--dst=set", "--models=dense"])
    assert tm.parse_config(["--dst=rigl", "--models=sparse"])["dst"] == "rigl"


# ---- no GPU: one line, before any GPU-only import ----------------------------------------------
@no_gpu
@pytest.mark.parametrize("module,call", [
    ("bench_kernels", lambda m: m.main(["--quick"])),
    ("tune_kernels", lambda m: m.main([])),
    ("decompose_wide", lambda m: m.main([])),
    ("bench_cold", lambda m: m.main([])),
    ("bench_first_use", lambda m: m.main([])),
    ("profile_launch", lambda m: m.main([])),
    ("profile_launch", lambda m: m.main(["--train", "32"])),
    ("ncu_kernels", lambda m: m.main([])),
    ("sanitize_kernels", lambda m: m.cli(["--tiled"])),
])
def test_gpu_scripts_say_they_need_a_gpu(module, call):
    import importlib
    m = importlib.import_module(f"experiments.{module}")
    msg = one_line_exit(call, m)
    assert "needs a CUDA GPU" in msg and "GPU machine" in msg


@no_gpu
def test_gpu_scripts_check_their_options_first(capsys):
    from experiments import profile_launch, sanitize_kernels, tune_kernels
    assert "--cprofile applies" in _usage_error(capsys, profile_launch.main, ["--cprofile"])
    for bad in ("500", "640,2048", "0"):
        assert "multiples of 32 in [32, 1024]" in _usage_error(capsys, tune_kernels.main, ["--own-threads", bad])
    for opt, bad, what in (("--own-threads", "x", "comma-separated list"), ("--shape", "12", "OUTxIN"),
                           ("--shape", "0x5", "OUTxIN"), ("--batch", "x", "comma-separated list"),
                           ("--batch", "0", "positive ints"), ("--sparsity", "1", "in [0, 1)"),
                           ("--bt", "3", "1, 2, 4, 8"), ("--threads", "100", "multiples of 32"),
                           ("--chunks", "0", "auto or positive"), ("--split", "y", "comma-separated"),
                           ("--ops", "fwd,bwd", "among fwd, dx, sddmm"),
                           ("--row-order", "on,maybe", "among auto, on, off")):
        msg = _usage_error(capsys, tune_kernels.main, [opt, bad])
        assert opt in msg and what in msg, msg
    from experiments import bench_cold, decompose_wide
    for opt, bad in (("--shape", "4096"), ("--sparsity", "-0.1"), ("--batch", "a")):
        assert opt in _usage_error(capsys, decompose_wide.main, [opt, bad])
        assert opt in _usage_error(capsys, bench_cold.main, [opt, bad])
    for opt in ("--copies", "--replays"):
        assert f"{opt} must be >= 1" in _usage_error(capsys, bench_cold.main, [opt, "0"])
    from experiments import bench_first_use
    for args, what in ((["--full-runs", "0"], "--full-runs must be >= 1"), (["--sparsity", "1"], "--sparsity must be in [0, 1)"),
                       (["--shape", "4096"], "--shape must be OUTxIN"), (["--dtype", "int8"], "--dtype")):
        assert what in _usage_error(capsys, bench_first_use.main, args)
    from experiments import bench_layer
    for args, what in ((["--sparsity", "2"], "--sparsity must be in [0, 1)"),
                       (["--in_features", "0"], "--in_features must be >= 1"),
                       (["--rep_ms", "0"], "--rep_ms must be > 0"),
                       (["--cold_l2"], "--cold_l2 times CUDA graphs: it needs --device cuda")):
        assert what in _usage_error(capsys, bench_layer.parse_args, ["--device", "cpu", *args])
    assert "at most one of" in _usage_error(capsys, sanitize_kernels.cli, ["--tiled", "--own"])
    assert "at most one of" in _usage_error(capsys, sanitize_kernels.cli, ["--mixed", "--staging"])
    assert "at most one of" in _usage_error(capsys, sanitize_kernels.cli, ["--gather", "--own"])
    assert "positions must be in [0, 6)" in _usage_error(capsys, sanitize_kernels.cli, ["--shapes", "0", "6"])
    assert "positions must be in [0, 3)" in _usage_error(capsys, sanitize_kernels.cli, ["--staging", "--shapes", "3"])
    msg = _usage_error(capsys, sanitize_kernels.cli, ["--mixed", "--dtypes", "float32"])
    assert "--dtypes" in msg and "float16" in msg and "float32" in msg


# ---- output paths: checked before anything runs -------------------------------------------------
def _bad_outputs(tmp_path):
    """Paths no file can be written at: a directory, a path under a regular file, /proc (Linux)."""
    (tmp_path / "file").write_text("x")
    bad = [(str(tmp_path), "is a directory"), (str(tmp_path / "file" / "x.csv"), "is not a directory")]
    if Path("/proc/self").is_dir():
        bad.append(("/proc/x.csv", "cannot write a file in /proc"))
    return bad


@pytest.mark.parametrize("module,argv,opt,heavy", [
    ("bench_cpu", [], "--out", "bench_blocks"),
    ("bench_layer", ["--device", "cpu", "--quick"], "--out", "measure"),
    ("bench_gpt2", ["--device", "cpu", "--tiny"], "--out", "dense_model"),
    ("bench_kernels", ["--quick"], "--out", "copy_bandwidth"),
    ("bench_cold", [], "--out", "copy_bandwidth"),
    ("bench_first_use", [], "--out", "_run_child"),
    ("tune_kernels", [], "--csv", "require_gpu"),
    ("decompose_wide", [], "--csv", "require_gpu"),
])
def test_scripts_check_their_output_path_before_running(capsys, tmp_path, monkeypatch, module, argv, opt, heavy):
    import importlib
    m = importlib.import_module(f"experiments.{module}")
    monkeypatch.setattr(m, heavy, lambda *a, **k: pytest.fail(f"{module} ran before checking {opt}"))
    for path, what in _bad_outputs(tmp_path):
        msg = _usage_error(capsys, m.main, [*argv, opt, path])
        assert f"error: {opt} {path}" in msg and what in msg, msg
    if hasattr(m, "parse_args"):  # a folder not there yet is fine (the writer makes it)
        new = str(tmp_path / "a" / "b.csv")
        assert getattr(m.parse_args([*argv, opt, new]), opt[2:]) == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the check leaves nothing behind


def test_plots_check_their_figure_path_before_drawing(capsys, tmp_path):
    """plot_*.py --out: a format matplotlib does not write, a directory, an unwritable place are
    usage errors before anything is read or drawn; no extension writes PNG at <out>.png and says so."""
    from experiments import plot_gpt2, plot_kernels, plot_layer
    bad = [(p.replace(".csv", ".png"), what) for p, what in _bad_outputs(tmp_path)] + [
        (str(tmp_path / "x.pdfx"), "'.pdfx' is not a figure format matplotlib writes"),
        (str(tmp_path / "x."), "'.' is not a figure format")]
    for mod in (plot_kernels, plot_layer, plot_gpt2):
        for path, what in bad:
            for extra in ([], ["--cold"]) if mod is plot_kernels else ([],):
                msg = _usage_error(capsys, mod.main, [*extra, "--csv", str(tmp_path / "none.csv"), "--out", path])
                assert f"--out {path}" in msg and what in msg, msg
    assert plot_layer.parse_args(["--out", str(tmp_path / "f.SVG")]).out == str(tmp_path / "f.SVG")
    out = plot_gpt2.main(["--csv", str(ROOT / "results" / "bench_gpt2_cpu.csv"), "--out", str(tmp_path / "fig")])
    assert out == tmp_path / "fig.png" and out.read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {tmp_path / 'fig.png'}" in capsys.readouterr().out
    # --markdown prints a table and writes nothing: its --out is not looked at
    assert plot_kernels.main(["--markdown", "--out", str(tmp_path), "--csv", str(ROOT / "results" / "bench_kernels_quick.csv")])


# ---- help ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["plot_kernels", "plot_layer", "plot_gpt2", "targets", "bench_kernels", "bench_cold",
                                    "bench_first_use", "bench_layer", "bench_gpt2", "bench_cpu"])
def test_every_option_says_what_it_does(monkeypatch, module):
    import importlib

    class Parsed(Exception):
        pass

    def stop(self, *a, **k):
        raise Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    m = importlib.import_module(f"experiments.{module}")
    with pytest.raises(Parsed) as e:
        (m.parse_args if hasattr(m, "parse_args") else m.main)([])
    parser = e.value.args[0]
    assert parser.description and parser.description.strip()
    bare = [a.option_strings[-1] for a in parser._actions if not a.help]
    assert bare == [], f"{module}.py: options without a help string: {bare}"


def test_make_help_lists_every_target():
    if shutil.which("make") is None:
        pytest.skip("no make here")
    text = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    phony = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    targets = set(phony.replace("\\", " ").split()) - {"help"}
    listed = set(re.findall(r"[a-z0-9][a-z0-9-]+", text))
    assert sorted(targets - listed) == []


# ---- missing inputs ----------------------------------------------------------------------------
def test_plots_name_a_missing_csv(tmp_path, monkeypatch):
    from experiments import plot_kernels, plot_layer
    missing = str(tmp_path / "missing.csv")
    for mod, script, flags in ((plot_kernels, "bench_kernels.py", []), (plot_layer, "bench_layer.py", []),
                               (plot_kernels, "bench_cold.py", ["--cold"]),
                               (plot_kernels, "bench_cold.py", ["--cold", "--markdown"])):
        msg = one_line_exit(mod.main, [*flags, "--csv", missing, "--out", str(tmp_path / "fig.png")])
        assert missing in msg and "does not exist" in msg and script in msg
    assert not (tmp_path / "fig.png").exists()


def test_plots_skip_their_default_csv_when_not_measured_yet(tmp_path, monkeypatch, capsys):
    from experiments import plot_kernels, plot_layer
    monkeypatch.setattr(plot_kernels, "DEFAULT_CSV", str(tmp_path / "results" / "bench_kernels.csv"))
    monkeypatch.setattr(plot_layer, "DEFAULT_CSV", str(tmp_path / "results" / "bench_layer.csv"))
    assert plot_kernels.main(["--out", str(tmp_path / "fig.png")]) is None
    assert plot_layer.main(["--out", str(tmp_path / "fig.png")]) is None
    out = capsys.readouterr().out
    assert out.count("nothing drawn") == 2 and not (tmp_path / "fig.png").exists()


def test_plots_refuse_a_csv_they_cannot_draw(tmp_path):
    # another script's CSV, a CSV of other columns, a binary file, a header only, timings that
    # are not numbers: one line naming the script that writes the expected CSV, no figure
    from experiments import plot_gpt2, plot_kernels, plot_layer
    layer_cols = "method,phase,sparsity,B,eager_us,graph_us\n"
    files = {"other.csv": "a,b\n1,2\n", "binary.csv": b"\xff\xfe\x00garbage", "header.csv": layer_cols,
             "nan.csv": layer_cols + "snack,infer,0.9,8,n/a,\nsnack,infer,0.9,32\n",
             "kernels.csv": (ROOT / "results" / "bench_kernels.csv").read_text()}
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    cases = [(plot_kernels, "bench_kernels.py", "other.csv", "lacks the column(s) shape, op"),
             (plot_layer, "bench_layer.py", "kernels.csv", "lacks the column(s) phase, B"),
             (plot_gpt2, "bench_gpt2.py", "kernels.csv", "lacks the column(s) model, n_layer"),
             (plot_layer, "bench_layer.py", "binary.csv", "not a readable CSV text file"),
             (plot_kernels, "bench_kernels.py", "binary.csv", "not a readable CSV text file"),
             (plot_layer, "bench_layer.py", "header.csv", "has no rows"),
             (plot_layer, "bench_layer.py", "nan.csv", "holds no timing")]
    for mod, script, name, what in cases:
        msg = one_line_exit(mod.main, ["--csv", str(tmp_path / name), "--out", str(tmp_path / "fig.png")])
        assert what in msg and name in msg, (mod.__name__, name, msg)
        assert what in ("has no rows", "holds no timing") or script in msg, msg
    assert not (tmp_path / "fig.png").exists()


def test_train_mnist_missing_dataset_is_one_line(tmp_path):
    from experiments import data
    if (data.FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST is installed here")
    env = dict(os.environ, SNACK_DATA_CACHE=str(tmp_path / "cache"))  # no cached copy either
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_mnist.py"), "--dataset=fashion-mnist",
                        "--quick", "--progress=false", "--device=cpu", f"--out_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "Fashion-MNIST is not installed" in line and data.FASHION_INSTALL in line


# ---- bench_cpu: the SDDMM is checked like the SpMMs ---------------------------------------------
def _small_problem(B=3):
    from snack.core import COO
    w = COO.random((24, 40), density=0.3, seed=1)
    g = torch.Generator().manual_seed(2)
    return (torch.randn(B, 40, generator=g), torch.randn(B, 24, generator=g), w.topology, w.values,
            w.to_dense())


def test_bench_cpu_checks_the_sddmm(monkeypatch):
    from experiments import bench_cpu
    x, dy, topo, vals, wd = _small_problem()
    bench_cpu.check_ops(x, dy, topo, vals, wd)  # the real ops pass
    real = bench_cpu.cpu.sddmm
    monkeypatch.setattr(bench_cpu.cpu, "sddmm", lambda dy, x, topo, out=None: real(dy, x, topo).flip(0))
    with pytest.raises(AssertionError):
        bench_cpu.check_ops(x, dy, topo, vals, wd)


def test_bench_cpu_tiny_run_writes_every_op(tmp_path, capsys):
    import warnings
    from experiments import bench_cpu
    out = tmp_path / "cpu.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's beta / invariant-check notes on CSR tensors
        bench_cpu.main(["--in_features", "40", "--out_features", "24", "--batches", "1,3", "--rounds", "1",
                        "--repeats", "1", "--warmup", "0", "--out", str(out)])
    with open(out, newline="") as f:
        ops = [(r["op"], r["B"]) for r in csv.DictReader(f)]
    assert ops == [(op, B) for B in ("1", "3") for op in ("forward", "dX", "SDDMM")]
    assert "bench_cpu: 100%" in capsys.readouterr().err  # the progress bar, on stderr, to its end


def test_train_ddp_command_line(capsys):
    from experiments import train_ddp as t
    a = t.parse(["--quick", "--epochs=2"])
    assert (a.epochs, a.train_limit, a.update_every) == (2, 4000, 10)
    a = t.parse([])
    assert (a.epochs, a.train_limit, a.update_every, a.dst) == (3, 0, 100, "rigl")
    assert "--sparsity must be in [0, 1)" in _usage_error(capsys, t.parse, ["--sparsity=1.0"])
    assert "--epochs must be >= 1" in _usage_error(capsys, t.parse, ["--epochs=0"])
    assert "--train_limit must be >= 0" in _usage_error(capsys, t.parse, ["--train_limit=-5"])
    assert "invalid choice" in _usage_error(capsys, t.parse, ["--dst=magnitude"])
    for argv, msg in ((["--lr=-1"], "--lr must be a finite number > 0, got -1.0"),
                      (["--lr=nan"], "--lr must be a finite number > 0"),
                      (["--drop_fraction=2"], "--drop_fraction must be in [0, 1), got 2.0"),
                      (["--drop_fraction=-0.5"], "--drop_fraction must be in [0, 1)"),
                      (["--seed=-9223372036854775809"], "--seed must fit in 64 bits"),
                      (["--save=ture"], "argument --save: expected a boolean (true/false), got 'ture'"),
                      (["--save=maybe"], "argument --save: expected a boolean"),
                      (["--progress=maybe"], "argument --progress: expected a boolean")):
        assert msg in _usage_error(capsys, t.parse, argv), argv
    # booleans as train_mnist.py takes them: true/false, yes/no, on/off, 1/0, or the bare flag
    for argv, want in (([], True), (["--save"], True), (["--save=false"], False), (["--save", "no"], False),
                       (["--save=OFF"], False), (["--save=1"], True)):
        assert t.parse(argv).save is want, argv
    assert t.parse(["--progress=false"]).progress is False


def test_git_commit_names_the_checkout_and_yields_to_snack_commit(monkeypatch):
    # every results row records it: the short HEAD (with "-dirty" when the code differs), or
    # SNACK_COMMIT where the tree was copied without a usable .git
    from experiments.results_io import ROOT, git_commit
    monkeypatch.setenv("SNACK_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("SNACK_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        assert git_commit() == "unknown"
    else:
        assert git_commit() in (head.stdout.strip(), head.stdout.strip() + "-dirty")


def test_plot_kernels_markdown_tables_from_the_csv(tmp_path, capsys):
    # the README's tables come from the CSV: times as written, speed-ups and ratios computed
    from experiments import plot_kernels
    head = ["gpu", "commit", "dtype", "shape", "sparsity", "batch", "op", "method", "graph_us", "roofline_frac"]
    times = {("forward", "snack"): 10.0, ("forward", "dense"): 40.0, ("forward", "dense_mask"): 80.0,
             ("forward", "cusparse_csr"): 25.0, ("dX", "snack"): 12.5, ("SDDMM", "snack"): 9.0,
             ("backward", "snack"): 20.0, ("backward", "snack_separate"): 21.5}
    rows = [["H200", "abc", "float32", "64x64", sp, b, op, m, t * (2 if b == 8 else 1), "0.25" if m == "snack" else ""]
            for sp in ("0.9", "0.99") for b in (1, 8) for (op, m), t in times.items()]
    path = tmp_path / "k.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([head] + rows)
    text = plot_kernels.main(["--csv", str(path), "--shape", "64x64", "--markdown"])
    assert text == capsys.readouterr().out.strip()
    lines = text.splitlines()
    assert "| 0.9 | 8 | 20.0 | 80.0 | 160 | 50.0 | 4.00 | 8.00 | 2.50 | 25% | 25.0 | 18.0 | 1.25 | 0.90 | 40.0 | 43.0 |" in lines
    assert "| 0.99 | 10.00: 4.00 / 8.00 / 2.50x, 25% | 20.00: 4.00 / 8.00 / 2.50x, 25% |" in lines
    assert one_line_exit(plot_kernels.main, ["--csv", str(path), "--shape", "8x8", "--markdown"]).startswith("no rows")


def test_plot_kernels_names_the_shapes_a_csv_has(tmp_path):
    # bench_kernels' GPT-2 shapes (its host-overhead rows at 4096 x 4096 are no shape to draw)
    from experiments import plot_kernels
    gpt2 = str(ROOT / "results" / "bench_kernels_gpt2.csv")
    for extra in ([], ["--markdown"]):
        msg = one_line_exit(plot_kernels.main, ["--csv", gpt2, "--out", str(tmp_path / "k.png"), *extra])
        assert msg.startswith("no rows for shape 4096x4096") and "its shapes: 2304x768, 3072x768, 768x3072, 768x768;" in msg
    msg = one_line_exit(plot_kernels.main, ["--cold", "--markdown", "--shape", "8x8", "--csv", str(ROOT / "results" / "bench_cold.csv")])
    assert "its shapes: 4096x4096;" in msg
    assert not list(tmp_path.iterdir())


def test_plot_kernels_cold_table_and_figure_from_bench_cold_csv(tmp_path, capsys):
    # the cold-L2 table: SNACK warm -> cold, speed-ups on the cold times, cold roofline; a method
    # missing from a point reads "-", a point missing from the grid an empty cell; and its figure
    from experiments import plot_kernels
    head = ["shape", "sparsity", "batch", "method", "warm_us", "cold_us", "roofline_frac_cold"]
    cold = {"snack": (4.0, 5.0, "0.5"), "dense": (20.0, 20.0, ""), "dense_mask": (60.0, 70.0, ""),
            "cusparse_csr": (10.0, 16.0, "")}
    rows = [["64x64", "0.9", 1, m, w, c, r] for m, (w, c, r) in cold.items()]
    rows += [["64x64", "0.99", 8, m, w, c, r] for m, (w, c, r) in cold.items() if m != "cusparse_csr"]
    path = tmp_path / "cold.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([head] + rows)
    text = plot_kernels.main(["--csv", str(path), "--shape", "64x64", "--markdown", "--cold"])
    assert text == capsys.readouterr().out.strip()
    lines = text.splitlines()
    assert lines[0] == "| sparsity | B = 1 | B = 8 |"
    assert "| 0.90 | 4.00 -> 5.00: 4.00 / 14.00 / 3.20x, 50% |  |" in lines
    assert "| 0.99 |  | 4.00 -> 5.00: 4.00 / 14.00 / -x, 50% |" in lines
    # without --markdown: the figure, warm and cold side by side
    png = tmp_path / "cold.png"
    assert plot_kernels.main(["--csv", str(path), "--shape", "64x64", "--cold", "--out", str(png)]) == str(png)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert one_line_exit(plot_kernels.main, ["--csv", str(path), "--markdown", "--cold"]).startswith("no rows")


def test_plot_layer_draws_the_cold_l2_times_beside_the_warm_ones(tmp_path):
    # a CSV from bench_layer.py --cold_l2: each method's cold graph time is a dashed line beside
    # its warm one, and SNACK's cold speed-ups are bars of their own, at the CSV's values
    from experiments import plot_layer
    head = ["method", "phase", "sparsity", "B", "eager_us", "graph_us", "graph_cold_us", "graph_vs_dense",
            "graph_cold_vs_dense", "in_features", "out_features"]
    times = {"snack": (10.0, 13.0), "dense": (40.0, 41.0)}
    rows = [[m, ph, "0.9", b, 100.0, w * b, c * b, 40.0 / 10.0 if m == "snack" else 1.0,
             41.0 / 13.0 if m == "snack" else 1.0, 64, 64]
            for m, (w, c) in times.items() for ph in ("train", "infer") for b in (1, 8)]
    path = tmp_path / "layer_cold.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([head] + rows)
    loaded, sparsity = plot_layer.load(str(path))
    fig = plot_layer.draw(loaded, sparsity)
    train, _infer, speedup = fig.axes[:3]
    lines = {ln.get_label(): ln for ln in train.get_lines()}
    assert set(lines) == {"SNACK (COO)", "SNACK (COO), cold L2", "dense", "dense, cold L2"}
    assert list(lines["SNACK (COO), cold L2"].get_ydata()) == [13.0, 104.0]
    assert lines["dense, cold L2"].get_linestyle() == "--" and lines["dense"].get_linestyle() == "-"
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in speedup.containers}
    assert bars["train vs dense (graph, cold L2)"] == pytest.approx([41 / 13] * 2)
    assert bars["infer vs dense (graph)"] == pytest.approx([4.0, 4.0])
    png = plot_layer.main(["--csv", str(path), "--out", str(tmp_path / "fig.png")])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_first_use_refuses_a_cache_dir_with_files_and_passes_its_children_the_rest(tmp_path, capsys):
    from experiments import bench_first_use as b
    (tmp_path / "k.cubin").write_bytes(b"x")
    assert "--cache-dir must be a new or empty directory" in _usage_error(capsys, b.parse_args, ["--cache-dir", str(tmp_path)])
    assert b.parse_args(["--cache-dir", str(tmp_path / "new")]).cache_dir == str(tmp_path / "new")
    argv = ["--out", "a.csv", "--batch", "1,8", "--out=b.csv", "--cache-dir", "c", "--dtype=bfloat16"]
    assert b._strip_option(b._strip_option(argv, "--out"), "--cache-dir") == ["--batch", "1,8", "--dtype=bfloat16"]


def test_bench_first_use_runs_empty_then_full_then_off_and_writes_every_call(tmp_path, monkeypatch, capsys):
    # the parent process's part (the measured processes need a GPU): which cache each run gets,
    # what reaches the CSV
    import csv
    import os
    from experiments import bench_first_use as b
    from experiments import bench_kernels
    monkeypatch.setattr(bench_kernels, "require_gpu", lambda *a, **k: None)
    monkeypatch.setattr(bench_kernels, "run_metadata", lambda dtype: dict(gpu="Fake GPU", commit="abc1234", dtype=dtype))
    seen = []

    def fake_child(argv, cache_value):
        seen.append((list(argv), cache_value, os.path.isdir(cache_value)))
        hits = 0 if len(seen) == 1 or cache_value == "0" else 3
        rows = [dict(sparsity=0.9, B=B, op=op, seconds=0.5 if hits == 0 else 0.01) for B in (1, 8) for op in b.OPS]
        return dict(rows=rows, import_s=1.0, total_s=2.0, worst_forward_error=1e-7,
                    stats=dict(hits=hits, misses=3 - hits if cache_value != "0" else 0, stored=3 if len(seen) == 1 else 0))
    monkeypatch.setattr(b, "_run_child", fake_child)
    out = tmp_path / "fu.csv"
    b.main(["--batch", "1,8", "--sparsity", "0.9", "--full-runs", "2", "--out", str(out)])
    assert [s[1] == "0" for s in seen] == [False, False, False, True]
    assert seen[0][1] == seen[1][1] == seen[2][1] and seen[0][2]  # one temporary directory, there while used
    assert not os.path.exists(seen[0][1])                       # and removed after
    assert all(s[0] == ["--batch", "1,8", "--sparsity", "0.9", "--full-runs", "2"] for s in seen)
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 4 * (8 + 2)
    assert [r["cache"] for r in rows[::10]] == ["empty", "full", "full", "off"]
    assert {(r["gpu"], r["commit"], r["dtype"], r["shape"]) for r in rows} == {("Fake GPU", "abc1234", "float32", "4096x4096")}
    calls = [r for r in rows if r["op"] in b.OPS]
    assert {(r["run"], r["B"], r["op"]) for r in calls} == {(str(i), str(B), op) for i in range(1, 5) for B in (1, 8) for op in b.OPS}
    assert "run 2 (full): first calls 0.08 s" in capsys.readouterr().out


def test_save_figure_is_atomic_and_takes_the_format_of_the_suffix(tmp_path, monkeypatch):
    """A figure goes to its path whole or not at all (a failed save keeps the figure there
    before); the format follows the suffix, and matplotlib's default (PNG) without one."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from experiments.results_io import save_figure
    fig = plt.figure()
    heads = {"a.png": b"\x89PNG", "b.svg": b"<?xm", "c.pdf": b"%PDF", "noext": b"\x89PNG"}
    for name, head in heads.items():
        assert save_figure(fig, tmp_path / name).read_bytes()[:4] == head, name
    good = (tmp_path / "a.png").read_bytes()

    def fail(*args, **kwargs):
        Path(args[0]).write_bytes(b"partial")
        raise OSError(27, "File too large")

    monkeypatch.setattr(fig, "savefig", fail)
    with pytest.raises(OSError, match="too large"):
        save_figure(fig, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(heads)
    plt.close(fig)
