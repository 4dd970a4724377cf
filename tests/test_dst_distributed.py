"""Dynamic sparse training under data parallelism: two gloo ranks on the CPU (subprocesses of
tests/dist_worker.py), each with its half of every batch, keep identical models through SET and
RigL updates; RigL's growth equals a single process's on the whole batch; disagreement, a missing
gradient or NaN on one rank are handled on every rank alike, without a hang."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import real_cuda_env

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
ROOT = WORKER.parents[1]

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")


def run(scenario, world, tmp_path, timeout=300, backend="gloo"):
    """Runs the scenario on `world` ranks; returns each rank's saved results."""
    out = tmp_path / f"{scenario}_{world}_{backend}"
    out.mkdir()
    init = tmp_path / f"{scenario}_{world}_{backend}_init"
    env = real_cuda_env()
    if backend == "gloo":  # the CPU only
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(r), str(world), str(init), str(out),
                               backend],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario}: the ranks did not finish within {timeout} s (a hang in a collective?)")
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} of {scenario} failed:\n{log[-3000:]}"
    return [torch.load(out / f"r{r}.pt", weights_only=False) for r in range(world)]


def same_layers(a, b, exact=True):
    for (ia, va), (ib, vb) in zip(a["layers"], b["layers"]):
        assert torch.equal(ia, ib)
        if exact:
            assert torch.equal(va, vb)
        else:
            torch.testing.assert_close(va, vb, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scenario", ["rigl", "rigl_group"])
def test_rigl_ranks_stay_identical_and_grow_as_the_whole_batch(tmp_path, scenario):
    r0, r1 = run(scenario, 2, tmp_path)  # rigl_group: the group passed as process_group
    ref, = run("rigl", 1, tmp_path)
    assert r0["errors"] == r1["errors"] == []
    assert len(r0["updates"]) == 2 and all(g > 0 for u in r0["updates"] for g in u)
    same_layers(r0, r1)  # bit for bit: DDP keeps the values equal, the updates agree
    # the gradient scores summed over the ranks rank the free coordinates as the whole batch's
    # gradient does: the same connections, values equal up to rounding
    same_layers(r0, ref, exact=False)
    assert r0["updates"] == ref["updates"]
    # and the pattern did change (the check above is not vacuous)
    from dist_worker import build, sparse_layers  # noqa: E402
    init = sparse_layers(build())
    assert any(not torch.equal(m.indices, i) for m, (i, _) in zip(init, r0["layers"]))


@pytest.mark.parametrize("scenario", ["set", "set_noseed"])
def test_set_ranks_stay_identical(tmp_path, scenario):
    r0, r1 = run(scenario, 2, tmp_path)
    assert r0["errors"] == r1["errors"] == []
    assert r0["seed"] == r1["seed"]  # set_noseed: rank 0's seed, drawn from different generators
    assert len(r0["updates"]) == 2
    same_layers(r0, r1)


def test_ranks_that_disagree_raise_on_every_rank_and_change_nothing(tmp_path):
    r0, r1 = run("set_seeds", 2, tmp_path)
    for r in (r0, r1):
        assert len(r["errors"]) == 1 and "the ranks chose different connections" in r["errors"][0]
        assert r["unchanged"] and r["num_steps"] == 1  # the refused update step is not counted
        assert r["updates"] == []


def test_a_rank_without_gradient_skips_the_layers_everywhere(tmp_path):
    r0, r1 = run("rigl_missing", 2, tmp_path)
    for r in (r0, r1):
        assert r["errors"] == [] and r["unchanged"]
        assert r["skipped"] == ["no gradient captured"] * 2
        assert any("no gradient was captured" in w for w in r["warnings"])


def test_nan_on_one_rank_stops_the_update_on_every_rank(tmp_path):
    r0, r1 = run("rigl_nan", 2, tmp_path)
    for r in (r0, r1):
        assert len(r["errors"]) == 1 and "NaN" in r["errors"][0] and "on at least one rank" in r["errors"][0]
        assert r["unchanged"] and r["num_steps"] == 0


def test_process_group_argument():
    import torch.nn as nn
    import snack
    model = nn.Sequential(snack.SparseLinear(8, 4, sparsity=0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert snack.dst.SET(model, opt).process_group is None  # torch.distributed not initialized here
    assert snack.dst.SET(model, opt, process_group=False).process_group is None
    for bad in (True, "world", object()):
        with pytest.raises(TypeError, match="process_group must be None, False or a torch.distributed"):
            snack.dst.RigL(model, opt, process_group=bad)


two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                                   and dist.is_nccl_available()), reason="needs two CUDA GPUs and NCCL")


@pytest.mark.gpu
@two_gpus
def test_nccl_ranks_on_two_gpus_stay_identical_and_refuse_alike(tmp_path):
    # float32 on the GPU kernels, the collectives' tensors on each rank's current CUDA device
    r0, r1 = run("rigl", 2, tmp_path, backend="nccl")
    assert r0["errors"] == r1["errors"] == []
    assert len(r0["updates"]) == 2 and all(g > 0 for u in r0["updates"] for g in u)
    same_layers(r0, r1)
    s0, s1 = run("set_noseed", 2, tmp_path, backend="nccl")
    assert s0["seed"] == s1["seed"] and s0["errors"] == s1["errors"] == []
    same_layers(s0, s1)
    for r in run("set_seeds", 2, tmp_path, backend="nccl"):
        assert len(r["errors"]) == 1 and "the ranks chose different connections" in r["errors"][0]
        assert r["unchanged"]
    for r in run("rigl_nan", 2, tmp_path, backend="nccl"):
        assert len(r["errors"]) == 1 and "on at least one rank" in r["errors"][0] and r["unchanged"]


@pytest.mark.gpu
def test_gloo_ranks_with_models_on_the_gpu(tmp_path):
    # both ranks on GPU 0 (gloo takes CUDA tensors): the GPU kernels in DDP training, the
    # collectives' tensors moved to the CPU and back
    r0, r1 = run("rigl", 2, tmp_path, backend="gloo_cuda")
    assert r0["errors"] == r1["errors"] == []
    assert len(r0["updates"]) == 2 and all(g > 0 for u in r0["updates"] for g in u)
    same_layers(r0, r1)
    for r in run("set_seeds", 2, tmp_path, backend="gloo_cuda"):
        assert len(r["errors"]) == 1 and "the ranks chose different connections" in r["errors"][0]
        assert r["unchanged"]
