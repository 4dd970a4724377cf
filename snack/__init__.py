"""SNACK: truly sparse neural-network layers for PyTorch.

Weights are stored as COO (row, column, value) for their non-zero connections only; forward,
backward and topology changes run on that form (Numba CUDA kernels on the GPU, a compiled CPU
backend otherwise).
"""
from snack.core import COO

__version__ = "0.1.0"
__all__ = ["COO", "__version__"]
