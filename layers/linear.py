"""SparseLinear: an nn.Linear whose weight is stored as COO, for its non-zero connections only.

Parameters and buffers (all that a state_dict holds):
    values   nn.Parameter (nnz,)   the weights, in canonical row-major order of `indices`
    indices  buffer int32 (2, nnz) [0] output (row) index, [1] input (column) index, sorted
                                   row-major, each coordinate once
    bias     nn.Parameter (out_features,) or None
Because `values` is an ordinary dense parameter, the torch.optim optimizers (all but Muon, which
takes only 2-D weights), gradient clipping, AMP's GradScaler and DDP work unchanged; the
optimizer state is (nnz,) too.
Trade-off: the number of connections is fixed at construction (dynamic sparse training changes
which connections, never how many), which keeps every buffer's shape and address stable, so a
training step can be captured once in a CUDA graph and replayed. The one exception is
`load_state_dict` of a checkpoint with another nnz (a layer made by `from_dense`, or at another
sparsity): the layer takes the checkpoint's connections (build the optimizer, and capture graphs,
after loading). An optimizer that already holds state of the old size for the layer's values
(Adam's moments, SGD's momentum) is stopped at its next step, before it changes anything, by a
RuntimeError that says so, unless its state was loaded to match too.
"""
from __future__ import annotations

import contextlib
import math
import sys
import warnings
import weakref
from numbers import Integral, Real
from typing import Optional, Union

import torch
import torch.nn as nn

from snack.core import INDEX_DTYPE, canonicalize, density_to_nnz, uniform_indices
from snack.core.coo import _MAX_DIM, check_device, check_mask
from .functional import _FLOAT_DTYPES, sparse_linear

__all__ = ["SparseLinear"]

# values Parameters resized by load_state_dict (by id: a weak reference and their number of
# connections before), until an optimizer holding them steps with state of the new size or none;
# the optimizer step pre-hook below, registered at the first resize, refuses a step whose state
# has the old size
_RESIZED: dict = {}
_RESIZE_HOOK = []


def _refuse_stale_optimizer_state(opt, args, kwargs):
    if not _RESIZED:
        return None
    for group in opt.param_groups:
        for p in group["params"]:
            entry = _RESIZED.get(id(p))
            if entry is None or entry[0]() is not p:
                continue
            old = entry[1]
            stale = sorted(k for k, v in opt.state.get(p, {}).items()
                           if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == old != p.shape[0])
            if stale:
                raise RuntimeError(
                    f"{type(opt).__name__} holds state ({', '.join(map(str, stale))}) for {old} connections of a "
                    f"SparseLinear that load_state_dict gave {p.shape[0]}: build the optimizer after loading "
                    "the model, or load the optimizer's state_dict saved with that checkpoint")
            del _RESIZED[id(p)]
    return None


def _note_resize(values: torch.Tensor, old_nnz: int) -> None:
    entry = _RESIZED.get(id(values))
    if entry is None or entry[0]() is not values:
        key = id(values)
        _RESIZED[key] = (weakref.ref(values, lambda _, key=key: _RESIZED.pop(key, None)), old_nnz)
    if not _RESIZE_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _RESIZE_HOOK.append(register_optimizer_step_pre_hook(_refuse_stale_optimizer_state))


def _check_features(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, Integral):  # int, numpy integers
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if not 0 < n <= _MAX_DIM:
        raise ValueError(f"{name} must be a positive int below 2**31 (int32 indices), got {n}")
    return int(n)


def _check_dtype(dtype) -> None:
    # the dtypes the op supports (functional's list), not any floating one: torch's float8 types
    # are floating too, but have no uniform_ for the initialisation nor kernels for the forward
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating torch.dtype the layer supports (float32, float64, float16, "
                        f"bfloat16) or None, got {dtype!r}")


def _warn_if_empty(nnz: int, shape, how: str) -> None:
    if nnz == 0:
        warnings.warn(f"SparseLinear {shape[1]} -> {shape[0]} holds no connection ({how}): its output "
                      "is the bias alone and no weight will train", stacklevel=3)


def _check_sparsity(sparsity) -> float:
    if isinstance(sparsity, torch.Tensor) and sparsity.dim() == 0 and sparsity.is_floating_point():
        sparsity = float(sparsity)
    if isinstance(sparsity, bool) or not isinstance(sparsity, Real) or math.isnan(sparsity) \
            or not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
    return float(sparsity)


def _static_address(indices: torch.Tensor) -> torch.Tensor:
    """Marks `indices` as an input whose address stays fixed from call to call, as
    `torch._dynamo.mark_static_address(indices)` does (without importing torch._dynamo): CUDA-graph
    compilation may then hand the buffer itself to the op, whose topology is cached on that
    tensor, rather than a copy refreshed at every replay (which would rebuild the topology, with
    a host sync, at every call). Returns `indices`."""
    indices._dynamo_static_input_type = "unguarded"
    return indices


def _loading_strictly() -> bool:
    """The `strict` of the `nn.Module.load_state_dict` call now loading (torch passes True to every
    module's `_load_from_state_dict` and applies strict=False only to the keys it reports
    afterwards); True where no such call is found (a direct `_load_from_state_dict` call)."""
    code = nn.Module.load_state_dict.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return bool(f.f_locals.get("strict", True))
        f = f.f_back
    return True


@contextlib.contextmanager
def _classic_conversion():
    """Turns torch's swap mode (`torch.__future__.set_swap_module_params_on_conversion(True)`)
    off around a SparseLinear's own load and conversion: `torch.utils.swap_tensors` refuses
    tensors that are weakly referenced, as `indices` is by its cached topology and `values` after
    a resize; the classic path (copy, `.data` assignment) keeps the same Parameter objects."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    if swap:
        torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        yield
    finally:
        if swap:
            torch.__future__.set_swap_module_params_on_conversion(True)


class SparseLinear(nn.Module):
    """y = x @ W.T + b with W (out_features, in_features) sparse: only nnz connections stored.

    Args:
        in_features, out_features: positive ints.
        bias: learn an additive bias (out_features,).
        sparsity: fraction of zero weights, in [0, 1); the layer holds exactly
            nnz = round((1 - sparsity) * in_features * out_features) connections, drawn
            uniformly at random (from torch's global RNG, so torch.manual_seed makes it
            reproducible) without ever building a dense matrix.
        device, dtype: of values and bias (indices are always int32, on the same device).
    Initialisation: as nn.Linear, values and bias ~ U(-1/sqrt(in_features), 1/sqrt(in_features)),
    i.e. each kept weight has the distribution it would have in the dense layer (the output's
    variance is then (1 - sparsity) times the dense layer's).
    Input (..., in_features) -> output (..., out_features), on values' device and dtype.
    torch.nn.utils.parametrize takes the bias but not `values` (a name torch's parametrization
    container, a ModuleDict, holds as a method: KeyError, and the failed call leaves the layer
    without its values); transform the values in a module around the layer instead.
    The topology metadata is rebuilt (and validated, with a host sync) whenever `indices` is
    written in place through torch (torch counts such writes); a write torch does not see (through
    `.data`, a numpy view, a torch.distributed collective into the buffer) leaves the old pattern
    in use until `torch.autograd.graph.increment_version(layer.indices)` is called. Under
    DistributedDataParallel pass forward_sync_buffers=False (torch >= 2.13; before it
    broadcast_buffers=False; all ranks build the same pattern from the same seed, or
    load it) so that it is not re-sent, and rebuilt, every step.
    """

    __constants__ = ["in_features", "out_features"]
    in_features: int
    out_features: int

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, sparsity: float = 0.9,
                 device=None, dtype=None):
        super().__init__()
        in_features = _check_features("in_features", in_features)
        out_features = _check_features("out_features", out_features)
        sparsity = _check_sparsity(sparsity)
        _check_dtype(dtype)
        device = check_device(device)
        nnz = density_to_nnz((out_features, in_features), density=1.0 - sparsity)
        if sparsity > 0:
            _warn_if_empty(nnz, (out_features, in_features), f"sparsity={sparsity} of "
                           f"{out_features * in_features} weights rounds to 0 connections")
        # the pattern is drawn on the CPU (following torch.manual_seed) whatever the default
        # device, then moved: under `with torch.device("meta")` the layer is built on meta
        with torch.device("cpu"):
            seed = int(torch.randint(0, 2**62, (1,)).item())
            idx = uniform_indices((out_features, in_features), nnz=nnz,
                                  generator=torch.Generator().manual_seed(seed))
        factory = {"device": device, "dtype": dtype}
        self._setup(in_features, out_features, idx.to(device=torch.empty(0, device=device).device),
                    torch.empty(nnz, **factory),
                    torch.empty(out_features, **factory) if bias else None)
        self.reset_parameters()

    def _setup(self, in_features: int, out_features: int, indices: torch.Tensor,
               values: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.values = nn.Parameter(values)
        with torch.inference_mode(False):  # an ordinary tensor (a version counter: its topology is cached)
            indices = indices.to(INDEX_DTYPE).contiguous()
            if indices.is_inference():
                indices = indices.clone()
        self.register_buffer("indices", _static_address(indices))
        if bias is not None:
            self.bias = nn.Parameter(bias)
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """values and bias ~ U(-1/sqrt(in_features), 1/sqrt(in_features)) (nn.Linear's bound)."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.values.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    # ---- properties ----------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        """Number of stored connections. Fixed at construction (training, dynamic sparse training
        included, changes which connections, never how many) until `load_state_dict` of a
        checkpoint with another nnz, which gives the layer the checkpoint's (see the module
        docstring)."""
        return int(self.indices.shape[1])

    @property
    def density(self) -> float:
        """nnz / (out_features * in_features)."""
        return self.nnz / (self.out_features * self.in_features)

    @property
    def sparsity(self) -> float:
        """Fraction of zero weights, 1 - nnz / (out_features * in_features)."""
        return 1.0 - self.density

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nnz={self.nnz}, sparsity={self.sparsity:.4f}, bias={self.bias is not None}")

    def __prepare_scriptable__(self):
        raise RuntimeError("SparseLinear cannot be compiled by TorchScript (torch.jit.script): its forward runs "
                           "Python and Numba kernels; use torch.compile or torch.export, or snack.densify(model) "
                           "for a dense copy of the model")

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the parameters and the buffer straight from their dicts (nn.Module.__getattr__ costs
        # ~0.3-0.6 us per name, per call); torch.func.functional_call swaps the dicts' entries,
        # so it is seen; a name moved out of them (torch.nn.utils.parametrize of the bias) goes
        # through getattr. (torch cannot parametrize `values`: its ParametrizationList container,
        # a ModuleDict, has a method of that name, and register_parametrization raises KeyError.)
        params, buffers = self._parameters, self._buffers
        values = params["values"] if "values" in params else self.values
        bias = params["bias"] if "bias" in params else self.bias
        indices = buffers["indices"] if "indices" in buffers else self.indices
        return sparse_linear(x, indices, values, self.out_features, bias, in_features=self.in_features)

    def to_coo(self):
        """The layer's connections as a `snack.core.COO` (a copy of its indices, its values
        detached, not copied): every connection, those whose value is 0 included (a COO made from
        `to_dense()` would drop them), without building the dense matrix."""
        from snack.core import COO
        shape = (self.out_features, self.in_features)
        if self.indices.is_meta:  # (nothing to check or copy: no index is stored)
            return COO(self.indices.clone(), self.values.detach(), shape, check=False)
        return COO(self.indices, self.values.detach(), shape)

    def to_dense(self) -> torch.Tensor:
        """The (out_features, in_features) weight, differentiable in values. For tests and export
        only: it allocates the dense matrix that the layer itself never builds."""
        w = torch.zeros(self.out_features, self.in_features, dtype=self.values.dtype,
                        device=self.values.device)
        idx = self.indices.to(torch.int64)
        return w.index_put((idx[0], idx[1]), self.values)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) leaves integer buffers alone, but Module.type(), or any fn that casts
        # every tensor, would not: keep indices int32 and follow only the device change.
        idx = self._buffers.get("indices")

        def keep_indices_int32(t):
            out = fn(t)
            if t is idx and isinstance(out, torch.Tensor) and out.dtype != idx.dtype:
                out = idx.to(device=out.device)
            return out
        with _classic_conversion():
            out = super()._apply(keep_indices_int32, recurse)
        if self._buffers.get("indices") is not None:
            _static_address(self._buffers["indices"])
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # the weight's shape goes with the checkpoint, in its metadata (no tensor of its own, so
        # the keys stay values / indices / bias): a checkpoint of another shape is refused on load
        super()._save_to_state_dict(destination, prefix, keep_vars)
        meta = getattr(destination, "_metadata", None)
        if meta is not None and isinstance(meta.get(prefix[:-1]), dict):
            meta[prefix[:-1]]["weight_shape"] = (self.out_features, self.in_features)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A checkpoint may hold another number of connections than this layer (a layer built by
        # from_dense or with another sparsity): the layer takes the checkpoint's. values and
        # indices are resized here (same Parameter object, same dtype and device) and then
        # filled by the default copy; indices stay int32 (an int64 checkpoint is cast).
        # A checkpoint is refused before anything changes when its weight has another shape
        # (from its metadata; a state_dict copied into a plain dict has none, and is checked by
        # its index range only) or its indices are not canonical (sorted row-major, each
        # coordinate once).
        shape = local_metadata.get("weight_shape") if isinstance(local_metadata, dict) else None
        if shape is not None and tuple(shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {prefix}indices: the checkpoint's weight is "
                              f"{shape[0]} x {shape[1]} (out x in), this layer's {self.out_features} x "
                              f"{self.in_features}")
            return
        idx = state_dict.get(prefix + "indices")
        val = state_dict.get(prefix + "values")
        if isinstance(idx, torch.Tensor) and isinstance(val, torch.Tensor):
            if idx.dim() != 2 or idx.shape[0] != 2 or val.dim() != 1 or val.shape[0] != idx.shape[1]:
                error_msgs.append(f"{prefix}indices / {prefix}values: expected shapes (2, nnz) and (nnz,), "
                                  f"got {tuple(idx.shape)} and {tuple(val.shape)}")
                return
            if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
                error_msgs.append(f"{prefix}indices must be an integer tensor, got {idx.dtype}")
                return
            nnz = int(idx.shape[1])
            bias = state_dict.get(prefix + "bias")
            if nnz != self.nnz and (
                    (self.bias is not None and isinstance(bias, torch.Tensor) and bias.shape != self.bias.shape)
                    or ((self.bias is None) != (bias is None) and _loading_strictly())):
                # the load fails on the bias anyway (torch reports it): leave values and indices as they are
                # (with strict=False a missing or unexpected bias is only reported: the load goes on)
                with _classic_conversion():
                    return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                         unexpected_keys, error_msgs)
            if nnz and idx.device.type != "meta":
                lo, hi = idx.amin(dim=1).tolist(), idx.amax(dim=1).tolist()
                if min(lo) < 0 or hi[0] >= self.out_features or hi[1] >= self.in_features:
                    error_msgs.append(
                        f"{prefix}indices hold rows {lo[0]}..{hi[0]} and columns {lo[1]}..{hi[1]}, outside this "
                        f"layer's {self.out_features} x {self.in_features} weight (a checkpoint of another shape?)")
                    return
                try:  # (in range: checked above) names a duplicated coordinate if there is one
                    _, _, in_order = canonicalize(idx, (self.out_features, self.in_features), check=False)
                except ValueError as e:
                    error_msgs.append(f"{prefix}indices: {e}")
                    return
                if not in_order:
                    error_msgs.append(
                        f"{prefix}indices are not in canonical row-major order (sorted by row, then "
                        "column); sort the checkpoint's indices and values with "
                        "snack.core.canonicalize(indices, shape, values)")
                    return
            if nnz != self.nnz:
                # (ordinary tensors even under torch.inference_mode: the layer must stay trainable
                # and its topology cacheable)
                _note_resize(self.values, self.nnz)
                with torch.inference_mode(False), torch.no_grad():
                    self.values.data = self.values.new_empty(nnz)
                    self.values.grad = None  # a gradient of the old size would break the next backward
                    self._buffers["indices"] = _static_address(
                        torch.empty(2, nnz, dtype=INDEX_DTYPE, device=self.indices.device))
        with _classic_conversion():
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        ind = self._buffers.get("indices")
        if ind is not None and (ind.dtype != INDEX_DTYPE or not ind.is_contiguous()):  # load_state_dict(assign=True)
            self._buffers["indices"] = _static_address(ind.to(INDEX_DTYPE).contiguous())
        elif ind is not None:
            _static_address(ind)

    # ---- conversion ----------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, weight_or_linear: Union[torch.Tensor, nn.Linear], *,
                   sparsity: Optional[float] = None, mask: Optional[torch.Tensor] = None) -> "SparseLinear":
        """A SparseLinear holding part of a dense weight (out_features, in_features).

        Args:
            weight_or_linear: a 2-D tensor (out, in), or an nn.Linear (its bias is copied too).
            sparsity: keep the round((1 - sparsity) * out * in) entries of largest |w|; ties are
                broken by position (the earlier entry in row-major order is kept). A weight holding
                NaN raises ValueError here (NaN has no magnitude to rank).
            mask: keep exactly the entries where mask (bool or 0/1, shape (out, in)) is true.
            With neither, the non-zero entries of the weight are kept (e.g. an already pruned
            weight). Giving both raises ValueError. A weight on the meta device (no values) with
            `sparsity` gives a meta layer of that many connections, whose pattern a checkpoint
            fills after `to_empty` (`load_state_dict`); with `mask`, a meta layer of the mask's.
        The result has the weight's device and dtype; its parameters are copies that require
        grad (unless the source is a Parameter that does not). Selection sorts |w|, which allocates temporaries of the dense size
        (the dense weight exists already).
        """
        bias = None
        if isinstance(weight_or_linear, nn.Linear):
            w, bias = weight_or_linear.weight, weight_or_linear.bias
        elif isinstance(weight_or_linear, torch.Tensor):
            w = weight_or_linear
        else:
            raise TypeError("weight_or_linear must be a 2-D torch.Tensor or an nn.Linear, got "
                            f"{type(weight_or_linear).__name__}")
        if w.dim() != 2:
            raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
        if w.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"weight must be a floating tensor of a dtype the layer supports (float32, float64, "
                            f"float16, bfloat16), got {w.dtype}")
        out_f, in_f = int(w.shape[0]), int(w.shape[1])
        if not (0 < out_f <= _MAX_DIM and 0 < in_f <= _MAX_DIM):
            raise ValueError("weight_or_linear's weight must have 1 to 2**31 - 1 rows (out_features) and "
                             f"columns (in_features), got shape {tuple(w.shape)}")
        if sparsity is not None and mask is not None:
            raise ValueError("give sparsity or mask, not both")
        wd = w.detach()
        if mask is not None:
            idx = check_mask(mask, (out_f, in_f), "the weight").nonzero().t().to(wd.device)  # row-major order
            _warn_if_empty(idx.shape[1], (out_f, in_f), "the mask keeps no entry")
        elif sparsity is None:
            if wd.is_meta:
                raise ValueError("weight is on the meta device: it holds no values, so its non-zero entries "
                                 "are unknown; give sparsity= (a meta layer of that many connections) or mask=")
            idx = (wd != 0).nonzero().t()
            _warn_if_empty(idx.shape[1], (out_f, in_f), "the weight has no non-zero entry")
        else:
            sparsity = _check_sparsity(sparsity)
            nan = torch.isnan(wd)
            if not wd.is_meta and bool(nan.any()):
                raise ValueError(f"weight holds {int(nan.sum())} NaN value(s) (e.g. at "
                                 f"{tuple(nan.nonzero()[0].tolist())}): keeping the largest magnitudes "
                                 "cannot rank them; clean the weight or give a mask")
            k = density_to_nnz((out_f, in_f), density=1.0 - sparsity)
            if sparsity > 0:
                _warn_if_empty(k, (out_f, in_f), f"sparsity={sparsity} of {out_f * in_f} weights "
                               "rounds to 0 connections")
            order = torch.sort(wd.abs().flatten(), descending=True, stable=True).indices[:k]
            keys = torch.sort(order).values
            idx = torch.stack([keys // in_f, keys % in_f])
        idx = idx.to(torch.int64)
        values = wd[idx[0], idx[1]].clone()
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(in_f, out_f, idx, values,
                     bias.detach().clone() if bias is not None else None)
        if isinstance(w, nn.Parameter):               # a frozen layer stays frozen
            layer.values.requires_grad_(w.requires_grad)
        if bias is not None:
            layer.bias.requires_grad_(bias.requires_grad)
        return layer
