"""One rank of a data-parallel dynamic sparse training run, for tests/test_dst_distributed.py.

python tests/dist_worker.py SCENARIO RANK WORLD INIT_FILE OUT_DIR [BACKEND]: joins a process group
(BACKEND gloo, the default: float64 on the CPU; nccl: float32 on GPU RANK; gloo_cuda: gloo, with
float32 on GPU 0 for every rank) through INIT_FILE
(WORLD > 1), trains a small model of two snack.SparseLinear layers, and saves what happened
(errors, warnings, each layer's indices and values, on the CPU) to OUT_DIR/rRANK.pt.
WORLD = 1 is the single-process reference on the whole batch.
"""
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import snack
from experiments.train_ddp import ddp

BATCH = 16


def build(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(snack.SparseLinear(30, 20, sparsity=0.8, dtype=dtype), nn.Tanh(),
                         snack.SparseLinear(20, 6, sparsity=0.5, dtype=dtype))


def batches(n, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 30, generator=g, dtype=dtype).to(device),
             torch.randn(BATCH, 6, generator=g, dtype=dtype).to(device)) for _ in range(n)]


def sparse_layers(model):
    return [m for m in model.modules() if isinstance(m, snack.SparseLinear)]


def main(scenario, rank, world, init, out, backend="gloo"):
    dtype, device = torch.float64, torch.device("cpu")
    if backend in ("nccl", "gloo_cuda"):
        dtype, device = torch.float32, torch.device("cuda", rank if backend == "nccl" else 0)
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(backend.replace("_cuda", ""), init_method=f"file://{init}", rank=rank,
                                world_size=world)
    model = build(dtype).to(device)
    layers = sparse_layers(model)
    res = {"updates": [], "errors": [], "warnings": []}
    per = BATCH // world
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if scenario in ("rigl", "rigl_group", "set", "set_seeds", "set_noseed"):
                net = ddp(model, [device.index] if device.type == "cuda" else None) if world > 1 else model
                opt = torch.optim.Adam(model.parameters(), lr=1e-2)
                kw = dict(update_every=2, drop_fraction=0.3, decay="constant")
                if scenario in ("rigl", "rigl_group", "set"):
                    kw["seed"] = 5
                if scenario == "rigl_group" and world > 1:  # an explicit group (here: every rank)
                    kw["process_group"] = dist.new_group(list(range(world)))
                elif scenario == "set_seeds":
                    kw["seed"] = 5 + rank  # the ranks disagree: refused
                else:
                    torch.manual_seed(100 + rank)  # the ranks' global generators differ
                dst = (snack.dst.RigL if scenario.startswith("rigl") else snack.dst.SET)(model, opt, **kw)
                res["seed"] = dst.seed
                for x, t in batches(4, dtype, device):
                    x, t = x[rank * per:(rank + 1) * per], t[rank * per:(rank + 1) * per]
                    ((net(x) - t) ** 2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    before = [m.indices.clone() for m in layers]
                    try:
                        s = dst.step()
                    except RuntimeError as e:
                        res["errors"].append(str(e))
                        res["unchanged"] = all(torch.equal(b, m.indices) for b, m in zip(before, layers))
                        res["num_steps"] = dst.num_steps
                        break
                    if s is not None:
                        res["updates"].append([r.grown for r in s.layers])
            elif scenario in ("rigl_missing", "rigl_nan"):
                # no DistributedDataParallel: one rank runs no forward / feeds NaN before the update
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                dst = snack.dst.RigL(model, opt, update_every=1, drop_fraction=0.3, seed=5)
                x, t = batches(1, dtype, device)[0]
                x = x[rank * per:(rank + 1) * per].clone()
                if scenario == "rigl_nan" and rank == 1:
                    x[0, 0] = float("nan")
                if not (scenario == "rigl_missing" and rank == 1):
                    ((model(x) - t[:per]) ** 2).mean().backward()
                before = [m.indices.clone() for m in layers]
                try:
                    s = dst.step()
                    res["updates"].append([r.grown for r in s.layers])
                    res["skipped"] = [r.skipped for r in s.layers]
                except ValueError as e:
                    res["errors"].append(str(e))
                    res["num_steps"] = dst.num_steps
                res["unchanged"] = all(torch.equal(b, m.indices) for b, m in zip(before, layers))
            else:
                raise SystemExit(f"unknown scenario {scenario}")
        res["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        res["layers"] = [(m.indices.cpu(), m.values.detach().cpu()) for m in layers]
        torch.save(res, f"{out}/r{rank}.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], *sys.argv[6:7])
    # the rank's results are saved and its process group destroyed: leave without the
    # interpreter's teardown, in which gloo's threads once aborted a finished rank
    # (std::terminate, "terminate called without an active exception", exit code -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
