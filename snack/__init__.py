"""SNACK: truly sparse neural-network layers for PyTorch.

Weights are stored as COO (row, column, value) for their non-zero connections only; forward,
backward and topology changes run on that form (Numba CUDA kernels on the GPU, a compiled CPU
backend otherwise).

    snack.SparseLinear, snack.sparsify, snack.densify, snack.functional.sparse_linear, snack.COO
    snack.dst.SET / snack.dst.RigL (dynamic sparse training, when installed)
    snack.optim.Adam / snack.optim.AdamW (torch's Adam with a fused full-occupancy GPU step)
    snack.graphs.CapturedStep (a training step replayed from a CUDA graph, with SET / RigL)
`snack.functional`, `snack.dst`, `snack.optim` and `snack.graphs` are aliases of
`snack.layers.functional`, `snack.layers.dst`, `snack.layers.optim` and `snack.layers.graphs`,
so `import snack.functional` works too.
"""
import importlib as _importlib
import sys as _sys
from pathlib import Path as _Path

# In a source checkout the subpackages snack.core, snack.gpu and snack.layers are the folders
# core/, gpu/ and layers/ beside this one: found here first, so that the checkout runs its own
# code with its root on sys.path, without an install, and never another checkout's installed
# in editable mode. An installed copy has them inside this folder instead.
_ROOT = _Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and all((_ROOT / d / "__init__.py").is_file() for d in ("core", "gpu", "layers")):
    __path__.append(str(_ROOT))

from snack.core import COO
from snack.layers import functional, graphs, optim
from snack.layers.linear import SparseLinear
from snack.layers.sparsify import densify, sparsify

_sys.modules.setdefault(__name__ + ".functional", functional)
_sys.modules.setdefault(__name__ + ".optim", optim)
_sys.modules.setdefault(__name__ + ".graphs", graphs)

try:
    dst = _importlib.import_module("snack.layers.dst")
except ModuleNotFoundError as _e:  # layers/dst.py not there (yet)
    if _e.name != "snack.layers.dst":
        raise
else:
    _sys.modules.setdefault(__name__ + ".dst", dst)

__version__ = "0.1.0"
__all__ = ["COO", "SparseLinear", "sparsify", "densify", "functional", "optim", "graphs", "__version__"]
if "dst" in globals():
    __all__.append("dst")
