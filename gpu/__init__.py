"""snack.gpu: Numba CUDA kernels for SNACK-COO (SpMM, transposed SpMM, SDDMM, and the three of a
backward fused in one pass), a fused Adam step, and their launchers.

Knows nothing of autograd or nn.Module. Tensors in, tensors out, on torch's current stream.
"""
from .launch import launch_mode
from .ops import spmm, spmm_t, sddmm, spmm_t_sddmm, fuses_backward, choose_tile, MIXED_VALUES
from .optim import adam_step, adam_steps

__all__ = ["spmm", "spmm_t", "sddmm", "spmm_t_sddmm", "fuses_backward", "adam_step", "adam_steps", "choose_tile", "is_available", "launch_mode",
           "MIXED_VALUES"]


def is_available() -> bool:
    """True when the kernels can run: a CUDA GPU visible to torch and Numba, or the simulator."""
    if launch_mode() == "sim":
        return True
    import torch
    if not torch.cuda.is_available():
        return False
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:  # numba-cuda missing its CUDA libraries
        return False
