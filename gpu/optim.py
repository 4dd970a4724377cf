"""One fused Adam / AdamW step on a float32 tensor: a single elementwise kernel over the whole
tensor with a grid that fills the GPU.

    adam_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
              decoupled=False)

PyTorch's foreach and fused Adam give each block a 65536-element chunk of a tensor: a SNACK
layer's `values` (1.7 M at 4096 x 4096, 90 %) gets ~26 blocks, a fifth of an H200's SMs, and its
step runs far below memory bandwidth. This kernel gives every thread a few elements instead.
The arithmetic is torch.optim.Adam's (see kernels.make_adam_kernel); `step` (a float32 tensor
of one element on the same device) holds the step count of this step, already incremented, so
the op is capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from . import kernels
from .launch import device_properties, launch, launch_mode

__all__ = ["adam_step"]

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


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float = 0.0, decoupled: bool = False) -> None:
    """Updates param, exp_avg and exp_avg_sq in place (one Adam step; AdamW's decoupled weight
    decay when `decoupled`). All float32, contiguous, same shape and device; `step` one float32
    element holding this step's count (>= 1)."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    n = param.numel()
    _check("param", param, param, n)
    if _GPU_ONLY and param.device.type != "cuda":
        raise ValueError(f"param must be on a CUDA device for snack.gpu, got {param.device}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name, t, param, n)
    _check("step", step, param, 1)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    for k, v in hyper.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{k} must be a Python number, got {type(v).__name__}")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta1 and beta2 must be in [0, 1), got {beta1} and {beta2}")
    if n == 0:
        return
    threads = kernels.ADAM_THREADS if _GPU_ONLY else 32
    n_sm = device_properties(param.device)[0]
    blocks = max(1, min(-(-n // threads), n_sm * (2048 // threads)))
    launch(kernels.make_adam_kernel(bool(decoupled)), (blocks, 1), threads, 0,
           [param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1), step.view(-1)],
           [n, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay)], param.device)
