"""Fused Adam / AdamW steps on float32 tensors: one elementwise kernel with a grid that fills the GPU.

    adam_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
              decoupled=False)
    adam_steps(params, grads, exp_avgs, exp_avg_sqs, steps, *, counter, lr, ...)

PyTorch's foreach and fused Adam give each block a 65536-element chunk of a tensor: a SNACK
layer's `values` (1.7 M at 4096 x 4096, 90 %) gets ~26 blocks, a fifth of an H200's SMs, and its
step runs far below memory bandwidth. This kernel gives every thread a few elements instead.
The arithmetic is torch.optim.Adam's (see kernels.make_adam_kernel).
`adam_step` takes `step` (a float32 tensor of one element on the same device) holding the step
count of this step, already incremented. `adam_steps` updates a list of tensors that share the
hyper-parameters, two tensors per launch (a layer's values and bias: one launch), and advances
their step counts itself (no separate increment launch); both are capturable in a CUDA graph.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from snack.core.coo import _span
from . import kernels
from .launch import BoundLaunch, device_properties, launch_mode
from .ops import _check_flag, dummy_array, overlaps

__all__ = ["adam_step", "adam_steps"]

_GPU_ONLY = launch_mode() != "sim"  # the simulator takes CPU tensors


def _check(name, t, ref, numel):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but param is on {ref.device}")
    if t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_set(param, grad, exp_avg, exp_avg_sq, step, where: str = ""):
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param{where} must be a torch.Tensor, got {type(param).__name__}")
    n = param.numel()
    _check(f"param{where}", param, param, n)
    if _GPU_ONLY and param.device.type != "cuda":
        raise ValueError(f"param{where} must be on a CUDA device for snack.gpu, got {param.device}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name + where, t, param, n)
    _check("step" + where, step, param, 1)
    named = (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("step", step))
    for i, (na, a) in enumerate(named):
        for nb, b in named[i + 1:]:
            if overlaps(a, b):
                raise ValueError(f"{na}{where} and {nb}{where} share memory; each needs a tensor of its own")


def _check_across_sets(sets) -> None:
    """ValueError when two sets share memory (the same parameter twice, a moment that is a view
    of another set's tensor...): one launch updates both, and one update would be lost. One sort
    of the tensors' byte ranges (the pairs inside a set: `_check_set`)."""
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps")
    spans = sorted((*sp, i, name) for i, s in enumerate(sets) for name, t in zip(names, s)
                   if (sp := _span(t)) is not None)
    last = None  # (storage, end, set, name) of the range reaching furthest in the current storage
    for storage, start, end, i, name in spans:
        if last is not None and last[0] == storage and start < last[1] and last[2] != i:
            a, b = sorted([(last[2], last[3]), (i, name)])  # the earlier set first
            raise ValueError(f"{a[1]}[{a[0]}] and {b[1]}[{b[0]}] share memory; every set needs tensors of "
                             "its own (the same parameter given twice?)")
        if last is None or last[0] != storage or end > last[1]:
            last = (storage, end, i, name)


def _check_hyper(lr, beta1, beta2, eps, weight_decay):
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    for k, v in hyper.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{k} must be a Python number, got {type(v).__name__}")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta1 and beta2 must be in [0, 1), got {beta1} and {beta2}")
    if not 0.0 <= lr < math.inf:  # (NaN fails every comparison)
        raise ValueError(f"lr must be a finite number >= 0, got {lr}")
    if not 0.0 <= eps < math.inf:  # (0 as torch allows it)
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")


# {(decoupled, n1, n2, inc, device): BoundLaunch} with the grid for n1 + n2 elements and the
# hyper-parameters given per call: a step compares and rewrites only what changed since the last
# one (grads are new tensors at every step), without a kernel lookup.
_BOUND = {}


def _bound(decoupled: bool, n1: int, n2: int, inc: int, dev) -> BoundLaunch:
    key = (decoupled, n1, n2, inc, dev)
    b = _BOUND.get(key)
    if b is None:
        threads = kernels.ADAM_THREADS if _GPU_ONLY else 32
        n_sm = device_properties(dev)[0]
        blocks = max(1, min(-(-(n1 + max(n2, 0)) // threads), n_sm * (2048 // threads)))
        b = _BOUND[key] = BoundLaunch(kernels.make_adam_kernel(decoupled), (blocks, 1), threads, 0, [None] * 11,
                                      [n1, n2, inc] + [None] * 7)
    return b


def _launch(sets, counter, inc, lr, beta1, beta2, eps, weight_decay, decoupled):
    """One launch over one or two (param, grad, exp_avg, exp_avg_sq, step) sets."""
    first = sets[0]
    dev = first[0].device
    n1 = first[0].numel()
    if len(sets) > 1:
        second, n2 = sets[1], sets[1][0].numel()
    else:
        second, n2 = (dummy_array(dev),) * 5, -1
    if counter is None:
        counter = dummy_array(dev, torch.int32)
    arrays = [*first, *second, counter]
    if not _GPU_ONLY:  # the simulator takes 1-D numpy views (the driver reads pointers and sizes)
        arrays = [t.view(-1) for t in arrays]
    b1, b2 = float(beta1), float(beta2)
    _bound(bool(decoupled), n1, n2, int(inc), dev)(
        arrays, dev, (float(lr), b1, b2, float(eps), float(weight_decay),
                      math.log(b1) if b1 > 0 else -math.inf, math.log(b2) if b2 > 0 else -math.inf))


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float = 0.0, decoupled: bool = False) -> None:
    """Updates param, exp_avg and exp_avg_sq in place (one Adam step; AdamW's decoupled weight
    decay when `decoupled`). All float32, contiguous, on one device, with the same number of
    elements (each read as a flat array: shapes are not compared); `step` one float32 element
    holding this step's count (>= 1), not changed."""
    _check_set(param, grad, exp_avg, exp_avg_sq, step)
    _check_hyper(lr, beta1, beta2, eps, weight_decay)
    _check_flag("decoupled", decoupled)
    if param.numel() == 0:
        return
    _launch([(param, grad, exp_avg, exp_avg_sq, step)], None, 0, lr, beta1, beta2, eps, weight_decay, decoupled)


def adam_steps(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], *, counter: torch.Tensor,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
               decoupled: bool = False) -> None:
    """One Adam (AdamW when `decoupled`) step of every params[i] with the same hyper-parameters,
    two tensors per launch. steps[i] (one float32 element) holds the count of the previous step
    and is advanced by one by the kernel (as torch's optimizers do before their update), so no
    other launch is needed. counter: int32 on the parameters' device with at least
    ceil(len(params) / 2) elements, all zero (the kernels leave them zero); launches that may run
    at the same time (other streams) must not share one. All tensors are checked before any is
    changed."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    if len({len(x) for x in lists}) != 1:
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, "
                         f"got {[len(x) for x in lists]}")
    sets = list(zip(*lists))
    for i, s in enumerate(sets):
        _check_set(*s, where=f"[{i}]")
        if s[0].device != sets[0][0].device:
            raise ValueError(f"params[{i}] is on {s[0].device} but params[0] is on {sets[0][0].device}")
    _check_across_sets(sets)
    _check_hyper(lr, beta1, beta2, eps, weight_decay)
    _check_flag("decoupled", decoupled)
    if not isinstance(counter, torch.Tensor) or counter.dtype != torch.int32 or not counter.is_contiguous():
        raise TypeError("counter must be a contiguous int32 torch.Tensor")
    if sets and counter.device != sets[0][0].device:
        raise ValueError(f"counter is on {counter.device} but params[0] is on {sets[0][0].device}")
    n_launch = -(-len(sets) // 2)
    if counter.numel() < n_launch:
        raise ValueError(f"counter must have at least {n_launch} elements, got {counter.numel()}")
    run_steps(sets, counter, lr, beta1, beta2, eps, weight_decay, decoupled)


def run_steps(sets, counter, lr, beta1, beta2, eps, weight_decay, decoupled) -> None:
    """`adam_steps` without its checks, for callers that guarantee them (snack.optim, whose step
    checks every tensor already): sets is a list of (param, grad, exp_avg, exp_avg_sq, step)."""
    for j in range(-(-len(sets) // 2)):
        # launch j counts its blocks in counter[j] (the kernel uses element 0 of what it is given)
        _launch(sets[2 * j:2 * j + 2], counter if j == 0 else counter[j:j + 1], 1, lr, beta1, beta2, eps,
                weight_decay, decoupled)
