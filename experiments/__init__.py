"""Experiments: training runs and benchmarks that write results/*.csv, and the data loader.

A regular package (not a namespace one) so that `from experiments.data import load` always finds
this folder first when the repository root is on sys.path.
"""
