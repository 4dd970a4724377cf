"""Tests of the CUDA kernels under Numba's simulator. They need NUMBA_ENABLE_CUDASIM=1 before
numba.cuda is imported, so they are collected only in a process started that way:
tests/test_gpu_simulator.py runs `pytest tests/gpu_sim` in a subprocess with it set."""
import os

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]
