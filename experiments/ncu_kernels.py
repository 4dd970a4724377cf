"""A few SNACK kernel launches for Nsight Compute (`ncu --clock-control none -k regex:snack ...`):
forward, dX and SDDMM at 4096 x 4096 for the cases named on the command line as
sparsity:B[:wide], e.g. `0.99:8 0.9:32:wide` (`wide` asks for the 32-wide kernels)."""
import sys

import torch


def main():
    import snack.gpu as G
    from snack.core import COO
    for case in sys.argv[1:] or ["0.99:8", "0.9:32"]:
        parts = case.split(":")
        sp, B = float(parts[0]), int(parts[1])
        kw = dict(wide=True) if parts[2:] == ["wide"] else {}
        coo = COO.random((4096, 4096), density=1 - sp, seed=0, device="cuda")
        x = torch.randn(B, 4096, device="cuda")
        dy = torch.randn(B, 4096, device="cuda")
        for _ in range(2):
            G.spmm(x, coo.topology, coo.values, **kw)
            G.spmm_t(dy, coo.topology, coo.values, **kw)
            G.sddmm(dy, x, coo.topology, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
