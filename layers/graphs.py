"""snack.graphs: a training step replayed from a CUDA graph, dynamic sparse training included.

Eager training of small sparse layers on a GPU is bound by host time: each op is a few
microseconds of GPU work and its Python launch and autograd Function cost more. `CapturedStep`
captures a whole training step once (forward, backward, optimizer step) and replays it, so a
step costs one replay of host time, and it handles what makes that fiddly in a loop with
SET / RigL: the warm-up on a side stream, `settle_autograd` before each capture, steps that a
graph cannot stand for (another batch shape, RigL's steps before an update), and a new capture
when the optimizer's hyper-parameters change (a captured step keeps the values it was captured
with). SET and RigL rewrite a layer's pattern in place, so a graph replays the new one.

    step = snack.graphs.CapturedStep(train_step, model=model, optimizer=opt, dst=dst)
    for x, y in batches:
        loss = step(x, y)        # train_step(x, y) on the GPU, replayed from a graph
        dst.step()
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional

import torch
import torch.nn as nn

from .functional import settle_autograd
from snack.core.coo import check_device

__all__ = ["CapturedStep", "capture_stream"]

_STREAMS: dict = {}


def capture_stream(device=None) -> torch.cuda.Stream:
    """The side stream on which every `CapturedStep` of a CUDA device (default: the current one)
    warms up and captures, one per device: torch gives each stream that cuBLAS runs on a
    workspace of its own (32 MiB on an H100), so a new stream per capture would add one each.
    Run a GEMM and its backward under it before measuring peak memory to make its workspaces
    first."""
    if device is None and not torch.cuda.is_available():
        raise ValueError("capture_stream needs a CUDA device, and torch sees none (torch.cuda.is_available() "
                         "is False)")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else check_device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def _detach(out):
    """out with every tensor detached, in containers of the same types (a namedtuple, an
    OrderedDict, a defaultdict with its factory and torch.return_types included)."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, tuple) and hasattr(type(out), "_fields"):  # a namedtuple
        return type(out)(*(_detach(o) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(o) for o in out)
    if isinstance(out, dict):
        d = {k: _detach(v) for k, v in out.items()}
        if isinstance(out, collections.defaultdict):  # (its first argument is the factory)
            return type(out)(out.default_factory, d)
        try:
            return type(out)(d)
        except TypeError:  # a mapping type that cannot be built from a dict
            return d
    return out


class CapturedStep:
    """A training step `fn(*inputs)` replayed from a CUDA graph.

    Args:
        fn: one whole training step: zero the gradients, forward, backward, `optimizer.step()`
            (and whatever else should run at every step, e.g. adding the loss to a running sum
            on the device). It returns a tensor, a (named) tuple / list / dict of tensors, or
            None. To be captured it must not wait on the GPU (no `.item()`, no `if` on a tensor's value) and
            must do the same work at every call. Zero the gradients in place
            (`zero_grad(set_to_none=False)`): eager steps between replays then accumulate into
            the tensors the graph uses.
        model: the nn.Module that fn trains (its CUDA devices are settled before each capture);
            a model without CUDA parameters is trained eagerly.
        optimizer: the optimizer that fn steps, optional: its param groups' hyper-parameters
            (lr, betas, weight_decay, ..., not tensor-valued ones) are compared at every call,
            and a change makes the next call capture again. Without it, call `invalidate()`
            after changing them. A scheduler that changes the learning rate at every step
            (cosine, one-cycle) would make every step a warm-up and a capture: give such an
            optimizer a tensor learning rate on the GPU (torch's Adam / AdamW with
            `capturable=True`), which schedulers update in place and a replay reads.
        dst: a `snack.dst.SET` / `RigL` object, optional: RigL's growth needs the gradient of
            the step before an update, which its forward hooks keep, so that step runs eagerly.
            Call `dst.step()` after each call yourself, as in eager training.
        warmup_steps: eager steps on the side stream before the first capture (>= 1; one before
            each later capture). They train as the replays do: they are steps of the run.

    Calling it runs one step. The first call with the model and every input on CUDA fixes the
    inputs' shapes, dtypes and devices: a later call whose inputs differ (a last, smaller batch)
    runs fn eagerly on them, as does every call while the model or the inputs are not on CUDA.
    Otherwise the inputs are copied into the graph's own tensors and the graph replays on the
    current stream. Outputs come back detached; after a replay they are the graph's output
    tensors, which the next replay overwrites (clone what you keep).

    Attributes: `captures` (how many times the step was captured), `replays`, `eager_steps`
    (warm-up steps included) and `capture_s` (seconds spent capturing, the GPU synchronised
    around each capture).
    """

    def __init__(self, fn: Callable, *, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 dst=None, warmup_steps: int = 3):
        if not callable(fn):
            raise TypeError(f"fn must be callable (one training step), got {type(fn).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if dst is not None and (isinstance(dst, type) or not (hasattr(dst, "is_update_step")
                                                             and hasattr(dst, "num_steps"))):
            raise TypeError(f"dst must be a snack.dst object (SET, RigL) or None, got "
                            f"{dst.__name__ + ' (a class: give an instance)' if isinstance(dst, type) else type(dst).__name__}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
            raise TypeError(f"warmup_steps must be an int, got {type(warmup_steps).__name__}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.fn, self.model, self.optimizer, self.dst = fn, model, optimizer, dst
        self.warmup_steps = warmup_steps
        self.captures, self.replays, self.eager_steps, self.capture_s = 0, 0, 0, 0.0
        self._graph, self._static, self._outputs, self._signature = None, None, None, None
        self._hyper, self._warm_left = None, warmup_steps

    def invalidate(self) -> None:
        """The next graph call captures the step again, after one warm-up step (call it after
        changing something the captured step holds, e.g. a hyper-parameter of an optimizer
        not given as `optimizer`)."""
        if self._graph is not None:
            self._graph, self._outputs, self._warm_left = None, None, 1

    def _hyper_parameters(self):
        if self.optimizer is None:
            return None
        return [{k: v for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)}
                for g in self.optimizer.param_groups]

    def _cuda_device(self) -> Optional[torch.device]:
        for p in self.model.parameters():
            if p.is_cuda:
                return p.device
        return None

    def __call__(self, *inputs):
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"inputs[{i}] must be a tensor, got {type(t).__name__}")
        signature = tuple((t.shape, t.dtype, t.device) for t in inputs)
        device = self._cuda_device()
        if self._signature is None and device is not None and all(t.is_cuda for t in inputs):
            self._signature = signature  # the first step that could be captured sets the inputs' form
        eager = (device is None or signature != self._signature
                 or any(not t.is_cuda for t in inputs)
                 or (self.dst is not None and getattr(self.dst, "needs_gradient", False)
                     and self.dst.is_update_step(self.dst.num_steps + 1)))
        if eager:
            self.eager_steps += 1
            return _detach(self.fn(*inputs))
        hyper = self._hyper_parameters()
        if self._graph is not None and hyper != self._hyper:
            self.invalidate()
        if self._static is None:
            self._static = [torch.empty_like(t) for t in inputs]
        for s, t in zip(self._static, inputs):
            s.copy_(t)
        if self._graph is None:
            with torch.cuda.device(device):
                warm_up_outputs = self._warm_up_or_capture(device, hyper)
            if self._graph is None:
                return warm_up_outputs
        self._graph.replay()
        self.replays += 1
        return self._outputs

    def _warm_up_or_capture(self, device: torch.device, hyper):
        """One eager step on the side stream (returns its outputs) while warm-up steps are left,
        else the capture (returns None; the caller replays it)."""
        side = capture_stream(device)
        # no AccumulateGrad node of an earlier eager pass reused by the warm-up or the capture
        settle_autograd(self.model)
        if self._warm_left:
            self._warm_left -= 1
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                outputs = _detach(self.fn(*self._static))
            torch.cuda.current_stream().wait_stream(side)
            self.eager_steps += 1
            return outputs
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):  # records the step: nothing runs until a replay
            outputs = _detach(self.fn(*self._static))
        torch.cuda.synchronize(device)
        self.capture_s += time.perf_counter() - t0
        self._graph, self._outputs, self._hyper = graph, outputs, hyper
        self.captures += 1
        return None
