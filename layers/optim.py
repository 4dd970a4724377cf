"""Adam and AdamW with a fused, full-occupancy step for float32 CUDA parameters.

    opt = snack.optim.Adam(model.parameters(), lr=1e-3)      # same arguments as torch.optim.Adam
    opt = snack.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)

Drop-in subclasses of `torch.optim.Adam` / `torch.optim.AdamW`: same hyper-parameters, same
state (`step`, `exp_avg`, `exp_avg_sq`), same `state_dict`, so checkpoints move between them and
torch's, and `snack.dst` keeps the moments of surviving connections as with torch's Adam. What
`step()` does differs: the float32 CUDA parameters of a group are updated two per kernel launch (a
layer's values and bias: one launch) by a kernel whose grid fills the GPU and which also advances
their step counts (`snack.gpu.adam_steps`). PyTorch's foreach and
fused implementations give each block a 65536-element chunk, which leaves most of the GPU idle
on a sparse layer's values (1.7 M of them at 4096 x 4096 and 90 % sparsity).

Host time: the step runs torch's step hooks itself (global and per-optimizer pre and post hooks,
as torch's wrapper does) and opens torch's profiler label around them only while a profiler
runs; `zero_grad()` with set_to_none=True (the default) sets the gradients to None in a plain
loop, without that label either. Together ~15 us less host time per training step on the CPU.

The step is capturable in a CUDA graph whatever `capturable` says (the step counts live on the
parameters' device), as long as the state exists before capture (one eager step), as with
torch's optimizers. The hyper-parameters are read at every eager step (learning-rate schedulers
work as with torch's); a captured graph replays those of the step it captured. Anything the kernel does not cover (CPU or non-float32 parameters, sparse
gradients, amsgrad, maximize, differentiable, a tensor learning rate, parameters that share
memory, sparse, lazy (uninitialized) or DTensor parameters as FSDP2 makes) makes `step()` run torch's
own implementation for that call, with the same results; so do steps under torch.amp.GradScaler
with `fused=True` (the scaler then passes its scale and inf flag to the step).
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import Callable, List, Optional

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks as _global_post_hooks
from torch.optim.optimizer import _global_optimizer_pre_hooks as _global_pre_hooks
from torch.nn.parameter import is_lazy

from snack.core.coo import _span

__all__ = ["Adam", "AdamW"]


def _kernel_device_type_for(params) -> Optional[str]:
    """_kernel_device_type(), without importing snack.gpu (numba-cuda: ~0.5 s) when no parameter
    is on a GPU and Numba's simulator is off: then torch's step runs anyway."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0") and not any(p.is_cuda for p in params):
        return None
    return _kernel_device_type()


@functools.lru_cache(maxsize=None)
def _kernel_device_type() -> Optional[str]:
    """The device type whose tensors snack.gpu's kernels take here ('cuda', or 'cpu' under Numba's
    simulator), or None when they cannot run; found once per process, not at every step."""
    try:
        from snack import gpu
    except Exception:  # numba-cuda missing or broken: torch's implementation only
        return None
    if gpu.launch_mode() == "sim":
        return "cpu"
    return "cuda" if gpu.is_available() else None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_PYTHON_KEY = torch._C.DispatchKey.Python


def _plain(t: torch.Tensor) -> bool:
    """Whether t is an ordinary strided tensor whose elements live in memory of its own, which
    the kernel can read and `_span` can locate. Not so: sparse layouts, a lazy module's
    UninitializedParameter (no storage until its first forward) and tensor subclasses with a
    __torch_dispatch__ (DTensor, as FSDP2 and tensor parallelism make parameters: their storage
    cannot be reached from Python, and the elements are not all in it); torch's step takes those."""
    if type(t) is torch.nn.Parameter or type(t) is torch.Tensor:  # (the common case: one compare)
        return t.layout is torch.strided
    return t.layout is torch.strided and not is_lazy(t) and not torch._C._dispatch_keys(t).has(_PYTHON_KEY)


class _SnackAdamStep:
    """step() of Adam and AdamW on snack.gpu.adam_step; falls back to the torch base class."""

    _decoupled_default = False

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.__dict__["_snack_shared"] = None  # (found again at the next step)

    def _shares_memory(self) -> bool:
        """Whether two of the parameters share memory (one given twice, two Parameters on one
        storage): the kernel updates two parameters per launch at once, torch's step one after the
        other, so those take torch's step. Found once per layout (`add_param_group` resets it).
        Parameters that are not `_plain` have no storage to compare (and take torch's step
        anyway: `_param_ok`); while a lazy module's parameter is still uninitialized the answer is
        not kept, so the parameter is compared once its first forward has made it."""
        shared = self.__dict__.get("_snack_shared")
        if shared is None:
            params = [p for g in self.param_groups for p in g["params"]]
            spans = sorted(s for p in params
                           if p.device.type != "meta" and _plain(p) and (s := _span(p)) is not None)
            # (sorted by start, any two that meet leave two neighbours that meet)
            shared = any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:]))
            if not any(is_lazy(p) for p in params):
                self.__dict__["_snack_shared"] = shared
        return shared

    def _group_ok(self, group: dict) -> bool:
        b1, b2 = group["betas"]
        if group.get("amsgrad", False) or group.get("maximize", False) or group.get("differentiable", False):
            return False
        for v in (group["lr"], b1, b2, group["eps"], group["weight_decay"]):
            if type(v) is not float and type(v) is not int and not _is_number(v):  # (exact types first)
                return False
        return True

    def _param_ok(self, p: torch.Tensor, dev_type: str) -> bool:
        g = p.grad
        dev = p.device
        if p.dtype is not torch.float32 or dev.type != dev_type or not _plain(p) or not p.is_contiguous():
            return False
        shape = p.shape
        if (g.is_sparse or not _plain(g) or g.dtype is not torch.float32 or not g.is_contiguous()
                or g.shape != shape):
            return False
        state = self.state.get(p)
        if state:
            for key in ("exp_avg", "exp_avg_sq"):
                t = state.get(key)
                if (not isinstance(t, torch.Tensor) or t.dtype is not torch.float32 or t.device != dev
                        or not t.is_contiguous() or t.shape != shape):
                    return False
            if not isinstance(state.get("step"), torch.Tensor):
                return False
        return True

    def _counter(self, device: torch.device, size: int) -> torch.Tensor:
        """int32 zeros on `device`, at least `size` of them, owned by the optimizer (the kernels
        leave them zero). A captured graph keeps the one it captured, so a replaced one is kept."""
        kept = self.__dict__.setdefault("_snack_counters", {})
        have = kept.setdefault(device, [])
        if not have or have[-1].numel() < size:
            made = torch.zeros(max(size, 8), dtype=torch.int32, device=device)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # made under capture, its zeros are written only when the graph replays: kept for
                # the graph, never handed to an eager step
                self.__dict__.setdefault("_snack_captured_counters", []).append(made)
                return made
            have.append(made)
        return have[-1]

    def _work(self) -> Optional[List[tuple]]:
        """[(param, group)] with gradients, or None when some of them need torch's step."""
        attrs = self.__dict__
        if attrs.get("found_inf") is not None or attrs.get("grad_scale") is not None:
            # torch.amp.GradScaler with fused=True hands the step its scale and inf flag instead
            # of unscaling the gradients (torch's fused step skips on inf and unscales)
            return None
        if self._shares_memory():
            return None
        dev_type = False  # (found from the first parameter with a gradient)
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if dev_type is False:
                # a CPU parameter with the simulator off needs torch's step whatever the others are
                dev_type = _kernel_device_type() if params[0].is_cuda else _kernel_device_type_for(params[:1])
            if dev_type is None or not self._group_ok(group):
                return None
            for p in params:
                if not self._param_ok(p, dev_type):
                    return None
                work.append((p, group))
        return work

    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimization step (see torch.optim.Adam.step); returns closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # no_grad's switch without its context manager (~1.5 us per step)
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            self._step_once()
        finally:
            torch._C._set_grad_enabled(grad_was)
        return loss

    def _step_once(self) -> None:
        work = self._work()
        if work is None:
            # torch's step, less the hook wrapper torch puts on a class's step when its first
            # instance is built (this class's own step carries one: the hooks run once)
            base = super().step.__func__
            while getattr(base, "hooked", False):
                base = base.__wrapped__
            base(self)
            return
        if not work:
            return
        from snack.gpu.optim import run_steps  # adam_steps less its checks: _work made them
        # one launch per two parameters of a group (a layer's values and bias: one), which also
        # advances their step counts; each launch has its own counter slot (to find its last block)
        by_group = {}
        for p, group in work:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device or state["step"].dtype != torch.float32:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
            by_group.setdefault((id(group), p.device), (group, []))[1].append(p)
        used = {}
        for (_, dev), (group, params) in by_group.items():
            first = used.get(dev, 0)
            used[dev] = first + -(-len(params) // 2)
            counter = self._counter(dev, used[dev])
            if first:  # (no view to make in the common case of one group per device)
                counter = counter[first:]
            b1, b2 = group["betas"]
            sets = []
            for p in params:
                st = self.state[p]
                sets.append((p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"]))
            run_steps(sets, counter, float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                      float(group["weight_decay"]),
                      bool(group.get("decoupled_weight_decay", self._decoupled_default)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's (see torch.optim.Optimizer.zero_grad); with set_to_none (the default) and no
        profiler running, a plain loop, without the profiler label torch's opens (~7 us)."""
        if not set_to_none or _labelled():
            return super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None


def _labelled() -> bool:
    """Whether the step and zero_grad take torch's own paths, with its profiler labels: while a
    profiler runs, or under torch.compile."""
    return torch._C._autograd._profiler_enabled() or torch.compiler.is_compiling()


def _hooked_step(func):
    """`func` (a step) running the optimizer step hooks as torch's wrapper does
    (`torch.optim.Optimizer.profile_hook_step`, which torch puts on an optimizer class's step
    unless it is marked `hooked`): global and per-optimizer pre hooks, which may replace the
    arguments, then the step, then the post hooks. Torch's wrapper also opens a profiler label
    around them (`record_function`, ~7 us of host time per step); this one does so only while a
    profiler runs (or under torch.compile). A subclass that overrides step has its own step
    wrapped by torch, which runs the hooks; its super().step() then runs `func` alone."""
    profiled = torch.optim.Optimizer.profile_hook_step(func)  # (made once: torch.compile guards on it)

    @functools.wraps(func)
    def step(*args, **kwargs):
        self = args[0]
        if type(self).step is not step:
            return func(*args, **kwargs)
        if _labelled():
            return profiled(*args, **kwargs)
        for pre_hook in itertools.chain(_global_pre_hooks.values(), self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if isinstance(result, tuple) and len(result) == 2:
                    args, kwargs = result
                else:
                    raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), "
                                       f"but got {result}.")
        out = func(*args, **kwargs)
        self._optimizer_step_code()
        for post_hook in itertools.chain(self._optimizer_step_post_hooks.values(), _global_post_hooks.values()):
            post_hook(self, args, kwargs)
        return out
    step.hooked = True
    return step


_SnackAdamStep.step = _hooked_step(_SnackAdamStep.step)


class Adam(_SnackAdamStep, torch.optim.Adam):
    """torch.optim.Adam with a fused full-occupancy step for float32 CUDA parameters (see the
    module docstring); arguments as torch.optim.Adam's."""


class AdamW(_SnackAdamStep, torch.optim.AdamW):
    """torch.optim.AdamW with a fused full-occupancy step for float32 CUDA parameters (see the
    module docstring); arguments as torch.optim.AdamW's."""

    _decoupled_default = True
