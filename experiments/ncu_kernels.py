"""A few SNACK kernel launches for Nsight Compute (`ncu --clock-control none -k regex:snack ...`):
forward, dX and SDDMM at 4096 x 4096 for the cases named on the command line as
sparsity:B[:wide], e.g. `0.99:8 0.9:32:wide` (`wide` asks for the 32-wide kernels)."""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `experiments` importable
    sys.path.insert(0, str(ROOT))
from experiments.bench_kernels import require_gpu  # noqa: E402

DEFAULT_CASES = ["0.99:8", "0.9:32"]


def parse_cases(argv=None):
    """[(sparsity, B, launch options)] from the command line's sparsity:B[:wide] cases."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", metavar="sparsity:B[:wide]",
                    help=f"default {' '.join(DEFAULT_CASES)}")
    cases = []
    for case in ap.parse_args(argv).cases or DEFAULT_CASES:
        parts = case.split(":")
        try:
            sp, B = float(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            sp, B = -1.0, 0
        if len(parts) not in (2, 3) or parts[2:] not in ([], ["wide"]) or not 0.0 <= sp < 1.0 or B < 1:
            ap.error(f"a case is sparsity:B or sparsity:B:wide with sparsity in [0, 1) and B >= 1, got {case!r}")
        cases.append((sp, B, dict(wide=True) if parts[2:] == ["wide"] else {}))
    return cases


def main(argv=None):
    cases = parse_cases(argv)
    require_gpu("ncu_kernels.py", triton=False)
    import snack.gpu as G
    from snack.core import COO
    for sp, B, kw in cases:
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
