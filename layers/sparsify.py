"""sparsify(model): replace a model's dense linear layers with SparseLinear, in place.

Replaces every selected nn.Linear, and Hugging Face transformers' Conv1D (GPT-2: weight stored
(in, out), y = x @ W + b; recognised by class name and module path, so transformers is not a
dependency), by `SparseLinear.from_dense`, keeping the entries of largest magnitude. Per-layer
densities are uniform (every layer at `sparsity`) or ERK (RigL: density proportional to
(out + in) / (out * in), same total number of connections). A `SparsifySummary` of what was
replaced (shapes, densities, parameters and bytes before and after) is kept in `last_summary`
and returned with `summary=True`; printing it gives a table.
Trade-off: selection by magnitude needs the dense weights (they exist already); layers whose
weight or bias is shared with another module (tied embeddings, e.g. GPT-2's lm_head) and the
output projection inside nn.MultiheadAttention (which reads `.weight` directly) are left dense
and listed as skipped, because replacing them would silently untie or break them. So are, with
a warning, subclasses of nn.Linear with a forward of their own, modules with hooks (forward,
backward, state-dict) or a forward replaced on the instance, and modules with a parametrized
weight or bias (replacing them would drop that behaviour). nn.TransformerEncoder
(Layer)s whose feed-forward layers were replaced leave their inference fast path (which reads
the dense weights) and run their ordinary forward.
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from snack.core import erk_densities
from .linear import SparseLinear, _check_sparsity

__all__ = ["sparsify", "densify", "SparsifySummary", "LayerRow", "last_summary"]

Pattern = Union[str, Callable[[str, nn.Module], bool]]

last_summary: Optional["SparsifySummary"] = None


@dataclass
class LayerRow:
    """One replaced layer. shape is (out_features, in_features); bytes count weight + bias,
    and for the sparse layer values + int32 indices (8 bytes per connection) + bias."""
    name: str
    kind: str
    shape: Tuple[int, int]
    density: float
    nnz: int
    params_before: int
    params_after: int
    bytes_before: int
    bytes_after: int


@dataclass
class SparsifySummary:
    """What `sparsify` did: one row per replaced layer, the skipped layers with the reason."""
    distribution: str
    sparsity: float
    rows: List[LayerRow] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def params_before(self) -> int:
        return sum(r.params_before for r in self.rows)

    @property
    def params_after(self) -> int:
        return sum(r.params_after for r in self.rows)

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.rows)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.rows)

    @property
    def weights_before(self) -> int:
        """Dense weight entries of the replaced layers (no biases)."""
        return sum(r.shape[0] * r.shape[1] for r in self.rows)

    @property
    def nnz(self) -> int:
        return sum(r.nnz for r in self.rows)

    @property
    def density(self) -> float:
        """Overall fraction of weights kept in the replaced layers."""
        n = self.weights_before
        return self.nnz / n if n else 0.0

    def table(self) -> str:
        """A plain-text table: one line per layer, then the totals and the skipped layers."""
        head = ("layer", "kind", "shape", "density", "params before", "params after",
                "MB before", "MB after")
        lines = [[r.name, r.kind, f"{r.shape[0]}x{r.shape[1]}", f"{r.density:.4f}",
                  f"{r.params_before:,}", f"{r.params_after:,}", f"{r.bytes_before / 1e6:.3f}",
                  f"{r.bytes_after / 1e6:.3f}"] for r in self.rows]
        lines.append(["total", "", f"{len(self.rows)} layers", f"{self.density:.4f}",
                      f"{self.params_before:,}", f"{self.params_after:,}",
                      f"{self.bytes_before / 1e6:.3f}", f"{self.bytes_after / 1e6:.3f}"])
        widths = [max(len(head[i]), *(len(l[i]) for l in lines)) for i in range(len(head))]

        def fmt(cells):
            return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        out = [f"sparsify: distribution={self.distribution}, sparsity={self.sparsity}",
               fmt(head), fmt(["-" * w for w in widths])]
        out += [fmt(l) for l in lines[:-1]] + [fmt(["-" * w for w in widths]), fmt(lines[-1])]
        out += [f"skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


def _is_conv1d(m: nn.Module) -> bool:
    t = type(m)
    # (transformers_modules: the code of trust_remote_code models)
    return t.__name__ == "Conv1D" and (t.__module__ or "").split(".")[0] in (
        "transformers", "pytorch_transformers", "transformers_modules")


def _dense_of(m: nn.Module):
    """(kind, weight (out, in) view, bias) of a replaceable module, or None."""
    if isinstance(m, nn.Linear):
        return "Linear", m.weight, m.bias
    if _is_conv1d(m):
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            return "Conv1D", w.t(), getattr(m, "bias", None)
    return None


def _torch_leftover(hook) -> bool:
    """A hook torch leaves on a module after undoing what registered it (weight_norm's loading
    compatibility hook stays after remove_parametrizations): nothing a replacement would lose."""
    h = getattr(hook, "hook", hook)  # (load-state-dict hooks come wrapped)
    return getattr(h, "__name__", "") == "_weight_norm_compat_hook" or type(h).__name__ == "_WeightNormCompatHook"


def _unsafe_to_replace(m: nn.Module, action: str = "sparsify") -> str:
    """Why replacing module m (by `action`: sparsify or densify) would change what the model
    computes, or "" if it is safe: a lazy module not yet initialized (nn.LazyLinear before its
    first forward: no weight to keep), a subclass of nn.Linear with a forward of its own (its extra
    behaviour would be lost), hooks registered on the module (they would stay behind on the
    replaced one: forward, backward and state-dict hooks, or a forward replaced on the instance)
    or a parametrized weight or bias (torch.nn.utils.parametrize, weight_norm, spectral_norm)."""
    t = type(m)
    if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        return f"{t.__name__} is not initialized yet (run a forward pass before {action})"
    if isinstance(m, nn.Linear) and t.forward is not nn.Linear.forward:
        return f"{t.__name__} subclasses nn.Linear with a forward of its own"
    if getattr(m, "parametrizations", None) is not None:
        return (f"its {' and '.join(m.parametrizations.keys()) or 'tensors'} "
                f"{'are' if len(m.parametrizations) > 1 else 'is'} parametrized (torch.nn.utils.parametrize)")
    f = vars(m).get("forward")
    if f is not None and not (getattr(f, "__self__", None) is m and getattr(f, "__func__", None) is t.forward):
        return "its forward is replaced on the instance (a wrapper such as accelerate's hooks)"
    hooks = [k for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                         "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                         "_load_state_dict_post_hooks")
             if any(not _torch_leftover(h) for h in getattr(m, k, {}).values())]
    if hooks:
        return (f"has hooks ({', '.join(h.strip('_').replace('_', ' ') for h in hooks)}); register them "
                f"after {action}")
    return ""


def _leave_transformer_fast_path(model: nn.Module) -> None:
    """nn.TransformerEncoder(Layer)'s inference fast path reads linear1/linear2's dense `.weight`;
    where those became SparseLinear the layers take their ordinary path instead (the same
    result, computed by the modules). The flags they had are kept on the modules for `densify`."""
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoderLayer) and _holds_sparse(m):
            if not hasattr(m, _FAST_PATH_KEPT):
                setattr(m, _FAST_PATH_KEPT, m.activation_relu_or_gelu)
            m.activation_relu_or_gelu = 0  # read only by the fast path's checks
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder) and any(
                isinstance(l, nn.TransformerEncoderLayer) and not l.activation_relu_or_gelu for l in m.layers):
            if not hasattr(m, _FAST_PATH_KEPT):
                setattr(m, _FAST_PATH_KEPT, m.use_nested_tensor)
            m.use_nested_tensor = False  # the encoder's own fast path reads the first layer's weights


_FAST_PATH_KEPT = "_snack_fast_path_flag"  # the flag `_leave_transformer_fast_path` turned off


def _holds_sparse(layer: nn.Module) -> bool:
    return isinstance(layer.linear1, SparseLinear) or isinstance(layer.linear2, SparseLinear)


def _restore_transformer_fast_path(model: nn.Module) -> None:
    """After `densify`: the transformer layers left without SparseLinear, and the encoders whose
    layers all are, get back the fast-path flags they had before `sparsify`."""
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoderLayer) and hasattr(m, _FAST_PATH_KEPT) and not _holds_sparse(m):
            m.activation_relu_or_gelu = getattr(m, _FAST_PATH_KEPT)
            delattr(m, _FAST_PATH_KEPT)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder) and hasattr(m, _FAST_PATH_KEPT) and not any(
                isinstance(l, nn.TransformerEncoderLayer) and _holds_sparse(l) for l in m.layers):
            m.use_nested_tensor = getattr(m, _FAST_PATH_KEPT)
            delattr(m, _FAST_PATH_KEPT)


def _as_patterns(name: str, p) -> Optional[List[Pattern]]:
    """None for None (no filter), else the list of patterns (an empty one matches nothing)."""
    if p is None:
        return None
    if isinstance(p, str) or callable(p):
        return [p]
    if isinstance(p, (Sequence, set, frozenset)):
        for q in p:
            if not (isinstance(q, str) or callable(q)):
                raise TypeError(f"{name} must hold name patterns (str) or callables (name, module) -> bool, "
                                f"got an item of type {type(q).__name__}")
        return list(p)
    raise TypeError(f"{name} must be None, a pattern, a callable or a list of them, got {type(p).__name__}")


def _matches(patterns: List[Pattern], name: str, module: nn.Module) -> bool:
    for p in patterns:
        if isinstance(p, str):
            if fnmatch.fnmatchcase(name, p):
                return True
        elif p(name, module):
            return True
    return False


def _selected(inc: Optional[List[Pattern]], exc: Optional[List[Pattern]], names: List[str], m: nn.Module) -> bool:
    """A module reachable by `names` passes include (if given: an empty include passes nothing)
    and no exclude pattern."""
    return not ((inc is not None and not any(_matches(inc, n, m) for n in names))
                or (exc and any(_matches(exc, n, m) for n in names)))


def _warn_unmatched(fn: str, inc: List[Pattern], exc: List[Pattern], names: List[str], what: str) -> None:
    """One warning per include / exclude name pattern that matches none of the candidate names."""
    for label, patterns in (("include", inc), ("exclude", exc)):
        for q in patterns or ():
            if isinstance(q, str) and not any(fnmatch.fnmatchcase(n, q) for n in names):
                warnings.warn(f"{fn}: the {label} pattern {q!r} matches no {what} module "
                              f"(their names: {', '.join(names[:8]) or 'none'}"
                              f"{', ...' if len(names) > 8 else ''})", stacklevel=3)


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _replace(model: nn.Module, replaced: dict) -> nn.Module:
    """Puts replaced[id(m)] wherever module m is attached in model (every place, for a module
    attached in several); returns the model, or its replacement when it is itself replaced."""
    if id(model) in replaced:
        return replaced[id(model)]
    for _, parent in model.named_modules(remove_duplicate=False):
        for cname, child in list(parent._modules.items()):
            if child is not None and id(child) in replaced:
                setattr(parent, cname, replaced[id(child)])
    return model


def sparsify(model: nn.Module, sparsity: float = 0.9, *, distribution: str = "uniform",
             include: Union[None, Pattern, Sequence[Pattern]] = None,
             exclude: Union[None, Pattern, Sequence[Pattern]] = None, summary: bool = False):
    """Replaces the model's nn.Linear (and transformers' Conv1D) modules by SparseLinear, in place.

    Args:
        model: any nn.Module. If it is itself an nn.Linear, the new SparseLinear is returned
            (a module cannot replace itself in place).
        sparsity: overall fraction of zero weights over the replaced layers, in [0, 1).
        distribution: "uniform" (each layer at `sparsity`) or "erk" (per-layer densities from
            `snack.core.erk_densities`: small layers denser, same total connections; layers
            that would exceed density 1 stay fully connected, still as SparseLinear, whose
            product then runs as a dense one on its values).
        include: name pattern(s) (fnmatch on the qualified module name, e.g. "encoder.*"; one, or a
            list, tuple or set of them) or callables (name, module) -> bool; only matching layers
            are replaced (default: all). A module attached in several places matches by any of
            its names.
        exclude: the same; matching layers are left dense (applied after include).
        summary: also return the SparsifySummary.
    Each layer keeps its round(density * out * in) entries of largest |w| and its bias, device,
    dtype and requires_grad. Returns the model (or (model, summary) with summary=True); the
    summary is kept in `sparsify.last_summary` as well (an attribute of this function, so
    `snack.sparsify.last_summary` works).
    """
    global last_summary
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    sparsity = _check_sparsity(sparsity)
    if distribution not in ("uniform", "erk"):
        raise ValueError(f"distribution must be 'uniform' or 'erk', got {distribution!r}")
    inc = _as_patterns("include", include)
    exc = _as_patterns("exclude", exclude)

    # who owns each parameter (to spot tied weights) and every place each module is attached
    owners = {}
    names_of = {}  # every name a module is reachable by (a shared module has several)
    for mname, m in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(m), []).append(mname)
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(m))
    report = SparsifySummary(distribution=distribution, sparsity=sparsity)
    chosen = []          # (name, module, kind, weight (out, in), bias)
    unexpected = []      # skipped for a reason the user may not expect (warned)
    linear_names = []
    seen = set()
    for name, m in model.named_modules():
        d = _dense_of(m)
        if d is None or id(m) in seen:
            continue
        seen.add(id(m))
        names = names_of.get(id(m), [name])
        linear_names += names
        if not _selected(inc, exc, names, m):
            continue
        kind, w, b = d
        tied = [k for k in ("weight", "bias") if isinstance(getattr(m, k, None), torch.Tensor)
                and len(owners.get(id(getattr(m, k)), ())) > 1]
        if tied:
            report.skipped.append((name, f"{' and '.join(tied)} shared with another module (tied)"))
            continue
        if isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear):
            report.skipped.append((name, "output projection of nn.MultiheadAttention (reads .weight)"))
            continue
        why = _unsafe_to_replace(m)
        if why:
            report.skipped.append((name, why))
            unexpected.append(f"{name}: {why}")
            continue
        chosen.append((name, m, kind, w, b))
    if unexpected:
        warnings.warn("sparsify left these layers dense:\n  " + "\n  ".join(unexpected), stacklevel=2)
    _warn_unmatched("sparsify", inc, exc, linear_names, "nn.Linear / Conv1D")
    if not linear_names and any(isinstance(m, SparseLinear) for m in model.modules()):
        warnings.warn("sparsify: the model holds no dense nn.Linear / Conv1D left to replace (it is "
                      "sparse already; to change a SparseLinear's sparsity, rebuild it with "
                      "SparseLinear.from_dense(layer.to_dense(), sparsity=...))", stacklevel=2)

    shapes = [tuple(w.shape) for _, _, _, w, _ in chosen]
    if distribution == "erk":
        for (name, _, _, w, _), shape in zip(chosen, shapes):
            if 0 in shape:  # (erk_densities would refuse it without the module's name)
                raise ValueError(f"sparsify: module '{name}': its weight (out, in) = {shape} has no entries")
        densities = erk_densities(shapes, sparsity) if shapes else []
    else:
        densities = [1.0 - sparsity] * len(shapes)

    replaced = {}
    empty = []  # modules left without a connection (rounding at a sparsity near 1)
    for (name, m, kind, w, b), dens in zip(chosen, densities):
        dens = min(1.0, max(0.0, float(dens)))
        layer_sparsity = min(1.0 - dens, 1.0 - 1e-12)   # density 0 -> nnz 0
        with torch.no_grad():
            try:
                with warnings.catch_warnings():  # warned below, once, with the modules' names
                    warnings.filterwarnings("ignore", message="SparseLinear .* holds no connection")
                    new = SparseLinear.from_dense(w.detach(), sparsity=layer_sparsity)
            except (ValueError, TypeError) as e:  # (the model is not changed: modules are replaced after the loop)
                raise type(e)(f"sparsify: module '{name}': {e}") from e
            if new.nnz == 0:
                empty.append(f"{name} ({w.shape[1]} -> {w.shape[0]})")
            if b is not None:
                new.bias = nn.Parameter(b.detach().clone(), requires_grad=b.requires_grad)
        new.values.requires_grad_(getattr(m, "weight").requires_grad)
        new.train(m.training)
        if kind == "Conv1D":
            new._dense_class = type(m)  # what `densify` makes of it again
        replaced[id(m)] = new
        wb = w.numel() * w.element_size()
        report.rows.append(LayerRow(
            name=name, kind=kind, shape=(int(w.shape[0]), int(w.shape[1])), density=new.density,
            nnz=new.nnz, params_before=w.numel() + (b.numel() if b is not None else 0),
            params_after=new.nnz + (b.numel() if b is not None else 0),
            bytes_before=wb + _nbytes(b),
            bytes_after=_nbytes(new.values) + _nbytes(new.indices) + _nbytes(b)))

    result = _replace(model, replaced)
    if result is model:
        _leave_transformer_fast_path(model)
    if empty:
        warnings.warn(f"sparsify: at sparsity {sparsity} ({distribution}) these layers hold no connection, so their "
                      "output is the bias alone and no weight will train: " + ", ".join(empty), stacklevel=2)
    last_summary = report
    sparsify.last_summary = report  # also reachable as snack.sparsify.last_summary
    return (result, report) if summary else result


sparsify.last_summary = None


def _dense_module(layer: SparseLinear) -> nn.Module:
    """The dense module computing what `layer` computes: an nn.Linear, or the transformers Conv1D
    that `sparsify` made the layer from (weight stored (in, out))."""
    w = layer.to_dense().detach()
    b = layer.bias
    cls = getattr(layer, "_dense_class", None)
    if cls is not None:
        new = cls(layer.out_features, layer.in_features).to(device=w.device, dtype=w.dtype)  # Conv1D(nf, nx)
        w = w.t()  # stored (in, out)
    else:
        new = torch.nn.utils.skip_init(nn.Linear, layer.in_features, layer.out_features, bias=b is not None,
                                       device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if b is not None:
            new.bias.copy_(b.detach())
        elif new.bias is not None:  # a Conv1D always has one
            new.bias.zero_()
    new.weight.requires_grad_(layer.values.requires_grad)
    if b is not None:
        new.bias.requires_grad_(b.requires_grad)
    new.train(layer.training)
    return new


def densify(model: nn.Module, *, include: Union[None, Pattern, Sequence[Pattern]] = None,
            exclude: Union[None, Pattern, Sequence[Pattern]] = None) -> nn.Module:
    """Replaces the model's SparseLinear modules by dense ones, in place: the way back from
    `sparsify`, for export to tools that do not know SNACK (ONNX, an evaluation harness, a
    checkpoint for the original model class).

    Each SparseLinear becomes an nn.Linear whose weight is `layer.to_dense()` (zeros where there
    is no connection), or, for a layer that `sparsify` made from transformers' Conv1D, a Conv1D
    again (weight (in, out)), so that the state_dict loads into the original model. Bias, device,
    dtype, requires_grad and training mode are kept; the outputs are those of the sparse layer
    (within rounding). This allocates every layer's dense weight: it is for the end of training.
    nn.TransformerEncoder(Layer)s whose feed-forward layers are all dense again get back the
    inference fast path that `sparsify` turned off for them.

    Args:
        model: any nn.Module. If it is itself a SparseLinear, its dense module is returned.
        include / exclude: as in `sparsify`: name patterns or callables choosing the layers.
    Layers with hooks are left sparse, with a warning: a DST object (`snack.dst.RigL`) keeps a
    forward hook on every layer; call its `remove_hooks()` first. An optimizer or DST object
    holding the old layers' parameters does not follow the replacement.
    Returns the model (or the new module).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    inc = _as_patterns("include", include)
    exc = _as_patterns("exclude", exclude)
    names_of = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(m), []).append(mname)
    replaced, kept, sparse_names = {}, [], []
    for name, m in model.named_modules():
        if not isinstance(m, SparseLinear):
            continue
        names = names_of.get(id(m), [name])
        sparse_names += names
        if not _selected(inc, exc, names, m):
            continue
        for key in [k for k, h in m._forward_hooks.items()
                    if type(h).__name__ == "_CaptureHook" and not h.alive]:
            for hooks in (m._forward_hooks, m._forward_hooks_with_kwargs, m._forward_hooks_always_called):
                hooks.pop(key, None)     # a copied (or orphaned) RigL hook: it does nothing
        why = _unsafe_to_replace(m, "densify")
        if why:
            kept.append(f"{name}: {why}" + (" (a snack.dst object's: call its remove_hooks())"
                                              if any(type(h).__name__ == "_CaptureHook"
                                                     for h in m._forward_hooks.values()) else ""))
            continue
        replaced[id(m)] = _dense_module(m)
    if kept:
        warnings.warn("densify left these layers sparse:\n  " + "\n  ".join(kept), stacklevel=2)
    _warn_unmatched("densify", inc, exc, sparse_names, "SparseLinear")
    if not sparse_names:
        warnings.warn("densify: the model holds no SparseLinear", stacklevel=2)
    model = _replace(model, replaced)
    _restore_transformer_fast_path(model)
    return model
