"""Train LeNet-300-100 (784-300-100-10) on real MNIST, truly sparse next to dense, side by side.

The dense MLP is built once from the seed; the sparse model is the same initial network passed
through `snack.sparsify` (every nn.Linear becomes a snack.SparseLinear keeping the largest-|w|
connections, `sparsity` overall, spread uniformly or by ERK). Both then train with the same
optimizer, learning rate, batch order and number of epochs. Per model it prints and writes to
`<out_dir>/train_mnist.csv`: test accuracy, training time, parameter and connection counts, the
bytes of weights (+ indices), gradients and optimizer state counted from the actual tensors, and
peak memory (CUDA: torch.cuda.max_memory_allocated over the run; CPU: those state bytes plus
the tensors autograd saves for backward in one step); the CSV also says whether the steps were
replayed from a CUDA graph (cuda_graph, graph_captures, graph_replays, capture_s). The run's
config goes beside the CSV, and
each trained model to `<out_dir>/train_mnist_<model>.pt` (`load_trained(path)` rebuilds it).

By default the connection pattern stays the one chosen at initialisation; `--dst=set` or
`--dst=rigl` trains the sparse model with snack.dst (prune and regrow every `update_every` steps,
same nnz). On a GPU the training step is replayed from a CUDA graph (`--cuda_graph=auto`, the
default; `true` asks for it and fails without a GPU, `false` trains eagerly): it captures the whole training step (batch gather, forward,
backward, optimizer step, loss sum) in a CUDA graph after a few eager steps and replays it, which
removes the per-step host time that bounds these small layers; steps the graph cannot stand for
run eagerly in between: a last batch of another size, RigL's gradient capture before its updates,
and after a learning-rate change the graph is captured again (SET / RigL rewrite the pattern in
place, so the graph replays the new one). The capture time is reported (`capture_s`) and not
counted as training time. Trade-off: the whole data set lives in memory (on the GPU when training there), so
that loading never hides the layers' speed, at 220 MB for MNIST in float32 (train and test).

Config nanoGPT-style: every default below can be overridden as --key=value, e.g.
    python experiments/train_mnist.py                               # full run
    python experiments/train_mnist.py --sparsity=0.95 --distribution=uniform --epochs=5
    python experiments/train_mnist.py --dst=rigl --epochs=20
    python experiments/train_mnist.py --quick                       # seconds: a smoke test
    python experiments/train_mnist.py --cuda_graph=false            # GPU: eager steps, as a plain loop
sparse_learning's MNIST recipe (SGD with Nesterov momentum, lr 0.1 divided by 10 every 25000 steps,
weight decay 5e-4, batch 100, 100 epochs on 54000 images, SET once per epoch to the end):
    python experiments/train_mnist.py --optimizer=sgd --nesterov --lr=0.1 --lr_decay_every=25000 \
        --weight_decay=5e-4 --batch_size=100 --epochs=100 --train_limit=54000 --distribution=uniform \
        --dst=set --drop_fraction=0.5 --update_every=540 --dst_end=1.0
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))

import snack  # noqa: E402
from snack.layers.backend import backend_name  # noqa: E402
from experiments.cli import bool_arg, out_arg  # noqa: E402
from experiments.cuda_workspaces import make_cublas_workspaces  # noqa: E402
from experiments.data import DataFileError, DatasetNotFoundError, load  # noqa: E402
from experiments.results_io import git_commit, save_torch, write_csv, write_text  # noqa: E402

# ---- config: defaults, overridable with --key=value ------------------------------------------
OPTIONS = (  # (key, default, what it sets: the option's --help)
    ("dataset", "mnist", "mnist | fashion-mnist"),
    ("models", "dense,sparse", "which of the two to train, comma separated, in this order"),
    ("sparsity", 0.9, "fraction of connections removed, over all layers together, in [0, 1)"),
    ("distribution", "erk", "erk | uniform: how sparsity is spread over the layers"),
    ("dst", "none", "none | set | rigl: dynamic sparse training of the sparse model (sparsity > 0)"),
    ("drop_fraction", 0.3, "dst: fraction pruned and regrown per update (cosine decay), in [0, 1)"),
    ("update_every", 100, "dst: steps between updates"),
    ("dst_end", 0.75, "dst: no update after this fraction of training (1.0: to the end)"),
    ("epochs", 10, "passes over the training examples"),
    ("batch_size", 128, "examples per step"),
    ("optimizer", "adam", "adam | sgd (with momentum)"),
    ("lr", 1e-3, "learning rate, > 0"),
    ("momentum", 0.9, "sgd only: momentum, >= 0"),
    ("nesterov", False, "sgd only: Nesterov momentum"),
    ("weight_decay", 0.0, "L2 penalty added to the gradients, >= 0"),
    ("lr_decay_every", 0, "multiply lr by lr_decay every this many steps (0: constant lr)"),
    ("lr_decay", 0.1, "factor of each lr decay, in (0, 1]"),
    ("seed", 0, "seed of the initial weights, the batch order and DST's choices"),
    ("device", "auto", "auto | cpu | cuda"),
    ("train_limit", 0, "use the first N training examples (0: all 60000)"),
    ("test_limit", 0, "use the first N test examples (0: all 10000)"),
    ("threads", 0, "torch CPU threads (0: torch's default)"),
    ("cuda_graph", "auto", "auto | true | false: replay the training step from a CUDA graph "
                           "(auto: on a GPU)"),
    ("backward_thread", "caller", "caller | device: where autograd runs the backward on a GPU: this "
                                  "thread (torch.autograd.set_multithreading_enabled(False), faster for "
                                  "small eager steps) or torch's worker thread per device (its default)"),
    ("progress", True, "tqdm bars"),
    ("out_dir", "results", "train_mnist.csv and train_mnist.json go here"),
    ("save", True, "also <out_dir>/train_mnist_<model>.pt: each trained model (load_trained reads it)"),
    ("quick", False, "a smoke run of seconds (the values marked --quick); explicit --key=value still win"),
)
DEFAULTS = {key: default for key, default, _ in OPTIONS}
# --quick: few steps, and a DST update every 10 of them (at least one before dst_end)
QUICK = dict(epochs=1, train_limit=3000, test_limit=1000, batch_size=64, update_every=10)


def _auto_bool(s: str):
    """"auto" or a boolean (true/false), for the options that default to auto."""
    if str(s).strip().lower() == "auto":
        return "auto"
    try:
        return bool_arg(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {s!r}") from None


def parse_config(argv=None) -> dict:
    """DEFAULTS overridden by --key=value (or --key value) arguments; --quick applies QUICK."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, default, text in OPTIONS:
        flag = "--" + key
        text = f"{text} (default {default}" + (f"; --quick: {QUICK[key]})" if key in QUICK else ")")
        if key == "cuda_graph":
            p.add_argument(flag, type=_auto_bool, nargs="?", const=True, default=argparse.SUPPRESS, help=text)
        elif isinstance(default, bool):
            p.add_argument(flag, type=bool_arg, nargs="?", const=True, default=argparse.SUPPRESS, help=text)
        else:
            p.add_argument(flag, type=type(default), default=argparse.SUPPRESS, help=text)
    given = vars(p.parse_args(argv))
    cfg = dict(DEFAULTS)
    if given.get("quick", False):
        cfg.update(QUICK)
    cfg.update(given)
    _validate(cfg)
    out_arg(p, "out_dir", Path(cfg["out_dir"]) / "train_mnist.csv")  # before the run, not after it
    return cfg


def _validate(cfg: dict) -> None:
    if not str(cfg["out_dir"]).strip():  # (Path("") is the current folder: an unset shell variable's value)
        raise ValueError("out_dir must not be empty (--out_dir=. writes into the current folder)")
    if cfg["dataset"] not in ("mnist", "fashion-mnist"):
        raise ValueError(f"dataset must be 'mnist' or 'fashion-mnist', got {cfg['dataset']!r}")
    models = [m.strip() for m in cfg["models"].split(",") if m.strip()]
    if not models or any(m not in ("dense", "sparse") for m in models) or len(set(models)) < len(models):
        raise ValueError(f"models must be a comma-separated subset of dense,sparse, each once, got {cfg['models']!r}")
    if not 0.0 <= cfg["sparsity"] < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {cfg['sparsity']}")
    if cfg["distribution"] not in ("erk", "uniform"):
        raise ValueError(f"distribution must be 'erk' or 'uniform', got {cfg['distribution']!r}")
    if cfg["dst"] not in ("none", "set", "rigl"):
        raise ValueError(f"dst must be none, set or rigl, got {cfg['dst']!r}")
    if cfg["dst"] != "none" and "sparse" not in models:
        raise ValueError(f"dst={cfg['dst']} trains the sparse model, but models={cfg['models']} has none: "
                         "add sparse to --models or leave out --dst")
    if cfg["dst"] != "none" and cfg["sparsity"] == 0.0:  # every coordinate held: nothing to regrow into
        raise ValueError(f"dst={cfg['dst']} needs sparsity > 0: at sparsity 0 the sparse model holds every "
                         "connection, with no free one to regrow into")
    if not 0.0 <= cfg["drop_fraction"] < 1.0:
        raise ValueError(f"drop_fraction must be in [0, 1), got {cfg['drop_fraction']}")
    if cfg["update_every"] < 1:
        raise ValueError(f"update_every must be >= 1, got {cfg['update_every']}")
    if not 0.0 < cfg["dst_end"] <= 1.0:
        raise ValueError(f"dst_end must be in (0, 1], got {cfg['dst_end']}")
    if cfg["optimizer"] not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {cfg['optimizer']!r}")
    if cfg["backward_thread"] not in ("caller", "device"):
        raise ValueError(f"backward_thread must be 'caller' or 'device', got {cfg['backward_thread']!r}")
    if cfg["device"] not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {cfg['device']!r}")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if cfg["cuda_graph"] not in ("auto", True, False):
        raise ValueError(f"cuda_graph must be auto, true or false, got {cfg['cuda_graph']!r}")
    if cfg["cuda_graph"] is True and (cfg["device"] == "cpu" or not torch.cuda.is_available()):
        raise ValueError(f"cuda_graph needs a CUDA GPU, got device={cfg['device']!r}"
                         + ("" if cfg["device"] == "cpu" else " and torch.cuda.is_available() is False"))
    for key in ("epochs", "batch_size"):
        if cfg[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    for key in ("train_limit", "test_limit", "threads"):
        if cfg[key] < 0:
            raise ValueError(f"{key} must be >= 0, got {cfg[key]}")
    if not 0.0 < cfg["lr"] < math.inf:
        raise ValueError(f"lr must be a finite number > 0, got {cfg['lr']}")
    for key in ("momentum", "weight_decay"):
        if not 0.0 <= cfg[key] < math.inf:
            raise ValueError(f"{key} must be a finite number >= 0, got {cfg[key]}")
    if not -2**63 <= cfg["seed"] < 2**64:
        raise ValueError(f"seed must fit in 64 bits (torch.manual_seed), got {cfg['seed']}")
    if cfg["nesterov"] and (cfg["optimizer"] != "sgd" or not cfg["momentum"] > 0):
        raise ValueError(f"nesterov needs optimizer=sgd with momentum > 0, got optimizer={cfg['optimizer']!r}, "
                         f"momentum={cfg['momentum']}")
    if cfg["lr_decay_every"] < 0:
        raise ValueError(f"lr_decay_every must be >= 0, got {cfg['lr_decay_every']}")
    if not 0.0 < cfg["lr_decay"] <= 1.0:
        raise ValueError(f"lr_decay must be in (0, 1], got {cfg['lr_decay']}")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device(name)


# ---- the model -------------------------------------------------------------------------------
def lenet_300_100() -> nn.Sequential:
    """LeNet-300-100: 784-300-100-10 with ReLU, torch's default initialisation."""
    return nn.Sequential(nn.Linear(784, 300), nn.ReLU(), nn.Linear(300, 100), nn.ReLU(),
                         nn.Linear(100, 10))


def cpu_state_dict(model: nn.Module) -> dict:
    """model.state_dict() with every tensor a detached copy on the CPU (the dict itself kept: its
    metadata carries each sparse layer's shape)."""
    state = model.state_dict()
    for k, v in state.items():
        state[k] = v.detach().cpu().clone()
    return state


def save_trained(path, model, kind: str, config: dict, test_acc: float) -> Path:
    """Writes a trained LeNet-300-100 (kind "dense" or "sparse"; the model, or its
    `cpu_state_dict`) to `path` whole, in the format `load_trained` reads; returns the path."""
    state = cpu_state_dict(model) if isinstance(model, nn.Module) else model
    return save_torch(path, dict(model=kind, state_dict=state, config=config, test_acc=test_acc))


def load_trained(path, device="cpu") -> nn.Module:
    """The model a run saved to `path` (<out_dir>/train_mnist_<model>.pt), ready to evaluate or
    train on: LeNet-300-100, made sparse for a sparse run (its connections as they were trained,
    DST updates included)."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    model = lenet_300_100()
    if ckpt["model"] == "sparse":
        model = snack.sparsify(model, sparsity=0.5)  # any sparsity: load_state_dict takes the saved connections
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval()


def build(kind: str, init: nn.Module, cfg: dict) -> nn.Module:
    """A copy of the initial dense network, made truly sparse for kind='sparse'."""
    model = copy.deepcopy(init)
    if kind == "sparse":
        model = snack.sparsify(model, sparsity=cfg["sparsity"], distribution=cfg["distribution"])
        if not any(isinstance(m, snack.SparseLinear) for m in model.modules()):
            raise RuntimeError("snack.sparsify left no SparseLinear layer in the model")
    return model


def connections(model: nn.Module) -> int:
    """Stored weight entries: nnz of sparse layers, in * out of dense ones (biases excluded)."""
    n = 0
    for m in model.modules():
        if isinstance(m, snack.SparseLinear):
            n += int(m.nnz)
        elif isinstance(m, nn.Linear):
            n += m.weight.numel()
    return n


# ---- memory, counted from the tensors themselves -----------------------------------------------
def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def _add(seen: dict, t) -> None:
    if isinstance(t, torch.Tensor) and t.numel():
        seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())


def _cached_arrays(obj, indices: np.ndarray):
    """The tensors and numpy arrays (as tensors sharing their memory) in a topology cache entry,
    looking inside dicts, lists and tuples (the CPU backend keeps dicts of numpy arrays); a
    numpy view of the indices themselves (counted with them) is left out."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, np.ndarray):
        if not np.may_share_memory(obj, indices):
            yield torch.from_numpy(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _cached_arrays(v, indices)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _cached_arrays(v, indices)


def _topology_tensors(model: nn.Module):
    """Tensors of the cached topology metadata of every SparseLinear (row pointers, column
    permutation, backend-specific arrays), which the backend keeps beside the layer."""
    from snack.layers.backend import get_topology
    for m in model.modules():
        if isinstance(m, snack.SparseLinear):
            topo = get_topology(m.indices, (m.out_features, m.in_features))
            yield topo.indices
            idx = topo.indices.numpy() if topo.indices.device.type == "cpu" else np.empty(0)
            yield from _cached_arrays(topo.cache, idx)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of distinct storages: weights (parameters, buffers such as indices, and cached
    topology metadata), gradients, optimizer state. Shared storages count once."""
    out, seen = {}, {}
    groups = (
        ("weight_bytes", [*model.parameters(), *model.buffers(), *_topology_tensors(model)]),
        ("grad_bytes", [p.grad for p in model.parameters()]),
        ("optim_bytes", [t for s in optimizer.state.values() for t in s.values()]),
    )
    for name, tensors in groups:
        before = sum(seen.values())
        for t in tensors:
            _add(seen, t)
        out[name] = sum(seen.values()) - before
    out["state_bytes"] = sum(seen.values())
    out["_seen"] = seen
    return out


def saved_activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, exclude: dict) -> int:
    """Bytes of the tensors autograd keeps for backward in one training step (storages not in
    `exclude`, i.e. not already counted as weights/gradients/optimizer state)."""
    seen = {}

    def pack(t):
        if _storage_key(t) not in exclude:
            _add(seen, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
    del loss
    return sum(seen.values())


# ---- training ------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, cfg: dict) -> torch.optim.Optimizer:
    if cfg["optimizer"] == "adam":   # snack.optim.Adam: torch's Adam; on the GPU one launch per two tensors
        return snack.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    return torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                           weight_decay=cfg["weight_decay"], nesterov=cfg["nesterov"])


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, x.shape[0], batch):
        correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    model.train()
    return correct / max(x.shape[0], 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_sizes) -> None:
    """Forward + backward (no optimizer step) at every batch size training will use, so that
    kernel compilation (Numba JIT, cuBLAS handles) is not counted as training time."""
    for b in batch_sizes:
        F.cross_entropy(model(x[:b]), y[:b]).backward()
    model.zero_grad(set_to_none=False)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               idx: torch.Tensor, loss_sum: torch.Tensor) -> torch.Tensor:
    """One optimizer step on the examples x[idx], y[idx]; adds the loss to loss_sum (in place) and
    returns it detached. The gradients are zeroed in place, never set to None: eager steps and a
    captured one share the same gradient tensors. (A loss kept with its autograd graph would keep
    that step's AccumulateGrad nodes, with the stream they were made on, for the next step's
    backward: a step after a graph's capture or warm-up would run its backward across streams.)"""
    xb, yb = x[idx], y[idx]
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    loss = loss.detach()
    loss_sum.add_(loss)
    return loss


def use_cuda_graph(cfg: dict, device: torch.device) -> bool:
    """Whether training steps replay a CUDA graph: --cuda_graph true, or auto on a GPU."""
    return cfg["cuda_graph"] is True or (cfg["cuda_graph"] == "auto" and device.type == "cuda")


def train_one(kind: str, init: nn.Module, data, cfg: dict, device: torch.device, trained=None) -> dict:
    """Trains one model (kind "dense" or "sparse") and returns its result row. With cfg["save"]
    its checkpoint is written now, or, given a dict `trained`, kept there for `main` to write
    with the CSV once every model has trained."""
    from tqdm.auto import tqdm
    x_train, y_train, x_test, y_test = data
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    model = build(kind, init, cfg).to(device)
    opt = make_optimizer(model, cfg)
    order = torch.Generator().manual_seed(cfg["seed"])  # same batch order for every model
    n, bs = x_train.shape[0], cfg["batch_size"]
    steps_per_epoch = math.ceil(n / bs)
    warm_up(model, x_train, y_train, sorted({min(bs, n), n % bs or min(bs, n)}))
    dst = None
    if kind == "sparse" and cfg["dst"] != "none":
        dst = {"set": snack.dst.SET, "rigl": snack.dst.RigL}[cfg["dst"]](
            model, opt, drop_fraction=cfg["drop_fraction"], update_every=cfg["update_every"],
            end_step=max(1, int(cfg["dst_end"] * cfg["epochs"] * steps_per_epoch)), seed=cfg["seed"])
    sched = None
    if cfg["lr_decay_every"]:  # stepped once per optimizer step, like the step count it counts
        sched = torch.optim.lr_scheduler.StepLR(opt, cfg["lr_decay_every"], gamma=cfg["lr_decay"])
    loss_sum = torch.zeros((), device=device)   # (one tensor: a captured step adds to it)

    def one_step(idx):
        return train_step(model, opt, x_train, y_train, idx, loss_sum)
    # replayed from a CUDA graph: eager where a graph cannot stand for the step (the last batch, of
    # another size; RigL's steps before an update), captured again after a learning-rate change
    graphed = (snack.graphs.CapturedStep(one_step, model=model, optimizer=opt, dst=dst)
               if use_cuda_graph(cfg, device) else None)
    train_time, accs, dst_updates = 0.0, [], 0
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(n, generator=order).to(device)
        bar = tqdm(range(steps_per_epoch), desc=f"{kind:>6} epoch {epoch + 1}/{cfg['epochs']}",
                   disable=not cfg["progress"], leave=False, dynamic_ncols=True)
        _sync(device)
        t0, captured_before = time.perf_counter(), graphed.capture_s if graphed else 0.0
        loss_sum.zero_()
        for step in bar:
            idx = perm[step * bs:(step + 1) * bs]
            loss = graphed(idx) if graphed is not None else one_step(idx)
            if sched is not None:
                sched.step()
            if dst is not None and dst.step() is not None:  # prunes and regrows; nnz stays the same
                dst_updates += 1
            if step % 50 == 49 and cfg["progress"]:
                bar.set_postfix(loss=f"{float(loss):.3f}")
        _sync(device)
        train_time += time.perf_counter() - t0 - ((graphed.capture_s - captured_before) if graphed else 0.0)
        bar.close()
        accs.append(evaluate(model, x_test, y_test))
        print(f"{kind:>6} epoch {epoch + 1}/{cfg['epochs']}: train loss {float(loss_sum) / steps_per_epoch:.4f}  "
              f"test acc {accs[-1]:.4f}  ({train_time:.1f} s training so far)", flush=True)
    mem = state_bytes(model, opt)
    # a batch gathered as in training (a copy, not a view that would pin the whole data set)
    act = saved_activation_bytes(model, x_train[perm[:bs]], y_train[perm[:bs]], mem.pop("_seen"))
    row = dict(
        model=kind,
        dataset=cfg["dataset"],
        sparsity=cfg["sparsity"] if kind == "sparse" else 0.0,
        distribution=cfg["distribution"] if kind == "sparse" else "",
        dst=cfg["dst"] if kind == "sparse" else "none",
        dst_updates=dst_updates,
        cuda_graph=graphed is not None,
        graph_captures=graphed.captures if graphed else 0,
        capture_s=round(graphed.capture_s, 3) if graphed else 0.0,
        graph_replays=graphed.replays if graphed else 0,
        final_lr=opt.param_groups[0]["lr"],
        achieved_sparsity=round(1.0 - connections(model) / connections(init), 6),
        params=sum(p.numel() for p in model.parameters()),
        connections=connections(model),
        test_acc=accs[-1],
        best_test_acc=max(accs),
        final_train_loss=float(loss_sum) / steps_per_epoch,
        train_time_s=round(train_time, 3),
        ms_per_step=round(1000 * train_time / (cfg["epochs"] * steps_per_epoch), 4),
        epochs=cfg["epochs"],
        batch_size=bs,
        train_examples=n,
        **mem,
        activation_bytes=act,
    )
    if cfg["save"]:  # main passes `trained` and writes it with the CSV, after every model has trained
        path = Path(cfg["out_dir"]) / f"train_mnist_{kind}.pt"
        row["checkpoint"] = str(path)
        if trained is None:  # (a caller of its own: written now)
            save_trained(path, model, kind, cfg, accs[-1])
        else:
            trained[kind] = (path, cpu_state_dict(model), accs[-1])
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row["peak_source"] = "torch.cuda.max_memory_allocated"
    else:
        row["peak_bytes"] = mem["state_bytes"] + act
        row["peak_source"] = "tensor bytes: state + saved activations"
    return row


# ---- reporting ---------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    commit = git_commit()
    return dict(
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        cpu_threads=torch.get_num_threads(),
        torch=torch.__version__,
        snack=getattr(snack, "__version__", ""),
        python=platform.python_version(),
        git_commit=commit,
        sparse_backend=backend_name(device),
    )


def _mb(b: int) -> str:
    return f"{b / 2**20:.2f}"


def _sparsity(v: float) -> str:
    """Two decimals, or as many as the value needs (0.995 is not printed as 1.00)."""
    return f"{v:.2f}" if round(v, 2) == v else f"{v:g}"


def print_table(rows) -> None:
    rows = [{**r, "label": r["model"] + (f"+{r['dst']}" if r["dst"] != "none" else "")} for r in rows]
    cols = [("model", "label", str), ("sparsity", "sparsity", _sparsity),
            ("params", "params", str), ("connections", "connections", str),
            ("test acc", "test_acc", lambda v: f"{100 * v:.2f}%"),
            ("train s", "train_time_s", lambda v: f"{v:.1f}"), ("ms/step", "ms_per_step", lambda v: f"{v:.2f}"),
            ("weights MiB", "weight_bytes", _mb), ("grads MiB", "grad_bytes", _mb),
            ("optim MiB", "optim_bytes", _mb), ("state MiB", "state_bytes", _mb), ("peak MiB", "peak_bytes", _mb)]
    cells = [[h for h, _, _ in cols]] + [[f(r[k]) for _, k, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for j, line in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    by_model = {r["model"]: r for r in rows}
    if set(by_model) == {"dense", "sparse"}:
        d, s = by_model["dense"], by_model["sparse"]
        print(f"sparse / dense: state bytes x{s['state_bytes'] / d['state_bytes']:.3f}, peak x"
              f"{s['peak_bytes'] / d['peak_bytes']:.3f}, train time x{s['train_time_s'] / max(d['train_time_s'], 1e-9):.2f}, "
              f"accuracy {100 * (s['test_acc'] - d['test_acc']):+.2f} points")


def backward_thread_name(device: torch.device, backward_thread: str) -> str:
    """Where autograd runs each backward for --backward_thread on `device`: its worker thread only
    for "device" on a GPU (a CPU backward always runs on the calling thread)."""
    return "autograd's worker thread" if device.type != "cpu" and backward_thread == "device" else "the calling thread"


def main(argv=None) -> list:
    """Runs the experiment; returns the result rows (also written to <out_dir>/train_mnist.csv)."""
    t_start = time.perf_counter()
    cfg = parse_config(argv)
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    device = pick_device(cfg["device"])
    env = environment(device)
    dst = "" if cfg["dst"] == "none" else f", dynamic sparse training: {cfg['dst']}"
    decay = f" x{cfg['lr_decay']} every {cfg['lr_decay_every']} steps" if cfg["lr_decay_every"] else ""
    threads = (f"steps {'replayed from a CUDA graph' if use_cuda_graph(cfg, device) else 'eager'}, "
               f"backward on {backward_thread_name(device, cfg['backward_thread'])}, ")
    print(f"train_mnist: {cfg['dataset']} LeNet-300-100, dense vs snack.SparseLinear at sparsity "
          f"{cfg['sparsity']} ({cfg['distribution']}{dst}), {cfg['epochs']} epoch(s), batch {cfg['batch_size']}, "
          f"{cfg['optimizer']} lr {cfg['lr']}{decay}, on {env['device']} ({env['device_name']}, {threads}"
          f"{env['cpu_threads']} CPU threads), sparse backend '{env['sparse_backend']}', torch {env['torch']}, "
          f"commit {env['git_commit'] or '?'}", flush=True)

    x_train, y_train = load(cfg["dataset"], "train", limit=cfg["train_limit"] or None, device=device)
    x_test, y_test = load(cfg["dataset"], "test", limit=cfg["test_limit"] or None, device=device)
    print(f"data: {x_train.shape[0]} train / {x_test.shape[0]} test examples", flush=True)

    torch.manual_seed(cfg["seed"])
    init = lenet_300_100()
    make_cublas_workspaces(device)  # (kept for the process: not charged to the first model's peak)
    if use_cuda_graph(cfg, device):  # and the graphs' stream's (made outside a capture, not in its pool)
        with torch.cuda.stream(snack.graphs.capture_stream(device)):
            make_cublas_workspaces(device)
    rows, trained = [], {}
    # SparseLinear's backward is Python: on autograd's worker thread for the GPU it must take the
    # GIL from this thread, which costs host time at every small step (README, "snack.optim")
    with torch.autograd.set_multithreading_enabled(cfg["backward_thread"] == "device"):
        for kind in [m.strip() for m in cfg["models"].split(",") if m.strip()]:
            row = train_one(kind, init, (x_train, y_train, x_test, y_test), cfg, device, trained)
            rows.append({**row, **{k: env[k] for k in ("device", "device_name", "sparse_backend", "torch",
                                                       "git_commit")}})

    print()
    print_table(rows)
    out_dir = Path(cfg["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / "train_mnist.csv", out_dir / "train_mnist.json"
    # a run interrupted while training leaves the files of the run before it as they were
    for kind, (path, state, acc) in trained.items():
        save_trained(path, state, kind, cfg, acc)
    write_csv(csv_path, rows)  # (each file written whole or not at all)
    wall = time.perf_counter() - t_start
    write_text(json_path, json.dumps(dict(config=cfg, environment=env,
                                          argv=sys.argv[1:] if argv is None else list(argv),
                                          examples=dict(train=int(x_train.shape[0]), test=int(x_test.shape[0])),
                                          wall_time_s=round(wall, 2)), indent=2))
    saved = [r["checkpoint"] for r in rows if r.get("checkpoint")]
    print(f"wrote {csv_path} and {json_path}" + (f" and the trained models ({', '.join(saved)}: "
                                                   "experiments.train_mnist.load_trained reads them)" if saved else "")
          + f"; total wall time {wall:.1f} s")
    return rows


if __name__ == "__main__":
    try:
        parse_config()  # a bad value: one line and exit status 2, like argparse's own errors
    except ValueError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except (DatasetNotFoundError, DataFileError) as e:  # not installed, or a damaged file: on one line
        sys.exit(f"{Path(sys.argv[0]).name}: error: " + " ".join(str(e).split()))
