"""snack.layers: autograd Functions (and the same op as torch.library custom ops, for
torch.compile), SparseLinear, sparsify(model) and densify(model), backend dispatch (and
dynamic sparse training in snack.layers.dst when present). Imports without a GPU: the CUDA
backend is loaded on the first call with a CUDA tensor."""
from . import backend, functional, library
from .functional import sparse_linear, SparseLinearFunction
from .linear import SparseLinear
from .sparsify import sparsify, densify, SparsifySummary, LayerRow

__all__ = ["backend", "functional", "library", "sparse_linear", "SparseLinearFunction", "SparseLinear",
           "sparsify", "densify", "SparsifySummary", "LayerRow"]
