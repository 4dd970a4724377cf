"""Data-parallel truly sparse training: LeNet-300-100 on MNIST over several processes.

    torchrun --standalone --nproc_per_node=2 experiments/train_ddp.py                 # RigL, 3 epochs
    torchrun --standalone --nproc_per_node=2 experiments/train_ddp.py --dst=set --epochs=10
    torchrun --standalone --nproc_per_node=2 experiments/train_ddp.py --quick         # seconds

Every rank builds the same sparse network (`snack.sparsify` of LeNet-300-100 from the seed) and
wraps it in DistributedDataParallel without buffer syncing at every forward (the indices are
buffers that every rank changes alike). Each step the global batch (`--batch_size`) is cut into one slice per rank;
DDP averages the values' and biases' gradients; `snack.dst.SET` or `snack.dst.RigL` then prunes
and regrows on every rank alike (their `process_group` is the world group: RigL scores the
gradient of the global batch, and the ranks compare their choices before writing them). After
every epoch the ranks compare fingerprints of every layer's indices and values, and rank 0
prints the loss, the test accuracy and whether the copies are identical. Backend: NCCL with one
GPU per rank where there are enough GPUs, else gloo on the CPU (`--device=cpu` forces it).
Run without torchrun it trains in one process.

Options (--key=value): epochs, batch_size (global), lr, sparsity, distribution (erk/uniform),
dst (rigl/set/none), update_every, drop_fraction, train_limit (0: all 60000), seed, device
(auto/cpu), backward_thread (caller/device: on a GPU, where autograd runs each backward: this
thread, `torch.autograd.set_multithreading_enabled(False)`, as train_mnist.py does by default, or
autograd's worker thread for the GPU; one GPU per rank either way), progress, out_dir (rank 0 writes <out_dir>/train_ddp.json: config, environment, per-epoch
loss / accuracy / agreement; and, unless --save=false, the trained model to
<out_dir>/train_ddp_model.pt, which `experiments.train_mnist.load_trained` reads), quick (1 epoch on 4000 examples, update_every 10, for what is not
given).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
import snack  # noqa: E402
from experiments.cli import bool_arg, out_arg  # noqa: E402
from experiments.data import DataFileError, DatasetNotFoundError, load  # noqa: E402
from experiments.results_io import write_text  # noqa: E402
from experiments.train_mnist import (backward_thread_name, environment, evaluate, lenet_300_100,  # noqa: E402
                                    save_trained)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--batch_size", type=int, default=128, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate, > 0")
    p.add_argument("--sparsity", type=float, default=0.9, help="fraction of connections removed, in [0, 1)")
    p.add_argument("--distribution", choices=("erk", "uniform"), default="erk")
    p.add_argument("--dst", choices=("rigl", "set", "none"), default="rigl")
    p.add_argument("--update_every", type=int, default=None, help="default 100 (--quick: 10)")
    p.add_argument("--drop_fraction", type=float, default=0.3,
                   help="fraction pruned and regrown per update (cosine decay to 0 at 75%% of the steps, "
                        "no update after), in [0, 1)")
    p.add_argument("--train_limit", type=int, default=None, help="default 0: all (--quick: 4000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--backward_thread", choices=("caller", "device"), default="caller",
                   help="on a GPU: run each backward on the calling thread (default) or on autograd's worker thread")
    p.add_argument("--progress", type=bool_arg, nargs="?", const=True, default=True, help="tqdm bar (rank 0)")
    p.add_argument("--out_dir", default=str(ROOT / "results"), help="where rank 0 writes train_ddp.json")
    p.add_argument("--save", type=bool_arg, nargs="?", const=True, default=True,
                   help="rank 0 also saves the trained model to <out_dir>/train_ddp_model.pt")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    # --quick fills in only what was not given
    for name, normal, quick in (("epochs", 3, 1), ("train_limit", 0, 4000), ("update_every", 100, 10)):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else normal)
    if a.train_limit < 0:
        p.error(f"--train_limit must be >= 0, got {a.train_limit}")
    for name in ("epochs", "batch_size", "update_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if not 0.0 <= a.sparsity < 1.0:
        p.error(f"--sparsity must be in [0, 1), got {a.sparsity}")
    if not 0.0 < a.lr < math.inf:
        p.error(f"--lr must be a finite number > 0, got {a.lr}")
    if not 0.0 <= a.drop_fraction < 1.0:
        p.error(f"--drop_fraction must be in [0, 1), got {a.drop_fraction}")
    if not -2**63 <= a.seed < 2**64:
        p.error(f"--seed must fit in 64 bits (torch.manual_seed), got {a.seed}")
    out_arg(p, "out_dir", Path(a.out_dir) / "train_ddp.json")  # before the run, not after it
    return a


def ddp(model: nn.Module, device_ids=None) -> nn.Module:
    """DistributedDataParallel that does not re-send the buffers (the indices) at every forward:
    every rank changes them alike (forward_sync_buffers=False from torch 2.13, before it
    broadcast_buffers=False)."""
    import inspect
    DDP = nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return DDP(model, device_ids=device_ids, forward_sync_buffers=False)
    return DDP(model, device_ids=device_ids, broadcast_buffers=False)


def fingerprint(model: nn.Module) -> torch.Tensor:
    """Per SparseLinear: sums of its indices and values, plain and position-weighted (float64)."""
    out = []
    for m in model.modules():
        if isinstance(m, snack.SparseLinear):
            for t in (m.indices.flatten(), m.values.detach()):
                t = t.double()
                w = torch.arange(1, t.numel() + 1, dtype=torch.float64, device=t.device)
                out += [t.sum(), (t * w).sum()]
    return torch.stack(out)


def main(argv=None) -> dict:
    a = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = a.device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    lead = rank == 0
    if a.batch_size % world:
        raise SystemExit(f"--batch_size {a.batch_size} must be a multiple of the {world} ranks")
    if world > 1 and not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the cores
    try:
        x_train, y_train = load("mnist", "train", limit=a.train_limit or None, device=device)
        x_test, y_test = load("mnist", "test", device=device)
        torch.manual_seed(a.seed)  # the same network on every rank
        model = snack.sparsify(lenet_300_100(), sparsity=a.sparsity, distribution=a.distribution).to(device)
        net = ddp(model, [local] if use_cuda else None) if world > 1 else model
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
        n, per = x_train.shape[0], a.batch_size // world
        steps = n // a.batch_size  # whole global batches (the rest of an epoch's order is left out)
        if steps == 0:
            raise SystemExit(f"--batch_size {a.batch_size} is larger than the {n} training examples")
        dst = None
        if a.dst != "none":  # RigL's cosine decay of the drop fraction, no update after 75% of the steps
            dst = (snack.dst.RigL if a.dst == "rigl" else snack.dst.SET)(
                model, opt, drop_fraction=a.drop_fraction, update_every=a.update_every,
                total_steps=a.epochs * steps, seed=a.seed)
        if lead:
            print(f"train_ddp: {world} rank(s) ({'NCCL, one GPU each' if use_cuda and world > 1 else 'gloo, CPU' if world > 1 else device}), "
                  f"LeNet-300-100 at sparsity {a.sparsity} ({a.distribution}), DST {a.dst}, global batch "
                  f"{a.batch_size} ({per} per rank), {a.epochs} epoch(s) on {n} examples, backward on "
                  f"{backward_thread_name(device, a.backward_thread)}",
                  flush=True)
        order = torch.Generator().manual_seed(a.seed)  # the same batch order on every rank
        from tqdm.auto import tqdm
        identical, updates, t_train, epochs = True, 0, 0.0, []
        for epoch in range(a.epochs):
            perm = torch.randperm(n, generator=order).to(device)
            loss_sum = torch.zeros((), device=device)
            t0 = time.perf_counter()
            with torch.autograd.set_multithreading_enabled(a.backward_thread == "device"):
                for step in tqdm(range(steps), desc=f"epoch {epoch + 1}/{a.epochs}", disable=not (lead and a.progress),
                                 leave=False, dynamic_ncols=True):
                    idx = perm[step * a.batch_size:(step + 1) * a.batch_size][rank * per:(rank + 1) * per]
                    loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if dst is not None and dst.step() is not None:
                        updates += 1
                    loss_sum += loss.detach()
            t_train += time.perf_counter() - t0
            fp = fingerprint(model)
            if world > 1:  # the ranks agree where max(fp) == min(fp) = -max(-fp): one collective
                both = torch.cat([fp, -fp])
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                same = bool(torch.equal(both[:fp.numel()], -both[fp.numel():]))
                identical &= same
                loss_all = loss_sum.clone()
                dist.all_reduce(loss_all)
                loss_sum = loss_all / world
            else:
                same = True
            if lead:
                acc = evaluate(model, x_test, y_test)
                epochs.append(dict(epoch=epoch + 1, train_loss=round(float(loss_sum) / steps, 6), test_acc=acc,
                                   dst_updates=updates, identical=same, train_time_s=round(t_train, 3)))
                print(f"epoch {epoch + 1}/{a.epochs}: train loss {float(loss_sum) / steps:.4f}  test acc {acc:.4f}  "
                      f"DST updates so far {updates}  copies on the {world} rank(s) "
                      f"{'identical' if same else 'DIFFER'}  ({t_train:.1f} s training)", flush=True)
        res = dict(world=world, test_acc=evaluate(model, x_test, y_test), identical=identical, dst_updates=updates,
                   nnz=sum(m.nnz for m in model.modules() if isinstance(m, snack.SparseLinear)))
        if lead:
            path = Path(a.out_dir) / "train_ddp.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            if a.save:  # train_mnist.py's checkpoint format (load_trained reads both)
                res["checkpoint"] = str(save_trained(Path(a.out_dir) / "train_ddp_model.pt", model, "sparse",
                                                     vars(a), res["test_acc"]))
            write_text(path, json.dumps(dict(config=vars(a), backend=dist.get_backend() if world > 1 else "",
                                             environment=environment(device), epochs=epochs, **res), indent=2))
            print(f"done: test accuracy {res['test_acc']:.4f}, {res['nnz']} connections, {updates} DST update(s); "
                  f"the ranks' models {'stayed identical' if identical else 'DIVERGED'}; wrote {path}", flush=True)
        if not identical:
            raise SystemExit("the ranks' models diverged")
        return res
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (DatasetNotFoundError, DataFileError) as e:  # not installed, or a damaged file: on one line
        sys.exit(f"{Path(sys.argv[0]).name}: error: " + " ".join(str(e).split()))
