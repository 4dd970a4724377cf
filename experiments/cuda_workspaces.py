"""cuBLAS's one-off allocations, made before a benchmark measures peak memory.

cuBLAS keeps a workspace per handle, and torch keeps a handle per thread: the calling thread's
is made at its first GEMM or GEMV, autograd's worker thread of the device (which runs the
backward's GEMMs) gets its own at the first backward that multiplies, and cuBLASLt allocates one
more at the first GEMM with a bias (nn.Linear's addmm). They stay allocated for the life of the
process (32 MB each for cuBLAS and 1 MB for cuBLASLt on an H200 with torch 2.11), so a peak
measured from `torch.cuda.memory_allocated()` before a model was built charges them to whichever
model runs such a GEMM first on each thread. `make_cublas_workspaces(device)` runs a tiny forward
and backward with those GEMMs first.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def make_cublas_workspaces(device) -> None:
    """Allocates cuBLAS's and cuBLASLt's workspaces for this thread and for autograd's worker
    thread of `device` (a CUDA device); nothing else stays allocated. A no-op on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    with torch.enable_grad():
        a = torch.randn(8, 8, device=device, requires_grad=True)
        (torch.mm(a, a).sum() + torch.mv(a, a[0]).sum() + F.linear(a, a, a[0]).sum()).backward()
    del a
    torch.cuda.synchronize(device)
