"""A few SNACK kernel launches for Nsight Compute (`ncu --clock-control none -k regex:snack ...`):
forward at 4096 x 4096 for the cases named on the command line, e.g. `0.99:8 0.9:32`."""
import sys

import torch


def main():
    import snack.gpu as G
    from snack.core import COO
    for case in sys.argv[1:] or ["0.99:8", "0.9:32"]:
        sp, B = case.split(":")
        coo = COO.random((4096, 4096), density=1 - float(sp), seed=0, device="cuda")
        x = torch.randn(int(B), 4096, device="cuda")
        for _ in range(2):
            G.spmm(x, coo.topology, coo.values)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
