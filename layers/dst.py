"""Dynamic sparse training (SET, RigL) on SparseLinear's COO weights, without a dense mask.

    dst = snack.dst.RigL(model, optimizer, total_steps=10_000)   # or snack.dst.SET(...)
    for x, t in data:
        loss(model(x), t).backward(); optimizer.step(); optimizer.zero_grad()
        dst.step()                       # prunes and regrows every `update_every` steps

Every `update_every` steps (until `end_step`) each layer drops a fraction f(t) of its connections
by `drop_scores` (lowest first) and grows as many new ones at coordinates it does not hold, by
`grow_scores` (highest first). The connection pattern is changed on the COO form only:
- drop: a stable sort of the (nnz,) scores (SET: per sign group);
- grow, SET: distinct ranks sampled among the out*in - nnz free coordinates and mapped to
  coordinates through the sorted keys of the current pattern (one searchsorted), i.e. exactly
  uniform over the free coordinates, O(nnz) memory;
- grow, RigL: |dL/dW| at free coordinates, dL/dW = dY^T X from the layer's last input X (B, in)
  and output gradient dY (B, out), captured by a forward hook on update steps only. The (out, in)
  grid is scored in tiles of at most `grad_block_numel` entries (default 2**21, 8 MB in float32),
  taking the top-k of each tile and merging, so the extra memory of an update is
  O(grad_block_numel + nnz) plus the captured activations, never O(out * in). In a model
  compiled by torch.compile the hook does nothing on other steps and runs eagerly on update
  steps (a graph break there, so `fullgraph=True` works with SET only);
- the new canonical indices are written into `layer.indices` in place (the topology cache sees
  the version change), values in place with regrown entries at exactly 0, and every (nnz,)
  optimizer state tensor and `values.grad` are permuted in place: survivors keep their moments,
  regrown entries start at 0, a pruned entry's state is discarded.
  The layer's topology is rebuilt right away, into its existing arrays (`Topology.refresh_from`),
  so a training step captured in a CUDA graph before the update replays the new pattern.
Under torch.distributed (data-parallel copies of the model) the updates are synchronised over a
process group: a common default seed, RigL's scores summed over the ranks, agreed skips and
refusals, and a comparison of the ranks' choices before anything is written (`process_group`).
Trade-off: tensors keep their shape and address (CUDA-graph friendly, optimizers untouched), but
the re-sort costs O(nnz log nnz) and RigL recomputes the full dense-gradient product
(B * out * in multiply-adds) tile by tile on every update step, as RigL itself does.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from snack.core.coo import check_seed
from snack.core.topology import sample_distinct

from . import backend
from .functional import _in_functorch
from .linear import SparseLinear

__all__ = ["DynamicSparseTraining", "SET", "RigL", "LayerUpdate", "UpdateSummary",
           "cosine_drop_fraction"]

_DECAYS = ("cosine", "constant")


# ---- schedule ----------------------------------------------------------------------------------
def cosine_drop_fraction(t: int, drop_fraction: float, end_step: float) -> float:
    """RigL's cosine decay f(t) = drop_fraction / 2 * (1 + cos(pi * t / end_step)), 0 from end_step."""
    if t >= end_step:
        return 0.0
    return drop_fraction / 2.0 * (1.0 + math.cos(math.pi * t / end_step))


# ---- summaries ---------------------------------------------------------------------------------
@dataclass
class LayerUpdate:
    """What one update did to one layer (`grown == dropped` always; nnz is unchanged)."""
    name: str
    shape: Tuple[int, int]
    nnz: int
    dropped: int
    grown: int
    skipped: str = ""   # why the layer was left alone, if it was


@dataclass
class UpdateSummary:
    """One prune-and-regrow step: the DST step count, the drop fraction used, one row per layer."""
    step: int
    drop_fraction: float
    layers: List[LayerUpdate] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return sum(r.dropped for r in self.layers)

    @property
    def grown(self) -> int:
        return sum(r.grown for r in self.layers)

    def __str__(self) -> str:
        lines = [f"DST update at step {self.step}, drop fraction {self.drop_fraction:.4f}"]
        for r in self.layers:
            extra = f" (skipped: {r.skipped})" if r.skipped else ""
            lines.append(f"  {r.name or '<layer>'} {r.shape[0]}x{r.shape[1]} nnz={r.nnz}: "
                         f"dropped {r.dropped}, grown {r.grown}{extra}")
        return "\n".join(lines)


# ---- COO helpers (all O(nnz) memory) ---------------------------------------------------------------
def _resolve_group(process_group):
    """The torch.distributed group a DST object synchronises over, or None (see its docstring)."""
    if process_group is False:
        return None
    import torch.distributed as dist
    ready = dist.is_available() and dist.is_initialized()
    if process_group is None:
        return dist.group.WORLD if ready and dist.get_world_size() > 1 else None
    if process_group is True or not ready or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError("process_group must be None, False or a torch.distributed ProcessGroup of an "
                        f"initialized process group, got {process_group!r}")
    return process_group


_P31 = 2**31 - 1


def _fingerprint(k: torch.Tensor) -> torch.Tensor:
    """Two int64 hashes of a set of non-negative int64 values (sums of a hash per value)."""
    r = k % _P31
    return torch.stack([(r * 1103515245 % _P31).sum(), (r * 48271 % _P31 + r // 7).sum()])


def _flat_keys(layer: SparseLinear) -> torch.Tensor:
    """int64 (nnz,) row * in_features + col, ascending (indices are canonical)."""
    idx = layer.indices.to(torch.int64)
    return idx[0] * layer.in_features + idx[1]


_sample_distinct = sample_distinct  # k distinct values in [0, n): snack.core.topology


def _free_ranks_to_keys(ranks: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Flat keys of the free coordinates with the given ranks (0-based, in row-major order).

    keys: sorted distinct int64 (nnz,) of the occupied coordinates. keys[i] - i is the number of
    free coordinates before keys[i] (non-decreasing), so the rank-j free coordinate is
    j + #{i : keys[i] - i <= j}. Sorted ranks give sorted keys."""
    if keys.numel() == 0:
        return ranks
    before = keys - torch.arange(keys.numel(), device=keys.device, dtype=torch.int64)
    return ranks + torch.searchsorted(before, ranks, right=True)


def _select_drop(scores: torch.Tensor, groups: Optional[torch.Tensor], counts: List[int]) -> torch.Tensor:
    """Positions (int64, ascending) of the counts[g] lowest-scoring entries of each group g
    (ties broken by position: the earlier entry in row-major order is dropped first)."""
    if groups is None:
        order = torch.sort(scores, stable=True).indices
        return torch.sort(order[:counts[0]]).values
    picked = []
    for g, k in enumerate(counts):
        if k == 0:
            continue
        pos = (groups == g).nonzero().flatten()
        order = torch.sort(scores[pos], stable=True).indices
        picked.append(pos[order[:k]])
    if not picked:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    return torch.sort(torch.cat(picked)).values


#: the name of SparseLinear.forward's input, for a layer called with it as a keyword (layer(x=...))
_INPUT_NAME = list(inspect.signature(SparseLinear.forward).parameters)[1]


class _CaptureHook:
    """The forward hook of a layer under RigL: forwards to the DST object's `_capture` through a
    weak reference (the layer does not keep the DST object, its optimizer or its activations
    alive) and pickles / deep-copies as a no-op hook, so torch.save(model) and
    copy.deepcopy(model) neither drag the DST object along nor feed it from the copy.
    Registered with_kwargs=True, so that the input is found also when the layer is called with it
    as a keyword; a hook pickled before that (called without the kwargs) is taken as well."""

    def __init__(self, dst: Optional["DynamicSparseTraining"] = None):
        self._ref = weakref.ref(dst) if dst is not None else None

    def _target(self) -> Optional["DynamicSparseTraining"]:
        return self._ref() if self._ref is not None else None

    @property
    def alive(self) -> bool:
        """Whether a DST object is behind this hook (False in a copy, or once that object is gone)."""
        return self._target() is not None

    def __call__(self, module, inputs, *rest):
        # (module, args, kwargs, output) as registered; (module, args, output) from an older pickle
        dst = self._target()
        if dst is not None:
            kwargs, output = rest if len(rest) == 2 else ({}, rest[-1])
            dst._capture(module, inputs, kwargs, output)

    def __reduce__(self):
        return (_CaptureHook, ())


# ---- the base class ----------------------------------------------------------------------------
_SCHEDULE_KEYS = ("drop_fraction", "update_every", "end_step", "decay")


def _disable_keep_in_compiled_code() -> None:
    """DynamicSparseTraining._keep wrapped in torch.compiler.disable, once per process."""
    keep = DynamicSparseTraining._keep
    if not getattr(keep, "_snack_eager", False):
        keep = torch.compiler.disable(keep)
        keep._snack_eager = True
        DynamicSparseTraining._keep = keep


class DynamicSparseTraining:
    """Prunes and regrows the connections of SparseLinear layers on a schedule; owns the
    optimizer-state remap. Subclasses define `drop_scores` (and `drop_groups`) and the growth
    (`grow_scores`, or `grow` itself).

    Args:
        model: an nn.Module; every snack.SparseLinear in it is updated (or only `layers`),
            except frozen ones (values.requires_grad False), which keep their pattern and are
            listed in `skipped`.
        optimizer: the torch.optim optimizer that holds each layer's `values` parameter; its
            (nnz,) state tensors (Adam's exp_avg / exp_avg_sq, momentum buffers, ...) are
            permuted with the connections on every update; scalar state (step) is left alone.
            A regrown connection's state starts at 0: the fresh state of Adam, AdamW, SGD's
            momentum, RMSprop, Adagrad (with its default initial_accumulator_value) and
            Adadelta; not of Rprop, whose per-weight step sizes start at lr (a regrown one
            restarts at step_sizes' minimum).
        drop_fraction: fraction of each layer's connections replaced at an update, in [0, 1)
            (at t = 0 for the cosine decay).
        update_every: update every this many calls of `step()` (>= 1).
        end_step: no update at or after this step. Default: max(1, int(0.75 * total_steps))
            (75% of total_steps, floored, at least 1) when total_steps is given, else updates
            never stop.
        total_steps: the training length in optimizer steps (only used for end_step's default).
        decay: "cosine" (f(t) = drop_fraction / 2 * (1 + cos(pi * t / end_step))) or "constant".
            The cosine needs a horizon: without end_step / total_steps the fraction is constant.
        seed: seeds this object's own CPU generator (the random choices of an update); by default
            a seed is drawn from torch's global generator, so torch.manual_seed repeats a run.
            The same seed gives the same patterns on CPU and CUDA.
        layers: an iterable of SparseLinear modules (a list, an nn.ModuleList, ...; or one) to
            update instead of all those in `model` (a frozen one raises ValueError).
        process_group: data-parallel training (torch.distributed), where every rank holds a copy
            of the model kept equal by DistributedDataParallel: the ranks' copies must change
            alike. None (default): the default group when torch.distributed is initialized with
            more than one rank, else no synchronisation; a ProcessGroup: that group; False: no
            synchronisation. With a group, the seed drawn by default is rank 0's; RigL sums
            its gradient scores over the ranks (the gradient of the global batch); a layer is
            skipped (no gradient captured) or an update refused (NaN) on every rank when it is
            on one; and before anything is written the ranks compare what they chose: where
            they differ (values not kept equal, different seeds) every rank raises
            RuntimeError and no layer changes. Every rank must call `step()` the same number of
            times (the update steps run collectives); tensors travel on the current CUDA device
            with NCCL, on the CPU with gloo. Ranks that train models of their own (a sweep
            under torchrun, model parallelism) need process_group=False.

    Call `step()` once per training step, after optimizer.step(). Per layer and update, exactly
    as many connections are grown as dropped (nnz never changes), round(f * nnz) of them (Python's
    rounding: halves to even), at most the layer's free coordinates; no coordinate appears
    twice, grown coordinates are ones the layer did not hold before the update (a dropped
    connection is not regrown in the same update), regrown values and their optimizer state are 0.
    Where this differs from the papers: RigL's algorithm grows among all coordinates inactive
    after the drop, so a connection dropped and regrown at once keeps its value, and it skips the
    optimizer step on update steps; here every update replaces exactly that many connections
    (a nearly dense layer changes at most its free coordinates), and the optimizer step of an
    update step is taken (RigL's growth scores the gradient at the weights before it, the drop
    the magnitudes after it).
    `last_update` holds the `UpdateSummary` of the latest update (also returned by `step()`).
    Under DistributedDataParallel the ranks make the same choices (see `process_group`).
    """

    #: whether the growth needs the layers' last input and output gradient (RigL)
    needs_gradient = False

    def __init__(self, model: nn.Module, optimizer, *, drop_fraction: float = 0.3,
                 update_every: int = 100, end_step: Optional[int] = None,
                 total_steps: Optional[int] = None, decay: str = "cosine",
                 seed: Optional[int] = None, layers: Optional[Iterable[SparseLinear]] = None,
                 process_group=None):
        _disable_keep_in_compiled_code()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "state"):
            raise TypeError("optimizer must be a torch.optim.Optimizer (with param_groups and "
                            f"state), got {type(optimizer).__name__}")
        if isinstance(drop_fraction, torch.Tensor) and drop_fraction.dim() == 0 \
                and drop_fraction.is_floating_point():
            drop_fraction = float(drop_fraction)    # a 0-d tensor, as a float
        if isinstance(drop_fraction, bool) or not isinstance(drop_fraction, Real):
            raise TypeError(f"drop_fraction must be a number in [0, 1), got {type(drop_fraction).__name__}")
        if math.isnan(drop_fraction) or not 0.0 <= float(drop_fraction) < 1.0:
            raise ValueError(f"drop_fraction must be a number in [0, 1), got {drop_fraction!r}")
        update_every = self._check_int("update_every", update_every)
        if end_step is not None:
            end_step = self._check_int("end_step", end_step)
        if total_steps is not None:
            total_steps = self._check_int("total_steps", total_steps)
        if decay not in _DECAYS:
            raise ValueError(f"decay must be one of {_DECAYS}, got {decay!r}")
        if seed is not None:
            seed = check_seed(seed)

        names = {id(m): n for n, m in model.named_modules()}
        #: (name, layer) of the SparseLinear layers left alone because they are frozen
        self.skipped: List[Tuple[str, SparseLinear]] = []
        if layers is None:
            found = [m for m in model.modules() if isinstance(m, SparseLinear)]
            if not found:
                raise ValueError(f"model ({type(model).__name__}) holds no snack.SparseLinear layer; "
                                 "convert it with snack.sparsify(model) first")
            # a frozen layer (values.requires_grad False) keeps its pattern: regrown connections
            # would start at 0 and never train
            self.skipped = [(names.get(id(m), ""), m) for m in found if not m.values.requires_grad]
            found = [m for m in found if m.values.requires_grad]
            if not found:
                raise ValueError(f"every snack.SparseLinear of model ({type(model).__name__}) is frozen "
                                 "(values.requires_grad is False): there is nothing to train")
        else:
            if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
                layers = [layers]  # (one layer; a ModuleList or Sequential is iterated)
            try:
                layers = iter(layers)
            except TypeError:
                raise TypeError("layers must be an iterable of snack.SparseLinear modules (or one "
                                f"SparseLinear), got {type(layers).__name__}") from None
            found = []
            for i, m in enumerate(layers):
                if not isinstance(m, SparseLinear):
                    raise TypeError(f"layers[{i}] must be a snack.SparseLinear, got {type(m).__name__}")
                if not m.values.requires_grad:
                    raise ValueError(f"layers[{i}] is frozen (values.requires_grad is False): its regrown "
                                     "connections would start at 0 and never train")
                if all(m is not f for f in found):
                    found.append(m)
            if not found:
                raise ValueError("layers is empty; give at least one snack.SparseLinear")
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.layers: List[Tuple[str, SparseLinear]] = []
        for i, m in enumerate(found):
            name = names.get(id(m), f"layers[{i}]")
            if id(m.values) not in held:
                raise ValueError(f"optimizer does not hold the values parameter of layer "
                                 f"{name or '<model>'} ({m.out_features}x{m.in_features}, "
                                 f"nnz={m.nnz}); pass model.parameters() to the optimizer")
            self.layers.append((name, m))

        self.model = model
        self.optimizer = optimizer
        self.drop_fraction = float(drop_fraction)
        self.update_every = update_every
        self.total_steps = total_steps
        if end_step is not None and total_steps is not None and end_step > total_steps + 1:
            warnings.warn(f"{type(self).__name__}: end_step={end_step} is past total_steps={total_steps} (the "
                          "training's end): updates run to the end of training (end_step=total_steps + 1 "
                          "says so)", stacklevel=2)
        if end_step is None and total_steps is not None:
            end_step = max(1, int(0.75 * total_steps))
        self.end_step = end_step
        if end_step is not None and end_step <= update_every:
            warnings.warn(f"{type(self).__name__}: end_step={end_step} <= update_every={update_every}, so no "
                          "update will ever happen (updates run at steps update_every, 2 * update_every, "
                          "... before end_step)", stacklevel=2)
        self.decay = decay
        self.process_group = _resolve_group(process_group)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
            if self.process_group is not None:  # rank 0's, so that random choices agree
                seed = int(self._collective(torch.tensor([seed], dtype=torch.int64), "broadcast").item())
        self.seed = int(seed)
        self._gen = torch.Generator().manual_seed(self.seed)
        self._step = 0
        self.last_update: Optional[UpdateSummary] = None
        self._captured: Dict[int, list] = {}
        self._hooks = []
        if self.needs_gradient:
            for _, m in self.layers:
                self._hooks.append(m.register_forward_hook(_CaptureHook(self), with_kwargs=True))

    @staticmethod
    def _check_int(name: str, v) -> int:
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
        return int(v)

    # ---- schedule -----------------------------------------------------------------------------
    @property
    def _step(self) -> int:
        return self._t

    @_step.setter
    def _step(self, t: int) -> None:
        # the hooks read one flag that changes only around update steps, not the step count:
        # under torch.compile a guard on the count would recompile the model at every step
        self._t = t
        self._capture_next = self.is_update_step(t + 1)

    @property
    def num_steps(self) -> int:
        """How many times `step()` has been called (restored by load_state_dict)."""
        return self._step

    def is_update_step(self, t: int) -> bool:
        """Whether the t-th call of `step()` (t = 1, 2, ...) prunes and regrows."""
        return t >= 1 and t % self.update_every == 0 and (self.end_step is None or t < self.end_step)

    def drop_fraction_at(self, t: int) -> float:
        """The fraction of connections replaced at step t (0 at or after end_step)."""
        if self.end_step is not None and t >= self.end_step:
            return 0.0
        if self.decay == "cosine" and self.end_step is not None:
            return cosine_drop_fraction(t, self.drop_fraction, self.end_step)
        return self.drop_fraction

    # ---- scores (override) --------------------------------------------------------------------
    def drop_scores(self, layer: SparseLinear) -> torch.Tensor:
        """(nnz,) scores of the layer's connections; the lowest are dropped. Default |value|."""
        return layer.values.detach().abs()

    def drop_groups(self, layer: SparseLinear) -> Optional[torch.Tensor]:
        """None (one group), or int64 (nnz,) group ids 0..G-1: each group drops the same
        fraction of its own members. Default None."""
        return None

    def grow_scores(self, layer: SparseLinear, rows: Tuple[int, int], cols: Tuple[int, int]) -> torch.Tensor:
        """Scores (r1 - r0, c1 - c0) of the tile rows [r0, r1) x cols [c0, c1) of the (out, in)
        grid; the highest free coordinates are grown. Called tile by tile by `grow`."""
        raise NotImplementedError(f"{type(self).__name__} defines no grow_scores")

    #: largest number of grid entries scored at once by `grow` (the memory bound of an update)
    grad_block_numel = 2**21

    def grow(self, layer: SparseLinear, keys: torch.Tensor, k: int) -> torch.Tensor:
        """Sorted int64 flat keys (row * in + col) of k free coordinates with the highest
        `grow_scores`. keys: the sorted (nnz,) keys of the current pattern, which are excluded.

        The (out, in) grid is scored in tiles of at most `grad_block_numel` entries (whole rows
        when a row fits, else pieces of one row); each tile keeps its top k, merged into a
        running top k, so memory is O(grad_block_numel + k)."""
        out_f, in_f = layer.out_features, layer.in_features
        budget = max(1, int(self.grad_block_numel))
        if in_f <= budget:
            rb = max(1, budget // in_f)
            tiles = [(r0, min(out_f, r0 + rb), 0, in_f) for r0 in range(0, out_f, rb)]
        else:
            tiles = [(r, r + 1, c0, min(in_f, c0 + budget))
                     for r in range(out_f) for c0 in range(0, in_f, budget)]
        # each tile's occupied coordinates are a contiguous run of the sorted keys
        lo = torch.tensor([r0 * in_f + c0 for r0, _, c0, _ in tiles], dtype=torch.int64,
                          device=keys.device)
        hi = torch.tensor([(r1 - 1) * in_f + c1 for _, r1, _, c1 in tiles], dtype=torch.int64,
                          device=keys.device)
        bounds = torch.searchsorted(keys, torch.stack([lo, hi])).tolist()
        best_s = best_k = None
        for (r0, r1, c0, c1), a, b in zip(tiles, bounds[0], bounds[1]):
            w = c1 - c0
            s = self.grow_scores(layer, (r0, r1), (c0, c1))
            if tuple(s.shape) != (r1 - r0, w):
                raise ValueError(f"grow_scores must return shape {(r1 - r0, w)}, got {tuple(s.shape)}")
            s = s.reshape(-1).clone() if not s.is_contiguous() else s.reshape(-1)
            if b > a:
                occ = keys[a:b]
                s[(occ // in_f - r0) * w + (occ % in_f - c0)] = -math.inf
            ts, ti = torch.topk(s, min(k, s.numel()), sorted=False)
            tk = (ti // w + r0) * in_f + (ti % w + c0)
            if best_s is None:
                best_s, best_k = ts, tk
            else:
                best_s, best_k = torch.cat([best_s, ts]), torch.cat([best_k, tk])
                if best_s.numel() > k:
                    sel = torch.topk(best_s, k, sorted=False).indices
                    best_s, best_k = best_s[sel], best_k[sel]
        return torch.sort(best_k).values

    # ---- gradient capture (RigL) --------------------------------------------------------------
    def _capture(self, module: SparseLinear, inputs, kwargs, output) -> None:
        # a forward hook: keeps X and (through a hook on the output) dY, on update steps only
        if self._capture_next:
            self._keep(module, inputs, kwargs, output)

    def _keep(self, module: SparseLinear, inputs, kwargs, output) -> None:
        # eager even in a compiled model (a graph break on update steps only): traced, the hook
        # on the output cannot be captured and the growing record lists would force recompiles.
        # `_disable_keep_in_compiled_code` wraps it in torch.compiler.disable when the first DST
        # object is made (not at import: that imports torch._dynamo, ~1 s)
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        # inside a torch.func transform (grad, vmap, jvp, ...: per-sample gradients) X and dY are
        # the transform's wrappers, which must not outlive it (scoring them after it raises): the
        # call is not captured, as a forward without backward is not
        if _in_functorch():
            return
        x = inputs[0] if inputs else kwargs.get(_INPUT_NAME)   # layer(x) or layer(x=x)
        if not isinstance(x, torch.Tensor):
            return
        x = x.detach().reshape(-1, module.in_features)
        rec = [x, None]
        self._captured.setdefault(id(module), []).append(rec)

        def keep_grad(g, rec=rec, out_f=module.out_features):
            # several backward passes through one output (retain_graph, several losses) add up,
            # as they do in .grad
            g = g.detach().reshape(-1, out_f)
            rec[1] = g if rec[1] is None else rec[1] + g
        output.register_hook(keep_grad)

    def _records(self, layer: SparseLinear) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(x, dy) for x, dy in self._captured.get(id(layer), []) if dy is not None]

    def remove_hooks(self) -> None:
        """Detaches the forward hooks (RigL); the object must not be stepped afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._captured.clear()

    # ---- the update ---------------------------------------------------------------------------
    def step(self) -> Optional[UpdateSummary]:
        """Counts one training step; on an update step prunes and regrows every layer and returns
        the `UpdateSummary` (also kept in `last_update`), else returns None."""
        if self.needs_gradient and not self._hooks:  # (registered at construction, one per layer)
            raise RuntimeError(f"{type(self).__name__}.step() after remove_hooks(): the dense gradients its "
                               "growth needs are no longer captured; build a new one to go on")
        self._step += 1
        t = self._step
        if not self.is_update_step(t):
            self._captured.clear()
            return None
        f = self.drop_fraction_at(t)
        summary = UpdateSummary(step=t, drop_fraction=f)
        skipped, frozen = [], []
        try:
            with torch.no_grad(), self._no_autocast():
                missing = self._check_finite(t) if f > 0.0 else set()
                plans = [self._plan_layer(name, layer, f, missing) for name, layer in self.layers]
                if self.process_group is not None:
                    self._check_agreement(t, plans)
                for (name, layer), (row, work) in zip(self.layers, plans):
                    if work is not None:
                        self._rewire(layer, *work)
                    if row.skipped:
                        (frozen if row.skipped == "frozen" else skipped).append(name or "<model>")
                    summary.layers.append(row)
        except BaseException:
            # whatever failed (NaN / inf, the ranks' disagreement, a grow_scores of a subclass,
            # memory), this call did not happen: the step count as before it, so that the next
            # call is this update step again (the checks above raise before any layer changes)
            self._step -= 1
            raise
        finally:
            # the records are dropped on failure too: kept, they would be added to the next
            # forward/backward's (their NaN / inf refusing every later try of this update)
            self._captured.clear()
        if skipped:
            warnings.warn(f"{type(self).__name__} step {t}: no gradient was captured for layer(s) "
                          f"{', '.join(skipped)} (run forward and backward of the step before "
                          "dst.step(); a backward inside torch.func.grad / vmap is not captured); "
                          "their connections were left unchanged", RuntimeWarning,
                          stacklevel=2)
        if frozen:
            warnings.warn(f"{type(self).__name__} step {t}: layer(s) {', '.join(frozen)} are frozen "
                          "(values.requires_grad is False) and kept their connections: regrown ones "
                          "would start at 0 and never train", RuntimeWarning, stacklevel=2)
        self.last_update = summary
        return summary

    def _no_autocast(self) -> contextlib.ExitStack:
        """Autocast off on the layers' device types for an update: a step called inside a
        torch.autocast region must score (RigL's dY^T X products) in fp32, not in its dtype."""
        stack = contextlib.ExitStack()
        for dev in sorted({layer.values.device.type for _, layer in self.layers}):
            if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        return stack

    def _check_finite(self, t: int) -> set:
        """Raises ValueError, before any layer changes, where a layer's values hold NaN or the
        inputs and output gradients captured for its grow scores hold NaN or inf: pruning and
        regrowing would rank NaN, i.e. rewire at random (an inf captured becomes NaN in dY^T X
        where it meets a 0, e.g. a ReLU's zeros: an fp16 backward that overflowed). An inf in the
        values is ranked as the largest magnitude (kept), as `from_dense` prunes it. Returns the
        ids of the layers that need a captured gradient and have none. With a process group both
        are agreed over the ranks (NaN or no gradient on one rank counts for all). One host sync
        per device (and one collective)."""
        whats = ("values", "its captured input", "its captured output gradient")
        flags = {}  # device -> [(0-d flag, slot)]; per layer 4 slots: 3 NaN / inf kinds, no gradient
        vec = torch.zeros(4 * len(self.layers), dtype=torch.int64)
        for i, (name, layer) in enumerate(self.layers):
            tensors = [(0, layer.values)]
            if self.needs_gradient:
                recs = self._records(layer)
                for x, dy in recs:
                    tensors += [(1, x), (2, dy)]
                vec[4 * i + 3] = int(not recs)
            for kind, v in tensors:
                bad = torch.isnan(v.detach()) if kind == 0 else ~torch.isfinite(v)
                flags.setdefault(v.device, []).append((bad.any(), 4 * i + kind))
        for items in flags.values():
            vals = torch.stack([f for f, _ in items]).cpu().tolist()
            for on, (_, slot) in zip(vals, items):
                if on:
                    vec[slot] = 1
        if self.process_group is not None:
            vec = self._collective(vec, "max")
        for i, (name, _) in enumerate(self.layers):
            for kind in range(3):
                if vec[4 * i + kind]:
                    where = " (on at least one rank)" if self.process_group is not None else ""
                    head = f"{type(self).__name__} step {t}: layer '{name or '<model>'}': {whats[kind]}"
                    if kind == 0:
                        raise ValueError(f"{head} hold(s) NaN{where} (has training diverged?); pruning and "
                                         "regrowing cannot rank NaN, so no layer was changed and the step "
                                         "was not counted")
                    raise ValueError(f"{head} hold(s) NaN or inf{where} (has training diverged, or did an "
                                     "fp16 backward overflow?); RigL's grow scores dY^T X would hold NaN, so "
                                     "no layer was changed and the step was not counted. The captured "
                                     "records are dropped: the next call makes this update from its own "
                                     "forward and backward (with torch.amp.GradScaler, catch this error on "
                                     "a step whose optimizer step the scaler skipped)")
        return {id(layer) for i, (_, layer) in enumerate(self.layers) if vec[4 * i + 3]}

    # ---- data-parallel ranks ------------------------------------------------------------------
    def _collective(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """A copy of t broadcast from the group's rank 0 (op "broadcast"), or summed / maxed over
        the group's ranks ("sum", "max"), on t's device. NCCL moves it to the current CUDA
        device, a single gloo/MPI backend to the CPU."""
        import torch.distributed as dist
        g = self.process_group
        backend = str(dist.get_backend(g)).lower()
        if backend == "nccl":
            dev = torch.device("cuda", torch.cuda.current_device())
        elif ":" in backend:  # one backend per device type ("cpu:gloo,cuda:nccl")
            dev = t.device
        else:
            dev = torch.device("cpu")
        u = t.to(dev, copy=True)
        if op == "broadcast":
            dist.broadcast(u, src=dist.get_global_rank(g, 0), group=g)
        else:
            dist.all_reduce(u, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=g)
        return u.to(t.device)

    def reduce_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks of `process_group` (t itself without one): for grow scores
        that sum per-rank quantities (RigL's gradient). Every rank must call it alike."""
        return t if self.process_group is None else self._collective(t, "sum")

    def _check_agreement(self, t: int, plans) -> None:
        """Raises RuntimeError on every rank, before anything is written, when the ranks chose
        different connections to drop or grow for a layer."""
        fps = []
        for row, work in plans:
            if work is None:
                fps.append(torch.zeros(5, dtype=torch.int64))
            else:
                _, drop_pos, new_keys = work  # one host copy per layer
                fps.append(torch.cat([drop_pos.new_tensor([drop_pos.numel()]), _fingerprint(drop_pos),
                                      _fingerprint(new_keys)]).cpu())
        v = torch.stack(fps).reshape(-1)
        both = self._collective(torch.cat([v, -v]), "max")
        hi, lo = both[:v.numel()], -both[v.numel():]
        for i, (name, _) in enumerate(self.layers):
            if not torch.equal(hi[5 * i:5 * i + 5], lo[5 * i:5 * i + 5]):
                raise RuntimeError(
                    f"{type(self).__name__} step {t}: the ranks chose different connections for layer "
                    f"'{name or '<model>'}' (are the models' values kept equal, e.g. by "
                    "DistributedDataParallel, and the seeds the same? ranks that train models of their "
                    "own need process_group=False); no layer was changed")

    def _plan_layer(self, name: str, layer: SparseLinear, f: float, missing: set):
        """(LayerUpdate, (keys, drop positions, new keys) or None when nothing changes); nothing is
        written. missing: ids of layers without a captured gradient (on some rank)."""
        out_f, in_f = layer.out_features, layer.in_features
        nnz = layer.nnz
        free = out_f * in_f - nnz
        row = LayerUpdate(name=name, shape=(out_f, in_f), nnz=nnz, dropped=0, grown=0)
        if nnz == 0 or free == 0 or f <= 0.0:
            return row, None
        if not layer.values.requires_grad:  # frozen since construction: as the constructor would
            row.skipped = "frozen"
            return row, None
        if self.needs_gradient and id(layer) in missing:  # (missing: from _check_finite, with f > 0)
            row.skipped = "no gradient captured"
            return row, None
        groups = self.drop_groups(layer)
        if groups is None:
            sizes = [nnz]
        else:
            sizes = torch.bincount(groups, minlength=1).tolist()
        counts = [int(round(f * s)) for s in sizes]
        total = sum(counts)
        if total > free:  # cannot grow more than there are free coordinates: scale down to free,
            # each group by its share, the rounding's remainder to the largest fractions
            scaled = [c * free // total for c in counts]
            rest = sorted(range(len(counts)), key=lambda i: (scaled[i] * total - counts[i] * free, i))
            for i in rest[:free - sum(scaled)]:
                scaled[i] += 1
            counts = scaled
        k = sum(counts)
        if k == 0:
            return row, None
        keys = _flat_keys(layer)
        drop_pos = _select_drop(self.drop_scores(layer), groups, counts)
        new_keys = self.grow(layer, keys, k)
        if new_keys.numel() != k:
            raise RuntimeError(f"grow returned {new_keys.numel()} coordinates, expected {k}")
        row.dropped = row.grown = k
        return row, (keys, drop_pos, new_keys.to(keys.device))

    def _rewire(self, layer: SparseLinear, keys: torch.Tensor, drop_pos: torch.Tensor,
                new_keys: torch.Tensor) -> None:
        """Replaces the connections at positions drop_pos by those at new_keys (sorted, free),
        writing indices, values, values.grad and the (nnz,) optimizer state in place. The
        remapped copies are all made before anything is written (with Adam: about four (nnz,)
        float tensors and a copy of the indices at once, still nothing of the dense size)."""
        nnz, in_f = keys.numel(), layer.in_features
        keep = torch.ones(nnz, dtype=torch.bool, device=keys.device)
        keep[drop_pos] = False
        kept_pos = keep.nonzero().flatten()
        n_new = new_keys.numel()
        merged, order = torch.sort(torch.cat([keys[kept_pos], new_keys]))
        if n_new and bool((merged[1:] == merged[:-1]).any()):
            raise RuntimeError("grow returned a coordinate the layer already holds")

        def remap(t: torch.Tensor) -> torch.Tensor:
            # survivors move to their new positions, new entries get 0; nothing else is carried
            src = torch.cat([t[kept_pos], t.new_zeros(n_new)])
            return src[order]

        new_idx = torch.stack([merged // in_f, merged % in_f]).to(layer.indices.dtype)
        # everything remapped first, written after the pattern is in: a failure on the way
        # leaves the layer as it was, never new indices with values in the old order
        values = layer.values
        writes = [(values.detach(), remap(values.detach()))]
        if values.grad is not None and values.grad.shape == (nnz,):
            writes.append((values.grad, remap(values.grad)))
        state = self.optimizer.state.get(values) if hasattr(self.optimizer.state, "get") else None
        for key, v in (state or {}).items():
            if key != "step" and isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == nnz:
                writes.append((v, remap(v)))
        old_idx = layer.indices.clone()
        layer.indices.copy_(new_idx)            # bumps the version: the topology is rebuilt
        try:
            # now, not at the next eager call: its arrays take the new pattern in place, so a
            # training step captured in a CUDA graph replays the new pattern
            backend.get_topology(layer.indices, (layer.out_features, in_f))
        except BaseException:
            layer.indices.copy_(old_idx)
            raise
        with torch.no_grad():
            for dst, src in writes:
                dst.copy_(src)

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step count and the random generator's state (the model and the optimizer save
        the topology, values and moments themselves)."""
        return {"step": self._step, "rng_state": self._gen.get_state(), "seed": self.seed,
                "drop_fraction": self.drop_fraction, "update_every": self.update_every,
                "end_step": self.end_step, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        """Restores the step count and the random generator (hyper-parameters stay as built:
        a checkpoint made with another schedule is loaded with a warning naming the differences)."""
        if not isinstance(state, dict) or "step" not in state or "rng_state" not in state:
            raise ValueError("state must be a dict from DynamicSparseTraining.state_dict() with "
                             f"'step' and 'rng_state', got {type(state).__name__}"
                             + (f" with keys {sorted(state)}" if isinstance(state, dict) else ""))
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, Integral) or step < 0:
            raise ValueError(f"state['step'] must be an int >= 0, got {step!r}")
        seed = state.get("seed", self.seed)
        if isinstance(seed, bool) or not isinstance(seed, Integral):
            raise TypeError(f"state['seed'] must be an int, got {type(seed).__name__}")
        rng = state["rng_state"]
        try:  # checked on a scratch generator first, so that nothing changes on a bad state
            torch.Generator().set_state(rng)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"state['rng_state'] is not a CPU generator state from "
                            f"torch.Generator.get_state() ({e})") from None
        differ = [f"{k}={state[k]!r} (here {getattr(self, k)!r})" for k in _SCHEDULE_KEYS
                  if k in state and state[k] != getattr(self, k)]
        if differ:
            warnings.warn(f"{type(self).__name__}.load_state_dict: the checkpoint's schedule differs: "
                          f"{', '.join(differ)}; the run goes on with this object's", stacklevel=2)
        self._gen.set_state(rng)
        self._step = int(step)
        self.seed = int(seed)
        self._captured.clear()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={len(self.layers)}, drop_fraction={self.drop_fraction}, "
                f"update_every={self.update_every}, end_step={self.end_step}, decay={self.decay!r}, "
                f"step={self._step})")


# ---- SET -------------------------------------------------------------------------------------------
class SET(DynamicSparseTraining):
    """Sparse Evolutionary Training (Mocanu et al., 2018).

    Drop: positive and negative weights separately, the same fraction of each group: the
    smallest positives and the negatives closest to zero (zeros count as positives, dropped
    first). Each group's count is rounded on its own, so a small layer may drop (and regrow) one
    more or one fewer than round(fraction * nnz); where the layer has fewer free coordinates than
    that, the groups share them in proportion. Grow: uniformly at random among the free coordinates (what top-k of i.i.d. uniform
    grow scores would give), sampled in rank space without a mask, at value 0 (a choice: the
    paper's implementation draws new weights at random). The paper keeps the fraction
    constant (decay="constant"); the default follows RigL's comparison (cosine). Arguments as
    `DynamicSparseTraining`.
    """

    def drop_groups(self, layer: SparseLinear) -> torch.Tensor:
        """0 for values >= 0, 1 for values < 0."""
        return (layer.values.detach() < 0).to(torch.int64)

    def grow(self, layer: SparseLinear, keys: torch.Tensor, k: int) -> torch.Tensor:
        """k free coordinates uniformly at random (this object's generator), sorted flat keys."""
        free = layer.out_features * layer.in_features - keys.numel()
        ranks = _sample_distinct(free, k, self._gen).to(keys.device)
        return _free_ranks_to_keys(ranks, keys)


# ---- RigL ------------------------------------------------------------------------------------------
class RigL(DynamicSparseTraining):
    """Rigging the Lottery (Evci et al., 2020).

    Drop: the connections of smallest |value|. Grow: the free coordinates of largest |dL/dW|,
    dL/dW = sum over the step's forward calls of dY^T X, from the input and output gradient
    captured by a forward hook during the forward/backward that precedes an update step
    (nothing is kept on other steps; every gradient that reaches the layer's output in between
    is added: several backward passes, and also an `autograd.grad` call through it). The grid is scored in tiles of at most `grad_block_numel`
    entries. Defaults as the paper: drop fraction 0.3 with cosine decay, update every 100 steps,
    stop at 75% of total_steps, new weights at zero.

    Args: as `DynamicSparseTraining`, plus
        grad_block_numel: the most (out, in) grid entries scored at once (default 2**21).
    The capture runs eagerly, also inside a compiled model on update steps (a graph break there,
    so not with `fullgraph=True`); a replayed CUDA graph is not seen, nor is a call inside a
    torch.func transform (grad, vmap: per-sample gradients; their tensors cannot outlive it).
    A layer that produced no gradient before an update step is left unchanged, with a warning.
    """

    needs_gradient = True

    def __init__(self, model: nn.Module, optimizer, *, grad_block_numel: int = 2**21, **kwargs):
        self.grad_block_numel = self._check_int("grad_block_numel", grad_block_numel)
        super().__init__(model, optimizer, **kwargs)

    def grow_scores(self, layer: SparseLinear, rows: Tuple[int, int], cols: Tuple[int, int]) -> torch.Tensor:
        """|dY[:, r0:r1]^T X[:, c0:c1]| summed over the captured calls, in float32 (float64 for
        float64 layers)."""
        (r0, r1), (c0, c1) = rows, cols
        acc = None
        for x, dy in self._records(layer):
            dt = torch.float64 if dy.dtype == torch.float64 or x.dtype == torch.float64 else torch.float32
            g = torch.mm(dy[:, r0:r1].t().to(dt), x[:, c0:c1].to(dt))
            acc = g if acc is None else acc.add_(g.to(acc.dtype))
        return self.reduce_over_ranks(acc).abs_()  # with a process group: the global batch's
