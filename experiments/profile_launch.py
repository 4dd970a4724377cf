"""Host-overhead profile of one SNACK forward call (B = 1, 4096 x 4096, 90 %): cProfile of 2000
calls, top entries by own time. Usage (GPU machine): python experiments/profile_launch.py
"""
import cProfile
import pstats

import torch


def main():
    import snack.gpu as G
    from snack.core import COO
    coo = COO.random((4096, 4096), density=0.1, seed=0, device="cuda")
    x = torch.randn(1, 4096, device="cuda")
    for _ in range(20):
        G.spmm(x, coo.topology, coo.values)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        G.spmm(x, coo.topology, coo.values)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
